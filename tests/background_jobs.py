"""Spawned multi-rank jobs run in the background while the one-process tests run.

pytest runs one test at a time, on one core; a 2-rank job spawned by a module fixture runs on
two, and the suite leaves one core idle most of the time. A test module declares its job with
a module-level ``background_job(items) -> Job | None`` (``items``: its collected tests, so a
job covers only what this session runs). When collection ends, ``tests/conftest.py`` queues the
declared jobs in the order their modules run, on one thread that runs each in a helper process
(its own process group, output to a log file, never into a test's captured output) at the
lowest CPU priority (nice 19): the job takes the core the other tests leave idle and hardly
slows them; a fixture that waits for a running job puts it back to normal priority.

The module's fixture then calls :meth:`BackgroundJobs.result`: the background run's result if it
finished; if that run has not started yet, failed, or there is no background run (pytest-xdist
workers, ``--collect-only``), the job runs in the foreground, exactly as it did before, so a
failing job is always reported from a foreground run. What a job proves is unchanged: the same
function on the same ranks with the same arguments.

    >>> import math
    >>> job = Job(math.gcd, 2, (4,), {"timeout_s": 300})
    >>> job.background().kwargs["pg_timeout_s"]   # a starved peer is no stalled peer
    300
"""
from __future__ import annotations

import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional


_OWN_GROUP = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
"""The helper in a process group of its own (ended as one), in this session: a new session
would be a new scheduler autogroup on Linux, sharing the CPU equally with pytest's whatever
its niceness."""


@dataclass(frozen=True)
class Job:
    """``tidal.runtime.distributed.spawn(fn, world, *args, **kwargs)``."""
    fn: Callable
    world: int
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)

    def run(self) -> list:
        """The ranks' results (``spawn``'s list), here and now."""
        from tidal.runtime.distributed import spawn

        return spawn(self.fn, self.world, *self.args, **self.kwargs)

    def background(self) -> "Job":
        """This job as the background runs it: a collective may wait as long as the whole job
        (a peer starved by the foreground tests is not a stalled one)."""
        limit = max(self.kwargs.get("timeout_s", 180.0), self.kwargs.get("pg_timeout_s", 60.0))
        return replace(self, kwargs={**self.kwargs, "pg_timeout_s": limit})


def sized_job(items, test: str, fn: Callable, size: int) -> Optional[Job]:
    """``Job(fn, size)`` when ``items`` (a module's collected tests) hold the case of ``test``
    (parametrized by ``size``) of that size, else None: a module's ``background_job`` for the
    larger world of a test that runs the same function on 2 and 4 ranks."""
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.name.startswith(test + "[") and params.get("size") == size:
            return Job(fn, size)
    return None


class BackgroundJobs:
    """The queued background jobs of a session, by name (the test module's)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.queued: dict[str, tuple[Job, Future]] = {}
        self.folder = ""     # made by the first job run
        self.helper: Optional[subprocess.Popen] = None
        self.lock = threading.Lock()

    def submit(self, name: str, job: Job) -> None:
        """Queue ``job`` under ``name`` (before :meth:`start`)."""
        if self.enabled:
            self.queued[name] = (job, Future())

    def start(self) -> None:
        """Start the thread that runs the queued jobs one after another."""
        if self.enabled and self.queued:
            threading.Thread(target=self._work, name="tidal-background-jobs",
                             daemon=True).start()

    def result(self, name: str, job: Job) -> list:
        """``job``'s result: the background run's if it ran and succeeded, else run here."""
        entry = self.queued.get(name)
        if entry is not None and entry[0] == job and not entry[1].cancel():
            self._hurry()
            try:
                return entry[1].result()
            except Exception:  # noqa: BLE001 - rerun in the foreground, which reports it
                pass
        return job.run()

    def close(self) -> None:
        """Cancel what has not started and end a running helper (its whole process group)."""
        for _, future in self.queued.values():
            future.cancel()
        with self.lock:
            if self.helper is not None and self.helper.poll() is None:
                try:
                    os.killpg(self.helper.pid, signal.SIGKILL)
                except OSError:
                    pass
        if self.folder:
            shutil.rmtree(self.folder, ignore_errors=True)

    def _hurry(self) -> None:
        """The running helper and its ranks back to the normal priority: a test waits for it
        (where lowering the niceness is not permitted, it goes on at nice 19)."""
        with self.lock:
            if self.helper is not None and self.helper.poll() is None:
                try:
                    os.setpriority(os.PRIO_PGRP, self.helper.pid, 0)
                except (AttributeError, OSError):
                    pass

    def _work(self) -> None:
        for name, (job, future) in list(self.queued.items()):
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(self._run_helper(name, job.background()))
            except BaseException as e:  # noqa: BLE001 - handed to the fixture
                future.set_exception(e)

    def _run_helper(self, name: str, job: Job) -> list:
        self.folder = self.folder or tempfile.mkdtemp(prefix="tidal-background-")
        base = os.path.join(self.folder, name.replace(".", "_"))
        with open(base + ".job", "wb") as f:
            pickle.dump(job, f)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        with open(base + ".log", "wb") as log, self.lock:
            self.helper = subprocess.Popen(
                [sys.executable, "-m", __name__, base + ".job", base + ".out"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                **_OWN_GROUP)
            try:
                os.setpriority(os.PRIO_PROCESS, self.helper.pid, 19)
            except (AttributeError, OSError):
                pass
        code = self.helper.wait()
        if code != 0 or not os.path.exists(base + ".out"):
            raise RuntimeError(f"background job {name}: helper exit code {code} (log: "
                               f"{base}.log)")
        with open(base + ".out", "rb") as f:
            status, value = pickle.load(f)
        if status != "ok":
            raise RuntimeError(f"background job {name}: {value}")
        return value


def main(job_path: str, out_path: str) -> int:
    """The helper process: run the pickled job, pickle ``("ok", result)`` or ``("error",
    message)``."""
    with open(job_path, "rb") as f:
        job = pickle.load(f)
    try:
        outcome: tuple[str, Any] = ("ok", job.run())
    except Exception as e:  # noqa: BLE001 - reported to the parent
        outcome = ("error", f"{type(e).__name__}: {e}")
    with open(out_path, "wb") as f:
        pickle.dump(outcome, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1], sys.argv[2]))
