"""Test configuration: the repository root on sys.path (for ``examples.models``), one thread,
and the ``cli`` fixture (the tidal command line run in this process)."""
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` are skipped where no CUDA device is visible (``make gpu-check``
    runs them on a GPU machine: ``pytest -m cuda``)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run by make gpu-check)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def cli(capfd):
    """``cli(*args, cwd=None, scratch=False)``: ``tidal ARGS`` run in this process through
    ``tidal.compiler.cli.main`` (``cli_inprocess.run_cli``): exit status, stdout and stderr
    as a subprocess would give them, the process left as it was."""
    from cli_inprocess import run_cli

    return lambda *args, cwd=None, scratch=False: run_cli(capfd, args, cwd, scratch)
