"""Time to first output from a cold weight store: load-all-then-run vs per-layer pipelining vs
PipeSwitch's optimal grouping, on a device (the CPU by default).

For ResNet-152 and the BERT-base encoder (batch 1) the script
1. calibrates the planner to this machine: the forward throughput (annotated FLOPs / a warm
   forward's time on the device) gives ``peak_tflops``; the link bandwidth is, on the CPU, a
   cold read of a store file (the "link" is the disk read of the safetensors file (checked reads)
   plus the copy into the model's memory), on a GPU a copy from pinned host memory;
2. compiles the model three times with the ``layer_groups`` pass (``grouping`` = ``single``,
   ``per_layer``, ``optimal``) and writes each grouping's store file;
3. for each of ``--repeats`` rounds and each grouping runs the pipelined forward
   (``LayerGroupsProgram.run``) and reads its time to the first output from the
   :class:`~tidal.runtime.programs.layer_groups.LoadTimeline` (the backend's clock: CUDA events
   on a GPU). On the CPU each round is cold (the file's pages dropped from the page cache,
   ``posix_fadvise DONTNEED``); on a GPU the weights come from the program's pinned host copy
   (PipeSwitch's setting: the models wait in host memory), filled and checked by a warm-up run.
It prints the median times and the ratios to load-all-then-run, and checks every output
against the eager model. :func:`time_strategies` is the measurement of one model on a device
(what ``make gpu-check`` can call).

Run: ``.venv/bin/python benchmarks/cold_start.py`` (``--models resnet152`` for one model,
``--device cuda`` on a GPU).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import tidal  # noqa: E402
from examples.models import ZOO  # noqa: E402
from tidal.ir import cost  # noqa: E402
from tidal.ir.table import format_table  # noqa: E402
from tidal.passes.layer_groups import LayerGroups  # noqa: E402
from tidal.runtime.programs.layer_groups import LayerGroupsProgram  # noqa: E402
from tidal.runtime.weights.loader import write_groups  # noqa: E402
from tidal.runtime.weights.store import drop_page_cache  # noqa: E402

STRATEGIES = (("load all, then run", "single"), ("per-layer pipelining", "per_layer"),
              ("optimal grouping", "optimal"))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cold_read_gbps(path: Path) -> float:
    drop_page_cache(path)
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass
    return path.stat().st_size * 8 / 1e9 / (time.perf_counter() - t0)


def _pinned_copy_gbps(nbytes: int, device: torch.device) -> float:
    """Host (pinned) to ``device`` bandwidth, from the best of three copies of ``nbytes``."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(3):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return nbytes * 8 / 1e9 / best


def _calibrate(model, x, tmp: Path, device: Any = "cpu") -> tidal.Cluster:
    """The machine the planner plans for: ``model``'s forward throughput on ``device`` and
    the link its weights come over (see the module docstring)."""
    device = torch.device(device)
    plain = tidal.compile(model, x, lower="none")
    flops = cost.total_cost(plain.graph_module, 1)["fwd_flops"]
    there = copy.deepcopy(model).to(device)
    xs = tuple(t.to(device) for t in x)
    fwd_s = float("inf")
    with torch.no_grad():
        there(*xs)
        for _ in range(3):  # the best of three warm forwards
            _sync(device)
            t0 = time.perf_counter()
            there(*xs)
            _sync(device)
            fwd_s = min(fwd_s, time.perf_counter() - t0)
    del there
    probe = tmp / "probe.safetensors"
    c = tidal.compile(model, x, passes=[LayerGroups(grouping="single")])
    write_groups(c.graph_module, probe)
    gbps = _cold_read_gbps(probe) if device.type == "cpu" else \
        _pinned_copy_gbps(probe.stat().st_size, device)
    probe.unlink()
    return tidal.Cluster(gpus=1, bandwidth_gbps=gbps, latency_us=50.0,
                         peak_tflops=flops / fwd_s / 1e12)


