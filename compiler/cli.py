"""The ``tidal`` command line: list passes, inspect what passes do to a model, write dumps.

    tidal passes
    tidal inspect MODEL [--passes a,b|auto] [--gpus N] [--batch B] [--input-shape 3,224,224]
                        [--bandwidth-gbps G] [--latency-us L] [-o key=value] [--dump DIR] [--json]
    tidal dump MODEL --out DIR [same model options]

MODEL is ``module:factory``, ``path/to/file.py:factory`` or, from a checkout of the
repository, a zoo model name such as ``resnet50_small``. Bad input is one line on stderr and
exit status 2 (set TIDAL_DEBUG=1 for the full traceback).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Optional, Sequence

from tidal.ir.errors import TidalError

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (no usage dump) and exit with status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return v


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be greater than 0")
    return v


def _option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"{text!r} is not key=value")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL",
                   help="module:factory, path/to/file.py:factory, or a zoo model name")
    p.add_argument("--passes", default="",
                   help="comma-separated pass names, or 'auto' for every pass that applies "
                        "(default: none; trace and cost annotation only)")
    p.add_argument("--gpus", type=_positive_int, default=None,
                   help="GPUs in the cluster to plan for (default: world size, else 1)")
    p.add_argument("--batch", type=_positive_int, default=8, help="global batch (default 8)")
    p.add_argument("--input-shape", action="append", metavar="SHAPE",
                   help="an input's shape without the batch, e.g. 3,224,224 or long[30522]:128; "
                        "repeat for several inputs (default: the model's example_inputs)")
    p.add_argument("--bandwidth-gbps", type=_positive_float, default=100.0,
                   help="per-GPU link bandwidth in Gb/s (default 100)")
    p.add_argument("--latency-us", type=float, default=10.0,
                   help="per-transfer latency in microseconds (default 10)")
    p.add_argument("--leaf", action="append", default=[], metavar="PATH",
                   help="keep this module path whole when tracing (repeatable)")
    p.add_argument("-o", "--option", action="append", type=_option, default=[],
                   metavar="KEY=VALUE", help="a pass option (value read as JSON if it parses)")


def build_parser() -> argparse.ArgumentParser:
    """The ``tidal`` argument parser."""
    parser = _Parser(prog="tidal", description=(
        "tidal: compile PyTorch models with graph passes from published systems papers, and "
        "see what each pass did."))
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    sub.add_parser("passes", help="list the registered passes, one line each",
                   description="List the registered passes, one line each.")
    inspect_p = sub.add_parser(
        "inspect", help="compile MODEL and print the per-pass report and plans",
        description="Trace MODEL, annotate costs, run the passes, and print the per-pass table "
                    "(wall time, nodes added/removed, plan) and each plan.")
    _add_model_args(inspect_p)
    inspect_p.add_argument("--dump", metavar="DIR", help="also write the visualization dump here")
    inspect_p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    dump_p = sub.add_parser("dump", help="write graph visualizations for MODEL",
                            description="Write per-pass DOT/SVG graphs and index.html.")
    _add_model_args(dump_p)
    dump_p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    return parser


def _compile(args: argparse.Namespace):
    import tidal
    from tidal.compiler.model_spec import build_model, example_inputs_for

    model = build_model(args.model)
    inputs = example_inputs_for(model, args.model, args.batch, args.input_shape)
    cluster_kw = {} if args.gpus is None else {"gpus": args.gpus}
    cluster = tidal.Cluster(bandwidth_gbps=args.bandwidth_gbps, latency_us=args.latency_us,
                            **cluster_kw)
    return tidal.compile(model, inputs, passes=args.passes or (), cluster=cluster,
                         leaf_modules=args.leaf, verbose=True, **dict(args.option))


def _cmd_passes() -> int:
    from tidal.passes import registry

    reg = registry()
    if not reg:
        print("no passes registered yet")
    for name, cls in sorted(reg.items()):
        doc = (cls.__doc__ or "").strip().splitlines()
        print(f"{name:22s} {doc[0] if doc else ''}")
    return 0


def _record_json(r) -> dict:
    return {"name": r.name, "seconds": r.seconds, "nodes_before": r.nodes_before,
            "nodes_after": r.nodes_after, "added": list(r.added), "removed": list(r.removed),
            "plan": json.loads(r.plan.to_json()) if r.plan else None, "notes": list(r.notes)}


def _cmd_inspect(args: argparse.Namespace) -> int:
    compiled = _compile(args)
    index = compiled.dump(args.dump) if args.dump else None
    if args.json:
        print(json.dumps({"model": args.model, "batch": args.batch,
                          "records": [_record_json(r) for r in compiled.records],
                          "dump": str(index) if index else None}, indent=1))
        return 0
    print(compiled.report())
    for r in compiled.records:
        if r.plan is not None:
            print(f"\n== {r.name} plan ==\n{r.plan.table()}")
    if index:
        print(f"\ndump: {index}")
    return 0


def _cmd_dump(args: argparse.Namespace) -> int:
    index = _compile(args).dump(args.out)
    print(f"dump: {index}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the CLI; return the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        import tidal

        print(f"tidal {tidal.__version__}")
        return 0
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        if args.command == "passes":
            return _cmd_passes()
        if args.command == "inspect":
            return _cmd_inspect(args)
        return _cmd_dump(args)
    except (TidalError, ValueError, TypeError) as e:
        if os.environ.get("TIDAL_DEBUG"):
            raise
        print(f"tidal {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
