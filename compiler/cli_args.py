"""Argument types and the MODEL options shared by the ``tidal`` subcommands."""
from __future__ import annotations

import argparse
import json
from typing import Any


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return v


def positive_float(text: str) -> float:
    """argparse type: a number > 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be greater than 0")
    return v


def option(text: str) -> tuple[str, Any]:
    """argparse type: ``key=value`` with the value read as JSON when it parses."""
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"{text!r} is not key=value")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The MODEL argument and the options that say how to build, trace and plan it."""
    p.add_argument("model", metavar="MODEL",
                   help="module:factory, path/to/file.py:factory, or a zoo model name")
    p.add_argument("--passes", default="",
                   help="comma-separated pass names, or 'auto' for every pass that applies "
                        "(default: none; trace and cost annotation only)")
    p.add_argument("--gpus", type=positive_int, default=None,
                   help="GPUs in the cluster to plan for (default: world size, else 1)")
    p.add_argument("--batch", type=positive_int, default=8, help="global batch (default 8)")
    p.add_argument("--input-shape", action="append", metavar="SHAPE",
                   help="an input's shape without the batch, e.g. 3,224,224 or long[30522]:128; "
                        "repeat for several inputs (default: the model's example_inputs)")
    p.add_argument("--bandwidth-gbps", type=positive_float, default=100.0,
                   help="per-GPU link bandwidth in Gb/s (default 100)")
    p.add_argument("--latency-us", type=float, default=10.0,
                   help="per-transfer latency in microseconds (default 10)")
    p.add_argument("--leaf", action="append", default=[], metavar="PATH",
                   help="keep this module path whole when tracing (repeatable)")
    p.add_argument("--amp-limit", type=float, default=None, metavar="A",
                   help="burst_parallel: GPU-sec amplification limit (default 2)")
    p.add_argument("-o", "--option", action="append", type=option, default=[],
                   metavar="KEY=VALUE", help="a pass option (value read as JSON if it parses)")


def pass_options(args: argparse.Namespace) -> dict[str, Any]:
    """Pass options from ``-o key=value`` and the per-pass convenience flags."""
    options = dict(args.option)
    if getattr(args, "amp_limit", None) is not None:
        options["amp_limit"] = args.amp_limit
    return options


def compile_from_args(args: argparse.Namespace, **extra: Any):
    """Build the model and inputs the MODEL options name and compile them."""
    import tidal
    from tidal.compiler.model_spec import build_model, example_inputs_for

    model = build_model(args.model)
    inputs = example_inputs_for(model, args.model, args.batch, args.input_shape)
    cluster_kw = {} if args.gpus is None else {"gpus": args.gpus}
    cluster = tidal.Cluster(bandwidth_gbps=args.bandwidth_gbps, latency_us=args.latency_us,
                            **cluster_kw)
    return tidal.compile(model, inputs, passes=args.passes or (), cluster=cluster,
                         leaf_modules=args.leaf, verbose=True, **pass_options(args), **extra)