def time_strategies(model: torch.nn.Module, inputs: Sequence[Any], device: Any = "cpu",
                    repeats: int = 3, tmp: Optional[Path] = None,
                    cluster: Optional[tidal.Cluster] = None) -> dict[str, dict]:
    """Time to the first output of ``model`` (eval mode) on ``inputs`` when its weights load
    onto ``device`` from a store, for each grouping of :data:`STRATEGIES` (``single`` is
    load-all-then-run): ``{grouping: {"groups", "predicted_s", "first_output_s", "wall_s"}}``
    (the planner's prediction and the medians over ``repeats`` rounds (``first_output_s`` on the backend's clock, from the
    first load's start to the last group's end; ``wall_s`` the host's time for the whole
    run)), and ``"<grouping>_vs_single"`` ratios of ``first_output_s``. Each output is checked
    against the eager model (``AssertionError`` naming the grouping). ``cluster`` is the
    machine to plan for (default: :func:`_calibrate` on ``device``); the stores go to a
    temporary folder in ``tmp`` (default: the current one, on disk). A few seconds on the CPU
    for a small model (``examples.models.ZOO["resnet50_small"]``, batch 1)."""
    device = torch.device(device)
    xs = tuple(t.to(device) for t in inputs)
    with torch.no_grad():
        expected = copy.deepcopy(model).to(device)(*xs)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(dir=tmp if tmp is not None else ".") as d:
        cluster = cluster or _calibrate(model, tuple(inputs), Path(d), device)
        runs = []
        for _, grouping in STRATEGIES:  # every store written before any run moves a weight
            c = tidal.compile(model, tuple(inputs), cluster=cluster,
                              passes=[LayerGroups(grouping=grouping)], lower="none")
            path = Path(d) / f"{grouping}.safetensors"
            write_groups(c.graph_module, path)
            runs.append((grouping, c.graph_module, LayerGroupsProgram(path, device),
                         c.plan.get("layer_groups").total_us * 1e-6))
        for grouping, gm, program, predicted in runs:
            cold = device.type == "cpu"
            if not cold:
                program.run(gm, xs)  # fills and checks the pinned host copy; warms the kernels
            first, wall = [], []
            for _ in range(repeats):
                if cold:
                    drop_page_cache(program.path)
                _sync(device)
                t0 = time.perf_counter()
                result, tl = program.run(gm, xs)
                _sync(device)
                wall.append(time.perf_counter() - t0)
                first.append(tl.first_output)
                if not torch.allclose(result, expected, rtol=1e-4, atol=1e-5):
                    raise AssertionError(f"{grouping}: the output differs from the eager model "
                                         f"by {float((result - expected).abs().max()):.3g}")
            out[grouping] = {"groups": len(tl.transfer), "predicted_s": predicted,
                             "first_output_s": statistics.median(first),
                             "wall_s": statistics.median(wall)}
    for _, grouping in STRATEGIES[1:]:
        out[f"{grouping}_vs_single"] = (out[grouping]["first_output_s"]
                                        / out["single"]["first_output_s"])
    return out


def bench(name: str, repeats: int, tmp: Path, device: Any = "cpu", batch: int = 1
          ) -> list[list]:
    torch.manual_seed(0)
    model = ZOO[name]().eval()
    x = model.example_inputs(batch)
    cluster = _calibrate(model, x, tmp, device)
    print(f"{name}: link {cluster.bandwidth_gbps:.1f} Gb/s, "
          f"{cluster.peak_tflops * 1e3:.0f} GFLOP/s (forward) on {device}", file=sys.stderr,
          flush=True)
    times = time_strategies(model, x, device, repeats, tmp, cluster)
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    rows = []
    for label, grouping in STRATEGIES:
        t = times[grouping]
        rows.append([name, label, t["groups"], f"{size / 2**20:.0f}",
                     f"{t['predicted_s'] * 1e3:.1f}", f"{t['first_output_s'] * 1e3:.1f}", f"{t['wall_s'] * 1e3:.1f}",
                     f"{t['first_output_s'] / times['single']['first_output_s']:.2f}"])
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["resnet152", "bert_base"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu", help="where the weights load (cpu, cuda, ...)")
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(dir=".") as d:  # on disk, not a tmpfs
        for name in args.models:
            rows += bench(name, args.repeats, Path(d), args.device, args.batch)
    print(format_table(["model", "strategy", "groups", "MiB", "predicted ms",
                        "first output ms (median)",
                        "wall ms (median)", "median vs load-all"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
