"""The priority runtime (DeepPool §5) on the device's backend: a foreground job's p50/p99
iteration time alone, beside a background training job, and beside it with priorities off;
the background's throughput alone and in both.

Foreground: an MLP's forward lowered into captured segments (``compile(lower="graphs")``, CUDA
graphs on a GPU), each iteration followed by a host-side wait (a server waiting for requests,
a rank for its peers: ``benchmarks/collocation.py``'s ``fg_job``) ``WAIT_PER_COMPUTE`` times
as long as its compute alone (once on the CPU); background: another MLP's training as
``Compiled.job``; both through ``Runtime(backend=backend_for(device))`` (on the CPU the
backend's gate stands in for one device)."""
from __future__ import annotations

import dataclasses

import torch

import tidal
from benchmarks.collocation import fg_job
from benchmarks.gpu_check.common import fail, mlp, percentile
from tidal.runtime.backend import backend_for
from tidal.runtime.scheduler import BoundPiece, FunctionJob, Runtime

SUMMARY = ("alone.p50_ms", "alone.p99_ms", "beside.p50_ms", "beside.p99_ms",
           "no_priorities.p50_ms", "no_priorities.p99_ms", "bg_alone.it_per_s",
           "beside.bg_it_per_s", "no_priorities.bg_it_per_s")


WAIT_PER_COMPUTE = 4.0
"""The foreground's idle time after an iteration, over its compute time (full run)."""


def _without_grad(job: FunctionJob) -> FunctionJob:
    """``job`` with every piece run under ``torch.no_grad()``: a lowered forward replays its
    CUDA graphs only without autograd, and the runtime's dispatcher is in grad mode (the
    background job trains)."""
    return dataclasses.replace(job, make_pieces=lambda i: [
        BoundPiece(b.piece, torch.no_grad()(b.fn)) for b in job.make_pieces(i)])


def _jobs(device: torch.device, quick: bool):
    """Makers of the foreground job (``iterations``, ``wait_s`` idle after each) and the
    background job (until stopped)."""
    fg_widths, bg_widths = ([32, 64, 64, 10], [32, 128, 128, 10]) if quick else \
        ([1024, 4096, 4096, 1024], [2048, 8192, 8192, 1000])
    fg_batch, bg_batch = (8, 16) if quick else (64, 256)
    fg_model = mlp(fg_widths, seed=0).to(device).eval().requires_grad_(False)
    x = torch.randn(fg_batch, fg_widths[0], device=device)
    fg = tidal.compile(fg_model, (x,), lower="graphs")
    bg_model = mlp(bg_widths, seed=1).to(device)
    xb = torch.randn(bg_batch, bg_widths[0], device=device)
    yb = torch.randint(0, bg_widths[-1], (bg_batch,), device=device)
    bg = tidal.compile(bg_model, (xb,), loss_fn=torch.nn.functional.cross_entropy,
                       optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-3))

    def make_fg(iterations: int, wait_s: float = 0.0) -> FunctionJob:
        return _without_grad(fg_job(fg.lowered, (x,), iterations, wait_s))

    def make_bg(iterations=None):
        return bg.job(lambda i: ((xb,), yb), name="bg", iterations=iterations)

    return make_fg, make_bg


def _run(device: torch.device, fg, bg, **options) -> dict:
    with Runtime(backend=backend_for(device), **options) as rt:
        if fg is not None:
            rt.submit(fg, priority="high")
        if bg is not None:
            rt.submit(bg, priority="low")
        return rt.run(until="foreground" if fg is not None else "all")


def _fg_figures(stats, label: str) -> dict:
    fg = stats["fg"]
    if fg.error:
        raise RuntimeError(f"{label}: the foreground job failed: {fg.error}")
    its = [t / 1e3 for t in fg.iteration_us[1:]]  # the first iteration calibrates
    out = {f"{label}.p50_ms": percentile(its, 50), f"{label}.p99_ms": percentile(its, 99)}
    if "bg" in stats:
        out[f"{label}.bg_it_per_s"] = _rate_beside(stats["bg"], fg)
        out[f"{label}.bg_iterations"] = stats["bg"].iterations
        out[f"{label}.bg_pauses"] = stats["bg"].feedback_pauses
        out[f"{label}.bg_error"] = stats["bg"].error
    return out


def _rate_beside(bg, fg) -> float:
    """The background's iterations per second over the foreground's run (its own span would
    make one iteration look like a full rate)."""
    span_us = (fg.last_us or 0.0) - (fg.first_us or 0.0)
    return bg.iterations / (span_us * 1e-6) if span_us > 0 else 0.0


def run(device: str, quick: bool) -> dict:
    dev = torch.device(device)
    iters = 12 if quick else 200
    make_fg, make_bg = _jobs(dev, quick)
    figures: dict = {"fg_iterations": iters}
    compute = _fg_figures(_run(dev, make_fg(iters // 2 + 2), None), "compute")  # + warm-up
    # idle after each iteration: as long as its compute on the CPU; on a GPU 4 times as long
    # (a server at 20% load), so that the background's forward and backward (one piece each,
    # about 1.5 and 3 ms on an H200) fit into the gaps the feedback leaves it
    wait_s = compute["compute.p50_ms"] * 1e-3 * (1 if quick else WAIT_PER_COMPUTE)
    figures["fg_wait_ms"] = wait_s * 1e3
    figures.update(_fg_figures(_run(dev, make_fg(iters, wait_s), None), "alone"))
    solo = _run(dev, None, make_bg(iters))["bg"]
    figures["bg_alone.it_per_s"] = solo.throughput
    figures.update(_fg_figures(_run(dev, make_fg(iters, wait_s), make_bg()), "beside"))
    figures.update(_fg_figures(_run(dev, make_fg(iters, wait_s), make_bg(), priorities=False),
                               "no_priorities"))
    for label in ("beside", "no_priorities"):
        error = figures.pop(f"{label}.bg_error", None)
        if error is not None:
            fail(figures, f"{label}: the background job failed: {error}")
        elif not figures[f"{label}.bg_it_per_s"] > 0 and not quick:
            # a quick run's foreground can end before one background iteration does (a quiet
            # CPU: 1 ms steps); the full run is long enough for the background to progress
            fail(figures, f"{label}: the background job made no progress")
    if solo.error:
        fail(figures, f"background alone failed: {solo.error}")
    return figures
