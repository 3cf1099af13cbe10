"""Simulate one training iteration of MODEL on a model of a GPU cluster.

    tidal simulate MODEL --gpus 8 --global-batch 32 --plan dp|burst|burst+bg [--profile FILE]
                         [--bandwidth-gbps G] [--latency-us L] [--amp-limit A]
                         [--bg-batch B] [--interference F]

Layer times come from ``--profile`` (a DeepPool ``.prof``/``.txt`` file or a saved tidal
``DeviceProfile`` JSON) where it has the layer, else from FLOPs at ``--peak-tflops``. Prints the
iteration time, throughput, GPU-seconds and busy fraction. These are simulated figures, not
measurements. ``burst`` plans with the burst_parallel pass (DeepPool's planner) and simulates
that plan; ``burst+bg`` also packs a background job — the same model at ``--bg-batch`` samples —
into every GPU's idle time, with the foreground slowed by ``--interference``. ``tick_tock`` and
``round_robin`` plan with Wavelet's passes and show their schedules' predicted timelines (these
need a model with ``default_loss`` and ``example_targets``, as the zoo models have).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from tidal.compiler.cli_args import add_model_args, positive_float, positive_int

PLANS = ("dp", "burst", "burst+bg", "tick_tock", "round_robin")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``tidal simulate`` options."""
    add_model_args(p)
    p.add_argument("--global-batch", type=positive_int, default=None,
                   help="global batch of the simulated job (default: --batch)")
    p.add_argument("--plan", choices=PLANS, default="dp",
                   help="execution strategy to simulate (default dp: data parallelism)")
    p.add_argument("--profile", metavar="FILE",
                   help="per-layer device times: DeepPool .prof/.txt or a DeviceProfile JSON")
    p.add_argument("--peak-tflops", type=positive_float, default=100.0,
                   help="device throughput for layers the profile lacks (default 100)")
    p.add_argument("--trace", metavar="FILE",
                   help="write the data-parallel timeline as a Chrome trace (Perfetto) JSON")
    p.add_argument("--scaling", metavar="CSV",
                   help="statistical-efficiency table (global_batch,steps to the target "
                        "accuracy): also simulate weak, strong and batch-optimal scaling over "
                        "1, 2, 4, ... --gpus GPUs (DeepPool Figure 1)")
    p.add_argument("--scaling-svg", metavar="FILE", default="tidal-scaling.svg",
                   help="where --scaling writes its chart (default tidal-scaling.svg)")
    p.add_argument("--bg-batch", type=positive_int, default=8,
                   help="burst+bg: batch of the background job (default 8)")
    p.add_argument("--interference", type=positive_float, default=1.1,
                   help="burst+bg: foreground slowdown while collocated (default 1.1)")


def _load_profile(path: str):
    from tidal.ir.device_profile import DeviceProfile

    f = Path(path)
    if not f.is_file():
        raise ValueError(f"--profile {path}: no such file")
    if f.suffix in (".prof", ".txt"):
        return DeviceProfile.from_deeppool(f)
    return DeviceProfile.load(f)


