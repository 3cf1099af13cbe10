"""Programs on the device's backend (issue #31): which backend a runner uses, streams that wait
for the stream that made their inputs, captures that read parameters in place and keep a memory
pool per owner, one clock. CPU tests emulate what CUDA does; the ``cuda`` ones run on a GPU."""
import threading

import pytest
import torch
import torch.nn.functional as F

import tidal
from tidal.ir.capture import capture_train_step, step_inputs
from tidal.runtime.backend import CpuBackend, backend_for
from tidal.runtime.lower import lower
from tidal.runtime.program import (COMPUTE, CapturedProgram, Piece, Program, ProgramExecutor,
                                   ProgramRunner, data_parallel, runner_backend, state_inputs)
from tidal.runtime.programs.data_parallel import DataParallelProgram


def _bn_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.BatchNorm1d(6), torch.nn.ReLU(),
                               torch.nn.Linear(6, 3))


class _Recording(CpuBackend):
    """A CPU backend that records what each capture was given."""

    def __init__(self):
        super().__init__(slots=None)
        self.captures, self.pools = [], []

    def memory_pool(self):
        self.pools.append(object())
        return self.pools[-1]

    def capture(self, program, static_inputs, *, pool=None, in_place=()):
        self.captures.append((list(static_inputs), tuple(in_place), pool))
        return super().capture(program, static_inputs, pool=pool, in_place=in_place)


def test_a_runner_takes_the_backend_of_its_device():
    assert isinstance(runner_backend("cpu"), CpuBackend)
    assert runner_backend("cpu").gate.slots is None  # streams run freely, as before
    if not torch.cuda.is_available():  # it asks for CUDA's (it used to run a CpuBackend)
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            runner_backend("cuda")


def test_the_executor_runs_each_step_on_the_backend_of_the_model_device(monkeypatch):
    asked = []
    real = backend_for

    def spy(device, **options):
        asked.append(torch.device(device))
        return real(device, **options)

    monkeypatch.setattr("tidal.runtime.program.backend_for", spy)
    model = _bn_model()
    ex = ProgramExecutor(DataParallelProgram())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ex.step(model, model, (torch.randn(4, 8),), torch.tensor([0, 1, 2, 0]), F.cross_entropy,
            opt)
    assert asked == [torch.device("cpu")] and ex.runner.backend.device == torch.device("cpu")
    ex.device = torch.device("meta")  # a step on another device gets a new runner
    with pytest.raises(ValueError, match="no runtime backend for device type 'meta'"):
        ex.runner
    ex.close()


def test_the_program_waits_for_the_stream_that_made_its_inputs():
    be = CpuBackend(slots=None)
    producer, gate = be.stream(), threading.Event()
    x = torch.zeros(3)
    be.launch(producer, lambda: (gate.wait(10), x.fill_(1.0)))  # not run yet
    seen = []
    with ProgramRunner(backend=be) as runner, be.use(producer):
        threading.Timer(0.2, gate.set).start()
        runner.launch(Program((Piece("read", COMPUTE),), 1),
                      lambda i, piece: lambda: seen.append(x.clone()))
    assert torch.equal(seen[0], torch.ones(3))  # it read what the producer wrote


def test_the_host_stream_completes_at_once_and_the_clock_is_the_launches():
    with CpuBackend(slots=None) as be:
        ev = be.event()
        be.record(be.current_stream(), ev)
        assert ev.query()
        before = be.now_us()
        launch = be.launch(be.stream(), lambda: None)
        launch.wait()
        assert before <= launch.start_us <= launch.end_us <= be.now_us()


def test_captures_read_parameters_in_place_and_get_a_pool_per_program():
    model = _bn_model()
    x, y = torch.randn(6, 8), torch.randint(0, 3, (6,))
    step = capture_train_step(model, (x,), y, F.cross_entropy)
    program = data_parallel(step, world=1)
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    flat = step_inputs(step, model, (x,), y)
    be = _Recording()
    first = CapturedProgram.build(program, step.gm, flat, be, state=state_inputs(step))
    CapturedProgram.build(program, step.gm, flat, be, state=state_inputs(step))
    assert len(be.pools) == 2  # one pool per program, shared by its captures
    assert {id(pool) for _, _, pool in be.captures} == {id(p) for p in be.pools}
    read_in_place = [id(static[i]) for static, in_place, _ in be.captures for i in in_place]
    assert read_in_place and set(read_in_place) <= {id(p) for p in params.values()}
    # the BatchNorm statistics are written in place by the step: never captured in place
    assert not set(read_in_place) & {id(b) for b in buffers.values()}
    names = {first.lowered._cg.var(n) for n in step.gm.graph.nodes if n.op == "placeholder"}
    assert first.lowered.in_place < names
    be.close()


