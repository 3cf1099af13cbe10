"""``tidal whatif``: does gradient compression pay for this model on that cluster?

    tidal whatif --model resnet101 --batch 64 --gpus 64 --bandwidth 10Gbps --compressor powersgd:4

prints the predicted iteration time of sync SGD (DDP) and of the compressor from the
performance model (:mod:`tidal.ir.perf_model`, dissertation Eq. 4.1), the speedup, the crossover
bandwidth, and the compression ratio needed for near-linear scaling (Figs. 4.8 and 4.11): the
smallest ratio ``c`` by which an ideal compressor (all-reduce compatible, bucketed and
overlapped like sync SGD, free to encode) must shrink the gradient so that a step on the GPUs
takes at most ``--near-linear`` (10 %) longer than the step on one GPU, at this batch and at
the batch sizes of ``--ratio-batches`` (the paper: ~4x at 10 Gb/s "even for quite small batch
sizes").

Inputs of the model, all stated in the output:

- the model's parameter shapes and FLOPs come from the in-repo zoo built on the meta device (no
  memory), traced and costed by :mod:`tidal.ir.cost`; ``resnet101`` is the zoo's torchvision-
  layout ``ResNet`` with layers ``[3, 4, 23, 3]`` (44,549,160 parameters);
- compute time is FLOPs at an effective V100 FP32 training throughput of 9.0 TFLOPS, derived
  from NVIDIA's published 367 img/s for ResNet-50 v1.5 training on one V100 16GB in FP32
  (NVIDIA DeepLearningExamples, PyTorch ResNet50 v1.5 README, DGX-1 table) times the cost
  model's 24.5 GFLOP per image for forward + backward (``--tflops`` to change it);
- encode+decode time is the dissertation's Table 4.1 (ResNet-50 on V100) scaled by the
  parameter count (PowerSGD also by rank / 4) unless ``--encode-ms`` is given.

Wired into ``compiler/cli.py``'s ``_SUBCOMMANDS`` through ``add_arguments``, ``run`` and
``DESCRIPTION`` (what ``tidal whatif --help`` shows).

Example:
    >>> import argparse
    >>> from tidal.compiler import cli_whatif
    >>> p = argparse.ArgumentParser(); cli_whatif.add_arguments(p)
    >>> args = p.parse_args(["--model", "resnet50", "--gpus", "8", "--compressor", "signsgd"])
    >>> (args.bandwidth, args.compressor.spec(), cli_whatif.parse_bandwidth("800Mbps"))
    (10.0, 'signsgd', 0.8)
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

from tidal.compiler.cli_args import (bandwidth, bandwidths, non_empty, non_negative_float,
                                     percent, positive_float, positive_int, positive_ints)
from tidal.compiler.cli_errors import UsageError, bad_input, one_line
from tidal.ir import perf_model
from tidal.ir.cluster import Cluster
if TYPE_CHECKING:  # imported where used: ``tidal whatif --help`` must not import torch
    from tidal.runtime.comm.compressors import Compressor

DESCRIPTION = """Predict whether gradient compression pays for a model on a cluster, from the
performance model of "On the utility of gradient compression" (Eq. 4.1): the iteration time of
synchronous SGD (DDP, bucketed all-reduces overlapping backward) and of the chosen compressor,
the speedup, the bandwidth above which synchronous SGD is faster, and the compression ratio an
ideal compressor would need for near-linear scaling (a step at most --near-linear longer than on
one GPU) at this batch and at --ratio-batches. The model's parameters and FLOPs come from the
in-repo zoo (built on the meta device, no memory); compute time is FLOPs at --tflops (default: an
effective V100 FP32 rate); encode+decode time is the paper's Table 4.1 scaled by parameter count
unless --encode-ms is given. All inputs are printed with the result; nothing is measured."""

V100_FP32_TFLOPS = 9.0
"""Effective V100 FP32 training throughput: 367 img/s (NVIDIA, ResNet-50 v1.5, 1x V100 16GB,
FP32) x 24.5 GFLOP per image (forward + backward from the cost model)."""

TABLE_4_1_PARAMS = 25_557_032
"""Parameters of ResNet-50, the model Table 4.1 timed."""

_TABLE_4_1_KEY = {"powersgd": "PowerSGD-Rank4", "topk": "TopK-1%", "randomk": "RandomK-1%",
                  "signsgd": "SignSGD", "qsgd": "QSGD-2bit"}

parse_bandwidth = bandwidth
"""``"10Gbps"``, ``"100 Mbps"``, ``"25Gb/s"`` or ``"10"`` (Gb/s) -> Gb/s (finite, > 0)."""


def _compressor(text: str) -> Compressor:
    from tidal.runtime.comm.compressors import make_compressor

    try:
        return make_compressor(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def model_factory(name: str):
    """Any MODEL spec (``module:factory``, ``file.py:factory``, a zoo name such as
    ``resnet101``) -> its factory; ``ModelSpecError`` naming an unknown one."""
    from tidal.compiler.model_spec import cwd_importable, load_factory

    cwd_importable()
    return load_factory(name)


@dataclass(frozen=True)
class ModelStats:
    """What the performance model needs of a model: per-sample FLOPs and gradient shapes in
    backward (reverse registration) order."""

    name: str
    params: int
    fwd_flops_per_sample: float
    bwd_flops_per_sample: float
    grad_shapes: tuple[tuple[int, ...], ...]


def model_stats(name: str) -> ModelStats:
    """Build ``name`` on the meta device, trace it and read its FLOPs and parameter shapes."""
    import torch  # here, not at import: ``tidal whatif --help`` must not import torch

    from tidal.ir.capture import trace
    from tidal.ir import cost
    from tidal.ir.param_owners import trainable

    from tidal.compiler.model_spec import ModelSpecError, build_model

    with torch.device("meta"):
        model = build_model(name)
    if not callable(getattr(model, "example_inputs", None)):
        raise ModelSpecError(f"--model {name!r} has no example_inputs(batch) method to size "
                             "its FLOPs with (zoo models have one)")
    inputs = model.example_inputs(2)
    gm = trace(model, inputs)
    cost.annotate(gm, inputs)
    one = cost.total_cost(gm, 1)
    shapes = tuple(tuple(p.shape) for p in reversed(trainable(model).values()))
    return ModelStats(name, sum(p.numel() for p in model.parameters()), one["fwd_flops"],
                      one["bwd_flops"], shapes)


def table_4_1_encode_s(compressor: Compressor, params: int) -> float:
    """Table 4.1's V100 encode+decode time for this kind of compressor, scaled linearly by
    parameter count from ResNet-50 (and by rank / 4 for PowerSGD)."""
    if compressor.name not in _TABLE_4_1_KEY:
        return 0.0
    ms = perf_model.PAPER_TABLE_4_1_MS[_TABLE_4_1_KEY[compressor.name]][0]
    if compressor.name == "powersgd":
        ms *= compressor.level("") / 4
    return ms * 1e-3 * params / TABLE_4_1_PARAMS


@dataclass(frozen=True)
class WhatIf:
    """The model's verdict for one setting."""

    workload: perf_model.Workload
    comp: perf_model.CompressorCost
    cluster: Cluster
    gamma: float
    sync: perf_model.StepTime
    compressed: perf_model.StepTime
    crossover_gbps: Optional[float]
    required_ratio: Optional[float]

    @property
    def speedup(self) -> float:
        """Sync SGD step over compressed step."""
        return self.sync.total_s / self.compressed.total_s


