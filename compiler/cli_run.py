"""``tidal run -n N script.py [args...]``: run a script on N local ranks through ``torchrun``.

A thin wrapper: ``python -m torch.distributed.run --standalone --nproc-per-node N script.py
args...``. Wired into ``compiler/cli.py``'s ``_SUBCOMMANDS`` through ``add_arguments``, ``run``
and ``DESCRIPTION`` (what ``tidal run --help`` shows).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

from tidal.compiler.cli_args import non_empty, positive_int
from tidal.compiler.cli_errors import UsageError

DESCRIPTION = """Run SCRIPT with its arguments on N local processes (ranks) through torchrun
(python -m torch.distributed.run --standalone --nproc-per-node N SCRIPT ARGS...). Inside the
script, tidal.compile plans for the world size N by default, and Compiled.step runs the compiled
plan on every rank: join the process group first with
tidal.runtime.distributed.init_process_group_from_env(). Exits with the script's status."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``-n N script [args...]`` to ``parser``."""
    parser.add_argument("-n", "--nproc", type=positive_int, required=True, metavar="N",
                        help="number of local ranks (processes)")
    parser.add_argument("script", type=non_empty, help="the Python script every rank runs")
    parser.add_argument("script_args", nargs=argparse.REMAINDER,
                        help="arguments passed to the script")


def command(args: argparse.Namespace) -> list[str]:
    """The torchrun command line for ``args``; a ``UsageError`` for a bad ``-n``.

    Example:
        >>> p = argparse.ArgumentParser(); add_arguments(p)
        >>> command(p.parse_args(["-n", "2", "train.py", "--lr", "0.1"]))[3:]
        ['--standalone', '--nproc-per-node=2', 'train.py', '--lr', '0.1']
    """
    if args.nproc < 1:
        raise UsageError(f"-n {args.nproc}: need at least one rank")
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={args.nproc}", args.script, *args.script_args]


def run(args: argparse.Namespace) -> int:
    """Run the script under torchrun and return its exit status; a ``UsageError`` (exit status
    2 in the CLI) for a missing script or a bad ``-n``."""
    cmd = command(args)
    if not os.path.isfile(args.script):
        raise UsageError(f"script {args.script!r} not found")
    return subprocess.call(cmd)
