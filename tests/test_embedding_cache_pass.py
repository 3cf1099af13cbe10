"""The embedding_cache pass (Bagpipe) and the ``tidal::cached_embedding`` op.

Reference semantics: the rewritten graph, fed each batch's working set gathered from the full
tables, computes what the eager model computes (float64, bit for bit), and the gradient it gives
each table's rows is, bit for bit, those rows of the eager full-table gradient (Zipf-skewed ids,
so rows repeat many times). Lookups whose ids do not come from the inputs stay in the model with
a note; bad options and missing working sets are clear errors.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import tidal
from examples.models.recsys import deepfm_small, dlrm_small
from tidal.ir.capture import capture_train_step, trace
from tidal.ir.errors import PassError
from tidal.ir.pass_api import PassContext
from tidal.ir.plan import CompiledPlan, Plan
from tidal.ir.plans.embedding_cache import (CachedTable, EmbeddingCachePlan, table_ids,
                                            working_set)
from tidal.passes.embedding_cache import EmbeddingCache  # registers tidal::cached_embedding

OP = torch.ops.tidal.cached_embedding


def zipf(rows, shape, seed=0, alpha=1.2):
    """Ids with many duplicates: rank r drawn with probability proportional to 1/(r+1)^alpha."""
    g = torch.Generator().manual_seed(seed)
    p = 1.0 / torch.arange(1, rows + 1, dtype=torch.float64) ** alpha
    n = int(torch.tensor(shape).prod())
    return torch.multinomial(p, n, replacement=True, generator=g).reshape(shape)


# ---------------------------------------------------------------- the op: bit-for-bit gradients

OP_CASES = {
    "embedding_1d": dict(module=lambda: nn.Embedding(40, 5), shape=(300,)),
    "embedding_2d": dict(module=lambda: nn.Embedding(40, 5), shape=(30, 9)),
    "embedding_padding": dict(module=lambda: nn.Embedding(40, 5, padding_idx=0), shape=(30, 9)),
    "embedding_freq": dict(module=lambda: nn.Embedding(40, 3, scale_grad_by_freq=True),
                           shape=(30, 9)),
    "sum_offsets": dict(module=lambda: nn.EmbeddingBag(40, 5, mode="sum"), shape=(300,),
                        offsets=[0, 4, 4, 90, 200]),
    "mean_offsets": dict(module=lambda: nn.EmbeddingBag(40, 5, mode="mean"), shape=(300,),
                         offsets=[0, 4, 4, 90, 200]),
    "max_offsets": dict(module=lambda: nn.EmbeddingBag(40, 5, mode="max"), shape=(300,),
                        offsets=[0, 4, 4, 90, 200]),
    "sum_2d_weights": dict(module=lambda: nn.EmbeddingBag(40, 7, mode="sum"), shape=(30, 9),
                           weights=True),
    "sum_offsets_weights_padding": dict(
        module=lambda: nn.EmbeddingBag(40, 5, mode="sum", padding_idx=1), shape=(300,),
        offsets=[0, 4, 4, 90, 200], weights=True),
    "mean_2d_padding": dict(module=lambda: nn.EmbeddingBag(40, 5, mode="mean", padding_idx=0),
                            shape=(30, 9)),
    "max_2d_padding": dict(module=lambda: nn.EmbeddingBag(40, 5, mode="max", padding_idx=0),
                           shape=(30, 9)),
    "mean_last_offset": dict(
        module=lambda: nn.EmbeddingBag(40, 5, mode="mean", include_last_offset=True),
        shape=(300,), offsets=[0, 4, 4, 90, 200, 300]),
}


@pytest.mark.parametrize("case", sorted(OP_CASES))
def test_op_gradient_equals_full_table_rows_bit_for_bit(case):
    spec = OP_CASES[case]
    torch.manual_seed(0)
    module = spec["module"]().double()
    ids = zipf(40, spec["shape"])
    offsets = torch.tensor(spec["offsets"]) if "offsets" in spec else None
    weights = torch.rand(spec["shape"], dtype=torch.float64) if spec.get("weights") else None
    bag = isinstance(module, nn.EmbeddingBag)
    out = module(ids, offsets, weights) if bag else module(ids)
    grad = torch.randn_like(out)
    out.backward(grad)

    unique = torch.unique(ids, sorted=True)
    assert unique.numel() < ids.numel() / 4  # many duplicates per row
    rows = module.weight.detach()[unique].requires_grad_()
    cached = OP("t", unique, rows, ids, offsets, weights, module.mode if bag else "",
                padding_idx=module.padding_idx,
                include_last_offset=getattr(module, "include_last_offset", False),
                scale_grad_by_freq=module.scale_grad_by_freq)
    assert torch.equal(cached, out)
    cached.backward(grad)
    assert torch.equal(rows.grad, module.weight.grad[unique])
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[unique] = False
    assert not module.weight.grad[untouched].any()
    if module.padding_idx is not None and bool((unique == module.padding_idx).any()):
        pad_row = int((unique == module.padding_idx).nonzero())
        assert not rows.grad[pad_row].any()  # as in eager: the padding row gets no gradient


def test_op_per_sample_weights_gradient():
    torch.manual_seed(0)
    module = nn.EmbeddingBag(40, 6, mode="sum").double()
    ids = zipf(40, (20, 5))
    weights = torch.rand(20, 5, dtype=torch.float64, requires_grad=True)
    out = module(ids, None, weights)
    grad = torch.randn_like(out)
    out.backward(grad)
    unique = torch.unique(ids)
    mine = weights.detach().clone().requires_grad_()
    OP("t", unique, module.weight.detach()[unique], ids, None, mine, "sum").backward(grad)
    # a dot product per sample: the summation order inside BLAS depends on alignment
    torch.testing.assert_close(mine.grad, weights.grad, rtol=0, atol=1e-12)


def test_op_errors_name_the_table():
    table = torch.randn(10, 3, dtype=torch.float64)
    ids = torch.tensor([[1, 4], [4, 9]])
    unique = torch.tensor([1, 4])
    with pytest.raises(ValueError, match=r"table 'tables\.2': id 9 is not in its working set"):
        OP("tables.2", unique, table[unique], ids, None, None, "")
    with pytest.raises(ValueError, match=r"table 'tables\.2': no working set \(rows is None\)"):
        OP("tables.2", unique, None, ids, None, None, "")
    with pytest.raises(ValueError, match=r"table 'tables\.2': unique_ids must be sorted"):
        OP("tables.2", torch.tensor([4, 1]), table[[4, 1]], ids, None, None, "")
    with pytest.raises(ValueError, match=r"table 'tables\.2': rows must be"):
        OP("tables.2", unique, table[:3], ids, None, None, "")
    with pytest.raises(ValueError, match=r"table 'tables\.2': bag_mode 'median'"):
        OP("tables.2", unique, table[unique], ids, None, None, "median")


# ------------------------------------------------------------------------------- models

class Bags(nn.Module):
    """EmbeddingBags (sum with per-sample weights, mean with padding, max) fed 1-D ids and
    offsets built in the forward, each table its own slice of the (batch-first) inputs."""

    def __init__(self):
        super().__init__()
        self.bags = nn.ModuleList([nn.EmbeddingBag(50, 4, mode="sum"),
                                   nn.EmbeddingBag(60, 4, mode="mean", padding_idx=0),
                                   nn.EmbeddingBag(70, 4, mode="max")])
        self.top = nn.Linear(12 + 3, 1)

    def forward(self, dense, ids, weights):
        b, _, per = ids.shape
        offsets = torch.arange(0, b * per, per)
        pooled = [self.bags[0](ids[:, 0].reshape(-1), offsets, weights.reshape(-1)),
                  self.bags[1](ids[:, 1].reshape(-1), offsets),
                  self.bags[2](ids[:, 2].reshape(-1) + 0, offsets)]
        return self.top(torch.cat(pooled + [dense], dim=1)).squeeze(1)


def bags_inputs(batch=6, per=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([zipf(50, (batch, per), seed), zipf(60, (batch, per), seed + 1),
                       zipf(70, (batch, per), seed + 2)], dim=1)
    weights = torch.rand(batch, per, generator=g, dtype=torch.float64)
    return torch.rand(batch, 3, generator=g, dtype=torch.float64), ids, weights


class Tokens(nn.Module):
    """nn.Embedding on 2-D ids with a padding row, beside position embeddings whose ids come
    from a buffer and from ``torch.arange`` (both stay in the model)."""

    def __init__(self):
        super().__init__()
        self.words = nn.Embedding(80, 6, padding_idx=0)
        self.pos = nn.Embedding(16, 6)
        self.seg = nn.Embedding(16, 6)
        self.register_buffer("seg_ids", torch.arange(12) % 2)  # sequences of 12 tokens
        self.head = nn.Linear(6, 2)

    def forward(self, tokens):
        n = tokens.shape[1]
        h = self.words(tokens) + self.pos(torch.arange(n)) + self.seg(self.seg_ids)
        return self.head(torch.tanh(h)).sum(1)


class FunctionalTable(nn.Module):
    """``F.embedding`` on a parameter read with ``get_attr``, and a tied pair (an embedding
    whose weight the output layer shares) that must stay in the model."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(30, 4))
        self.tied = nn.Embedding(20, 4)
        self.out = nn.Linear(4, 20, bias=False)
        self.out.weight = self.tied.weight

    def forward(self, a, b):
        return F.embedding(a, self.table, padding_idx=-1).sum(1) + self.out(self.tied(b)).sum(
            1)[:, :4]