def test_lower_reads_no_input_in_place_unless_asked():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    x = torch.randn(2, 4)
    be = _Recording()
    lowered = lower(tidal.trace(model, (x,)), (x,), backend=be)
    assert lowered.in_place == frozenset() and all(not ip for _, ip, _ in be.captures)
    assert torch.equal(lowered(x), model(x))
    be.close()


@pytest.mark.cuda
def test_cuda_data_parallel_step_equals_eager_with_dropout_and_reads_params_in_place():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.5),
                                torch.nn.ReLU(), torch.nn.Linear(32, 4)).cuda()
    eager = torch.nn.Sequential(*[m for m in __import__("copy").deepcopy(model)])
    x, y = torch.randn(8, 16, device="cuda"), torch.randint(0, 4, (8,), device="cuda")
    ex = ProgramExecutor(DataParallelProgram())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    for _ in range(3):
        state = torch.cuda.get_rng_state()
        loss = ex.step(model, model, (x,), y, F.cross_entropy, opt)
        after = torch.cuda.get_rng_state()
        torch.cuda.set_rng_state(state)
        opt_e.zero_grad()
        ref = F.cross_entropy(eager(x), y)
        ref.backward()
        opt_e.step()
        assert torch.equal(torch.cuda.get_rng_state(), after)  # the same draws as eager
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
    for a, b in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert ex.fallback_reason == ""
    assert type(ex.runner.backend).__name__ == "CudaBackend"
    ex.close()


@pytest.mark.cuda
def test_cuda_launch_times_and_now_share_one_clock():
    be = backend_for("cuda")
    assert be.device.index is not None
    s = be.stream()
    a = torch.randn(2048, 2048, device="cuda")
    before = be.now_us()
    launch = be.launch(s, lambda: a @ a)
    launch.wait()
    after = be.now_us()
    assert before - 1000 <= launch.start_us <= launch.end_us <= after + 1000


@pytest.mark.cuda
def test_cuda_program_streams_wait_for_the_producer_stream():
    be = backend_for("cuda")
    producer = torch.cuda.Stream()
    with torch.cuda.stream(producer):
        torch.cuda._sleep(50_000_000)  # the producer is busy a while
        x = torch.ones(1 << 20, device="cuda")
    seen = []
    with ProgramRunner(backend=be) as runner, torch.cuda.stream(producer):
        runner.launch(Program((Piece("read", COMPUTE),), 1),
                      lambda i, piece: lambda: seen.append(x.sum()))
    torch.cuda.synchronize()
    assert seen[0].item() == float(1 << 20)


class _CountingReplays(CpuBackend):
    """A CPU backend standing in for one whose replays drop autograd (its device is not the
    CPU), counting replays."""

    def __init__(self):
        super().__init__(slots=None)
        self.device = torch.device("meta")
        self.replays = 0

    def capture(self, program, static_inputs, *, pool=None, in_place=()):
        captured = super().capture(program, static_inputs, pool=pool, in_place=in_place)

        def replay(*inputs):
            self.replays += 1
            return captured.program(*inputs)
        captured.replay = replay
        return captured


def test_a_frozen_forward_in_grad_mode_replays_its_captures():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).requires_grad_(False)
    x = torch.randn(2, 4)
    be = _CountingReplays()
    lowered = lower(tidal.trace(model, (x,)), (x,), backend=be)
    before = be.replays  # capturing ran it once
    with torch.enable_grad():
        assert torch.equal(lowered(x), model(x)) and be.replays == before + 1  # no grad needed
        model[0].weight.requires_grad_(True)   # now autograd must record: run uncaptured
        out = lowered(x)
    assert be.replays == before + 1 and out.requires_grad
    be.close()


class _HiddenHostSync(torch.nn.Module):
    """A host sync the lowering's rules cannot see (``bool(tensor)`` inside a leaf module;
    ``torch.equal(x, x)`` would not do: it returns at once for one tensor)."""

    def forward(self, x):
        return x * 2 if bool((x.abs() + 1).min() > 0) else x


@pytest.mark.cuda
def test_cuda_failed_capture_runs_uncaptured_and_leaves_the_device_usable():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), _HiddenHostSync()).cuda()
    x = torch.randn(4, 8, device="cuda")
    stream = torch.cuda.current_stream()
    with pytest.warns(RuntimeWarning, match="capture failed"):
        lowered = lower(tidal.trace(model, (x,), leaf_modules=[_HiddenHostSync]), (x,))
    assert torch.cuda.current_stream() == stream  # torch.cuda.graph's stream is gone
    assert "capture failed" in lowered.report.stops[0][1]
    torch.testing.assert_close(lowered(x), model(x))
    torch.randn(3, device="cuda")  # the generator left capture mode ('Offset increment ...')
    torch.nn.functional.dropout(x, 0.5, training=True)
