"""IR: cost annotation, custom ops, plans, layer graph."""
import enum
from dataclasses import dataclass
from typing import Optional

import pytest
import sympy
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

import tidal
from examples.models import ZOO
from tidal.ir.capture import trace
from tidal.ir import cost, layer_graph, meta, ops
from tidal.ir.plan import CompiledPlan, Plan


# ---------------------------------------------------------------- cost model
def test_linear_and_conv_costs_are_exact_in_batch():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Flatten(),
                                torch.nn.Linear(8 * 4 * 4, 5))
    gm = trace(model, (torch.randn(2, 3, 4, 4),))
    cost.annotate(gm, (torch.randn(2, 3, 4, 4),))
    conv, _, lin = [n for n in gm.graph.nodes if n.op == "call_module"]
    B = cost.BATCH
    assert meta.get_cost(conv).fwd_flops == 2 * 8 * 3 * 9 * 16 * B  # 2·Cout·Cin·k²·HW per sample
    assert meta.get_cost(lin).fwd_flops == 2 * 128 * 5 * B
    assert meta.get_cost(lin).out_bytes == 5 * 4 * B
    assert meta.get_cost(lin).param_bytes == (128 * 5 + 5) * 4
    assert meta.get_tensors(conv)[0].shape == (2, 8, 4, 4)
    # backward of a linear layer: grad input + grad weight = 2x forward
    assert meta.get_cost(lin).bwd_flops == 2 * meta.get_cost(lin).fwd_flops


def test_annotate_matches_flop_counter_on_whole_model_and_leaves_params_alone():
    model = ZOO["bert_small"]()
    x = model.example_inputs(3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    gm = trace(model, x)
    cost.annotate(gm, x)
    with torch.utils.flop_counter.FlopCounterMode(display=False) as fc:
        model(*model.example_inputs(5))
    assert cost.total_cost(gm, 5)["fwd_flops"] == fc.get_total_flops() > 0
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]) and v.device.type == "cpu"


def test_attention_flops_are_counted_and_affine():
    model = ZOO["llama_small"]()
    x = model.example_inputs(2)
    gm = trace(model, x)
    cost.annotate(gm, x)
    matmuls = [meta.get_cost(n) for n in gm.graph.nodes
               if n.op == "call_function" and getattr(n.target, "__name__", "") == "matmul"]
    assert matmuls and all(c.fwd_flops.free_symbols == {cost.BATCH} for c in matmuls)


def test_node_time_uses_profile_then_flops():
    gm = trace(torch.nn.Sequential(torch.nn.Linear(4, 4)), (torch.randn(2, 4),))
    cost.annotate(gm, (torch.randn(2, 4),))
    lin = next(n for n in gm.graph.nodes if n.op == "call_module")
    cl = tidal.Cluster(gpus=1, peak_tflops=1.0)
    fwd, bwd = cost.node_time_us(gm, lin, 4, cl)
    assert fwd == pytest.approx(2 * 16 * 4 / 1e6) and bwd == pytest.approx(2 * fwd)
    from tidal.ir.device_profile import LayerTime
    from tidal.ir.profiler import node_signature
    prof = tidal.DeviceProfile("toy", {node_signature(gm, lin, 4): LayerTime(7.0, 9.0)})
    profiled = tidal.Cluster(gpus=1, profile=prof)
    assert cost.node_time_us(gm, lin, 4, profiled) == (7.0, 9.0)
    for cl_ in (cl, profiled):  # the whole-graph form gives the same times, node by node
        assert cost.node_times_us(gm, 4, cl_) == {
            n.name: cost.node_time_us(gm, n, 4, cl_) for n in gm.graph.nodes}


