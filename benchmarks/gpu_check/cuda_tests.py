"""``pytest -m cuda`` over the tests folder (on the CPU every such test is skipped): the counts
of passed, failed, skipped and errors, and the failing tests' names. Quick mode collects only
the test files that use the marker (collecting the whole folder takes longer than the tests).
pytest runs from the repository root in a subprocess of this one, stopped 5 s before the
check's deadline (``TIDAL_GPU_CHECK_DEADLINE``, set by the driver) so the counts of the tests
that ran are kept."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.gpu_check.common import fail

SUMMARY = ("passed", "failed", "skipped", "errors", "files")
ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
OUTCOMES = ("passed", "failed", "skipped", "errors")


def marked_files() -> list[str]:
    """Test files that mention the ``cuda`` marker (relative to the repository root)."""
    return sorted(str(p.relative_to(ROOT)) for p in TESTS.rglob("test_*.py")
                  if "mark.cuda" in p.read_text(errors="replace"))


def counts(output: str) -> dict:
    """The counts of a ``pytest -v`` output: from its summary line (``3 passed, 1 skipped in
    2.0s``), or, when it was stopped before one, from its per-test lines."""
    found = dict.fromkeys(OUTCOMES, 0)
    summary = [ln for ln in output.splitlines()
               if re.search(r"\d+ (passed|failed|skipped|errors?|deselected)\b.* in [\d.]+s", ln)]
    if summary:
        for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)",
                                  summary[-1]):
            found["errors" if word.startswith("error") else word] = int(n)
        return found
    for word in re.findall(r"^\S+::\S+ (PASSED|FAILED|SKIPPED|ERROR)", output, re.M):
        found[{"ERROR": "errors"}.get(word, word.lower())] += 1
    return found


def run(device: str, quick: bool) -> dict:
    files = marked_files() if quick else ["tests"]
    figures: dict = {"files": len(marked_files()),
                     "selection": "marked files" if quick else "tests/"}
    if not files:
        figures["note"] = "no test uses the cuda marker"
        return figures
    deadline = float(os.environ.get("TIDAL_GPU_CHECK_DEADLINE", time.time() + 600))
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-v", "-rfE", *files]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                              timeout=max(deadline - time.time() - 5.0, 1.0))
        output, status = proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as e:
        output = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else \
            (e.stdout or "")
        status = None
        fail(figures, "pytest -m cuda stopped at the check's time limit")
    print(output[-20000:], flush=True)
    figures.update(counts(output))
    figures["exit_status"] = status
    failing = re.findall(r"^(?:FAILED|ERROR) (\S+)", output, re.M)
    if failing:
        figures["failing"] = " ".join(failing)
    if status not in (0, 5, None):  # 5: no test selected
        fail(figures, f"pytest -m cuda: exit status {status}; {figures['failed']} failed, "
                      f"{figures['errors']} errors"
                      + (f": {' '.join(failing[:8])}" if failing else ""))
    return figures