def run(args: argparse.Namespace) -> int:
    """Run ``tidal simulate``; return the exit status."""
    import tidal
    from tidal.compiler.model_spec import build_model, example_inputs_for
    from tidal.runtime.sim.programs import data_parallel, layer_times, summarize

    global_batch = args.global_batch or args.batch
    gpus = args.gpus or 1
    if global_batch % gpus:
        raise ValueError(f"--global-batch {global_batch} is not divisible by --gpus {gpus}")
    model = build_model(args.model)
    inputs = example_inputs_for(model, args.model, global_batch, args.input_shape)
    cluster = tidal.Cluster(gpus=gpus, bandwidth_gbps=args.bandwidth_gbps,
                            latency_us=args.latency_us, peak_tflops=args.peak_tflops,
                            profile=_load_profile(args.profile) if args.profile else None)
    compiled = tidal.compile(model, inputs, cluster=cluster, leaf_modules=args.leaf)
    gm = compiled.graph_module
    times = lambda b: layer_times(gm, cluster, b)  # noqa: E731
    one = summarize(data_parallel(times, 1, global_batch, cluster), 1, global_batch)
    dp = summarize(data_parallel(times, gpus, global_batch, cluster), gpus, global_batch)
    print(f"simulated (not measured): {args.model}, global batch {global_batch}")
    print(f"  1 GPU            : {one.summary()}")
    print(f"  data parallel    : {dp.summary()}  ({one.iteration_us / dp.iteration_us:.2f}x)")
    if args.trace:
        import json

        from tidal.runtime.sim.engine import chrome_trace

        Path(args.trace).write_text(json.dumps(chrome_trace(dp.intervals, "data parallel")))
        print(f"  timeline: {args.trace}")
    if args.scaling:
        _simulate_scaling(args, gm, cluster, global_batch)
    if args.plan in ("tick_tock", "round_robin"):
        _simulate_wavelet(args, model, inputs, cluster, global_batch, one)
    elif args.plan != "dp":
        from tidal.compiler.cli_args import pass_options
        from tidal.runtime.sim.scenarios import fig9_scenarios

        s = fig9_scenarios(model, inputs, cluster, bg_batch=args.bg_batch,
                           interference=args.interference, leaf_modules=args.leaf,
                           **pass_options(args))
        note = "  [planner fell back to data parallelism]" if s["fallback"] else ""
        print(f"  burst parallel   : {s['bp']:.1f} samples/s ({s['bp'] / s['single']:.2f}x){note}")
        if args.plan == "burst+bg":
            c = s["bp_col"]
            print(f"  burst + background: foreground {c['fg']:.1f}, background {c['bg']:.1f}, "
                  f"cluster {c['cluster']:.1f} samples/s (background alone on every GPU: "
                  f"{s['bg_only']:.1f})")
    return 0


def _simulate_wavelet(args, model, inputs, cluster, global_batch, one) -> None:
    import tidal
    from tidal.compiler.cli_args import pass_options
    from tidal.runtime.sim.programs import schedule_result

    loss_fn, targets = getattr(model, "default_loss", None), getattr(model, "example_targets", None)
    if loss_fn is None or targets is None:
        raise ValueError(f"--plan {args.plan} plans a training step: MODEL {args.model!r} needs "
                         "default_loss and example_targets(batch) methods")
    compiled = tidal.compile(model, inputs, passes=[args.plan], cluster=cluster,
                             loss_fn=loss_fn, optimizer=lambda ps: None,
                             example_targets=targets(global_batch), leaf_modules=args.leaf,
                             **pass_options(args))
    plan = compiled.plan.get(args.plan)
    # a tick_tock schedule runs `batches` wave iterations of half the global batch each; a
    # round_robin cycle runs the whole global batch as N micro-batches
    waves = plan.schedule.batches if args.plan == "tick_tock" else 2
    r = schedule_result(plan.schedule, global_batch * waves // 2)
    print(f"  {args.plan:17s}: {r.summary()} ({one.iteration_us / r.iteration_us * r.global_batch / global_batch:.2f}x"
          f" samples/s of 1 GPU)")
    print("\n".join("    " + line for line in plan.schedule.table().splitlines()[1:5]))
    if args.plan == "tick_tock":
        print("    (the schedule's timing lets one wave's forward overlap the other's backward at "
              "full speed on a rank: Wavelet's premise that one wave leaves a GPU underused; "
              "an upper bound where a device is already saturated)")


def _simulate_scaling(args, gm, cluster, global_batch: int) -> None:
    from dataclasses import replace

    from tidal.runtime.sim.programs import data_parallel, layer_times, summarize
    from tidal.runtime.sim.scaling import StepsTable, scaling_speedups, scaling_svg

    table = StepsTable.load(args.scaling)
    gpus = [1 << k for k in range(cluster.gpus.bit_length()) if 1 << k <= cluster.gpus]
    cache: dict[int, object] = {}

    def times(b: int):
        if b not in cache:
            cache[b] = layer_times(gm, cluster, b)
        return cache[b]

    def iteration(g: int, b: int) -> float:
        c = replace(cluster, gpus=g)
        return summarize(data_parallel(times, g, b, c), g, b).iteration_us

    per_gpu = max(1, global_batch // cluster.gpus)
    s = scaling_speedups(iteration, table, gpus, per_gpu, global_batch)
    print(f"  scaling (speedup in time to accuracy; weak: {per_gpu}/GPU, strong: "
          f"{global_batch} global)")
    for mode, vals in s.items():
        print(f"    {mode:14s}" + " ".join(f"{g}:{v:.2f}x" for g, v in zip(gpus, vals)))
    Path(args.scaling_svg).write_text(scaling_svg(gpus, s, f"{args.model}: simulated scaling"))
    print(f"  scaling chart: {args.scaling_svg}")