def test_cluster_validates_and_defaults_to_world_size(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert tidal.Cluster().gpus == 4
    with pytest.raises(ValueError, match="gpus"):
        tidal.Cluster(gpus=0)
    with pytest.raises(ValueError, match="bandwidth_gbps"):
        tidal.Cluster(gpus=1, bandwidth_gbps=0)
    assert tidal.Cluster(gpus=1, bandwidth_gbps=8, latency_us=5).transfer_us(1000) == 6.0


# ---------------------------------------------------------------- custom ops
def test_group_boundary_is_kept_by_dce_runs_and_is_captured():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    x = torch.randn(3, 4)
    gm = trace(model, (x,))
    second = [n for n in gm.graph.nodes if n.op == "call_module"][1]
    with gm.graph.inserting_before(second):
        gm.graph.call_function(ops.GROUP_BOUNDARY, (1,))
    assert not gm.graph.eliminate_dead_code()  # nothing removed
    gm.recompile()
    torch.testing.assert_close(gm(x), model(x))
    params = dict(gm.named_parameters())

    def step(params, x):
        out = torch.func.functional_call(gm, params, (x,))
        return torch.autograd.grad(out.sum(), list(params.values()))

    joint = make_fx(step, tracing_mode="fake")(params, x)
    assert any(n.target is ops.GROUP_BOUNDARY for n in joint.graph.nodes)
    assert ops.is_tidal_op(ops.GROUP_BOUNDARY) and not ops.is_tidal_op(torch.ops.aten.add.Tensor)


# ---------------------------------------------------------------- plans
class Mode(enum.Enum):
    DP = "dp"
    BURST = "burst"


@dataclass(frozen=True)
class LayerChoice:
    layer: str
    gpus: int
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class ToyPlan(Plan):
    mode: Mode
    layers: tuple[LayerChoice, ...]
    ranges: dict[int, tuple[int, int]]
    time_us: float
    note: Optional[str] = None


def _toy():
    return ToyPlan(Mode.BURST, (LayerChoice("conv1", 4, (0, 1, 2, 3)), LayerChoice("fc", 1, (0,))),
                   {0: (0, 8), 3: (24, 32)}, 1234.5, None)


def test_plan_json_round_trip_exact():
    plan = _toy()
    back = Plan.from_json(plan.to_json())
    assert back == plan and type(back) is ToyPlan and isinstance(back.layers[0].ranks, tuple)
    assert back.to_json() == plan.to_json()
    nested = CompiledPlan((("burst_parallel", plan), ("other", ToyPlan(Mode.DP, (), {}, 0.0))))
    assert CompiledPlan.from_json(nested.to_json()) == nested
    assert nested.get("other").mode is Mode.DP


def test_plan_json_errors_name_the_field():
    text = _toy().to_json().replace('"gpus": 4', '"gpus": "four"')
    with pytest.raises(tidal.PlanError, match=r"layers\[0\]\.gpus"):
        ToyPlan.from_json(text)
    with pytest.raises(tidal.PlanError, match="not valid"):
        ToyPlan.from_json("{nope")
    with pytest.raises(tidal.PlanError, match="no importable class"):
        Plan.from_json('{"kind": "tidal.nowhere:Gone", "data": {}}')
    with pytest.raises(tidal.PlanError, match="not a ToyPlan"):
        ToyPlan.from_json(CompiledPlan(()).to_json())


# ---------------------------------------------------------------- registries
def test_a_registry_lists_without_importing_and_names_what_it_knows(tmp_path, monkeypatch):
    import sys
    import uuid

    from tidal.ir.registry import Entry, Registry, RegistryError

    name = f"tidal_registry_probe_{uuid.uuid4().hex}"
    (tmp_path / f"{name}.py").write_text("class Thing:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = Registry("widget", (Entry("b", f"{name}:Thing", "The thing."),
                              Entry("a", "builtins:len", "Length.")))
    assert reg.names() == ("b", "a") and "b" in reg and "c" not in reg
    assert dict(reg.descriptions()) == {"b": "The thing.", "a": "Length."}
    assert name not in sys.modules  # listing and describing import nothing
    with pytest.raises(RegistryError, match=r"unknown widget 'c' \(registered: b, a\)"):
        reg.get("c")
    assert name not in sys.modules
    assert reg.get("b").__name__ == "Thing" and name in sys.modules
    assert [n for n, _ in reg.items()] == ["b", "a"] and reg.items()[1][1] is len
    with pytest.raises(RegistryError, match="'a' is registered twice"):
        Registry("widget", (Entry("a", "builtins:len"), Entry("a", "builtins:min")))
    with pytest.raises(RegistryError, match="not 'module:attribute'"):
        Entry("a", "builtins.len")
    defined = Registry("widget", (Entry("a", "builtins:len"),),
                       defined=lambda: [("a", len), ("z", min)])
    assert defined.names() == ("a", "z") and defined.get("z") is min
    assert defined.items() == (("a", len), ("z", min))


