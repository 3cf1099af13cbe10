"""``tidal simulate``: one training iteration of MODEL on a model of a GPU cluster.

Wired into ``compiler/cli.py``'s ``_SUBCOMMANDS``: ``add_arguments(parser)``, ``run(args)`` and
``DESCRIPTION`` (what ``tidal simulate --help`` shows).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from tidal.compiler.cli_args import (UsageError, add_model_args, check_pass_options,
                                     cluster_from_args, model_and_inputs, pass_options,
                                     positive_float, positive_int, steps_table,
                                     training_options, write_dump, write_text)
from tidal.compiler.cli_errors import bad_input

PLANS = ("dp", "burst", "burst+bg", "tick_tock", "round_robin")
PLAN_PASSES = {"dp": "", "burst": "burst_parallel", "burst+bg": "burst_parallel",
               "tick_tock": "tick_tock", "round_robin": "round_robin"}
"""The pass each ``--plan`` compiles with: the one its pass options (``-o``) go to."""

DESCRIPTION = """Simulate one training iteration of MODEL on a model of a GPU cluster and print
the iteration time, throughput, GPU-seconds and busy fraction. These are simulated figures, not
measurements. Layer times come from --profile (a DeepPool .prof/.txt file, a saved tidal
DeviceProfile JSON, or a100: DeepPool's published A100 profiles with its A100 link) where it has
the layer, else from FLOPs at --peak-tflops. --plan burst plans with the burst_parallel pass
(DeepPool's planner) and simulates that plan as a training step whose per-layer gradient
all-reduces overlap backward (and, for comparison, under the planner's own model, where they do
not); burst+bg also packs a background job (the same model at --bg-batch samples) around it,
with the foreground slowed by --interference, as a range: from idle GPU time only to also using
the capacity small foreground kernels leave unused. tick_tock and round_robin plan with
Wavelet's passes (loss and optimizer from --loss, --optimizer, --lr) and show their schedules'
timelines for steps of the global batch, as the schedule's builder timed them and re-run with
contention."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``tidal simulate`` options."""
    add_model_args(p)
    p.add_argument("--global-batch", type=positive_int, default=None,
                   help="global batch of the simulated job (default: --batch)")
    p.add_argument("--plan", choices=PLANS, default="dp",
                   help="execution strategy to simulate (default dp: data parallelism)")
    p.add_argument("--profile", metavar="FILE|a100",
                   help="per-layer device times: DeepPool .prof/.txt, a DeviceProfile JSON, or "
                        "'a100' for DeepPool's published A100 profiles (vgg16, "
                        "wide_resnet101_2, inception_v3, ...; per-GPU batches 1-128), which "
                        "also sets DeepPool's A100 link (2.66e5 bytes/us, 40 us) and 312 TFLOPS "
                        "unless given")
    p.add_argument("--peak-tflops", type=positive_float, default=None,
                   help="device throughput for layers the profile lacks (default 100; 312 "
                        "with --profile a100)")
    p.set_defaults(bandwidth_gbps=None, latency_us=None)  # filled in by _link_defaults
    p.add_argument("--trace", metavar="FILE",
                   help="write the data-parallel timeline as a Chrome trace (Perfetto) JSON")
    p.add_argument("--scaling", metavar="CSV",
                   help="statistical-efficiency table (global_batch,steps to the target "
                        "accuracy): also simulate weak, strong and batch-optimal scaling over "
                        "1, 2, 4, ... --gpus GPUs (DeepPool Figure 1)")
    p.add_argument("--scaling-svg", metavar="FILE", default="tidal-scaling.svg",
                   help="where --scaling writes its chart (default tidal-scaling.svg)")
    p.add_argument("--dump", metavar="DIR",
                   help="also write the compile's dump to DIR; with --scaling its index shows "
                        "the scaling chart")
    p.add_argument("--bg-batch", type=positive_int, default=8,
                   help="burst+bg: batch of the background job (default 8)")
    p.add_argument("--interference", type=positive_float, default=1.1,
                   help="burst+bg: foreground slowdown while collocated (default 1.1)")


def _load_profile(path: str):
    from tidal.ir.device_profile import DeviceProfile, deeppool_a100

    if path.lower() == "a100":
        try:
            return deeppool_a100()
        except FileNotFoundError as e:
            raise UsageError(f"--profile a100: {e}") from None
    f = Path(path)
    if not f.is_file():
        raise UsageError(f"--profile {path}: no such file")
    with bad_input(f"--profile {path}"):
        if f.suffix in (".prof", ".txt"):
            return DeviceProfile.from_deeppool(f)
        return DeviceProfile.load(f)


GENERIC_LINK = (100.0, 10.0, 100.0)


def _link_defaults(args: argparse.Namespace) -> None:
    """Fill the link and device options the user left out: DeepPool's A100 setting with
    ``--profile a100``, else tidal's generic defaults."""
    from tidal.ir.device_profile import DEEPPOOL_A100_LINK

    a100 = (args.profile or "").lower() == "a100"
    bw, lat, tflops = DEEPPOOL_A100_LINK if a100 else GENERIC_LINK
    args.bandwidth_gbps = bw if args.bandwidth_gbps is None else args.bandwidth_gbps
    args.latency_us = lat if args.latency_us is None else args.latency_us
    args.peak_tflops = tflops if args.peak_tflops is None else args.peak_tflops


def run(args: argparse.Namespace) -> int:
    """Run ``tidal simulate``; return the exit status."""
    import tidal
    from tidal.sim.programs import data_parallel, layer_times, summarize

    if args.passes:
        raise UsageError(f"--passes {args.passes}: simulate takes no --passes; --plan picks the "
                         f"pass it plans with ({', '.join(p for p in PLAN_PASSES.values() if p)})")
    _link_defaults(args)
    global_batch = args.global_batch or args.batch
    gpus = args.gpus or 1
    if global_batch % gpus:
        raise UsageError(f"--global-batch {global_batch} is not divisible by --gpus {gpus}")
    check_pass_options(args, PLAN_PASSES[args.plan])
    table = steps_table(args)  # a bad --scaling file fails before any simulation
    profile = _load_profile(args.profile) if args.profile else None
    model, inputs = model_and_inputs(args, global_batch)
    cluster = cluster_from_args(args, gpus=gpus, peak_tflops=args.peak_tflops, profile=profile)
    compiled = tidal.compile(model, inputs, cluster=cluster, leaf_modules=args.leaf)
    gm = compiled.graph_module
    if cluster.profile is not None:
        _report_coverage(args, gm, cluster, global_batch // gpus, global_batch)
    times = lambda b: layer_times(gm, cluster, b)  # noqa: E731
    one = summarize(data_parallel(times, 1, global_batch, cluster), 1, global_batch)
    dp = summarize(data_parallel(times, gpus, global_batch, cluster), gpus, global_batch)
    print(f"simulated (not measured): {args.model}, global batch {global_batch}")
    print(f"  1 GPU            : {one.summary()}")
    print(f"  data parallel    : {dp.summary()}  ({one.iteration_us / dp.iteration_us:.2f}x)")
    if args.trace:
        _write_trace(args.trace, dp)
    if table is not None:
        _simulate_scaling(args, gm, cluster, table, global_batch)
    if args.dump:
        print(f"  dump: {write_dump(compiled, args.dump, '--dump', scaling=table)}")
    if args.plan in ("tick_tock", "round_robin"):
        _simulate_wavelet(args, model, inputs, cluster, global_batch, one)
    elif args.plan != "dp":
        _simulate_burst(args, model, inputs, cluster)
    return 0


def _write_trace(path: str, dp) -> None:
    """Write the data-parallel timeline as Chrome trace JSON to ``--trace`` ``path``."""
    import json

    from tidal.sim.engine import chrome_trace

    write_text(path, json.dumps(chrome_trace(dp.intervals, "data parallel")), "--trace")
    print(f"  timeline: {path}")


def _simulate_burst(args, model, inputs, cluster) -> None:
    """``--plan burst`` and ``burst+bg``: DeepPool's Figure 9 scenarios."""
    from tidal.compiler.sim_scenarios import fig9_scenarios

    s = fig9_scenarios(model, inputs, cluster, bg_batch=args.bg_batch,
                       interference=args.interference, leaf_modules=args.leaf,
                       **pass_options(args))
    note = "  [planner fell back to data parallelism]" if s["fallback"] else ""
    print(f"  burst parallel   : {s['bp_overlap']:.1f} samples/s "
          f"({s['bp_overlap'] / s['single']:.2f}x; planner's model without overlap: "
          f"{s['bp']:.1f}){note}")
    if args.plan == "burst+bg":
        c, sm = s["bp_col"], s["bp_col_sm"]
        print(f"  burst + background: foreground {c['fg']:.1f}, background {c['bg']:.1f} "
              f"(idle time only) to {sm['bg']:.1f} (sharing unused SMs), cluster "
              f"{c['cluster']:.1f} to {sm['cluster']:.1f} samples/s (background alone on "
              f"every GPU: {s['bg_only']:.1f})")


def profiled_layers(gm, cluster, batch: int) -> tuple[int, int]:
    """(layers whose time at per-GPU ``batch`` comes from ``cluster.profile``, layers with any
    cost): a layer is profiled when its time differs from the FLOP estimate without the
    profile."""
    from dataclasses import replace

    from tidal.ir import cost

    with_p = cost.node_times_us(gm, batch, cluster)
    without = cost.node_times_us(gm, batch, replace(cluster, profile=None))
    costed = [n for n, t in without.items() if sum(t) > 0 or sum(with_p[n]) > 0]
    return sum(1 for n in costed if with_p[n] != without[n]), len(costed)


def _report_coverage(args, gm, cluster, batch: int, global_batch: int) -> None:
    hits, total = profiled_layers(gm, cluster, batch)
    if hits == 0:
        hint = (" (DeepPool profiled vgg16, wide_resnet101_2, inception_v3, resnet and vit "
                "layers at per-GPU batches 1-128)" if args.profile.lower() == "a100" else "")
        raise UsageError(f"--profile {args.profile}: no layer of {args.model} at per-GPU batch "
                         f"{batch} has a row in profile {cluster.profile.name!r}{hint}; "
                         f"drop --profile to time every layer from FLOPs")
    line = f"profile {cluster.profile.name}: {hits}/{total} layers at per-GPU batch {batch}"
    if global_batch != batch:
        one, _ = profiled_layers(gm, cluster, global_batch)
        line += f", {one}/{total} at batch {global_batch} (1 GPU)"
    print(f"{line}; the others from FLOPs at {cluster.peak_tflops:g} TFLOPS")


def _simulate_wavelet(args, model, inputs, cluster, global_batch, one) -> None:
    """``--plan tick_tock`` and ``round_robin``: the pass's schedule, whose steps each train on
    the global batch (tick-tock: two waves of half of it), as timelines."""
    import tidal
    from tidal.sim.programs import schedule_result

    compiled = tidal.compile(model, inputs, passes=[args.plan], cluster=cluster,
                             leaf_modules=args.leaf, **pass_options(args),
                             **training_options(args, model, inputs, global_batch, args.plan))
    plan = compiled.plan.get(args.plan)
    for label, contention in (("schedule", False), ("contended", True)):
        r = schedule_result(plan.schedule, global_batch, contention=contention)
        speed = r.throughput / one.throughput
        print(f"  {args.plan + ' ' + label:26s}: {r.summary()} ({speed:.2f}x samples/s of "
              f"1 GPU)")
    print("\n".join("    " + line for line in plan.schedule.table().splitlines()[1:5]))
    print("    (schedule: the builder's timing, where a rank's waves overlap at full speed "
          "(Wavelet's premise that one wave leaves a GPU underused), an upper bound; contended: "
          "the engine re-runs the actions with one compute lane and one link per GPU, the bound "
          "for a GPU one wave already saturates)")


def _simulate_scaling(args, gm, cluster, table, global_batch: int) -> None:
    """Weak, strong and batch-optimal scaling over the ``--scaling`` steps ``table``."""
    from tidal.sim.scaling import scaling_svg, simulate_scaling

    gpus, per_gpu, s = simulate_scaling(gm, cluster, table, global_batch)
    print(f"  scaling (speedup in time to accuracy; weak: {per_gpu}/GPU, strong: "
          f"{global_batch} global)")
    for mode, vals in s.items():
        print(f"    {mode:14s}" + " ".join(f"{g}:{v:.2f}x" for g, v in zip(gpus, vals)))
    write_text(args.scaling_svg, scaling_svg(gpus, s, f"{args.model}: simulated scaling"),
               "--scaling-svg")
    print(f"  scaling chart: {args.scaling_svg}")
