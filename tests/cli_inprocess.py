"""Run the ``tidal`` command line in the test process: ``tidal.compiler.cli.main(argv)``, the
function the ``tidal`` console script and ``python -m tidal`` call, with what a separate process
would give: the exit status (``SystemExit`` from argparse included; an uncaught exception is
exit status 1 with its traceback on stderr), stdout and stderr at the file-descriptor level
(``capfd``), Python's default warning filters with warnings printed to stderr, and a working
directory. Saves ~3 s of ``import torch`` per command over a subprocess. With ``scratch``, the
run sees what a process started in ``cwd`` would: the repository's own directories are off
``sys.path`` and the in-repo ``examples`` package is unloaded for the run (so a README command
finds ``examples/`` only through the scratch directory, as a user's shell would).

What a run changes in the process is put back afterwards, so nothing leaks into later tests:
the working directory, ``sys.path`` (the CLI puts the working directory and user packages on
it), modules imported from outside the repository and the virtual environment (user model
files under ``tmp_path``), ``os.environ``, the torch/random/numpy RNG states, torch's thread
count, default dtype and grad mode; a process group left initialised is destroyed and fails
the run. A few tests still run ``python -m tidal`` in a real subprocess (``run_subprocess``),
so that the entry point itself stays tested.
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
_KEEP = tuple(str(Path(p).resolve()) for p in {ROOT, sys.prefix, sys.base_prefix,
                                                 sys.exec_prefix})
# what ``python -m tidal`` starts with (Python's default warning filters, no -W options)
_DEFAULT_FILTERS = (("default", DeprecationWarning, "__main__"),
                    ("ignore", DeprecationWarning, None),
                    ("ignore", PendingDeprecationWarning, None),
                    ("ignore", ImportWarning, None),
                    ("ignore", ResourceWarning, None))


@dataclass
class CliResult:
    """What ``subprocess.run(..., capture_output=True, text=True)`` gives, for one command."""
    args: list
    returncode: int
    stdout: str
    stderr: str


def _show_on_stderr(message, category, filename, lineno, file=None, line=None):
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def _outside(module) -> bool:
    """Whether ``module`` was loaded from a file outside the repository and the environment
    (a user's model file or package in a temporary directory)."""
    f = getattr(module, "__file__", None)
    if not f:
        return False
    return not str(Path(f).resolve()).startswith(_KEEP)


def _is_repo_dir(entry: str) -> bool:
    try:
        return Path(entry or ".").resolve() in (ROOT, ROOT / "tests")
    except OSError:
        return False


def run_cli(capfd, args, cwd: Optional[Path] = None, scratch: bool = False) -> CliResult:
    """``tidal ARGS`` run through ``main`` in this process, from ``cwd`` (default: the
    repository root, as the subprocess tests ran it); ``scratch``: as from a directory outside
    the repository (see the module docstring)."""
    from tidal.compiler.cli import main

    args = [str(a) for a in args]
    capfd.readouterr()  # drop what the test printed before
    saved_cwd, saved_path = os.getcwd(), list(sys.path)
    saved_modules, saved_env = set(sys.modules), dict(os.environ)
    rng = (torch.random.get_rng_state(), random.getstate(), np.random.get_state())
    threads, dtype, grad = torch.get_num_threads(), torch.get_default_dtype(), \
        torch.is_grad_enabled()
    os.environ.pop("TIDAL_DEBUG", None)  # errors as the user sees them
    leaked = False
    stashed = {}
    try:
        os.chdir(cwd or ROOT)
        if scratch:
            sys.path[:] = [p for p in sys.path if not _is_repo_dir(p)]
            stashed = {name: sys.modules.pop(name) for name in list(sys.modules)
                       if name == "examples" or name.startswith("examples.")}
        with warnings.catch_warnings():
            warnings.resetwarnings()
            for action, category, module in reversed(_DEFAULT_FILTERS):
                if module is None:
                    warnings.simplefilter(action, category)
                else:
                    warnings.filterwarnings(action, category=category, module=module)
            warnings.showwarning = _show_on_stderr
            try:
                code = main(args)
            except SystemExit as e:  # argparse: --help (0), usage errors (2)
                code = e.code
                if code is None:
                    code = 0
                elif not isinstance(code, int):
                    print(code, file=sys.stderr)
                    code = 1
            except Exception:  # what the interpreter does with an uncaught exception
                traceback.print_exc()
                code = 1
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os.chdir(saved_cwd)
        sys.path[:] = saved_path
        for name in set(sys.modules) - saved_modules:
            if _outside(sys.modules[name]) or (stashed and name.split(".")[0] == "examples"):
                del sys.modules[name]
        sys.modules.update(stashed)
        os.environ.clear()
        os.environ.update(saved_env)
        torch.random.set_rng_state(rng[0])
        random.setstate(rng[1])
        np.random.set_state(rng[2])
        torch.set_num_threads(threads)
        torch.set_default_dtype(dtype)
        torch.set_grad_enabled(grad)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
            leaked = True
    out, err = capfd.readouterr()
    assert not leaked, f"tidal {' '.join(args)} left a process group initialised"
    return CliResult(args, code, out, err)


def run_subprocess(*args, cwd: Optional[Path] = None) -> subprocess.CompletedProcess:
    """``python -m tidal ARGS`` in a new process (the repository on ``PYTHONPATH``)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TIDAL_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "tidal", *map(str, args)], cwd=cwd or ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