def test_every_plan_kind_row_names_its_class():
    from tidal.ir.plan import PLANS, plan_classes, plan_kind

    for entry in PLANS.entries:
        cls = PLANS.get(entry.name)
        assert issubclass(cls, Plan) and plan_kind(cls) == entry.name
        assert entry.module.startswith("tidal.ir.plans.")
    assert ToyPlan in plan_classes() and PLANS.get("ToyPlan") is ToyPlan  # by being defined


def test_every_program_builder_row_is_its_modules_plan_kind():
    import importlib

    from tidal.ir.plan import PLANS
    from tidal.runtime.programs import BUILDERS, builders

    assert set(builders()) == set(BUILDERS.names())
    for entry in BUILDERS.entries:
        assert importlib.import_module(entry.module).PLAN_KIND == entry.name
        assert entry.name in PLANS.names()


# ---------------------------------------------------------------- layer graph
def _layer_graph(name, batch=2):
    model = ZOO[name]()
    x = model.example_inputs(batch)
    gm = trace(model, x)
    cost.annotate(gm, x)
    return gm, layer_graph.build(gm)


def test_inception_branch_blocks():
    gm, lg = _layer_graph("inception_small")
    blocks = layer_graph.branch_blocks(lg)
    joins = [lg.nodes[b.join]["layer"].scope for b in blocks]
    # 3 InceptionA, 1 B, 4 C, 1 D, 2 E: one outer block each, joined by the block's cat
    assert joins == ["Mixed_5b", "Mixed_5c", "Mixed_5d", "Mixed_6a", "Mixed_6b", "Mixed_6c",
                     "Mixed_6d", "Mixed_6e", "Mixed_7a", "Mixed_7b", "Mixed_7c"]
    widths = [len(b.branches) for b in blocks]
    assert widths == [4, 4, 4, 3, 4, 4, 4, 4, 3, 4, 4, 4][:len(widths)]
    # InceptionE splits two of its branches again (1x3 / 3x1): nested blocks
    mixed_7b = blocks[9]
    assert len(mixed_7b.nested) == 2
    assert all(len(b.branches) == 2 for b in mixed_7b.nested)
    # every layer inside a block belongs to exactly one branch
    for b in blocks:
        members = [n for br in b.branches for n in br]
        assert len(members) == len(set(members))


def test_resnet_blocks_are_residual_joins():
    gm, lg = _layer_graph("resnet50_small")
    blocks = layer_graph.branch_blocks(lg)
    n_bottlenecks = sum(1 for n in gm.graph.nodes if n.op == "call_module"
                        and n.target.endswith(".conv3"))
    assert len(blocks) == n_bottlenecks
    for b in blocks:
        assert lg.nodes[b.join]["layer"].kind == "add"
        assert len(b.branches) == 2  # main path + (downsample or identity skip)
    assert sum(1 for b in blocks if () in b.branches) == n_bottlenecks - 4  # 4 stages downsample


def test_chain_model_has_no_blocks_and_size_calls_are_looked_through():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(6, 6), torch.nn.Linear(6, 2)

        def forward(self, x):
            y = self.a(x)
            return self.b(y.view(y.size(0), -1))

    gm = trace(Net(), (torch.randn(2, 6),))
    cost.annotate(gm, (torch.randn(2, 6),))
    lg = layer_graph.build(gm)
    assert layer_graph.branch_blocks(lg) == []
    assert layer_graph.chain_order(lg) == ["a", "view", "b"]
    assert lg.graph["inputs"] == ["a"] and lg.graph["outputs"] == ["b"]


def test_a_tied_weight_counts_once():
    # an embedding and an output head sharing one weight (GPT-2's wte / lm_head): the shared
    # parameter's bytes go to the first node that uses it, not to both
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(50, 16)
            self.head = torch.nn.Linear(16, 50, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, ids):
            return self.head(self.emb(ids))

    gm = fx.symbolic_trace(Tied())
    cost.annotate(gm, (torch.randint(0, 50, (2, 3)),))
    nodes = {n.name: n for n in gm.graph.nodes}
    assert meta.get_cost(nodes["emb"]).param_bytes == 50 * 16 * 4
    assert meta.get_cost(nodes["head"]).param_bytes == 0