def _bert():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=32,
                                  max_position_embeddings=32)
    return transformers.BertModel(cfg)


def _model(name):
    """(model in float64 eval mode, example inputs (tuple or dict), weights by table name)."""
    torch.manual_seed(0)
    if name == "bags":
        model, inputs = Bags(), bags_inputs()
    elif name == "tokens":
        model, inputs = Tokens(), (zipf(80, (5, 12)),)
    elif name == "functional":
        model, inputs = FunctionalTable(), (zipf(30, (4, 7)), zipf(20, (4, 3), seed=1))
    elif name == "bert":
        model, inputs = _bert(), {"input_ids": zipf(64, (3, 9))}
    else:
        model = {"dlrm_small": dlrm_small, "deepfm_small": deepfm_small}[name]()
        inputs = None
    model = model.double().eval()
    if inputs is None:
        dense, sparse = model.example_inputs(16)
        inputs = (dense, zipf(100, (16, len(model.table_rows))))  # every table has >= 100 rows
    weights = {n.removesuffix(".weight"): p for n, p in model.named_parameters()}
    return model, inputs, weights


def _call(fn, inputs, **extra):
    return fn(**inputs, **extra) if isinstance(inputs, dict) else fn(*inputs, **extra)


def _output(out):
    return out["last_hidden_state"] if isinstance(out, dict) else \
        getattr(out, "last_hidden_state", out)


