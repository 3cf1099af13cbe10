"""The layer_groups pass, the grouped weight store and the pipelined loader."""
import copy
import os

import pytest
import torch

import tidal
from examples.models import ZOO
from tidal.ir import ops
from tidal.ir.plan import Plan
from tidal.ir.plans.layer_groups import LayerGroupPlan
from tidal.passes.layer_groups import LayerGroups
from tidal.runtime.programs.layer_groups import LayerGroupsProgram, run_pipelined
from tidal.runtime.weights.loader import group_tensors, write_groups
from tidal.runtime.weights.store import WeightStoreError, write_store

# a slow device and link so that the optimal grouping has several groups
CLUSTER = tidal.Cluster(gpus=1, bandwidth_gbps=1.0, latency_us=20.0, peak_tflops=0.005)
MODELS = ["resnet50_small", "inception_small", "bert_small"]


def _compile(name, **options):
    torch.manual_seed(0)
    model = ZOO[name]().eval()
    x = model.example_inputs(2)
    compiled = tidal.compile(model, x, cluster=CLUSTER, passes=[LayerGroups(**options)])
    return model, x, compiled


@pytest.fixture(scope="module", params=MODELS)
def grouped(request):
    return (request.param,) + _compile(request.param)


def _scramble(model):
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            if t.is_floating_point():
                t.normal_()


def test_markers_number_the_groups_and_change_nothing(grouped):
    name, model, x, compiled = grouped
    plan = compiled.plan.get("layer_groups")
    assert len(plan.groups) >= 2, plan.summary()
    marks = [n for n in compiled.graph_module.graph.nodes if n.target is ops.GROUP_BOUNDARY]
    assert [m.args[0] for m in marks] == list(range(len(plan.groups)))
    with torch.no_grad():
        assert torch.equal(compiled(*x), model(*x))


def test_grouped_tensors_cover_the_model_once(grouped):
    name, model, x, compiled = grouped
    groups = group_tensors(compiled.graph_module)
    names = [n for g in groups for n, _ in g]
    assert sorted(names) == sorted(dict(list(model.named_parameters())
                                        + list(model.named_buffers())))
    plan = compiled.plan.get("layer_groups")
    assert len(groups) == len(plan.groups)
    # the planner's bytes per group are the weights the loader moves for that group
    moved = [sum(t.numel() * t.element_size() for _, t in g) for g in groups]
    assert moved == list(plan.group_bytes)


def test_pipelined_loading_gives_the_plain_outputs(grouped, tmp_path):
    name, model, x, compiled = grouped
    with torch.no_grad():
        expected = model(*x)
    path = tmp_path / f"{name}.safetensors"
    write_groups(compiled.graph_module, path)
    _scramble(model)
    with torch.no_grad():
        assert not torch.equal(model(*x), expected)
    out, tl = run_pipelined(compiled.graph_module, path, x)
    assert torch.equal(out, expected)
    with torch.no_grad():  # the model's own parameters now hold the stored weights
        assert torch.equal(model(*x), expected)
    for k, ((t0, t1), (e0, e1)) in enumerate(zip(tl.transfer, tl.execute)):
        assert e0 >= t1, f"group {k} executed before its weights arrived"


def test_loading_overlaps_execution(tmp_path):
    model, x, compiled = _compile("resnet50_small")
    with torch.no_grad():
        expected = model(*x)
    path = tmp_path / "w.safetensors"
    write_groups(compiled.graph_module, path)
    # an emulated 0.2 GB/s link with 20 ms per transfer keeps the loader busy: group 0 would
    # have to wait for the host (a loaded one) longer than every later transfer together for
    # the overlap not to show
    out, tl = run_pipelined(compiled.graph_module, path, x, link_bytes_per_us=200.0,
                            link_overhead_us=20_000.0)
    assert torch.equal(out, expected)
    assert len(tl.transfer) >= 2
    assert tl.execute[0][0] < tl.transfer[-1][1], tl
    assert tl.overlaps()
    for prev, cur in zip(tl.transfer, tl.transfer[1:]):
        assert cur[0] >= prev[1]  # one link: transfers run one after another


