"""DLRM and DeepFM click models (examples/models/recsys.py)."""
import doctest
import math

import pytest
import torch
from torch.fx import symbolic_trace

import examples.models.recsys
import tidal
from examples.data import ClickData
from examples.models import SMALL_MODELS, ZOO
from examples.models.recsys import (CRITEO_LIKE_ROWS, DLRM, SMALL_ROWS, DeepFM, deepfm,
                                    deepfm_small, dlrm, dlrm_small)

SMALL = {"dlrm_small": dlrm_small, "deepfm_small": deepfm_small}


def _build(factory, double=False):
    torch.manual_seed(0)
    model = factory()
    return model.double() if double else model


def dlrm_reference(model, dense, sparse):
    """DLRM written out: explicit row gathers and a loop over the pairs (i > j)."""
    x = model.bottom(dense)
    vectors = [x] + [table.weight[sparse[:, t]] for t, table in enumerate(model.tables)]
    dots = [(vectors[i] * vectors[j]).sum(1) for i in range(len(vectors)) for j in range(i)]
    return model.top(torch.cat([x, torch.stack(dots, 1)], 1)).squeeze(1)


def deepfm_reference(model, dense, sparse):
    """DeepFM written out: the FM term as the sum of pairwise dot products."""
    emb = [table.weight[sparse[:, t]] for t, table in enumerate(model.tables)]
    linear = model.dense_linear(dense).squeeze(1) + sum(
        table.weight[sparse[:, t], 0] for t, table in enumerate(model.linear))
    fm = sum((emb[i] * emb[j]).sum(1) for i in range(len(emb)) for j in range(i))
    deep = model.deep(torch.cat(emb + [dense], 1)).squeeze(1)
    return linear + fm + deep


REFERENCES = {"dlrm_small": dlrm_reference, "deepfm_small": deepfm_reference}


def test_docstring_examples():
    result = doctest.testmod(examples.models.recsys,
                             optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


def test_registered_in_zoo_but_not_small():
    for name in ("dlrm", "dlrm_small", "deepfm", "deepfm_small"):
        assert name in ZOO and name not in SMALL_MODELS


@pytest.mark.parametrize("name", sorted(SMALL))
def test_forward_matches_written_out_reference_in_float64(name):
    model = _build(SMALL[name], double=True)
    dense, sparse = model.example_inputs(16)
    assert dense.dtype == torch.float64 and sparse.dtype == torch.int64
    out = model(dense, sparse)
    assert out.shape == (16,) and out.dtype == torch.float64
    torch.testing.assert_close(out, REFERENCES[name](model, dense, sparse), rtol=1e-12,
                               atol=1e-12)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_backward_reaches_every_parameter_and_only_looked_up_rows(name):
    model = _build(SMALL[name], double=True)
    dense, sparse = model.example_inputs(8)
    targets = model.example_targets(8)
    assert targets.dtype == torch.float64 and set(targets.tolist()) <= {0.0, 1.0}
    model.default_loss(model(dense, sparse), targets).backward()
    for pname, param in model.named_parameters():
        assert param.grad is not None and bool(torch.isfinite(param.grad).all()), pname
    for t, table in enumerate(model.tables):
        touched = table.weight.grad.abs().sum(1) != 0
        assert set(touched.nonzero().flatten().tolist()) == set(sparse[:, t].tolist())


@pytest.mark.parametrize("name", sorted(SMALL))
def test_fx_trace_has_one_call_module_per_table(name):
    model = _build(SMALL[name])
    gm = symbolic_trace(model)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    tables = [f"tables.{t}" for t in range(model.num_tables)]
    assert [t for t in targets if t.startswith("tables.")] == tables
    if name.startswith("deepfm"):
        linear = [f"linear.{t}" for t in range(model.num_tables)]
        assert [t for t in targets if t.startswith("linear.")] == linear
        assert isinstance(model.get_submodule("linear.0"), torch.nn.Embedding)
        assert model.get_submodule("linear.0").embedding_dim == 1
    else:
        assert model.get_submodule("tables.0").mode == "sum"
    inputs = model.example_inputs(4)
    assert torch.equal(gm(*inputs), model(*inputs))


@pytest.mark.parametrize("name", sorted(SMALL))
def test_compile_without_passes_is_the_model(name):
    model = _build(SMALL[name]).eval()
    inputs = model.example_inputs(4)
    compiled = tidal.compile(model, inputs)
    with torch.no_grad():
        assert torch.equal(compiled(*inputs), model(*inputs))


@pytest.mark.parametrize("name", sorted(SMALL))
def test_init_is_deterministic_from_the_global_seed(name):
    a, b = _build(SMALL[name]), _build(SMALL[name])
    for (key, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), key
    torch.manual_seed(1)
    c = SMALL[name]()
    assert not torch.equal(a.tables[0].weight, c.tables[0].weight)


def test_small_sizes():
    for factory in SMALL.values():
        model = factory()
        assert model.table_rows == SMALL_ROWS and model.num_tables == 8
        assert all(table.embedding_dim == 8 for table in model.tables)


def test_full_models_have_table_5_2_layers():
    with torch.device("meta"):
        big_dlrm, big_deepfm = dlrm(), deepfm()
    dense_params = sum(p.numel() for n, p in big_dlrm.named_parameters()
                       if not n.startswith("tables."))
    assert dense_params == 2_962_289  # Table 5.2
    widths = [m.out_features for m in big_dlrm.bottom if isinstance(m, torch.nn.Linear)]
    assert widths == [512, 256, 64, 48]
    widths = [m.out_features for m in big_dlrm.top if isinstance(m, torch.nn.Linear)]
    assert widths == [1024, 1024, 1024, 256, 128, 1]
    assert big_deepfm.deep[0].in_features == 26 * 48 + 13
    for model in (big_dlrm, big_deepfm):
        assert model.table_rows == CRITEO_LIKE_ROWS and model.num_tables == 26
        assert [t.num_embeddings for t in model.tables] == list(CRITEO_LIKE_ROWS)
        assert min(CRITEO_LIKE_ROWS) == 10_000 and max(CRITEO_LIKE_ROWS) == 100_000
        dense, sparse = model.example_inputs(2)
        assert model(dense, sparse).shape == (2,)


@pytest.mark.parametrize("cls", [DLRM, DeepFM])
@pytest.mark.parametrize("kwargs,argument", [
    (dict(num_dense=0), "num_dense"),
    (dict(table_rows=()), "table_rows"),
    (dict(table_rows=(5, 0)), r"table_rows\[1\]"),
    (dict(dim=0), "dim"),
])
def test_bad_sizes_are_named(cls, kwargs, argument):
    full = dict(num_dense=2, table_rows=(5, 6), dim=4) | kwargs
    with pytest.raises(ValueError, match=f"{cls.__name__}: {argument}"):
        cls(**full)


def test_deepfm_learns_click_data():
    """A few Adam steps on ClickData beat the best constant predictor on held-out batches."""
    model = _build(deepfm_small)
    data = ClickData(model.num_dense, model.table_rows, batch_size=256, alpha=1.0, seed=5)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for i in range(60):
        (dense, sparse), labels = data.batch(i)
        loss = model.default_loss(model(dense, sparse), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    held_out = [data.batch(10_000 + i) for i in range(4)]
    labels = torch.cat([b[1] for b in held_out])
    with torch.no_grad():
        logits = torch.cat([model(*b[0]) for b in held_out])
    rate = labels.mean().item()
    constant = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))
    assert model.default_loss(logits, labels).item() < constant - 0.02
