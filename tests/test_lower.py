"""Lowering: captured execution equals eager on the zoo, split pieces equal too, uncapturable
nodes are named, boundaries for tidal ops, re-capture on new shapes, autograd, hooks."""
import pytest
import torch

import tidal
from examples.models import SMALL_MODELS, ZOO
from tidal.ir import cost
from tidal.ir.ops import GROUP_BOUNDARY
from tidal.runtime.lower import lower


def _compiled(name, batch=2):
    torch.manual_seed(0)
    model = ZOO[name]().eval()
    inputs = model.example_inputs(batch)
    return model, inputs, tidal.compile(model, inputs).graph_module


@pytest.mark.parametrize("name", SMALL_MODELS)
def test_lowered_equals_eager_whole_and_split(name):
    model, inputs, gm = _compiled(name)
    whole = lower(gm, inputs)
    split = lower(gm, inputs, time_us=lambda n: 1.0, piece_us=12)  # scripted node times
    assert len(split.report.steps) > 3
    assert all(len(s.nodes) <= 12 for s in split.report.steps if s.kind == "captured")
    with torch.no_grad():
        ref = model(*inputs)
        torch.testing.assert_close(whole(*inputs), ref, rtol=0, atol=0)
        torch.testing.assert_close(split(*inputs), ref, rtol=0, atol=0)
        run = split.pieces(*inputs)
        assert len(run.pieces) == len(split.report.steps)
        for p in run.pieces:
            p.fn()
        torch.testing.assert_close(run.result(), ref, rtol=0, atol=0)


def test_split_bound_uses_the_cost_model_and_keeps_big_nodes_alone():
    model, inputs, gm = _compiled("vgg16_small")
    cl = tidal.Cluster(gpus=1, peak_tflops=1e-3)  # a slow device: µs are large
    times = [cost.node_time_us(gm, n, 2, cl)[0] for n in gm.graph.nodes]
    bound = sorted(times)[-3]  # a few nodes exceed it
    lowered = lower(gm, inputs, piece_us=bound, cluster=cl)
    for s in lowered.report.steps:
        assert s.predicted_us <= bound or len(s.nodes) == 1
    assert len(lowered.report.steps) > 1
    with torch.no_grad():
        torch.testing.assert_close(lowered(*inputs), model(*inputs), rtol=0, atol=0)


class _DataDependent(torch.nn.Module):
    def forward(self, x):
        y = torch.relu(x) * 2
        idx = torch.nonzero(y)
        s = y.sum().item()
        z = y + idx.shape[0]
        return torch.tanh(z * s + x)


def test_uncapturable_nodes_are_left_eager_and_named():
    m, x = _DataDependent(), torch.randn(5, 3)
    gm = tidal.trace(m, (x,))
    cost.annotate(gm, (x,))
    lowered = lower(gm, (x,))
    stops = dict(lowered.report.stops)
    assert "nonzero" in stops["nonzero"] and "data-dependent" in stops["nonzero"]
    assert stops["item"] == "host sync .item()"
    kinds = [s.kind for s in lowered.report.steps]
    assert kinds[0] == "captured" and "eager" in kinds
    assert "stopped by" in lowered.report.table()
    for _ in range(3):  # data-dependent values are recomputed every call
        x = torch.randn(5, 3)
        torch.testing.assert_close(lowered(x), m(x), rtol=0, atol=0)


class _Mutating(torch.nn.Module):
    def forward(self, x):
        y = x * 3
        x.add_(1)
        return y + x


def test_tidal_op_is_its_own_boundary_and_in_place_input_update_is_eager():
    x = torch.randn(4)
    gm = tidal.trace(_Mutating(), (x.clone(),))
    mul = next(n for n in gm.graph.nodes if n.op == "call_function")
    with gm.graph.inserting_after(mul):
        gm.graph.call_function(GROUP_BOUNDARY, (1,))
    gm.recompile()
    lowered = lower(gm, (x.clone(),))
    steps = lowered.report.steps
    assert steps[1].kind == "boundary" and steps[1].nodes[0].startswith("group_boundary")
    assert "group_boundary" in steps[1].reason
    assert steps[2].kind == "eager" and "in-place update of graph input x" in steps[2].reason
    a, b = x.clone(), x.clone()
    torch.testing.assert_close(lowered(a), _Mutating()(b), rtol=0, atol=0)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    run = lowered.pieces(x.clone())
    assert [b.piece.kind for b in run.pieces][1] == "collective"  # a tidal op between segments


