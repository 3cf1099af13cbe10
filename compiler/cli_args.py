"""Argument types and the MODEL options shared by the ``tidal`` subcommands.

This module does not import torch (``tidal --help`` builds its parser from it); what needs torch
is imported inside the functions that use it.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tidal.compiler.cli_errors import UsageError

LOSSES = ("default", "cross_entropy", "mse")
OPTIMIZERS = ("sgd", "adam")


def _int_at_least(text: str, low: int) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < low:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least {low}")
    return v


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _int_at_least(text, 0)


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
    p.add_argument("--memory-gb", type=positive_float, default=None, metavar="GIB",
                   help="memory budget of one GPU in GiB: tick_tock then sizes data "
                        "parallelism's and its own per-wave batch to it (default: no budget)")
    p.add_argument("--leaf", action="append", default=[], metavar="PATH",
                   help="keep this module path whole when tracing (repeatable)")
    p.add_argument("--amp-limit", type=float, default=None, metavar="A",
                   help="burst_parallel: GPU-sec amplification limit (default 2)")
    p.add_argument("-o", "--option", action="append", type=option, default=[],
                   metavar="KEY=VALUE", help="a pass option (value read as JSON if it parses)")
    add_training_args(p)


def add_training_args(p: argparse.ArgumentParser) -> None:
    """The loss and optimizer that passes transforming training (tick_tock, round_robin,
    compression) compile with."""
    p.add_argument("--loss", choices=LOSSES, default="default",
                   help="training loss for the training passes: the model's default_loss, "
                        "else cross_entropy over class targets (default), or mse")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd",
                   help="optimizer for the training passes (default sgd)")
    p.add_argument("--lr", type=positive_float, default=None,
                   help="learning rate (default 0.1 for sgd, 0.001 for adam)")


def pass_options(args: argparse.Namespace) -> dict[str, Any]:
    """Pass options from ``-o key=value`` and the per-pass convenience flags."""
    options = dict(args.option)
    if getattr(args, "amp_limit", None) is not None:
        options["amp_limit"] = args.amp_limit
    if getattr(args, "lookahead", None) is not None:
        options["lookahead"] = args.lookahead
    return options


def model_and_inputs(args: argparse.Namespace, batch: int) -> tuple[Any, tuple]:
    """The model MODEL names and its example inputs at ``batch``; inputs from ``--input-shape``
    are first run through the model, so one that does not fit is a ``UsageError`` naming it."""
    from tidal.compiler.model_spec import build_model, check_inputs_fit, example_inputs_for

    model = build_model(args.model)
    inputs = example_inputs_for(model, args.model, batch, args.input_shape)
    if args.input_shape:
        check_inputs_fit(model, inputs, args.model, args.input_shape)
    return model, inputs


def trains(passes: str) -> bool:
    """Whether ``--passes`` is ``auto`` or names a pass that transforms training."""
    from tidal.passes import registry

    if passes.strip() == "auto":
        return True
    reg = registry()
    return any(reg[n].training_only for n in (p.strip() for p in passes.split(",")) if n in reg)


def training_options(args: argparse.Namespace, model: Any, inputs: tuple, batch: int,
                     passes: str | None = None) -> dict[str, Any]:
    """``loss_fn``, ``optimizer`` and ``example_targets`` for ``tidal.compile`` when the
    ``passes`` (default ``--passes``) transform training (``--loss``, ``--optimizer``,
    ``--lr``); none otherwise. Under ``--passes auto`` a model whose loss cannot be derived
    compiles without them (compile then skips the training passes and says why in its
    report)."""
    from tidal.compiler.model_spec import loss_and_targets, optimizer_factory

    passes = args.passes if passes is None else passes
    if not trains(passes):
        return {}
    try:
        loss_fn, targets = loss_and_targets(model, args.model, args.loss, batch, inputs)
    except UsageError:
        if passes.strip() == "auto":
            return {}
        raise
    return {"loss_fn": loss_fn, "example_targets": targets,
            "optimizer": optimizer_factory(args.optimizer, args.lr)}


def cluster_from_args(args: argparse.Namespace, **overrides: Any):
    """The ``tidal.Cluster`` the MODEL options describe (``overrides`` win)."""
    import tidal

    kw = {"bandwidth_gbps": args.bandwidth_gbps, "latency_us": args.latency_us}
    if getattr(args, "memory_gb", None) is not None:
        kw["memory_gb"] = args.memory_gb
    if args.gpus is not None:
        kw["gpus"] = args.gpus
    return tidal.Cluster(**{**kw, **overrides})


def compile_from_args(args: argparse.Namespace, **extra: Any):
    """Build the model and inputs the MODEL options name and compile them."""
    import tidal

    model, inputs = model_and_inputs(args, args.batch)
    return tidal.compile(model, inputs, passes=args.passes or (), cluster=cluster_from_args(args),
                         leaf_modules=args.leaf, verbose=True, **pass_options(args),
                         **training_options(args, model, inputs, args.batch), **extra)


def steps_table(args: argparse.Namespace):
    """The ``--scaling`` statistical-efficiency table, or None; a ``UsageError`` naming the
    file when it is missing or malformed (checked before any simulation runs)."""
    if not getattr(args, "scaling", None):
        return None
    from tidal.sim.scaling import StepsTable

    try:
        return StepsTable.load(args.scaling)
    except OSError as e:
        raise UsageError(f"--scaling {args.scaling}: cannot read it ({e.strerror or e})") from None
    except ValueError as e:
        raise UsageError(f"--scaling {args.scaling}: {e}") from None


def write_dump(compiled: Any, directory: str, flag: str, **options: Any) -> Path:
    """``compiled.dump(directory, **options)``; a ``UsageError`` naming ``flag`` and the
    directory when it cannot be written."""
    try:
        return compiled.dump(directory, **options)
    except OSError as e:
        raise UsageError(f"{flag} {directory}: cannot write there "
                         f"({e.strerror or e}: {e.filename or directory})") from None


def write_text(path: str, text: str, flag: str) -> None:
    """Write ``text`` to ``path``; a ``UsageError`` naming ``flag`` and the path on failure."""
    try:
        Path(path).write_text(text)
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot write it ({e.strerror or e})") from None
