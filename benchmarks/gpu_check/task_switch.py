"""A PipeSwitch switch against stopping and starting a process: the time from a switch
request to job B's first output with tidal's ``Switcher`` (a standby worker, B's weights
carved from the arena and streamed group by group) against a process killed and a new one
started (``benchmarks/switching.py``'s ``tidal_switch`` and ``stop_and_start``), B's output
checked against the eager model."""
from __future__ import annotations

import inspect
import statistics

import torch
import torch.multiprocessing as mp

import tidal
from benchmarks.gpu_check.common import fail, mlp
from benchmarks.switching import stop_and_start, tidal_switch
from tidal.passes.layer_groups import LayerGroups
from tidal.runtime.switching import HostModel, Repeat, SwitchJob, Switcher

SUMMARY = ("switch.first_output_ms", "stop_start.first_output_ms", "switch.vs_stop_start",
           "switch.pipelining", "stop_start.device")


def _job(name: str, widths: list[int], seed: int, batch: int):
    model = mlp(widths, seed=seed).eval()
    x = torch.randn(batch, widths[0])
    with torch.no_grad():
        expected = model(x)
    c = tidal.compile(model, (x,), passes=[LayerGroups(grouping="optimal")])
    return SwitchJob(name, c.graph_module, Repeat((x,))), expected


def _close(out: torch.Tensor, expected: torch.Tensor) -> bool:
    return torch.allclose(out.detach().cpu(), expected, rtol=1e-4, atol=1e-5)


def run(device: str, quick: bool) -> dict:
    widths = [64] * 4 + [10] if quick else [2048] * 9 + [1000]
    rounds = 1 if quick else 3
    a, _ = _job("a", widths, 0, 4)
    b, expected = _job("b", widths, 1, 4)
    figures: dict = {"widths": f"{widths[0]}x{len(widths) - 1} layers"}
    switches = []
    with Switcher([a, b], device=device, standby=1, threads=1 if quick else None) as sw:
        sw.switch("a", iterations=1)
        sw.wait()
        for _ in range(rounds):
            switches.append(tidal_switch(sw, "b"))
            tidal_switch(sw, "a")
    for r in switches:
        if not _close(r["out"], expected):
            fail(figures, "tidal switch: B's output differs from the eager model")
    for k in ("first", "clean", "init", "alloc", "trans"):
        figures[f"switch.{k}_ms"] = statistics.median(r[k] for r in switches) * 1e3
    figures["switch.first_output_ms"] = figures.pop("switch.first_ms")
    figures["switch.pipelining"] = statistics.median(r["pipe"] for r in switches)
    ctx = mp.get_context("spawn")
    host = HostModel.of(b.graph)
    options = {"device": device} if "device" in inspect.signature(stop_and_start).parameters \
        else {}
    figures["stop_start.device"] = device if options else "cpu (stop_and_start has no device)"
    cold = [stop_and_start(ctx, b, host, **options) for _ in range(rounds)]
    for r in cold:
        if not _close(r["out"], expected):
            fail(figures, "stop-and-start: B's output differs from the eager model")
    figures["stop_start.first_output_ms"] = statistics.median(r["first"] for r in cold) * 1e3
    figures["stop_start.init_ms"] = statistics.median(r["init"] for r in cold) * 1e3
    figures["switch.vs_stop_start"] = (figures["switch.first_output_ms"]
                                       / figures["stop_start.first_output_ms"])
    return figures
