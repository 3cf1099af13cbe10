"""The ``tidal`` command line: list passes, inspect what passes do to a model, write dumps.

    tidal passes
    tidal inspect MODEL [--passes a,b|auto] [--gpus N] [--batch B] [--input-shape 3,224,224]
                        [--bandwidth-gbps G] [--latency-us L] [--memory-gb M] [-o key=value]
                        [--dump DIR] [--json]
                        [--bagpipe N [--trainers T] [--lookahead L] [--zipf-alpha A]]
    tidal dump MODEL --out DIR [same model options]

MODEL is ``module:factory``, ``path/to/file.py:factory`` or, from a checkout of the
repository, a zoo model name such as ``resnet50_small``. Bad input is one line on stderr and
exit status 2 (set TIDAL_DEBUG=1 for the full traceback): argparse's own errors, and any
``TidalError`` a subcommand raises. The argument types of ``cli_args`` refuse nonsense (nan, inf,
zero or negative sizes and times, huge counts and shapes) while parsing; Python errors raised
while the inputs are built are turned into a ``UsageError`` there (``cli_errors.bad_input``);
any other exception, from deep inside a pass, is a bug and stays a traceback.

Building the parser imports neither torch nor the subcommand modules: ``simulate``, ``run`` and
``whatif`` are imported (for their ``add_arguments``, ``run`` and user-facing ``DESCRIPTION``)
only when their subcommand is parsed, so ``tidal --help`` and ``tidal passes`` stay fast.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import textwrap
from typing import Any, Optional, Sequence

from tidal.compiler.cli_args import add_model_args, compile_from_args, steps_table, write_dump
from tidal.compiler.cli_bagpipe import add_bagpipe_args
from tidal.compiler.cli_errors import clip, one_line
from tidal.ir.errors import TidalError

EXIT_USAGE = 2
PASSES_WIDTH = 92  # columns of ``tidal passes``: descriptions are wrapped, whole sentences

_SUBCOMMANDS = (
    # (name, module, help): each module has add_arguments(parser), run(args) -> int and a
    # user-facing DESCRIPTION; it is imported only when its subcommand is parsed
    ("simulate", "tidal.compiler.cli_simulate", "simulate a training plan on a model of a GPU cluster"),
    ("run", "tidal.compiler.cli_run", "run a script on N local ranks through torchrun"),
    ("whatif", "tidal.compiler.cli_whatif",
     "predict whether gradient compression pays (the Eq. 4.1 performance model)"),
)


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (no usage dump) and exit with status 2. With
    ``module``, a subcommand's parser that imports that module and takes its arguments, run
    function and description only when it parses (its ``--help`` included)."""

    def __init__(self, *args: Any, module: Optional[str] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._module = module

    def error(self, message: str) -> None:  # type: ignore[override]
        message = " | ".join(line.strip() for line in message.splitlines() if line.strip())
        self.exit(EXIT_USAGE, f"{self.prog}: error: {clip(message)} (see {self.prog} --help)\n")

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        """Load the subcommand's module, then parse."""
        self._load()
        return super().parse_known_args(args, namespace)

    def _load(self) -> None:
        """Import the subcommand's module once and add its arguments, run and description."""
        if self._module is None:
            return
        module = importlib.import_module(self._module)
        self._module = None
        self.description = module.DESCRIPTION
        module.add_arguments(self)
        self.set_defaults(run=module.run)


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
                    "(wall time, nodes added/removed, plan) and each plan. With --bagpipe N "
                    "(and --passes embedding_cache on a recommendation model such as "
                    "dlrm_small), then train N iterations with Bagpipe and print each "
                    "iteration's cache hit rate, rows prefetched, rows synced on and off the "
                    "critical path and bytes moved.")
    add_model_args(inspect_p)
    inspect_p.add_argument("--dump", metavar="DIR", help="also write the visualization dump here "
                           "(with --bagpipe, its index shows the per-iteration table too)")
    inspect_p.add_argument("--json", action="store_true", help="print JSON instead of tables "
                           "(with --bagpipe, the per-iteration stats under \"bagpipe\")")
    add_bagpipe_args(inspect_p)
    dump_p = sub.add_parser("dump", help="write graph visualizations for MODEL",
                            description="Write per-pass DOT/SVG graphs and index.html.")
    add_model_args(dump_p)
    dump_p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    dump_p.add_argument("--scaling", metavar="CSV", help="statistical-efficiency table "
                        "(global_batch,steps): add the simulated weak/strong/batch-optimal "
                        "scaling chart (DeepPool Fig. 1) to the index")
    for name, module_name, help_text in _SUBCOMMANDS:
        sub.add_parser(name, help=help_text, module=module_name)
    return parser


def _cmd_passes() -> int:
    """Print each registered pass with its description, wrapped (no pass is imported)."""
    from tidal.passes import descriptions

    described = descriptions()
    if not described:
        print("no passes registered yet")
    width = max(map(len, described), default=0) + 2
    for name, text in sorted(described.items()):
        text = text.replace("``", "")  # docstring markup, not for a terminal
        print(textwrap.fill(text, width=PASSES_WIDTH, initial_indent=f"{name:<{width}}",
                            subsequent_indent=" " * width, break_on_hyphens=False))
    return 0


def _record_json(r) -> dict:
    return {"name": r.name, "seconds": r.seconds, "nodes_before": r.nodes_before,
            "nodes_after": r.nodes_after, "added": list(r.added), "removed": list(r.removed),
            "plan": json.loads(r.plan.to_json()) if r.plan else None, "notes": list(r.notes)}


def _cmd_inspect(args: argparse.Namespace) -> int:
    from tidal.compiler import cli_bagpipe

    cli_bagpipe.check_bagpipe_args(args)
    compiled = compile_from_args(args)
    run = None
    if args.bagpipe is not None:
        data = cli_bagpipe.prepare(args, compiled)
        if not args.json:  # the report first: the run takes a while
            _print_report(compiled)
        run = cli_bagpipe.run_bagpipe(args, compiled, data)
    sections = (lambda out: [cli_bagpipe.bagpipe_section(out, run)]) if run else None
    index = write_dump(compiled, args.dump, "--dump", sections=sections) if args.dump else None
    if args.json:
        print(json.dumps({"model": args.model, "batch": args.batch,
                          "records": [_record_json(r) for r in compiled.records],
                          "bagpipe": cli_bagpipe.stats_json(run) if run else None,
                          "dump": str(index) if index else None}, indent=1))
        return 0
    if run is None:
        _print_report(compiled)
    else:
        print(f"\n== {cli_bagpipe.title(run)} ==\n{cli_bagpipe.stats_table(run)}")
    if index:
        print(f"\ndump: {index}")
    return 0


def _print_report(compiled) -> None:
    print(compiled.report())
    for r in compiled.records:
        if r.plan is not None:
            print(f"\n== {r.name} plan ==\n{r.plan.table()}")
    sys.stdout.flush()


def _cmd_dump(args: argparse.Namespace) -> int:
    table = steps_table(args)
    index = write_dump(compile_from_args(args), args.out, "--out", scaling=table)
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
        if args.command == "dump":
            return _cmd_dump(args)
        return args.run(args)
    except TidalError as e:  # typed errors that name what is at fault
        if os.environ.get("TIDAL_DEBUG"):
            raise
        print(f"tidal {args.command}: error: {one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
