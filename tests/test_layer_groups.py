"""The layer_groups pass, the grouped weight store and the pipelined loader; training from a
store: the closed step, the open step (``Compiled.backward``, ``no_sync``, ``clip_grad_norm_``,
a ``GradScaler``) and steps inside ``torch.autocast`` against eager PyTorch."""
import contextlib
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
from tidal.runtime.programs.layer_groups import LOADING_STEP, LayerGroupsProgram, run_pipelined
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


# ------------------------------------------- the open step and autocast (issue 34, item 1)
OPEN_TOL = dict(rtol=1e-6, atol=1e-6)
"""Tidal's step against eager PyTorch's, float32 parameters (the same kernels)."""


def _open_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                               torch.nn.ReLU(), torch.nn.Linear(16, 3))


def _open_batch(step, k=0):
    g = torch.Generator().manual_seed(100 + 10 * step + k)
    return torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g)


def _from_store(tmp_path, optimizer=None):
    """(compiled, model, eager twin): the model's weights live only in a weight store in
    ``tmp_path`` (scrambled in the model), so the first call streams them in."""
    model = _open_net()
    twin = copy.deepcopy(model)
    x, y = _open_batch(0)
    path = tmp_path / "open.safetensors"
    write_groups(tidal.compile(model, (x,), passes=[LayerGroups(grouping="per_layer")])
                 .graph_module, path)
    c = tidal.compile(model, (x,), passes=[LayerGroups(grouping="per_layer",
                                                       weight_store=str(path))],
                      loss_fn=torch.nn.functional.cross_entropy, example_targets=y,
                      optimizer=optimizer)
    _scramble(model)
    return c, model, twin


def _sgd_plain(model):
    return torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9), None


def _adamw_two_groups(model):
    """AdamW with two param groups (no decay on the first layer) and a warm-up LambdaLR."""
    first = list(model[0].parameters())
    rest = [p for p in model.parameters() if all(p is not q for q in first)]
    opt = torch.optim.AdamW([{"params": first, "weight_decay": 0.0},
                             {"params": rest, "weight_decay": 0.1}], lr=2e-2)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))


class _EagerLoop:
    """The eager side of an open-step loop: ``backward`` adds the gradient of ``scale * loss``
    to ``.grad`` as ``Compiled.backward`` does (a ``GradScaler``: ``scaler.scale(loss)``)."""

    def __init__(self, model):
        self.model = model

    def backward(self, x, y, scale):
        loss = torch.nn.functional.cross_entropy(self.model(x), y)
        if isinstance(scale, torch.amp.GradScaler):
            scale.scale(loss).backward()
        else:
            (loss if scale is None else loss * scale).backward()
        return loss.detach()

    def no_sync(self):
        return contextlib.nullcontext()

    def clip(self, max_norm):
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)


class _CompiledLoop:
    def __init__(self, c):
        self.c = c

    def backward(self, x, y, scale):
        return self.c.backward((x,), y, scale=scale)

    def no_sync(self):
        return self.c.no_sync()

    def clip(self, max_norm):
        return self.c.clip_grad_norm_(max_norm)


def _open_loop(loop, model, optimizer, steps=3, micro=1, scale=None, clip=None, scaler=False):
    """A DDP-style loop: per step ``micro`` micro-batches (all but the last inside
    ``no_sync``), optionally a ``GradScaler``'s unscale_/step/update and clipping, the user's
    optimizer and schedule. Returns the losses and the clipped norms."""
    opt, schedule = optimizer(model)
    gs = torch.amp.GradScaler("cpu") if scaler else None
    losses, norms = [], []
    for step in range(steps):
        for k in range(micro):
            x, y = _open_batch(step, k)
            with loop.no_sync() if k < micro - 1 else contextlib.nullcontext():
                losses.append(float(loop.backward(x, y, gs if scaler else scale)))
        if gs is not None:
            gs.unscale_(opt)
        if clip is not None:
            norms.append(float(loop.clip(clip)))
        if gs is not None:
            gs.step(opt)
            gs.update()
        else:
            opt.step()
        opt.zero_grad()
        if schedule is not None:
            schedule.step()
    return losses, norms


def _same_params(got, want, tol=OPEN_TOL):
    for (name, a), b in zip(got.named_parameters(), want.parameters()):
        torch.testing.assert_close(a, b, **tol, msg=name)


OPEN_CASES = {
    "SGD": (_sgd_plain, {}),
    "AdamW, two groups, LambdaLR": (_adamw_two_groups, {}),
    "accumulation of 2, scale 1/2": (_adamw_two_groups, dict(micro=2, scale=0.5)),
    "clipping": (_sgd_plain, dict(clip=0.05)),
    "float scale": (_sgd_plain, dict(scale=0.3)),
    "GradScaler": (_adamw_two_groups, dict(scaler=True)),
}


@pytest.mark.parametrize("case", list(OPEN_CASES))
def test_open_step_equals_the_eager_loop(tmp_path, case):
    """``Compiled.backward`` under layer_groups (the first call streams the weights in), then
    the user's optimizer: the same parameters and losses as the eager loop."""
    optimizer, options = OPEN_CASES[case]
    c, model, twin = _from_store(tmp_path)
    got_losses, got_norms = _open_loop(_CompiledLoop(c), model, optimizer, **options)
    first = [p.name for p in c.executor.last_program.pieces]
    want_losses, want_norms = _open_loop(_EagerLoop(twin), twin, optimizer, **options)
    assert got_losses == pytest.approx(want_losses, rel=1e-6, abs=1e-7)
    assert got_norms == pytest.approx(want_norms, rel=1e-6)
    if options.get("clip"):
        assert min(want_norms) > options["clip"]   # the clip did change the gradients
    _same_params(model, twin)
    assert first[-1] == "grads" and not any(n.startswith("load") for n in first), first
    assert c.executor.fallback_reason == "" and c.executor.uncaptured() == []


