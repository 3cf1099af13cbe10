"""An AntMan memory cap that spills: a layer-grouped job run by a ``tidal.runtime.switching``
task on an arena region of the device, once with no cap and once with a cap of half its
weights. The capped job must spill (``ArenaStack.spills > 0``), stay within its cap in the
arena, run on the device and give the uncapped job's output (and the eager model's). In this
process (``Task`` + ``ArenaStack``, as ``tests/test_switching.py``); the switcher's workers do
the same."""
from __future__ import annotations

import dataclasses
import time

import torch

import tidal
from benchmarks.gpu_check.common import fail, mlp, on_device, sync
from tidal.passes.layer_groups import LayerGroups
from tidal.runtime.switching import ArenaStack, HostModel, Repeat, SwitchJob, Task, weightless

SUMMARY = ("capped.spills", "capped.spilled_mib", "cap_mib", "weights_mib", "uncapped.step_ms",
           "capped.step_ms", "equal")


def _run_task(job: SwitchJob, host: HostModel, device: torch.device, arena_bytes: int,
              cap, steps: int) -> tuple[torch.Tensor, ArenaStack, float]:
    """Activate ``job`` on a fresh arena region with ``cap``; run ``steps`` iterations; return
    the first output, the stack and the median ms of the resident iterations."""
    task = Task(dataclasses.replace(job, graph=weightless(job.graph)), device)
    stack = ArenaStack(torch.empty(arena_bytes, dtype=torch.uint8, device=device), cap=cap)
    try:
        task.activate(host, stack)
        out = task.step(0, stack).value
        times = []
        for i in range(1, steps + 1):
            sync(device)
            t0 = time.perf_counter()
            task.step(i, stack)
            sync(device)
            times.append(time.perf_counter() - t0)
        return out, stack, sorted(times)[len(times) // 2] * 1e3
    finally:
        task.close()


def run(device: str, quick: bool) -> dict:
    dev = torch.device(device)
    widths = [64] * 4 + [10] if quick else [4096] * 9 + [1000]
    model = mlp(widths, seed=0).eval()
    x = torch.randn(16, widths[0])
    with torch.no_grad():
        expected = model(x)
    c = tidal.compile(model, (x,), passes=[LayerGroups(grouping="per_layer")])
    job = SwitchJob("capped", c.graph_module, Repeat((x,)))
    host = HostModel.of(job.graph)
    arena = 2 * host.nbytes + (4 << 20)
    cap = host.nbytes // 2
    figures: dict = {"weights_mib": host.nbytes / 2**20, "cap_mib": cap / 2**20}
    steps = 2 if quick else 10
    free, free_stack, figures["uncapped.step_ms"] = _run_task(job, host, dev, arena, None, steps)
    capped, stack, figures["capped.step_ms"] = _run_task(job, host, dev, arena, cap, steps)
    figures.update({"capped.spills": stack.spills,
                    "capped.spilled_mib": stack.spilled_bytes / 2**20,
                    "capped.arena_mib": stack.high_water / 2**20,
                    "uncapped.spills": free_stack.spills,
                    "equal": bool(torch.equal(free, capped))})
    if not stack.spills > 0:
        fail(figures, f"a cap of {cap} bytes under {host.nbytes} bytes of weights did not spill")
    if stack.high_water > cap:
        fail(figures, f"the capped job holds {stack.high_water} bytes of arena, over its cap")
    if not (on_device(capped, dev) and on_device(free, dev)):
        fail(figures, f"outputs on {capped.device} / {free.device}, not on {dev}")
    if not figures["equal"]:
        fail(figures, "the capped job's output differs from the uncapped job's")
    if not torch.allclose(capped.cpu(), expected, rtol=1e-4, atol=1e-5):
        fail(figures, "the capped job's output differs from the eager model's")
    return figures