def test_new_input_shape_recaptures_and_grads_match_eager():
    model, inputs, gm = _compiled("resnet50_small")
    model.train()
    lowered = lower(gm, inputs)
    x = model.example_inputs(3)
    out = lowered(*x)
    assert len(lowered._captures) == 2
    out.sum().backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    model(*x).sum().backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(grads[k], p.grad, msg=k)


def test_hooks_keep_the_module_call_and_bad_inputs_are_named():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU())
    x = torch.randn(2, 3)
    seen = []
    model[0].register_forward_hook(lambda m, i, o: seen.append(o.shape))
    lowered = lower(tidal.trace(model, (x,)), (x,))
    seen.clear()
    torch.testing.assert_close(lowered(x), model(x))
    assert len(seen) == 2  # once lowered, once eager
    with pytest.raises(TypeError, match="unexpected input 'y'"):
        lowered(y=x)
    with pytest.raises(TypeError, match="GraphModule"):
        lower(model, (x,))


def test_batch_norm_statistics_written_by_a_joint_graph_run_uncaptured():
    """``native_batch_norm`` updates the running statistics without saying so in its schema; a
    CUDA graph would write its static copies, so the node runs uncaptured (named)."""
    from tidal.ir.capture import capture_train_step
    from tidal.runtime.lower import stop_reason

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    step = capture_train_step(model, (torch.randn(6, 4),), torch.randn(6, 8),
                              torch.nn.functional.mse_loss)
    reasons = {n.target.__name__.split(".")[0]: stop_reason(step.gm, n)
               for n in step.gm.graph.nodes if n.op == "call_function"}
    assert reasons["native_batch_norm"][0] == "eager"
    assert "in-place update of graph input" in reasons["native_batch_norm"][1]
    assert reasons["native_batch_norm_backward"] is None
    model.eval()
    frozen = capture_train_step(model, (torch.randn(6, 4),), torch.randn(6, 8),
                                torch.nn.functional.mse_loss)
    assert all(stop_reason(frozen.gm, n) is None for n in frozen.gm.graph.nodes
               if n.op == "call_function" and "batch_norm" in str(n.target))


def test_an_input_written_in_place_does_not_make_later_nodes_uncaptured():
    from tidal.ir.capture import capture_train_step, step_inputs
    from tidal.runtime.lower import lower

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                                torch.nn.ReLU(), torch.nn.Linear(8, 3))
    x, y = torch.randn(6, 4), torch.randn(6, 3)
    step = capture_train_step(model, (x,), y, torch.nn.functional.mse_loss)
    flat = step_inputs(step, model, (x,), y)
    kinds = [info.kind for info in lower(step.gm, flat).report.steps]
    assert kinds.count("eager") == 2 and kinds.count("captured") >= 2, kinds  # bn, its counter


class _SyncsOnTheHost(torch.nn.Module):
    """A module whose forward reads a tensor's value on the host (a CUDA capture would fail)."""

    uncaptured_reason = "reads a scale on the host"

    def forward(self, x):
        return x * float(x.detach().abs().max())


def test_a_module_that_names_why_it_cannot_be_captured_runs_uncaptured():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), _SyncsOnTheHost(), torch.nn.Linear(4, 2))
    x = torch.randn(3, 4)
    lowered = lower(tidal.trace(model, (x,), leaf_modules=[_SyncsOnTheHost]), (x,))
    assert [s.kind for s in lowered.report.steps] == ["captured", "eager", "captured"]
    assert lowered.report.stops == (("_1", "_SyncsOnTheHost: reads a scale on the host"),)
    torch.testing.assert_close(lowered(x), model(x))


class _CaptureFails(tidal.runtime.backend.CpuBackend):
    """A backend whose captures fail, as CUDA's does on a host sync the lowering's rules did
    not see (the CUDA backend's own recovery is tests/test_program_devices.py's)."""

    def capture(self, program, static_inputs, *, pool=None, in_place=()):
        raise tidal.runtime.backend.CaptureError("operation not permitted when stream is "
                                                 "capturing")


def test_a_step_whose_capture_fails_runs_uncaptured_with_a_warning_and_a_reason():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    x = torch.randn(3, 4)
    with pytest.warns(RuntimeWarning, match="runs uncaptured: capture failed: operation not "
                                            "permitted"):
        lowered = lower(tidal.trace(model, (x,)), (x,), backend=_CaptureFails())
    assert [s.kind for s in lowered.report.steps] == ["eager"]
    assert lowered.report.stops[0][1].startswith("capture failed: operation not permitted")
    torch.testing.assert_close(lowered(x), model(x))
    torch.testing.assert_close(lowered(2 * x), model(2 * x))  # a new signature: still eager
