"""PipeSwitch-style task switching (tidal.runtime.switching): the arena, stack-wise carving with
caps and spills, resumption bit for bit, and one multi-process case that spawns the workers once
(switch, preempt, resume, cap, a message that cannot cross, a dead worker). The tests that take
a ``device`` run on the CPU here and on a GPU too (``pytest -m cuda``)."""
from __future__ import annotations

import dataclasses
import functools
import os
import signal

import pytest
import torch

import tidal
from tidal.passes.layer_groups import LayerGroups
from tidal.runtime.switching import (Arena, ArenaStack, HostModel, Repeat, SwitchingError,
                                     SwitchJob, Switcher, Task, weightless)

SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
CE = torch.nn.functional.cross_entropy
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.fixture(autouse=True)
def _one_thread():
    """Bit-for-bit comparisons with the one-thread reference: the same thread count, so no
    kernel splits a reduction differently (machines differ in cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _mlp(width: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.BatchNorm1d(width),
                               torch.nn.ReLU(), torch.nn.Linear(width, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, 3))


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)


def _train_job(name: str = "train") -> SwitchJob:
    x, y = _batch(1)
    c = tidal.compile(_mlp(32, 0), (x,), passes=[LayerGroups(grouping="per_layer")])
    return SwitchJob(name, c.graph_module, Repeat(((x,), y)), CE, SGD)


def _infer_job(cap=None) -> tuple[SwitchJob, torch.nn.Module, torch.Tensor]:
    model = _mlp(64, 1).eval()
    x, _ = _batch(2)
    c = tidal.compile(model, (x,), passes=[LayerGroups(grouping="per_layer")])
    return SwitchJob("infer", c.graph_module, Repeat(x), cap=cap), model, x


def _region(device: str = "cpu", nbytes: int = 1 << 20) -> torch.Tensor:
    """An arena region of ``nbytes`` on ``device``."""
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _matches(out: torch.Tensor, want: torch.Tensor, device: str = "cpu") -> bool:
    """``out`` equals ``want``, both computed on ``device``: bit for bit on the CPU, to float32
    rounding on a GPU (kernels may be picked by the addresses of their operands, the arena's or
    the allocator's)."""
    if torch.device(device).type == "cpu":
        return torch.equal(out, want)
    torch.testing.assert_close(out, want)
    return True


def _same_output(out: torch.Tensor, model: torch.nn.Module, x: torch.Tensor,
                 device: str = "cpu") -> bool:
    """``out`` (on the CPU, as a worker sends it, or on the task's device) is ``model(x)`` run
    on ``device``."""
    return _matches(out, model.to(device)(x.to(device)).to(out.device), device)


def _reference(job: SwitchJob, iterations: int, device: str = "cpu") -> tuple[dict, dict]:
    """Weights and optimizer state after ``iterations`` uninterrupted steps, one process."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        host = HostModel.of(job.graph)
        task = Task(_shipped(job), device)
        stack = ArenaStack(_region(device))
        task.activate(host, stack)
        for i in range(iterations):
            task.step(i, stack)
        state = task.clean(host)
        task.close()
        return {k: t.clone() for k, t in host.tensors().items()}, state
    finally:
        torch.set_num_threads(threads)


def _shipped(job: SwitchJob) -> SwitchJob:
    """The job as a worker gets it: a weightless copy of its graph."""
    return dataclasses.replace(job, graph=weightless(job.graph))


def _same_state(a: dict, b: dict) -> bool:
    sa, sb = a["state"], b["state"]
    return sa.keys() == sb.keys() and all(
        torch.equal(sa[k]["momentum_buffer"], sb[k]["momentum_buffer"]) for k in sa)


def test_arena_allocates_once_and_leases_first_fit():
    arena = Arena(10_000)
    a, b = arena.lease("a", 3000), arena.lease("b", 3000)
    assert (a.offset, b.offset) == (0, 3072)
    arena.release(a)
    assert arena.lease("c", 2000).offset == 0 and arena.find(5000) is None
    with pytest.raises(SwitchingError, match="no free range"):
        arena.lease("d", 5000)
    assert arena.allocations == 1


def test_stack_cap_spills_to_host_and_cap_changes():
    region = torch.zeros(8192, dtype=torch.uint8)
    s = ArenaStack(region, cap=1000)
    w = s.take((100,), torch.float32)
    mark = s.mark()
    spilled = s.take((200,), torch.float32)
    assert s.on_arena(w) and not s.on_arena(spilled) and (s.spills, s.spilled_bytes) == (1, 800)
    s.set_cap(None)
    assert s.on_arena(s.take((200,), torch.float32)) and s.spills == 1
    s.pop(mark)
    assert s.used == mark


def _started_against_five_steps(job, device="cpu"):
    """The reference after 5 straight steps ``(weights, optimizer state)``, the job's host
    model, an arena stack and a first task activated on them."""
    want_w, want_opt = _reference(job, 5, device)
    host = HostModel.of(job.graph)
    stack = ArenaStack(_region(device))
    first = Task(_shipped(job), device)
    first.activate(host, stack)
    return want_w, want_opt, host, stack, first


def _resume_in_a_fresh_task(job, host, stack, first, start, want_w, want_opt):
    """Clean ``first``, resume the job in a fresh task (as another worker would) from
    iteration ``start`` to 5: weights, buffers and momentum equal 5 straight steps; the
    optimizer state handed over is in host memory, as it crosses processes."""
    state = first.clean(host)
    assert all(t.device.type == "cpu" for t in _tensors_of(state))
    stack.pop(0)
    second = Task(_shipped(job), first.device)
    second.activate(host, stack, state)
    for i in range(start, 5):
        second.step(i, stack)
    state = second.clean(host)
    assert all(torch.equal(t, want_w[k]) for k, t in host.tensors().items())
    assert _same_state(state, want_opt)
    first.close()
    second.close()


def _tensors_of(tree) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("device", DEVICES)
def test_task_resumes_bit_for_bit_in_another_task(device):
    """Clean after 2 steps, activate a fresh task (as another worker would), run 3 more: the
    weights (BatchNorm's running statistics included) and momentum equal 5 straight steps."""
    job = _train_job()
    want_w, want_opt, host, stack, first = _started_against_five_steps(job, device)
    for i in range(2):
        first.step(i, stack)
    _resume_in_a_fresh_task(job, host, stack, first, 2, want_w, want_opt)


class _AfterPieces:
    """A preemption request that arrives once ``n`` pieces were asked to start."""

    def __init__(self, n: int):
        self.n, self.asked = n, 0

    def __call__(self) -> bool:
        self.asked += 1
        return self.asked > self.n


@pytest.mark.parametrize("step, pieces", [(0, 2), (2, 1), (2, 5), (2, 8), (2, 11)],
                         ids=["while-transmitting", "first-group", "before-backward",
                              "inside-backward", "before-optimizer"])
def test_task_preempted_at_a_piece_rolls_back(step, pieces):
    """Stop iteration ``step`` after ``pieces`` pieces started: ``step`` returns None and the
    job resumed in a fresh task from that iteration equals 5 straight steps bit for bit (the
    stopped iteration's BatchNorm updates and gradients undone)."""
    job = _train_job()
    want_w, want_opt, host, stack, first = _started_against_five_steps(job)
    for i in range(step):
        assert first.step(i, stack, lambda: False) is not None
    stop = _AfterPieces(pieces)
    assert first.step(step, stack, stop) is None and stop.asked > pieces
    _resume_in_a_fresh_task(job, host, stack, first, step, want_w, want_opt)


def test_cleaning_an_idle_training_task_keeps_its_optimizer_state():
    """Preempted before its first iteration, a resumed training job hands back the optimizer
    state it was given (it used to return None: the momentum was lost)."""
    job = _train_job()
    _, want_opt = _reference(job, 2)
    task = Task(_shipped(job))
    task.activate(HostModel.of(job.graph), ArenaStack(torch.empty(1 << 20, dtype=torch.uint8)),
                  want_opt)
    assert _same_state(task.clean(HostModel.of(job.graph)), want_opt)


@pytest.mark.parametrize("device", DEVICES)
def test_over_cap_task_spills_and_completes(device):
    """A job over its cap spills (memory on the arena's device, outside the arena) and
    computes what it computes uncapped."""
    job, model, x = _infer_job()
    host = HostModel.of(job.graph)
    task = Task(_shipped(job), device)
    stack = ArenaStack(_region(device), cap=host.nbytes // 2)
    task.activate(host, stack)
    spilled = [t for t in task.loads.dsts if not stack.on_arena(t)]
    out = task.step(0, stack).value
    assert stack.spills > 0 and stack.used <= host.nbytes // 2
    assert spilled and all(t.device == task.device for t in spilled)
    task.release()
    stack = ArenaStack(_region(device))
    task.activate(host, stack)
    uncapped = task.step(0, stack).value
    task.close()
    assert stack.spills == 0 and _matches(out, uncapped, device)
    assert _same_output(out, model, x, device)


def test_over_cap_training_spills_and_matches_uncapped():
    """A training job capped below its weights trains on spilled memory and ends bit for bit
    where the uncapped run does."""
    job = _train_job()
    want_w, want_opt = _reference(job, 3)
    host = HostModel.of(job.graph)
    task = Task(_shipped(job))
    stack = ArenaStack(_region(), cap=host.nbytes // 2)
    task.activate(host, stack)
    for i in range(3):
        task.step(i, stack)
    state = task.clean(host)
    task.close()
    assert stack.spills > 0
    assert all(torch.equal(t, want_w[k]) for k, t in host.tensors().items())
    assert _same_state(state, want_opt)


@pytest.mark.parametrize("device", DEVICES)
def test_switcher_processes(device, recwarn):
    """One spawn for every multi-process case: train A, switch to an over-cap inference job B
    (A preempted at a step boundary, cleaned asynchronously), resume A to the end: its state
    equals an uninterrupted run bit for bit; B spilled and was right; raising B's cap stops the
    spills; the arena never allocated again; an optimizer state that cannot cross fails the
    switch at once, naming it; a killed worker gives an error naming it. On a GPU the device
    is a bare "cuda", resolved to an indexed device, and every host copy was page-locked."""
    total = 6
    train = _train_job("a")
    want_w, want_opt = _reference(train, total, device)
    infer, model, x = _infer_job(cap=4096)
    with Switcher([train, infer], device, standby=1, threads=1, timeout_s=60) as sw:
        assert sw.arena.allocations == 1 and sw.arena.block.device == sw.device
        assert sw.device.type == device and (device == "cpu" or sw.device.index is not None)
        first = sw.switch("a", iterations=total)
        assert first.first.result.iteration == 0
        rb = sw.switch("infer", iterations=2)
        assert _same_output(rb.output, model, x, device) and rb.first.spills > 0
        assert rb.worker != first.worker
        sw.wait()
        done_a = sw.wait_saved("a").next_iteration  # A is cleaned asynchronously
        assert sw.states["a"].cleaning_s is not None and 1 <= done_a <= total
        sw.set_cap("infer", None)
        ra = sw.switch("a", iterations=total - done_a) if done_a < total else None
        if ra is not None:
            assert ra.first.result.iteration == done_a
            sw.wait()
        sw.stop()
        nxt, weights, opt = sw.state("a")
        assert nxt == total
        assert all(torch.equal(t, want_w[k]) for k, t in weights.items())
        assert _same_state(opt, want_opt)
        again = sw.switch("infer", iterations=1)
        assert again.first.spills == 0 and _same_output(again.output, model, x, device)
        assert sw.arena.allocations == 1
        sw.stop()
        sw.states["a"].optimizer_state = {"state": {0: {"momentum_buffer": torch.ones(
            1, device="meta")}}, "param_groups": opt["param_groups"]}
        with pytest.raises(SwitchingError, match=r"the controller \(to worker .*message "
                                                 r"'activate' cannot cross processes.*meta"):
            sw.switch("a", iterations=1)
        assert sw.active is None and sw.arena.holder("a") is None
        sw.states["a"].optimizer_state = opt
        victim = next(w for w in sw.workers if w.state == "standby")
        os.kill(victim.proc.pid, signal.SIGKILL)
        victim.proc.join(timeout=10)
        with pytest.raises(SwitchingError, match=rf"worker {victim.wid} .*died"):
            sw.switch("a", iterations=1)
    assert not [w for w in recwarn if "cudaHost" in str(w.message)]