EXPECTED = {  # model -> (cached tables, tables kept in the model)
    "bags": (["bags.0", "bags.1", "bags.2"], []),
    "tokens": (["words"], ["pos", "seg"]),
    "functional": (["table"], ["tied"]),
    "bert": (["embeddings.word_embeddings"],
             ["embeddings.token_type_embeddings", "embeddings.position_embeddings"]),
    "dlrm_small": ([f"tables.{t}" for t in range(8)], []),
    "deepfm_small": ([f"{k}.{t}" for t in range(8) for k in ("tables", "linear")], []),
}


@pytest.fixture(scope="module", params=sorted(EXPECTED))
def cached(request):
    model, inputs, weights = _model(request.param)
    c = tidal.compile(model, inputs, passes=[EmbeddingCache(lookahead=3)])
    return request.param, model, inputs, weights, c


# ------------------------------------------------------------------- the pass on models

def test_forward_equals_eager_bit_for_bit(cached):
    name, model, inputs, weights, c = cached
    plan = c.plan.get("embedding_cache")
    assert isinstance(plan, EmbeddingCachePlan) and plan.lookahead == 3
    want_cached, want_kept = EXPECTED[name]
    assert sorted(t.name for t in plan.tables) == sorted(want_cached)
    notes = [n for r in c.records if r.name == "embedding_cache" for n in r.notes]
    for kept in want_kept:
        assert any(n.startswith(f"kept {kept} ") for n in notes), notes
    modules = dict(c.graph_module.named_modules())
    params = dict(c.graph_module.named_parameters())
    for t in plan.tables:  # the tables left the graph module; the plan keeps their shape
        assert t.name not in modules and t.name not in params
        assert (t.num_rows, t.dim, t.dtype) == (*weights[t.name].shape, "float64")
    ws = working_set(plan, _call(lambda *a, **k: table_ids(c.graph_module, plan, *a, **k),
                                 inputs), weights)
    with torch.no_grad():
        assert torch.equal(_output(_call(c.graph_module, inputs, **ws)),
                           _output(_call(model, inputs)))


