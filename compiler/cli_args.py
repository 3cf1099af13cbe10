"""Argument types and the MODEL options shared by the ``tidal`` subcommands.

This module does not import torch (``tidal --help`` builds its parser from it); what needs torch
is imported inside the functions that use it.
"""
from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path
from typing import Any

from tidal.compiler.cli_errors import MAX_COUNT, UsageError, bad_input, parse_shape, shown

LOSSES = ("default", "cross_entropy", "mse")
OPTIMIZERS = ("sgd", "adam")

_BANDWIDTH_UNITS = {"gbps": 1.0, "gb/s": 1.0, "gbit/s": 1.0, "mbps": 1e-3, "mb/s": 1e-3,
                    "mbit/s": 1e-3, "tbps": 1e3, "": 1.0}


def _int_in(text: str, low: int, high: int = MAX_COUNT) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{shown(text)} is not an integer") from None
    if v < low:
        raise argparse.ArgumentTypeError(f"{shown(text)} must be at least {low}")
    if v > high:
        raise argparse.ArgumentTypeError(f"{shown(text)} is too large (at most {high})")
    return v


def positive_int(text: str) -> int:
    """argparse type: an integer from 1 to ``MAX_COUNT``.

    Example:
        >>> positive_int("8")
        8
    """
    return _int_in(text, 1)


def non_negative_int(text: str) -> int:
    """argparse type: an integer from 0 to ``MAX_COUNT``."""
    return _int_in(text, 0)


def _finite(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{shown(text)} is not a number") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"{shown(text)} is not a finite number")
    return v


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (a time, rate, bandwidth, TFLOPS, size).

    Example:
        >>> positive_float("2.5")
        2.5
        >>> positive_float("nan")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: 'nan' is not a finite number
    """
    v = _finite(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"{shown(text)} must be greater than 0")
    return v


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0 (a latency or an encode time, which may be zero)."""
    v = _finite(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"{shown(text)} must be at least 0")
    return v


def percent(text: str) -> float:
    """argparse type: a finite percentage >= 0 such as ``10%`` or ``10``, as a fraction.

    Example:
        >>> percent("10%")
        0.1
    """
    try:
        return non_negative_float(text.strip().rstrip("%")) / 100
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{shown(text)}: expected a percentage >= 0 such as "
                                         "10%") from None


def positive_ints(text: str) -> tuple[int, ...]:
    """argparse type: comma-separated integers from 1 to ``MAX_COUNT``, at least one.

    Example:
        >>> positive_ints("16,32")
        (16, 32)
    """
    parts = [b.strip() for b in text.split(",")]
    if not any(parts) or not all(parts):
        raise argparse.ArgumentTypeError(f"{shown(text)}: expected positive integers such as "
                                         "16,32,64")
    return tuple(positive_int(b) for b in parts)


def bandwidth(text: str) -> float:
    """argparse type: ``"10Gbps"``, ``"100 Mbps"``, ``"25Gb/s"`` or ``"10"`` (Gb/s) -> a finite
    number of Gb/s > 0.

    Example:
        >>> bandwidth("800Mbps")
        0.8
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[-+]?[0-9]+)?)\s*([a-zA-Z/]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _BANDWIDTH_UNITS:
        raise argparse.ArgumentTypeError(f"bandwidth {shown(text)}: expected a number with "
                                         "Gbps/Mbps (e.g. 10Gbps)")
    value = float(m.group(1)) * _BANDWIDTH_UNITS[unit]
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"bandwidth {shown(text)}: must be finite and > 0")
    return value


def bandwidths(text: str) -> tuple[float, ...]:
    """argparse type: comma-separated bandwidths (see :func:`bandwidth`), at least one."""
    parts = [b for b in text.split(",")]
    if not all(b.strip() for b in parts):
        raise argparse.ArgumentTypeError(f"bandwidths {shown(text)}: expected e.g. 1,10,100")
    return tuple(bandwidth(b) for b in parts)


def non_empty(text: str) -> str:
    """argparse type: a string that is not empty or blank (a module path, a name)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{shown(text)} is empty")
    return text


def input_shape(text: str) -> str:
    """argparse type: an ``--input-shape`` that :func:`parse_shape` accepts (kept as text)."""
    try:
        parse_shape(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _finite_json(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is not a finite number")
    return value


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a finite number")


def option(text: str) -> tuple[str, Any]:
    """argparse type: ``key=value`` with the value read as JSON when it parses (a non-finite
    number, ``NaN`` or ``Infinity``, is refused).

    Example:
        >>> option("lookahead=2"), option("mode=fast")
        (('lookahead', 2), ('mode', 'fast'))
    """
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"{shown(text)} is not key=value")
    try:
        return key, json.loads(value, parse_float=_finite_json, parse_constant=_no_constant)
    except json.JSONDecodeError:
        return key, value
    except (ValueError, RecursionError) as e:
        raise argparse.ArgumentTypeError(f"{shown(text)}: {e}") from None


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
    p.add_argument("--input-shape", action="append", type=input_shape, metavar="SHAPE",
                   help="an input's shape without the batch, e.g. 3,224,224 or long[30522]:128; "
                        "repeat for several inputs (default: the model's example_inputs)")
    p.add_argument("--bandwidth-gbps", type=positive_float, default=100.0,
                   help="per-GPU link bandwidth in Gb/s (default 100)")
    p.add_argument("--latency-us", type=non_negative_float, default=10.0,
                   help="per-transfer latency in microseconds (default 10)")
    p.add_argument("--memory-gb", type=positive_float, default=None, metavar="GIB",
                   help="memory budget of one GPU in GiB: tick_tock then sizes data "
                        "parallelism's and its own per-wave batch to it (default: no budget)")
    p.add_argument("--leaf", action="append", type=non_empty, default=[], metavar="PATH",
                   help="keep this module path whole when tracing (repeatable)")
    p.add_argument("--amp-limit", type=positive_float, default=None, metavar="A",
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
    are first run through the model, so one that does not fit is a ``UsageError`` naming it,
    and inputs over ``MAX_INPUT_ELEMENTS`` are refused before they are allocated."""
    from tidal.compiler.model_spec import build_model, check_inputs_fit, example_inputs_for

    model = build_model(args.model)
    with bad_input(f"MODEL {args.model!r} at batch {batch}"):
        inputs = example_inputs_for(model, args.model, batch, args.input_shape)
    if args.input_shape:
        check_inputs_fit(model, inputs, args.model, args.input_shape)
    return model, inputs


def check_pass_options(args: argparse.Namespace, passes: str | None = None) -> None:
    """Build the passes ``passes`` (default ``--passes``) names with the pass options (``-o``,
    ``--amp-limit``, ``--lookahead``) before anything is compiled: an unknown pass or option,
    or a value a pass's constructor refuses, is a ``UsageError`` (a ``PassError`` stays one)."""
    from tidal.compiler.api import resolve_passes

    names = args.passes if passes is None else passes
    options = pass_options(args)
    with bad_input("pass options " + ", ".join(f"{k}={v!r}" for k, v in options.items())
                   if options else None):
        resolve_passes(names.strip() if names.strip() == "auto" else names or (), options)


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
    with bad_input():  # Cluster's ValueError names the field
        return tidal.Cluster(**{**kw, **overrides})


def compile_from_args(args: argparse.Namespace, **extra: Any):
    """Build the model and inputs the MODEL options name and compile them."""
    import tidal

    check_pass_options(args)
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
