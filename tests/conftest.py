"""Test configuration: the repository root on sys.path (for ``examples.models``), one thread,
the ``cli`` fixture (the tidal command line run in this process), and the background jobs: the
spawned multi-rank jobs that test modules declare (``background_job(items)``) start when
collection ends and run at the lowest CPU priority while the one-process tests run; a module's
fixture takes the result from the ``background_jobs`` fixture
(``background_jobs.py``)."""
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

torch.set_num_threads(1)

BACKGROUND = pytest.StashKey()
"""The session's ``BackgroundJobs`` in ``config.stash``."""


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


def pytest_collection_finish(session):
    """Queue and start the background jobs of the collected modules, in the order they run
    (none under pytest-xdist, whose workers would each start them, with --collect-only, or
    with ``TIDAL_TEST_BACKGROUND=0`` in the environment: every job then runs in its fixture)."""
    from background_jobs import BackgroundJobs

    enabled = not (os.environ.get("PYTEST_XDIST_WORKER") or session.config.option.collectonly
                   or os.environ.get("TIDAL_TEST_BACKGROUND") == "0")
    jobs = session.config.stash[BACKGROUND] = BackgroundJobs(enabled=enabled)
    by_module: dict = {}
    for item in session.items:
        module = getattr(item, "module", None)
        if module is not None and hasattr(module, "background_job"):
            by_module.setdefault(module, []).append(item)
    for module, items in by_module.items():
        job = module.background_job(items)
        if job is not None:
            jobs.submit(module.__name__, job)
    jobs.start()


def pytest_unconfigure(config):
    jobs = config.stash.get(BACKGROUND, None)
    if jobs is not None:
        jobs.close()


@pytest.fixture(scope="session")
def background_jobs(request):
    """The session's ``BackgroundJobs``: ``background_jobs.result(module.__name__, job)`` is
    ``job``'s result, from the background run when there was one."""
    from background_jobs import BackgroundJobs

    return request.config.stash.get(BACKGROUND, None) or BackgroundJobs(enabled=False)
