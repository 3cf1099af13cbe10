"""examples/train_loop.py, the README's complete training loop: the same losses as DDP."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _diffs(out: str) -> tuple[float, float]:
    m = re.search(r"max \|tidal - DDP\| over the losses: (\S+); resumed from the DCP "
                  r"checkpoint vs uninterrupted: (\S+)", out)
    assert m, out
    return float(m.group(1)), float(m.group(2))


def test_one_process_loop_equals_eager_and_resumes(capsys):
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import train_loop
    finally:
        sys.path.pop(0)
    assert train_loop.main(["--steps", "4"]) == 0
    versus_ddp, resume = _diffs(capsys.readouterr().out)
    assert versus_ddp == 0.0 and resume == 0.0


def test_two_ranks_under_compression_equal_ddp():
    """torchrun -n 2 through `tidal run`: DistributedSampler batches (compile(batch='local')),
    accumulation with no_sync, clipping, AdamW groups, warm-up + cosine, eval, DCP resume."""
    cmd = [sys.executable, "-m", "tidal", "run", "-n", "2", str(ROOT / "examples/train_loop.py"),
           "--pass", "compression", "--steps", "4"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    versus_ddp, resume = _diffs(done.stdout)
    assert versus_ddp <= 1e-6 and resume <= 1e-6, done.stdout