def test_store_is_a_safetensors_file_in_512_byte_groups(tmp_path):
    safetensors = pytest.importorskip("safetensors")
    model, x, compiled = _compile("bert_small")
    path = tmp_path / "w.safetensors"
    write_groups(compiled.graph_module, path)
    state = model.state_dict()
    with safetensors.safe_open(str(path), "pt") as f:
        names = [k for k in f.keys() if not k.startswith("__pad__")]
        assert sorted(names) == sorted(state)
        for k in names:
            assert torch.equal(f.get_tensor(k), state[k]), k
        import json
        ranges = json.loads(f.metadata()["tidal.groups"])
    assert len(ranges) == len(compiled.plan.get("layer_groups").groups)
    assert all(b % 512 == 0 and e % 512 == 0 for b, e in ranges)


def _counting_hook(model):
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    return calls


def test_truncated_missing_and_foreign_stores_fail_before_running(tmp_path):
    model, x, compiled = _compile("resnet50_small")
    gm = compiled.graph_module
    path = tmp_path / "w.safetensors"
    write_groups(gm, path)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    first_conv = next(n.target for n in gm.graph.nodes if n.op == "call_module")
    calls = []
    gm.get_submodule(first_conv).register_forward_pre_hook(lambda *a: calls.append(1))

    size = os.path.getsize(path)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(path.read_bytes()[:size // 2])
    with pytest.raises(WeightStoreError, match=r"truncated: tensor '[\w.]+' needs"):
        run_pipelined(gm, cut, x)
    with pytest.raises(WeightStoreError, match="does not exist"):
        run_pipelined(gm, tmp_path / "nope.safetensors", x)
    tiny = tmp_path / "tiny.safetensors"
    tiny.write_bytes(b"\x01\x02")
    with pytest.raises(WeightStoreError, match="truncated"):
        run_pipelined(gm, tiny, x)

    # a store of another model: the first tensor the plan expects is missing or different
    groups = group_tensors(gm)
    first_name, first_t = groups[0][0]
    other = [[(n, t) for n, t in g] for g in groups]
    other[0][0] = (first_name, torch.zeros(first_t.numel() + 1))
    foreign = tmp_path / "foreign.safetensors"
    write_store(foreign, other)
    with pytest.raises(WeightStoreError, match=f"tensor '{first_name}' is F32\\["):
        run_pipelined(gm, foreign, x)
    other[0][0] = ("renamed.weight", first_t)
    write_store(foreign, other)
    with pytest.raises(WeightStoreError, match=f"tensor '{first_name}' is missing"):
        run_pipelined(gm, foreign, x)
    assert calls == []  # nothing ran
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_executor_and_cold_start_stream_from_a_store(tmp_path):
    model, x, compiled = _compile("resnet50_small")
    path = tmp_path / "w.safetensors"
    write_groups(compiled.graph_module, path)
    with torch.no_grad():
        expected = model(*x)
    _scramble(model)
    assert torch.equal(compiled.cold_start(path), expected)  # example inputs by default

    c2 = tidal.compile(model, x, cluster=CLUSTER,
                       passes=[LayerGroups(weight_store=str(path))])
    _scramble(model)
    with torch.no_grad():
        assert torch.equal(c2(*x), expected)
        assert c2.executor.last_timeline is not None
        assert torch.equal(c2(*x), expected)  # resident now


def test_strategies_plan_json_table_and_svg():
    for grouping, count in (("per_layer", None), ("single", 1)):
        _, _, c = _compile("resnet50_small", grouping=grouping)
        plan = c.plan.get("layer_groups")
        assert len(plan.groups) == (count or len(plan.layers))
    _, _, fast = _compile("resnet50_small")
    _, _, c = _compile("resnet50_small", group_algorithm="dp")
    plan = c.plan.get("layer_groups")
    assert plan.total_us == pytest.approx(fast.plan.get("layer_groups").total_us, rel=1e-9)
    assert len(plan.layers) == 59  # one layer per module call of resnet50_small
    assert plan.total_us <= min(plan.per_layer_us, plan.single_group_us)
    again = Plan.from_json(plan.to_json())
    assert isinstance(again, LayerGroupPlan) and again == plan
    assert "group  layers" in plan.table()
    record = next(r for r in c.records if r.name == "layer_groups")
    svg = record.artifacts["layer_groups_timeline.svg"]
    assert svg.startswith("<svg") and svg.count(">transfer<") == 3
    assert svg.count("<title>group") == 2 * (len(plan.groups) + len(plan.layers) + 1)


def test_bad_options_are_value_errors():
    with pytest.raises(ValueError, match="group_bandwidth_gbps"):
        LayerGroups(group_bandwidth_gbps=0)
    with pytest.raises(ValueError, match="group_bandwidth_gbps"):
        LayerGroups(group_bandwidth_gbps=-3.0)
    with pytest.raises(ValueError, match="grouping"):
        LayerGroups(grouping="greedy")
    with pytest.raises(ValueError, match="link_bytes_per_us"):
        LayerGroupsProgram("w.safetensors", link_bytes_per_us=0)


def test_compiled_cold_start_streams_weights_from_the_store(tmp_path):
    import tidal
    from examples.models import ZOO
    from tidal.runtime.weights.loader import write_groups

    model = ZOO["resnet50_small"]().eval()
    x = model.example_inputs(2)
    with torch.no_grad():
        expected = model(*x)
    compiled = tidal.compile(model, x, passes=["layer_groups"])
    store = tmp_path / "w.safetensors"
    write_groups(compiled.graph_module, store)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.0)  # the weights now come only from the store
        out = compiled.cold_start(store)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


# ---------------------------------------------------------------- training as a program
class _HostGate(torch.nn.Module):
    """A layer whose forward reads a value on the host: a training step that ``make_fx``
    cannot capture (kept whole as a leaf module), so the program backpropagates eagerly."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(6, 6)

    def forward(self, x):
        return self.lin(x) if float(x.detach().abs().sum()) >= 0 else x


def _train_cases():
    """(name, model, inputs, targets, compile options) of each trained model (plain torch.nn)."""
    torch.manual_seed(0)
    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4),
                               torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(64, 5))
    gated = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), _HostGate(),
                                torch.nn.Linear(6, 5))
    return [("conv", conv, torch.randn(4, 3, 6, 6), torch.randint(0, 5, (4,)), {}),
            ("gated", gated, torch.randn(4, 4), torch.randint(0, 5, (4,)),
             {"leaf_modules": [_HostGate]})]


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _train_from_store(rank, world, stores):
    """One gloo rank: each model trains two steps through ``Compiled.step`` with its weights
    only in the store (the first step's program loads them). Returns per model the losses, the
    final state, each step's program and trace, and the fallback reason."""
    out = {}
    for name, model, x, y, options in _train_cases():
        c = tidal.compile(model, (x,), passes=[LayerGroups(grouping="per_layer",
                                                           weight_store=stores[name])],
                          loss_fn=torch.nn.functional.cross_entropy, optimizer=_sgd, **options)
        _scramble(model)
        runs = []
        for _ in range(2):
            loss = c.step((x,), y)
            runs.append((loss.item(), c.executor.last_program, tuple(c.executor.last_trace)))
        out[name] = (runs, model.state_dict(), c.executor.fallback_reason)
    return out


def _per_stream_order(spans, stream_of):
    """{stream: piece names by start time} from (name, start, end) spans."""
    order = {}
    for name, start, _ in sorted(spans, key=lambda s: s[1]):
        order.setdefault(stream_of[name], []).append(name)
    return order


def _check_dependencies(program, spans, what):
    at = {name: (start, end) for name, start, end in spans}
    for p in program.pieces:
        for d in p.deps:
            dep = program.pieces[d].name
            assert at[p.name][0] >= at[dep][1] - 1e-6, f"{what}: {p.name} began before {dep} ended"


def test_training_program_on_two_ranks_equals_eager_and_simulates_in_order(tmp_path):
    from tidal.runtime.distributed import spawn
    from tidal.sim.engine import simulate
    from tidal.sim.programs import join_ranks

    stores, expected = {}, {}
    for name, model, x, y, options in _train_cases():
        c = tidal.compile(model, (x,), passes=[LayerGroups(grouping="per_layer")], **options)
        stores[name] = str(tmp_path / f"{name}.safetensors")
        write_groups(c.graph_module, stores[name])
        opt, losses = _sgd(model.parameters()), []
        for _ in range(2):  # the single-process eager step
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        expected[name] = (losses, model.state_dict())

    for rank, result in enumerate(spawn(_train_from_store, 2, stores, timeout_s=300)):
        for name, (runs, state, reason) in result.items():
            losses, want = expected[name]
            assert ("runs the groups with autograd" in reason) == (name == "gated"), reason
            assert [r[0] for r in runs] == pytest.approx(losses, rel=1e-5, abs=1e-6)
            for k, v in want.items():
                torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6, msg=k)
            for step, (_, program, trace) in enumerate(runs):
                names = [p.name for p in program.pieces]
                loads = [n for n in names if n.startswith("load group")]
                assert bool(loads) == (step == 0), names  # loaded once, by the first step
                assert names[-1] == "optimizer" and sorted(t.name for t in trace) == sorted(names)
                real = [(t.name, t.start_us, t.end_us) for t in trace]
                took = {t.name: t.end_us - t.start_us for t in trace}
                sim = [(i.name, i.start_us, i.end_us) for i in simulate(
                    join_ranks({rank: program}, lambda r, piece: took[piece]))]
                stream_of = {p.name: p.stream for p in program.pieces}
                what = f"rank {rank} {name} step {step}"
                assert _per_stream_order(sim, stream_of) == _per_stream_order(real, stream_of), what
                _check_dependencies(program, real, what)
                _check_dependencies(program, sim, what + " (simulated)")


class _Counted(torch.nn.Module):
    """A linear layer that counts the rows it saw in a buffer written in place in forward."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 6)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.seen.add_(x.shape[0])
        return self.lin(x)


def test_training_segments_are_captured_and_name_what_runs_uncaptured(tmp_path):
    torch.manual_seed(0)
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    for first, uncaptured in ((torch.nn.Linear(4, 6), []), (_Counted(), ["add_"])):
        model = torch.nn.Sequential(first, torch.nn.ReLU(), torch.nn.Linear(6, 3))
        reference = copy.deepcopy(model)
        path = tmp_path / f"{type(first).__name__}.safetensors"
        write_groups(tidal.compile(model, (x,), passes=[LayerGroups(grouping="per_layer")])
                     .graph_module, path)
        c = tidal.compile(model, (x,), passes=[LayerGroups(grouping="per_layer",
                                                           weight_store=str(path))],
                          loss_fn=torch.nn.functional.cross_entropy, optimizer=_sgd)
        opt = _sgd(reference.parameters())
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            want = torch.nn.functional.cross_entropy(reference(x), y)
            want.backward()
            opt.step()
            assert c.step((x,), y).item() == pytest.approx(want.item(), rel=1e-6)
        assert c.executor.fallback_reason == ""
        got = c.executor.uncaptured()
        assert [node for node, _ in got] == uncaptured, got
        assert all("in-place update" in why for _, why in got), got
        for k, v in reference.state_dict().items():  # the counter too: 2 steps of 5 rows
            torch.testing.assert_close(model.state_dict()[k], v, rtol=1e-6, atol=1e-7, msg=k)
    assert int(model[0].seen) == 10