def test_the_first_open_step_streams_the_weights_in(tmp_path):
    c, model, twin = _from_store(tmp_path)
    x, y = _open_batch(0)
    loss = c.backward((x,), y, scale=0.5)
    names = [p.name for p in c.executor.last_program.pieces]
    assert [n for n in names if n.startswith("load")] == [f"load group {k}"
                                                          for k in range(5)], names
    assert names[-2:] == ["backward", "grads"]
    assert c.executor.uncaptured() == [("-", LOADING_STEP)]
    want = torch.nn.functional.cross_entropy(twin(x), y)
    (want * 0.5).backward()
    assert float(loss) == pytest.approx(float(want.detach()), rel=1e-6)
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)   # the stored weights
        torch.testing.assert_close(p.grad, q.grad, **OPEN_TOL, msg=name)


def test_open_and_closed_steps_alternate(tmp_path):
    """Open (first: streams the weights in), closed, open with accumulation, closed: one
    optimizer (the compile's, SGD with momentum), the eager loop's twin steps."""
    def sgd(params):
        return torch.optim.SGD(params, lr=0.3, momentum=0.9)

    c, model, twin = _from_store(tmp_path, optimizer=sgd)
    opt, twin_opt = c.optimizer, sgd(twin.parameters())
    eager = _EagerLoop(twin)
    for step, kind in enumerate(("open", "closed", "open", "closed")):
        x, y = _open_batch(step)
        if kind == "closed":
            got = c.step((x,), y)
            twin_opt.zero_grad()
            want = eager.backward(x, y, None)
            twin_opt.step()
        else:
            with c.no_sync():
                c.backward((x[:3],), y[:3], scale=0.5)
            got = c.backward((x[3:],), y[3:], scale=0.5)
            eager.backward(x[:3], y[:3], 0.5)
            want = eager.backward(x[3:], y[3:], 0.5)
            opt.step()
            twin_opt.step()
            opt.zero_grad()
            twin_opt.zero_grad()
        assert float(got) == pytest.approx(float(want), rel=1e-6), (step, kind)
        _same_params(model, twin)


def _bf16(on):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=on)


AUTOCAST_STEPS = (True, True, False, True)
"""Inside autocast (the loading step, then captured), outside (captured again), inside (the
first capture, kept)."""


def _autocast_run(step_fn, model, steps):
    """``step_fn(x, y)`` for each step, inside bf16 autocast where ``steps`` says; the
    losses."""
    losses = []
    for i, on in enumerate(steps):
        with _bf16(on):
            losses.append(float(step_fn(*_open_batch(i))))
    return losses


def _eager_autocast(steps):
    """Eager SGD steps of a fresh net with autocast where ``steps`` says; (losses, model)."""
    model = _open_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)

    def step(x, y):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    return _autocast_run(step, model, steps), model


@pytest.mark.parametrize("open_step", [False, True], ids=["closed", "open"])
def test_steps_under_autocast_equal_eager_autocast(tmp_path, open_step):
    def sgd(params):
        return torch.optim.SGD(params, lr=0.5)

    c, model, _ = _from_store(tmp_path, optimizer=sgd)

    def step(x, y):
        if not open_step:
            return c.step((x,), y)
        loss = c.backward((x,), y)
        c.optimizer.step()
        c.optimizer.zero_grad()
        return loss

    losses = _autocast_run(step, model, AUTOCAST_STEPS)
    want_losses, want = _eager_autocast(AUTOCAST_STEPS)
    assert losses == pytest.approx(want_losses, rel=1e-6, abs=1e-6)
    _same_params(model, want)
    fp32 = _eager_autocast((False,) * len(AUTOCAST_STEPS))[1]
    with pytest.raises(AssertionError):   # autocast made a difference the test can see
        _same_params(model, fp32, tol=dict(rtol=1e-4, atol=1e-4))
    assert c.executor.fallback_reason == "" and c.executor.uncaptured() == []


def test_freezing_and_eval_recapture_on_the_resident_weights(tmp_path):
    """A change of ``requires_grad`` or ``training`` after the first step is captured again by
    the same program, which does not stream the stored weights in again over the trained
    ones."""
    def sgd(params):
        return torch.optim.SGD(params, lr=0.3)

    c, model, twin = _from_store(tmp_path, optimizer=sgd)
    program = c.executor.rank_program
    twin_opt = sgd(twin.parameters())
    for step in range(4):
        if step == 1:
            model[0].weight.requires_grad_(False)
            twin[0].weight.requires_grad_(False)
        if step == 3:
            model.eval()
            twin.eval()
        x, y = _open_batch(step)
        got = c.step((x,), y)
        twin_opt.zero_grad()
        want = torch.nn.functional.cross_entropy(twin(x), y)
        want.backward()
        twin_opt.step()
        assert float(got) == pytest.approx(float(want.detach()), rel=1e-6), step
        _same_params(model, twin)
    assert c.executor.rank_program is program


def test_the_cold_start_forward_runs_under_the_callers_autocast(tmp_path):
    """The forward that streams the weights in runs its groups on stream workers, under the
    autocast of the thread that called it (autocast is thread-local)."""
    c, model, twin = _from_store(tmp_path)
    x, _ = _open_batch(0)
    with torch.no_grad(), _bf16(True):
        out, want = c(x), twin(x)
    assert out.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert c.executor.last_timeline is not None   # it was the streaming forward
