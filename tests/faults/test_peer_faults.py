"""A peer stalled and a peer killed under each training pass on 2 ranks run by ``torchrun``
(issue #35): the surviving rank's step raises ``PeerFailureError`` naming the pass, the piece,
the peer (rank 1) and the process group's timeout (5 s), within the timeout plus 5 s; torchrun
exits non-zero; and a DCP checkpoint written before the faults, loaded after the stall by a
fresh compile in a fresh process group, takes the next step exactly as the uninterrupted run
did (model, optimizer and runtime state and the loss, bit for bit).

Cost, the design behind it: a killed rank ends its job, so the suite needs one job per kill,
four in all; each job (``torchrun_faults.py``, its docstring says how) runs its pass's stall
first, in a process group of its own, then resumes the checkpoint and takes the kill in a fresh
group, so the stalls and the resumes cost no job of their own. The four torchrun jobs run at
once: most of a job is start-up (CPU) and the stall's timeout (idle), so together they take
about the time of two run one after another (measured on 2 busy cores: one job 15 s, the four
at once 30-40 s). They replace two spawned jobs (a kill under compression, a stall under
burst_parallel: 19.5 s). Before issue #35 the survivor raised raw gloo text
("Connection closed by peer", "Timed out waiting ... for recv") under three passes out of four.
"""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from .fault_cases import PG_TIMEOUT_S, TRAINING_PASSES

SCRIPT = Path(__file__).with_name("torchrun_faults.py")
JOB_LIMIT_S = 300


def _start(pass_name, out):
    """``torchrun`` of :data:`SCRIPT` for ``pass_name`` on 2 local ranks, in a session of its
    own (so that a job over its limit is ended whole); output to ``out/torchrun.log``."""
    out.mkdir()
    log = open(out / "torchrun.log", "wb")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", "--max-restarts", "0", str(SCRIPT), pass_name, str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log,
                            stderr=subprocess.STDOUT, env=env, start_new_session=True), log


def _finish(job, log, deadline):
    """``job``'s exit code, once it ends or (ended whole) at the ``time.monotonic`` deadline."""
    try:
        return job.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        return job.wait()
    finally:
        log.close()


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Per training pass: (torchrun's exit code, the job's folder). The four jobs run at once,
    :data:`JOB_LIMIT_S` for all of them."""
    folder = tmp_path_factory.mktemp("peer_faults")
    deadline = time.monotonic() + JOB_LIMIT_S
    running = {name: _start(name, folder / name) for name in TRAINING_PASSES}
    return {name: (_finish(*job, deadline), folder / name) for name, job in running.items()}


def _read(folder, name):
    path = folder / name
    assert path.exists(), f"{path} not written; torchrun's log:\n" + \
        (folder / "torchrun.log").read_text()[-3000:]
    kind, rest = path.read_text().split(" ", 1)
    pass_name, piece, seconds, message = rest.split("|", 3)
    return kind, pass_name, piece, float(seconds), message


def _assert_peer_failure(outcome, pass_name):
    kind, named_pass, piece, seconds, message = outcome
    assert kind == "PeerFailureError", outcome
    assert named_pass == pass_name and piece, outcome
    assert message.startswith(f"{pass_name}: piece {piece!r}: "), message
    assert "(rank 1; the process group's timeout: " f"{PG_TIMEOUT_S:g} s)" in message, message
    assert seconds < PG_TIMEOUT_S + 5, outcome


@pytest.mark.slow
@pytest.mark.parametrize("pass_name", list(TRAINING_PASSES))
def test_a_stalled_peer_fails_the_survivor_with_peer_failure(jobs, pass_name):
    _, folder = jobs[pass_name]
    outcome = _read(folder, "stalled.txt")
    _assert_peer_failure(outcome, pass_name)
    assert outcome[3] >= PG_TIMEOUT_S - 1, outcome   # it waited for the stalled peer


@pytest.mark.slow
@pytest.mark.parametrize("pass_name", list(TRAINING_PASSES))
def test_a_killed_peer_fails_the_survivor_and_torchrun(jobs, pass_name):
    code, folder = jobs[pass_name]
    _assert_peer_failure(_read(folder, "killed.txt"), pass_name)
    assert code != 0, (folder / "torchrun.log").read_text()[-3000:]



@pytest.mark.slow
@pytest.mark.parametrize("pass_name", list(TRAINING_PASSES))
def test_a_checkpoint_written_before_the_faults_resumes_bit_for_bit(jobs, pass_name):
    _, folder = jobs[pass_name]
    _read(folder, "stalled.txt")   # the stall came between the checkpoint and its resume
    errors = {r: (folder / f"resumed{r}.err").read_text() for r in range(2)
              if (folder / f"resumed{r}.err").exists()}
    assert not errors, (pass_name, "loading the checkpoint raised", errors)
    for rank in range(2):
        saved, reference, resumed = (torch.load(folder / f"{what}{rank}.pt") for what in
                                     ("saved", "reference", "resumed"))
        assert sorted(resumed) == sorted(reference), (rank, set(resumed) ^ set(reference))
        differ = [k for k in reference if not torch.equal(reference[k], resumed[k])]
        assert not differ, (pass_name, rank, differ)
        moved = [k for k in saved if k.startswith("/model/")
                 and not torch.equal(saved[k], reference[k])]
        assert moved, (pass_name, rank, "the step after the checkpoint changed no parameter")
