"""The README's commands run as printed: every ``tidal ...`` / ``python -m tidal ...`` line of
its shell blocks runs (from a scratch directory that sees the repository's ``examples/``, so
dump directories land there) and exits 0. Set-up lines (``make``, ``pip``, ``python3 -m
venv``) are what ``make test`` itself runs, so they are not repeated here. ``tidal ARGS`` runs
what the ``tidal`` console script runs, ``tidal.compiler.cli.main(ARGS)``, in this process (the
``cli`` fixture of conftest.py, ``scratch``: the repository off ``sys.path`` and its
``examples`` package unloaded for the run, as in a fresh process there); a ``python -m tidal``
line runs in a subprocess, as printed."""
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(?:sh|bash|console)\n(.*?)^```", re.S | re.M)


def readme_commands() -> list[str]:
    """The tidal command lines in the README's shell blocks, comments stripped."""
    out = []
    for block in FENCE.findall((ROOT / "README.md").read_text()):
        for line in block.splitlines():
            line = line.split("  #")[0].strip()
            if line.startswith(("tidal ", "python -m tidal")):
                out.append(line)
    return out


def test_the_readme_has_cli_examples():
    commands = readme_commands()
    assert any(c.startswith("tidal inspect") for c in commands), commands
    assert any(c.startswith("tidal simulate") for c in commands), commands


@pytest.mark.slow
@pytest.mark.parametrize("command", readme_commands())
def test_readme_command_runs_as_printed(command, tmp_path, cli):
    from tidal.ir.device_profile import deeppool_a100_dir

    if "--profile a100" in command and not any(deeppool_a100_dir().glob("A100_*.prof")):
        pytest.skip(f"DeepPool's A100 profiles are not in {deeppool_a100_dir()} (shared/data)")
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    argv = shlex.split(command)
    if argv[0] == "tidal":
        done = cli(*argv[1:], cwd=tmp_path, scratch=True)
    else:
        env = {**os.environ, "PYTHONPATH": str(tmp_path)}
        done = subprocess.run([sys.executable, *argv[1:]], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