def workload(stats: ModelStats, batch: int, tflops: float = V100_FP32_TFLOPS,
             bucket_bytes: float = perf_model.DDP_BUCKET_BYTES) -> perf_model.Workload:
    """Forward/backward time at ``tflops`` and DDP buckets of ``stats`` at per-GPU ``batch``."""
    rate = tflops * 1e12
    return perf_model.Workload.from_tensors(stats.fwd_flops_per_sample * batch / rate,
                                            stats.bwd_flops_per_sample * batch / rate,
                                            [4 * math.prod(s) for s in stats.grad_shapes],
                                            bucket_bytes)


def required_by_batch(stats: ModelStats, batches: Sequence[int], cluster: Cluster, *,
                      tflops: float = V100_FP32_TFLOPS,
                      bucket_bytes: float = perf_model.DDP_BUCKET_BYTES,
                      gamma: float = perf_model.DEFAULT_GAMMA,
                      tolerance: float = perf_model.NEAR_LINEAR_TOLERANCE
                      ) -> list[tuple[int, Optional[float]]]:
    """Fig. 4.8: the compression ratio needed for near-linear scaling at each per-GPU batch."""
    return [(b, perf_model.required_compression(workload(stats, b, tflops, bucket_bytes),
                                                cluster, gamma, tolerance)) for b in batches]


