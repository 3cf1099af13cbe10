"""The loss, targets and optimizer the CLI compiles training passes with."""
import torch

from tidal.compiler.model_spec import (cross_entropy, loss_and_targets, mse, optimizer_factory,
                                       package_module_name)


def _plain():
    return torch.nn.Sequential(torch.nn.Linear(6, 3))


def test_the_models_own_loss_and_targets_come_first():
    from examples.models import vgg16_small

    model = vgg16_small()
    loss_fn, targets = loss_and_targets(model, "vgg16_small", "default", 4,
                                        model.example_inputs(4))
    assert loss_fn is model.default_loss
    assert torch.equal(targets, model.example_targets(4))


def test_targets_are_derived_from_the_outputs():
    model, x = _plain(), (torch.randn(5, 6),)
    loss_fn, y = loss_and_targets(model, "m", "default", 5, x)
    assert loss_fn is cross_entropy and y.shape == (5,) and y.dtype == torch.long
    assert int(y.max()) < 3 and loss_fn(model(*x), y).ndim == 0
    loss_fn, y = loss_and_targets(model, "m", "mse", 5, x)
    assert loss_fn is mse and y.shape == (5, 3) and y.dtype == torch.float32
    assert model.training  # deriving ran the model in eval mode and restored it


def test_optimizer_factory():
    params = list(_plain().parameters())
    sgd = optimizer_factory("sgd", None)(params)
    assert isinstance(sgd, torch.optim.SGD) and sgd.param_groups[0]["lr"] == 0.1
    adam = optimizer_factory("adam", 0.01)(params)
    assert isinstance(adam, torch.optim.Adam) and adam.param_groups[0]["lr"] == 0.01


def test_package_module_name(tmp_path, monkeypatch):
    pkg = tmp_path / "top" / "sub"
    pkg.mkdir(parents=True)
    (tmp_path / "top" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "m.py").write_text("")
    (tmp_path / "alone.py").write_text("")
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p not in ("", ".")])
    monkeypatch.chdir(tmp_path.parent)
    assert package_module_name(pkg / "m.py") == (tmp_path.resolve(), "top.sub.m")
    assert package_module_name(tmp_path / "alone.py") is None
    monkeypatch.syspath_prepend(str(tmp_path / "top"))  # python -m sub.m from top/
    assert package_module_name(pkg / "m.py") == ((tmp_path / "top").resolve(), "sub.m")


def test_cli_losses_read_the_logits_of_a_traced_hugging_face_graph():
    """A traced HF graph returns a plain dict; ``--loss cross_entropy``/``mse`` used to raise
    'the model returns dict, not a tensor'."""
    import torch

    from tidal.compiler.model_spec import cross_entropy, mse

    logits = torch.randn(2, 3, 5)
    out = {"logits": logits, "past_key_values": None}
    targets = torch.zeros(2, 3, dtype=torch.long)
    assert torch.equal(cross_entropy(out, targets), cross_entropy(logits, targets))
    assert torch.equal(mse(out, torch.zeros(2, 3, 5)), mse(logits, torch.zeros(2, 3, 5)))
