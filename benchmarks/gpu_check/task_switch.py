"""A PipeSwitch switch against stopping and starting a process: the time from a switch
request to job B's first output with tidal's ``Switcher`` (a standby worker, B's weights
carved from the arena and streamed group by group) against a process killed and a new one
started (``benchmarks/switching.py``'s ``tidal_switch`` and ``stop_and_start``), B's output
checked against the eager model.

It prints one line per stage as it goes (the switcher ready, each round's switches, each
stop-and-start), so a run stopped at its time limit shows where it was; every wait of the
switcher and of a stop-and-start is bounded by what is left before the driver's deadline
(``TIDAL_GPU_CHECK_DEADLINE``), so a stall or a dead process ends as an error naming it."""
from __future__ import annotations

import os
import statistics
import time

import torch
import torch.multiprocessing as mp

import tidal
from benchmarks.gpu_check.common import fail, mlp
from benchmarks.switching import start_idle, stop_and_start, tidal_switch, wait_idle
from tidal.passes.layer_groups import LayerGroups
from tidal.runtime.switching import HostModel, Repeat, SwitchJob, Switcher

SUMMARY = ("switch.first_output_ms", "stop_start.first_output_ms", "switch.vs_stop_start",
           "switch.pipelining", "stop_start.device")

MARGIN_S = 5.0
"""Seconds kept before the driver's deadline: a wait that runs out still reports."""

WAIT_S = 60.0
"""The longest wait of a switch when the deadline is further."""


def _left() -> float:
    """Seconds a wait may take now: what is left before the driver's deadline less
    :data:`MARGIN_S` (at least 1), 600 without a deadline."""
    deadline = os.environ.get("TIDAL_GPU_CHECK_DEADLINE")
    if not deadline:
        return 600.0
    return max(float(deadline) - time.time() - MARGIN_S, 1.0)


def _progress(t0: float, line: str) -> None:
    print(f"task_switch {time.perf_counter() - t0:6.1f} s: {line}", flush=True)


def _job(name: str, widths: list[int], seed: int, batch: int):
    model = mlp(widths, seed=seed).eval()
    x = torch.randn(batch, widths[0])
    with torch.no_grad():
        expected = model(x)
    c = tidal.compile(model, (x,), passes=[LayerGroups(grouping="optimal")])
    return SwitchJob(name, c.graph_module, Repeat((x,))), expected


def _close(out: torch.Tensor, expected: torch.Tensor) -> bool:
    return torch.allclose(out.detach().cpu(), expected, rtol=1e-4, atol=1e-5)


def _switches(a: SwitchJob, b: SwitchJob, device: str, quick: bool, rounds: int,
              t0: float) -> list[dict]:
    """``rounds`` switches to B and back to A, after A ran once."""
    switches = []
    with Switcher([a, b], device=device, standby=1, threads=1 if quick else None,
                  timeout_s=min(WAIT_S, _left()), start_timeout_s=_left()) as sw:
        starts = ", ".join(f"{w.startup_s:.1f}" for w in sw.workers)
        _progress(t0, f"switcher ready on {sw.device} (worker start-up {starts} s)")
        sw.switch("a", iterations=1)
        sw.wait()
        for k in range(rounds):
            sw.timeout_s = min(WAIT_S, _left())
            switches.append(tidal_switch(sw, "b"))
            back = tidal_switch(sw, "a")
            _progress(t0, f"round {k}: switch to b {switches[-1]['first'] * 1e3:.1f} ms, "
                          f"to a {back['first'] * 1e3:.1f} ms")
    return switches


def _stop_and_starts(b: SwitchJob, device: str, rounds: int, t0: float) -> list[dict]:
    """``rounds`` stop-and-starts to B; job A's processes started together beforehand."""
    ctx = mp.get_context("spawn")
    host = HostModel.of(b.graph)
    olds = [start_idle(ctx) for _ in range(rounds)]
    cold = []
    try:
        for old in olds:  # all started before any is measured
            wait_idle(old, _left())
        _progress(t0, f"job A's processes started ({rounds})")
        for k, old in enumerate(olds):
            cold.append(stop_and_start(ctx, b, host, device, old=old, timeout_s=_left()))
            _progress(t0, f"stop_and_start {k}: first output {cold[-1]['first'] * 1e3:.0f} ms "
                          f"(new process start-up {cold[-1]['init'] * 1e3:.0f} ms)")
    finally:
        for proc, _ in olds:
            proc.kill()
    return cold


def run(device: str, quick: bool) -> dict:
    t0 = time.perf_counter()
    widths = [64] * 4 + [10] if quick else [2048] * 9 + [1000]
    rounds = 1 if quick else 3
    a, _ = _job("a", widths, 0, 4)
    b, expected = _job("b", widths, 1, 4)
    figures: dict = {"widths": f"{widths[0]}x{len(widths) - 1} layers"}
    _progress(t0, f"jobs built ({figures['widths']})")
    switches = _switches(a, b, device, quick, rounds, t0)
    for r in switches:
        if not _close(r["out"], expected):
            fail(figures, "tidal switch: B's output differs from the eager model")
    for k in ("first", "clean", "init", "alloc", "trans"):
        figures[f"switch.{k}_ms"] = statistics.median(r[k] for r in switches) * 1e3
    figures["switch.first_output_ms"] = figures.pop("switch.first_ms")
    figures["switch.pipelining"] = statistics.median(r["pipe"] for r in switches)
    cold = _stop_and_starts(b, device, rounds, t0)
    figures["stop_start.device"] = device
    for r in cold:
        if not _close(r["out"], expected):
            fail(figures, "stop-and-start: B's output differs from the eager model")
    figures["stop_start.first_output_ms"] = statistics.median(r["first"] for r in cold) * 1e3
    figures["stop_start.init_ms"] = statistics.median(r["init"] for r in cold) * 1e3
    figures["switch.vs_stop_start"] = (figures["switch.first_output_ms"]
                                       / figures["stop_start.first_output_ms"])
    return figures
