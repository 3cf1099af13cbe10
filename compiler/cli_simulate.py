"""Simulate one training iteration of MODEL on a model of a GPU cluster.

    tidal simulate MODEL --gpus 8 --global-batch 32 --plan dp [--profile FILE]
                         [--bandwidth-gbps G] [--latency-us L]

Layer times come from ``--profile`` (a DeepPool ``.prof``/``.txt`` file or a saved tidal
``DeviceProfile`` JSON) where it has the layer, else from FLOPs at ``--peak-tflops``. Prints the
iteration time, throughput, GPU-seconds and busy fraction. These are simulated figures, not
measurements.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from tidal.compiler.cli_args import add_model_args, positive_float, positive_int

PLANS = ("dp",)


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
    inputs = example_inputs_for(model, args.model, max(1, global_batch // gpus),
                                args.input_shape)
    cluster = tidal.Cluster(gpus=gpus, bandwidth_gbps=args.bandwidth_gbps,
                            latency_us=args.latency_us, peak_tflops=args.peak_tflops,
                            profile=_load_profile(args.profile) if args.profile else None)
    compiled = tidal.compile(model, inputs, cluster=cluster, leaf_modules=args.leaf)
    gm = compiled.graph_module
    one = summarize(data_parallel(lambda b: layer_times(gm, cluster, b), 1, global_batch,
                                  cluster), 1, global_batch)
    result = summarize(data_parallel(lambda b: layer_times(gm, cluster, b), gpus, global_batch,
                                     cluster), gpus, global_batch)
    print(f"simulated (not measured): {args.model}, plan {args.plan}")
    print(f"  1 GPU : {one.summary()}")
    print(f"  {gpus} GPUs: {result.summary()}")
    print(f"  speedup over 1 GPU: {one.iteration_us / result.iteration_us:.2f}x")
    return 0