def what_if(stats: ModelStats, batch: int, cluster: Cluster, compressor: Compressor, *,
            tflops: float = V100_FP32_TFLOPS, encode_s: Optional[float] = None,
            bucket_bytes: float = perf_model.DDP_BUCKET_BYTES,
            gamma: float = perf_model.DEFAULT_GAMMA,
            tolerance: float = perf_model.NEAR_LINEAR_TOLERANCE) -> WhatIf:
    """Predict sync SGD and ``compressor`` for ``stats`` at per-GPU ``batch`` on ``cluster``;
    ``tolerance``: how much slower than one GPU a step may be and still scale near-linearly."""
    from tidal.ir.compression_model import compressor_cost

    sizes = [4 * math.prod(s) for s in stats.grad_shapes]
    parts = perf_model.bucket_partition(sizes, bucket_bytes)
    work = workload(stats, batch, tflops, bucket_bytes)
    enc = table_4_1_encode_s(compressor, stats.params) if encode_s is None else encode_s
    comp = compressor_cost(compressor, [[stats.grad_shapes[i] for i in b] for b in parts], enc)
    return WhatIf(work, comp, cluster, gamma, perf_model.sync_sgd_step(work, cluster, gamma),
                  perf_model.compressed_step(work, comp, cluster),
                  perf_model.crossover_bandwidth_gbps(work, comp, cluster, gamma),
                  perf_model.required_compression(work, cluster, gamma, tolerance))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``whatif`` options."""
    p.add_argument("--model", type=non_empty, default="resnet101",
                   help="resnet101 or a zoo model name (default resnet101)")
    p.add_argument("--batch", type=positive_int, default=64, help="batch per GPU (default 64)")
    p.add_argument("--gpus", type=positive_int, default=64, help="GPUs (default 64)")
    p.add_argument("--bandwidth", type=bandwidth, default=10.0,
                   help="per-GPU bandwidth, e.g. 10Gbps or 800Mbps (default 10Gbps)")
    p.add_argument("--latency-us", type=non_negative_float, default=10.0,
                   help="latency alpha per collective step, microseconds (default 10)")
    p.add_argument("--compressor", type=_compressor, default="powersgd:4",
                   help="powersgd:RANK, topk:FRACTION, randomk:FRACTION, signsgd, qsgd:LEVELS")
    p.add_argument("--encode-ms", type=non_negative_float, default=None,
                   help="encode+decode ms per step (default: Table 4.1 scaled)")
    p.add_argument("--tflops", type=positive_float, default=V100_FP32_TFLOPS,
                   help=f"effective training TFLOPS per GPU (default {V100_FP32_TFLOPS}, V100)")
    p.add_argument("--bucket-mb", type=positive_float, default=25.0,
                   help="DDP bucket MiB (default 25)")
    p.add_argument("--gamma", type=positive_float, default=perf_model.DEFAULT_GAMMA,
                   help=f"backward slowdown under overlap (default {perf_model.DEFAULT_GAMMA})")
    p.add_argument("--sweep", type=bandwidths, default=(), metavar="G1,G2,..",
                   help="also print speedups at these bandwidths (Gb/s)")
    p.add_argument("--near-linear", type=percent, default=perf_model.NEAR_LINEAR_TOLERANCE,
                   metavar="PERCENT",
                   help="near-linear scaling: a step at most this much longer than the step on "
                        "one GPU (default 10%%); the compression ratio needed for it is the "
                        "smallest ratio by which an ideal compressor (all-reduce, bucketed and "
                        "overlapped like sync SGD, free to encode) must shrink the gradient")
    p.add_argument("--ratio-batches", type=positive_ints, default=(8, 16, 32, 64),
                   metavar="B1,B2,..",
                   help="per-GPU batch sizes to print that ratio for (Fig. 4.8; default "
                        "8,16,32,64)")


def _ratio(r: Optional[float]) -> str:
    return f"{r:.2f}x" if r is not None else "unreachable"


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f}"


def report(w: WhatIf, stats: ModelStats, batch: int, tflops: float, encode_given: bool,
           tolerance: float = perf_model.NEAR_LINEAR_TOLERANCE,
           by_batch: Sequence[tuple[int, Optional[float]]] = ()) -> str:
    """The text ``tidal whatif`` prints."""
    c, work, comp = w.cluster, w.workload, w.comp
    ratio = work.total_bytes / max(1.0, comp.total_payload)
    lines = [
        f"what-if: {stats.name} ({stats.params:,} parameters), batch {batch} per GPU, "
        f"{c.gpus} GPUs, {c.bandwidth_gbps:g} Gb/s, alpha {c.latency_us:g} us, "
        f"{len(work.bucket_bytes)} buckets, gamma {w.gamma:g}",
        f"compute at {tflops:g} TFLOPS: forward {_ms(work.fwd_s)} ms, backward "
        f"{_ms(work.bwd_s)} ms; gradient {work.total_bytes / perf_model.MIB:.1f} MiB",
        f"{comp.name}: {ratio:.1f}x fewer bytes, "
        f"{'all-reduce' if comp.all_reduce else 'all-gather'} x{comp.rounds}, encode+decode "
        f"{_ms(comp.encode_decode_s)} ms ({'given' if encode_given else 'Table 4.1, scaled'})",
        "",
        f"{'':<14}{'step ms':>10}{'comm ms':>10}",
        f"{'sync SGD':<14}{_ms(w.sync.total_s):>10}{_ms(w.sync.comm_s):>10}",
        f"{comp.name:<14}{_ms(w.compressed.total_s):>10}{_ms(w.compressed.comm_s):>10}",
        "",
        f"speedup of {comp.name} over sync SGD: {w.speedup:.2f}x",
        "crossover bandwidth: " + (f"{w.crossover_gbps:.2f} Gb/s (sync SGD is faster above)"
                                   if w.crossover_gbps is not None
                                   else "none in 0.001-100000 Gb/s"),
        f"compression needed for near-linear scaling (a step within {tolerance:.0%} of one "
        "GPU's forward + backward; ideal compressor: all-reduce, bucketed and overlapped like "
        f"sync SGD, free to encode): {_ratio(w.required_ratio)}",
    ]
    if by_batch:
        lines.append(f"  by batch per GPU at {c.bandwidth_gbps:g} Gb/s (Fig. 4.8: ~4x at 10 Gb/s "
                     "for small batches): "
                     + ", ".join(f"{b}: {_ratio(r)}" for b, r in by_batch))
    return "\n".join(lines)


def _inputs(args: argparse.Namespace) -> tuple[ModelStats, Cluster, Compressor]:
    """The model's stats, the cluster and the compressor the options name: a ``UsageError``
    naming the option at fault."""
    stats = model_stats(args.model)
    with bad_input():  # Cluster's ValueError names the field
        cluster = Cluster(gpus=args.gpus, bandwidth_gbps=args.bandwidth,
                          latency_us=args.latency_us)
    compressor = args.compressor
    if isinstance(compressor, str):
        from tidal.runtime.comm.compressors import make_compressor

        with bad_input(f"--compressor {compressor}"):
            compressor = make_compressor(compressor)
    return stats, cluster, compressor


def _check_finite(w: WhatIf, args: argparse.Namespace) -> None:
    """A ``UsageError`` when the options are so extreme that a predicted time is not finite."""
    if not all(math.isfinite(t) for t in (w.sync.total_s, w.compressed.total_s)):
        raise UsageError(f"--tflops {args.tflops:g}, --bandwidth {args.bandwidth:g}, "
                         f"--latency-us {args.latency_us:g}, --batch {args.batch}: the predicted "
                         "step time is not a finite number; give values nearer a real cluster")


def run(args: argparse.Namespace) -> int:
    """Run ``tidal whatif``; bad input is one line on stderr and status 2 (a ``UsageError``
    or ``ModelSpecError``; an error in the model's arithmetic itself is a traceback)."""
    try:
        stats, cluster, compressor = _inputs(args)
        common = dict(tflops=args.tflops,
                      encode_s=None if args.encode_ms is None else args.encode_ms * 1e-3,
                      bucket_bytes=args.bucket_mb * perf_model.MIB, gamma=args.gamma,
                      tolerance=args.near_linear)
        w = what_if(stats, args.batch, cluster, compressor, **common)
        _check_finite(w, args)
    except UsageError as e:
        print(f"tidal whatif: error: {one_line(e)}", file=sys.stderr)
        return 2
    by_batch = required_by_batch(stats, args.ratio_batches, cluster, tflops=args.tflops,
                                 bucket_bytes=common["bucket_bytes"], gamma=args.gamma,
                                 tolerance=args.near_linear)
    print(report(w, stats, args.batch, args.tflops, args.encode_ms is not None,
                 args.near_linear, by_batch))
    if args.sweep:
        print(f"\n{'Gb/s':>8}{'sync ms':>10}{compressor.spec() + ' ms':>18}{'speedup':>9}")
        for g in args.sweep:
            c = Cluster(gpus=args.gpus, bandwidth_gbps=g, latency_us=args.latency_us)
            s = what_if(stats, args.batch, c, compressor, **common)
            print(f"{g:>8g}{_ms(s.sync.total_s):>10}{_ms(s.compressed.total_s):>18}"
                  f"{s.speedup:>9.2f}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Stand-alone entry point (``python -m tidal.compiler.cli_whatif``)."""
    p = argparse.ArgumentParser(prog="tidal whatif", description=DESCRIPTION)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
