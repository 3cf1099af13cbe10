"""Time to first output from a cold weight store: load-all-then-run vs per-layer pipelining vs
PipeSwitch's optimal grouping, on this machine (CPU: the "link" is the disk read of the
memory-mapped safetensors file plus the copy into the model's memory).

For ResNet-152 and the BERT-base encoder (batch 1) the script
1. calibrates the planner to this machine: the forward throughput (annotated FLOPs / a warm
   forward's time) gives ``peak_tflops``; a cold read of a store file gives the link bandwidth;
2. compiles the model three times with the ``layer_groups`` pass (``grouping`` = ``single``,
   ``per_layer``, ``optimal``) and writes each grouping's store file;
3. for each of ``--repeats`` rounds and each grouping: drops the file's pages from the page
   cache (``posix_fadvise DONTNEED``), then times ``run_pipelined`` to the first output.
It prints the median times and the ratios to load-all-then-run, and checks every output
against the eager model.

Run: ``.venv/bin/python benchmarks/cold_start.py`` (``--models resnet152`` for one model).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import tidal  # noqa: E402
from examples.models import ZOO  # noqa: E402
from tidal.ir import cost  # noqa: E402
from tidal.ir.table import format_table  # noqa: E402
from tidal.passes.layer_groups import LayerGroups  # noqa: E402
from tidal.runtime.programs.layer_groups import run_pipelined  # noqa: E402
from tidal.runtime.weight_loader import write_groups  # noqa: E402
from tidal.runtime.weight_store import drop_page_cache  # noqa: E402

STRATEGIES = (("load all, then run", "single"), ("per-layer pipelining", "per_layer"),
              ("optimal grouping", "optimal"))


def _cold_read_gbps(path: Path) -> float:
    drop_page_cache(path)
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass
    return path.stat().st_size * 8 / 1e9 / (time.perf_counter() - t0)


def _calibrate(model, x, tmp: Path) -> tidal.Cluster:
    plain = tidal.compile(model, x)
    flops = cost.total_cost(plain.graph_module, 1)["fwd_flops"]
    with torch.no_grad():
        model(*x)
        t0 = time.perf_counter()
        model(*x)
        fwd_s = time.perf_counter() - t0
    probe = tmp / "probe.safetensors"
    c = tidal.compile(model, x, passes=[LayerGroups(grouping="single")])
    write_groups(c.graph_module, probe)
    gbps = _cold_read_gbps(probe)
    probe.unlink()
    return tidal.Cluster(gpus=1, bandwidth_gbps=gbps, latency_us=50.0,
                         peak_tflops=flops / fwd_s / 1e12)


def bench(name: str, repeats: int, tmp: Path) -> list[list]:
    torch.manual_seed(0)
    model = ZOO[name]().eval()
    x = model.example_inputs(1)
    with torch.no_grad():
        expected = model(*x)
    cluster = _calibrate(model, x, tmp)
    print(f"{name}: link {cluster.bandwidth_gbps:.1f} Gb/s (cold read), "
          f"{cluster.peak_tflops * 1e3:.0f} GFLOP/s (forward)", file=sys.stderr, flush=True)
    runs = {}
    for label, grouping in STRATEGIES:
        c = tidal.compile(model, x, cluster=cluster, passes=[LayerGroups(grouping=grouping)])
        path = tmp / f"{name}-{grouping}.safetensors"
        write_groups(c.graph_module, path)
        runs[label] = (c, path, [])
    for _ in range(repeats):
        for label, (c, path, times) in runs.items():
            drop_page_cache(path)
            out, tl = run_pipelined(c.graph_module, path, x)
            if not torch.equal(out, expected):
                raise AssertionError(f"{name} {label}: output differs from the eager model")
            times.append(tl.first_output)
    base = statistics.median(runs[STRATEGIES[0][0]][2])
    rows = []
    for label, (c, path, times) in runs.items():
        plan = c.plan.get("layer_groups")
        med = statistics.median(times)
        rows.append([name, label, len(plan.groups), f"{path.stat().st_size / 2**20:.0f}",
                     f"{plan.total_us / 1e3:.0f}", f"{med * 1e3:.0f}", f"{min(times) * 1e3:.0f}",
                     f"{med / base:.2f}"])
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["resnet152", "bert_base"])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(dir=".") as d:  # on disk, not a tmpfs
        for name in args.models:
            rows += bench(name, args.repeats, Path(d))
    print(format_table(["model", "strategy", "groups", "MiB", "predicted ms",
                        "first output ms (median)", "min ms", "median vs load-all"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
