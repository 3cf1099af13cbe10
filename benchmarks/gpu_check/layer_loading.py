"""Layer-group pipelined loading against load-all: the time to the first output of a model
whose weights stream from a cold store (page cache dropped) onto the device, for the
``layer_groups`` pass's groupings ``single`` (load all, then run), ``per_layer`` and
``optimal`` (``benchmarks/cold_start.py``'s strategies), through ``compiled.cold_start(path,
x, device=...)``; every output checked against the eager model. On the CPU the planner is
calibrated to this machine (``benchmarks/cold_start.py``); on a GPU it plans for a 200 Gb/s
host link and 50 TFLOP/s."""
from __future__ import annotations

import copy
import statistics
import tempfile
import time
from pathlib import Path

import torch

import tidal
from benchmarks.cold_start import STRATEGIES, _calibrate
from benchmarks.gpu_check.common import fail, mlp, on_device, sync
from tidal.passes.layer_groups import LayerGroups
from tidal.runtime.weights.loader import write_groups
from tidal.runtime.weights.store import drop_page_cache

SUMMARY = ("single.first_output_ms", "per_layer.first_output_ms", "optimal.first_output_ms",
           "optimal.vs_single", "optimal.groups", "store_mib")


def run(device: str, quick: bool) -> dict:
    dev = torch.device(device)
    widths = [64] * 6 + [10] if quick else [4096] * 17 + [1000]
    repeats = 2 if quick else 5
    model = mlp(widths, seed=0).eval()
    x = torch.randn(1 if quick else 8, widths[0])
    with torch.no_grad():
        expected = model(x)
    figures: dict = {"widths": f"{widths[0]}x{len(widths) - 1} layers"}
    with tempfile.TemporaryDirectory(prefix="layer-loading-", dir=".") as tmp:  # on disk
        cluster = _calibrate(model, (x,), Path(tmp)) if dev.type == "cpu" else \
            tidal.Cluster(gpus=1, bandwidth_gbps=200.0, latency_us=10.0, peak_tflops=50.0)
        for _, grouping in STRATEGIES:
            # a copy each: cold_start leaves the weights of the model it loads on the device
            c = tidal.compile(copy.deepcopy(model), (x,), cluster=cluster,
                              passes=[LayerGroups(grouping=grouping)])
            path = Path(tmp) / f"{grouping}.safetensors"
            write_groups(c.graph_module, path)
            figures["store_mib"] = path.stat().st_size / 2**20
            figures[f"{grouping}.groups"] = len(c.plan.get("layer_groups").groups)
            times = []
            for _ in range(repeats):
                drop_page_cache(path)
                sync(dev)
                t0 = time.perf_counter()
                out = c.cold_start(path, x.to(dev), device=dev)
                sync(dev)
                times.append(time.perf_counter() - t0)
                if not on_device(out, dev):
                    fail(figures, f"{grouping}: the output is on {out.device}, not {dev}")
                if not torch.allclose(out.cpu(), expected, rtol=1e-4, atol=1e-5):
                    diff = float((out.cpu() - expected).abs().max())
                    fail(figures, f"{grouping}: output differs from eager by {diff:.3g}")
            figures[f"{grouping}.first_output_ms"] = statistics.median(times) * 1e3
    single = figures["single.first_output_ms"]
    for _, grouping in STRATEGIES[1:]:
        figures[f"{grouping}.vs_single"] = figures[f"{grouping}.first_output_ms"] / single
    return figures