def test_table_ids_are_the_ids_the_modules_saw(cached):
    name, model, inputs, weights, c = cached
    plan = c.plan.get("embedding_cache")
    seen = {}

    def record(name):
        def hook(module, args):
            seen[name] = args[0]  # returns None: the call's arguments stay as they are
        return hook

    hooks = [m.register_forward_pre_hook(record(k)) for k, m in model.named_modules()
             if k in {t.name for t in plan.tables}]
    try:
        with torch.no_grad():
            _call(model, inputs)
    finally:
        for h in hooks:
            h.remove()
    got = _call(lambda *a, **k: table_ids(c.graph_module, plan, *a, **k), inputs)
    assert sorted(got) == sorted(t.name for t in plan.tables)
    for t in plan.tables:
        if t.name in seen:  # a module (F.embedding tables have no module to hook)
            assert torch.equal(got[t.name], seen[t.name])
    if name == "functional":
        assert torch.equal(got["table"], inputs[0])


def test_plan_json_round_trip(cached):
    c = cached[-1]
    plan = c.plan.get("embedding_cache")
    assert Plan.from_json(plan.to_json()) == plan
    assert CompiledPlan.from_json(c.plan.to_json()).get("embedding_cache") == plan
    assert plan.table().splitlines()[-1] == plan.summary()


@pytest.mark.parametrize("name", ["bags", "dlrm_small"])
def test_training_gradients_equal_eager_bit_for_bit(name):
    model, inputs, weights = _model(name)
    c = tidal.compile(model, inputs, passes=[EmbeddingCache()])
    gm, plan = c.graph_module, c.plan.get("embedding_cache")
    ws = working_set(plan, table_ids(gm, plan, *inputs), weights, requires_grad=True)
    gm(*inputs, **ws).square().mean().backward()
    model(*inputs).square().mean().backward()
    for t in plan.tables:
        assert torch.equal(ws[t.rows_input].grad, weights[t.name].grad[ws[t.ids_input]])
    for k, p in gm.named_parameters():
        assert torch.equal(p.grad, dict(model.named_parameters())[k].grad), k


def test_training_capture_through_the_op():
    """make_fx captures forward + backward through tidal::cached_embedding (the backward as
    tidal::cached_embedding_backward); the captured step's gradients equal eager's, and
    tidal's capture_train_step works on the rewritten graph."""
    model, (dense, sparse), weights = _model("dlrm_small")
    targets = model.example_targets(16)
    c = tidal.compile(model, (dense, sparse), passes=[EmbeddingCache()])
    gm, plan = c.graph_module, c.plan.get("embedding_cache")
    ws = working_set(plan, table_ids(gm, plan, dense, sparse), weights)
    params, buffers = dict(gm.named_parameters()), dict(gm.named_buffers())

    def step(params, buffers, ws, dense, sparse, targets):
        out = torch.func.functional_call(gm, {**params, **buffers}, (dense, sparse), ws)
        loss = model.default_loss(out, targets)
        rows = [ws[t.rows_input] for t in plan.tables]
        return loss, torch.autograd.grad(loss, list(params.values()) + rows)

    ws_grad = {k: v.requires_grad_() if v.is_floating_point() else v for k, v in ws.items()}
    joint = make_fx(step, tracing_mode="fake")(params, buffers, ws_grad, dense, sparse, targets)
    targets_of = [str(n.target) for n in joint.graph.nodes]
    assert targets_of.count("tidal.cached_embedding.default") == len(plan.tables)
    assert targets_of.count("tidal.cached_embedding_backward.default") == len(plan.tables)
    loss, grads = joint(params, buffers, ws_grad, dense, sparse, targets)
    model.default_loss(model(dense, sparse), targets).backward()
    eager = dict(model.named_parameters())
    for k, g in zip(params, grads):
        assert torch.equal(g, eager[k].grad), k
    for t, g in zip(plan.tables, grads[len(params):]):
        assert torch.equal(g, eager[t.name + ".weight"].grad[ws[t.ids_input]])
    kw = {"dense": dense, "sparse": sparse, **ws}
    step_loss, step_grads = capture_train_step(gm, kw, targets, model.default_loss).run(
        gm, kw, targets)
    assert torch.equal(step_loss, loss)
    assert all(torch.equal(g, eager[k].grad) for k, g in step_grads.items())


