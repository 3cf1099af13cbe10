"""Reusing an export (``tidal.ir.export_capture.reusing_exports``): a fresh model of the same
classes, config and input signature rebuilds its graph from the stored export, on its own
parameters, and gets the graph an export of its own gives; anything the export depends on
that differs (a config value, ``training``, shapes, dtypes, tied weights, grad mode, a
replaced ``forward``) is another key; a model the key cannot describe is exported every time;
graphs rebuilt from one export share nothing a pass could change."""
import pytest
import torch

from tidal.ir.export_capture import ExportCache, export_key, export_trace, reusing_exports


class Scaled(torch.nn.Module):
    """A Python float and a forward-made tensor constant, both baked into the export."""

    def __init__(self, scale: float = 2.0, bias: bool = True):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4, bias=bias)
        self.scale = scale

    def forward(self, x):
        return {"y": self.lin(x) * self.scale + torch.tensor([1.0, 2.0, 3.0, 4.0])}


class Tied(torch.nn.Module):
    def __init__(self, tie: bool):
        super().__init__()
        self.a = torch.nn.Linear(4, 4, bias=False)
        self.b = torch.nn.Linear(4, 4, bias=False)
        if tie:
            self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(self.a(x))


class Slotted:
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


X = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))


def test_a_fresh_model_alike_reuses_the_export_on_its_own_parameters():
    first, second = Scaled(), Scaled()
    with reusing_exports() as cache:
        gm1 = export_trace(first, (X,))
        gm2 = export_trace(second, (X,))
    assert (cache.misses, cache.hits) == (1, 1)
    assert gm2.lin.weight is second.lin.weight and gm1.lin.weight is first.lin.weight
    assert not torch.equal(first(X)["y"], second(X)["y"])       # other weights
    torch.testing.assert_close(gm2(X)["y"], second(X)["y"], rtol=0, atol=0)
    own = export_trace(Scaled(), (X,))                          # an export of its own
    assert gm2.code == own.code


@pytest.mark.parametrize("change", ["scale", "bias", "eval", "shape", "dtype", "frozen",
                                    "no_grad", "forward"])
def test_what_the_export_depends_on_is_in_the_key(change, monkeypatch):
    base = export_key(Scaled(), (X,))
    model, x = Scaled(), X
    if change == "scale":
        model = Scaled(scale=3.0)
    elif change == "bias":
        model = Scaled(bias=False)
    elif change == "eval":
        model.eval()
    elif change == "shape":
        x = torch.randn(5, 4)
    elif change == "dtype":
        model, x = model.double(), X.double()
    elif change == "frozen":
        model.lin.weight.requires_grad_(False)
    elif change == "forward":
        monkeypatch.setattr(Scaled, "forward", lambda self, x: {"y": self.lin(x)})
    if change == "no_grad":
        with torch.no_grad():
            key = export_key(model, (x,))
    else:
        key = export_key(model, (x,))
    assert key is not None and key != base
    assert export_key(Scaled(), (X,)) == base or change == "forward"


def test_tied_weights_are_another_key():
    assert export_key(Tied(True), (X,)) != export_key(Tied(False), (X,))
    assert export_key(Tied(True), (X,)) == export_key(Tied(True), (X,))


def test_a_different_config_misses_and_gets_its_own_graph():
    with reusing_exports() as cache:
        export_trace(Scaled(), (X,))
        other = Scaled(scale=3.0)
        gm = export_trace(other, (X,))
    assert (cache.misses, cache.hits) == (2, 0) and len(cache.programs) == 2
    torch.testing.assert_close(gm(X)["y"], other(X)["y"], rtol=0, atol=0)


def test_a_hugging_face_config_value_is_in_the_key():
    transformers = pytest.importorskip("transformers")

    def gpt2(**kw):
        cfg = dict(n_layer=1, n_embd=16, n_head=4, vocab_size=32, n_positions=16)
        cfg.update(kw)
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(**cfg)).eval()

    ids = {"input_ids": torch.zeros(2, 5, dtype=torch.long)}
    base = export_key(gpt2(), ids)
    assert base is not None and base == export_key(gpt2(), ids)
    assert base != export_key(gpt2(n_head=2), ids)
    assert base != export_key(gpt2(layer_norm_epsilon=1e-3), ids)
    assert base != export_key(gpt2(), {"input_ids": torch.zeros(2, 6, dtype=torch.long)})


def test_a_model_the_key_cannot_describe_is_exported_every_time():
    model = Scaled()
    model.extra = Slotted(1)          # state the key cannot compare
    assert export_key(model, (X,)) is None
    with reusing_exports() as cache:
        export_trace(model, (X,))
        export_trace(model, (X,))
    assert cache.programs == {} and (cache.misses, cache.hits) == (0, 0)


def test_graphs_rebuilt_from_one_export_share_nothing_a_pass_could_change():
    with reusing_exports(ExportCache()) as cache:
        gm1, gm2 = export_trace(Scaled(), (X,)), export_trace(Scaled(), (X,))
    assert cache.hits == 1
    (c1,) = [getattr(gm1, n.target) for n in gm1.graph.nodes
             if n.op == "get_attr" and not n.target.startswith("lin")]
    (c2,) = [getattr(gm2, n.target) for n in gm2.graph.nodes
             if n.op == "get_attr" and not n.target.startswith("lin")]
    assert c1 is not c2 and torch.equal(c1, c2)
    stacked = [n for n in gm1.graph.nodes if n.meta.get("nn_module_stack")]
    assert stacked
    for n in stacked:
        n.meta["nn_module_stack"].clear()
    with reusing_exports(cache):
        gm3 = export_trace(Scaled(), (X,))
    assert cache.hits == 2
    assert [n.meta.get("nn_module_stack") for n in gm3.graph.nodes] == \
        [n.meta.get("nn_module_stack") for n in gm2.graph.nodes]
    assert any(n.meta.get("nn_module_stack") for n in gm3.graph.nodes)


def test_outside_the_block_nothing_is_reused():
    with reusing_exports() as cache:
        export_trace(Scaled(), (X,))
    export_trace(Scaled(), (X,))
    assert (cache.misses, cache.hits) == (1, 0)


def test_without_reuse_every_capture_exports_and_keeps_its_export():
    with reusing_exports(reuse=False) as cache:
        export_trace(Scaled(), (X,))
        export_trace(Scaled(), (X,))
    assert (cache.misses, cache.hits, len(cache.programs)) == (2, 0, 1)
    with reusing_exports(cache):
        fresh = Scaled()
        gm = export_trace(fresh, (X,))
    assert cache.hits == 1
    torch.testing.assert_close(gm(X)["y"], fresh(X)["y"], rtol=0, atol=0)
