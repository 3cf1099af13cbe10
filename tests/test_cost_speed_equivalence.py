"""The cost model's shortcuts (``cost.annotate``'s default) give the annotations of its reference
path (``shortcuts=False``: every node counted forward and backward at both batch sizes, each
expression through ``sympy.nsimplify``), node by node, on zoo models and on a model built to hit
the shortcuts' edge cases; and they are taken where they should be."""
import pytest
import sympy
import torch
from torch import nn

from examples.models import ZOO
from tidal.ir import cost, meta
from tidal.ir.capture import trace

BATCHES = (1, 2, 3, 4, 7, 8, 64, 1000)
"""Batch sizes every expression is evaluated at (tests use 1 to 64)."""


def _annotated(model: nn.Module, inputs: tuple, shortcuts: bool):
    gm = trace(model, inputs)
    cost.annotate(gm, inputs, shortcuts=shortcuts)
    return gm


def _assert_same_annotations(fast, reference):
    pairs = list(zip(fast.graph.nodes, reference.graph.nodes))
    assert len(pairs) == len(reference.graph.nodes) == len(fast.graph.nodes)
    for got, want in pairs:
        assert got.name == want.name
        assert meta.get_tensors(got) == meta.get_tensors(want), got.name
        assert meta.get_layer(got) == meta.get_layer(want), got.name
        c, r = meta.get_cost(got), meta.get_cost(want)
        assert (c is None) == (r is None), got.name
        if r is None:
            continue
        assert (c.param_bytes, c.buffer_bytes) == (r.param_bytes, r.buffer_bytes), got.name
        for key in ("fwd_flops", "bwd_flops", "out_bytes"):
            a, b = getattr(c, key), getattr(r, key)
            assert a == b and sympy.simplify(a - b) == 0, (got.name, key, a, b)
            for batch in BATCHES:  # integers: exact, no tolerance needed
                assert a.subs(cost.BATCH, batch) == b.subs(cost.BATCH, batch), (got.name, key)


@pytest.mark.parametrize("name,batch", [("resnet50_small", 2), ("bert_small", 3),
                                        ("llama_small", 1)])
def test_shortcuts_give_the_reference_annotations_on_zoo_models(name, batch):
    model = ZOO[name]()
    inputs = model.example_inputs(batch)
    fast = _annotated(model, inputs, shortcuts=True)
    reference = _annotated(model, inputs, shortcuts=False)
    _assert_same_annotations(fast, reference)
    totals = cost.total_cost(fast, 4)
    assert totals["fwd_flops"] > 0 and totals["bwd_flops"] > totals["fwd_flops"]


class _EdgeCases(nn.Module):
    """Channels-last convolution into batch norm (strides kept), a dtype change on a
    shape-preserving op (the second-batch shortcut must not apply), a scalar-times-tensor, an
    integer path through an embedding, a broadcasting add of two tensors, a batch-free branch."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1).to(memory_format=torch.channels_last)
        self.bn = nn.BatchNorm2d(4)
        self.act = nn.GELU()
        self.emb = nn.Embedding(10, 4)
        self.norm = nn.LayerNorm(4)
        self.register_buffer("bias", torch.ones(4))

    def forward(self, image, ids):
        x = self.act(self.bn(self.conv(image)))                # (B, 4, 5, 5) channels last
        x = (x * 0.5).to(torch.float64).float()                 # dtype round trip
        pooled = x.mean(dim=(2, 3))                             # (B, 4)
        tokens = self.norm(self.emb(ids)) + self.bias.relu()    # (B, T, 4) + batch-free (4,)
        return torch.softmax(pooled, dim=-1), tokens.sum(1) @ self.bias.diag()


@pytest.mark.parametrize("batch", [1, 3])
def test_shortcuts_give_the_reference_annotations_on_edge_cases(batch):
    image = torch.randn(batch, 3, 5, 5).to(memory_format=torch.channels_last)
    ids = torch.randint(0, 10, (batch, 6))
    model = _EdgeCases()
    fast = _annotated(model, (image, ids), shortcuts=True)
    reference = _annotated(model, (image, ids), shortcuts=False)
    _assert_same_annotations(fast, reference)
    nodes = {n.name: n for n in fast.graph.nodes}
    assert meta.get_cost(nodes["conv"]).fwd_flops.free_symbols == {cost.BATCH}
    assert meta.get_cost(nodes["matmul"]).bwd_flops != 0
    assert meta.get_cost(nodes["bn"]).out_bytes == 4 * 5 * 5 * 4 * cost.BATCH


def test_shortcuts_are_taken_only_for_flop_free_ops():
    gm = trace(ZOO["resnet50_small"](), ZOO["resnet50_small"]().example_inputs(2))
    kinds = {}
    for n in gm.graph.nodes:
        if n.op == "call_module":
            kinds.setdefault(type(gm.get_submodule(n.target)).__name__,
                             cost.flop_free_kind(n, gm.get_submodule(n.target)))
    assert kinds["Conv2d"] is None and kinds["Linear"] is None
    assert kinds["BatchNorm2d"] == kinds["ReLU"] == cost.SHAPE_PRESERVING
    assert kinds["MaxPool2d"] == cost.FREE
    matmul = [n for n in trace(ZOO["llama_small"](), ZOO["llama_small"]().example_inputs(1))
              .graph.nodes if n.op == "call_function" and n.target.__name__ == "matmul"]
    assert matmul and all(cost.flop_free_kind(n) is None for n in matmul)
    aten_mm = torch.fx.Graph().create_node("call_function", torch.ops.aten.mm.default)
    aten_view = torch.fx.Graph().create_node("call_function", torch.ops.aten.view.default)
    assert cost.flop_free_kind(aten_mm) is None and cost.flop_free_kind(aten_view) == cost.FREE


@pytest.mark.parametrize("b0,v0,b1,v1", [(2, 64, 3, 96), (1, 7, 2, 7), (4, 10, 5, 13),
                                         (2, 5, 4, 10), (3, 0, 4, 0), (2, 2**40, 3, 3 * 2**39)])
def test_affine_equals_the_nsimplify_expression(b0, v0, b1, v1):
    fast, reference = cost.affine(b0, v0, b1, v1), cost.affine_by_nsimplify(b0, v0, b1, v1)
    assert fast == reference and sympy.srepr(fast) == sympy.srepr(reference)
    assert fast.subs(cost.BATCH, b0) == v0 and fast.subs(cost.BATCH, b1) == v1