# -------------------------------------------------------------------------------- errors

def test_missing_working_set_and_unknown_id_are_clear_errors():
    model, inputs, weights = _model("bags")
    c = tidal.compile(model, inputs, passes=[EmbeddingCache()])
    plan = c.plan.get("embedding_cache")
    with pytest.raises(ValueError, match=r"table 'bags\.0': no working set .*ids_input"):
        c.graph_module(*inputs)
    ws = working_set(plan, table_ids(c.graph_module, plan, *inputs), weights)
    t = plan.table_named("bags.1")
    missing = int(ws[t.ids_input][-1])
    ws[t.ids_input], ws[t.rows_input] = ws[t.ids_input][:-1], ws[t.rows_input][:-1]
    with pytest.raises(ValueError, match=rf"table 'bags\.1': id {missing} is not in its "):
        c.graph_module(*inputs, **ws)
    with pytest.raises(ValueError, match=r"table 'bags\.2' has 70 rows; id 70 is out of range"):
        working_set(plan, {"bags.0": torch.tensor([1]), "bags.1": torch.tensor([2]),
                           "bags.2": torch.tensor([3, 70])}, weights)
    with pytest.raises(ValueError, match=r"no weights for cached table 'bags\.0'"):
        working_set(plan, {t.name: torch.tensor([1]) for t in plan.tables}, {})


@pytest.mark.parametrize("tables, message", [
    (["nope"], r"tables: the model has no module 'nope' \(embedding lookups: "),
    (["top"], r"tables: 'top' is a Linear, not an nn\.Embedding"),
])
def test_bad_tables_option_raises_pass_error(tables, message):
    model, inputs, _ = _model("bags")
    with pytest.raises(PassError, match=message):
        tidal.compile(model, inputs, passes=[EmbeddingCache(tables=tables)])


def test_tables_option_selects_and_refuses_position_embeddings():
    model, inputs, weights = _model("tokens")
    with pytest.raises(PassError, match=r"cannot cache 'pos': its ids come from torch\.arange"):
        tidal.compile(model, inputs, passes=[EmbeddingCache(tables=["pos"])])
    model, inputs, weights = _model("bags")
    c = tidal.compile(model, inputs, passes=[EmbeddingCache(tables="bags.2", min_rows=0)])
    assert [t.name for t in c.plan.get("embedding_cache").tables] == ["bags.2"]
    c = tidal.compile(model, inputs, passes=[EmbeddingCache(min_rows=55)])
    assert [t.name for t in c.plan.get("embedding_cache").tables] == ["bags.1", "bags.2"]
    assert any("50 rows < min_rows=55" in n for r in c.records for n in r.notes)


def test_options_and_auto_selection():
    with pytest.raises(ValueError, match=r"embedding_cache: lookahead=-1 must be an int >= 0"):
        EmbeddingCache(lookahead=-1)
    with pytest.raises(ValueError, match="lookahead"):
        EmbeddingCachePlan(tables=(), lookahead=-2)
    t = CachedTable("a", 4, 2, "", "a_unique_ids", "a_rows", "float32")
    with pytest.raises(ValueError, match="table 'a' is listed twice"):
        EmbeddingCachePlan(tables=(t, t))
    model, inputs, _ = _model("bags")
    gm = trace(model, inputs)
    ctx = PassContext.for_inputs(inputs)
    assert "name it in passes=" in EmbeddingCache().why_not(gm, ctx)  # never chosen by "auto"
    plain = trace(nn.Sequential(nn.Linear(3, 2)), (torch.randn(2, 3),))
    assert "no embedding lookup" in EmbeddingCache().why_not(plain, ctx)
    result = EmbeddingCache()(plain, ctx)
    assert result.plan is None and "no table cached" in result.notes[-1]
