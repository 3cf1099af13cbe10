"""``tidal run -n N script.py [args...]``: run a script on N local ranks through ``torchrun``.

A thin wrapper: ``python -m torch.distributed.run --standalone --nproc-per-node N script.py
args...``. Inside the script, ``tidal.compile`` sees the world size as the default cluster
size, and ``Compiled.step`` of a ``burst_parallel`` compile runs the plan on every rank (join
the group first with ``tidal.runtime.distributed.init_process_group_from_env()``).

Wiring: one entry in ``compiler/cli.py``'s ``_SUBCOMMANDS``::

    ("run", "tidal.compiler.cli_run", "run a script on N local ranks through torchrun"),

Example:
    >>> import argparse
    >>> from tidal.compiler.cli_run import add_arguments, command
    >>> p = argparse.ArgumentParser(); add_arguments(p)
    >>> command(p.parse_args(["-n", "2", "train.py", "--lr", "0.1"]))[3:]
    ['--standalone', '--nproc-per-node=2', 'train.py', '--lr', '0.1']
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``-n N script [args...]`` to ``parser``."""
    parser.add_argument("-n", "--nproc", type=int, required=True, metavar="N",
                        help="number of local ranks (processes)")
    parser.add_argument("script", help="the Python script every rank runs")
    parser.add_argument("script_args", nargs=argparse.REMAINDER,
                        help="arguments passed to the script")


def command(args: argparse.Namespace) -> list[str]:
    """The torchrun command line for ``args``; ``ValueError`` for a bad ``-n``."""
    if args.nproc < 1:
        raise ValueError(f"-n {args.nproc}: need at least one rank")
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={args.nproc}", args.script, *args.script_args]


def run(args: argparse.Namespace) -> int:
    """Run the script under torchrun and return its exit status; ``ValueError`` (exit status 2
    in the CLI) for a missing script or a bad ``-n``."""
    cmd = command(args)
    if not os.path.isfile(args.script):
        raise ValueError(f"script {args.script!r} not found")
    return subprocess.call(cmd)
