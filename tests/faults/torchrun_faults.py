"""One training pass's faults on 2 ranks, the script ``torchrun`` runs (the test:
``test_peer_faults.py``)::

    python -m torch.distributed.run --standalone --nproc-per-node 2 --max-restarts 0 \\
        tests/faults/torchrun_faults.py PASS OUT_DIR

Two cases, each in a fresh default process group of its own (``PrefixStore`` over torchrun's
store, the group's timeout :data:`fault_cases.PG_TIMEOUT_S`) and a fresh compile, so that the
first fault leaves nothing the second uses:

1. **stalled**: a step, a DCP checkpoint (model, optimizer, runtime state), one more step whose
   state every rank records (``reference<rank>.pt``), then rank 1 stalls where its next step
   begins. Rank 0's step fails on the group's timeout; rank 0 writes what it raised to
   ``stalled.txt`` (after leaving its group, so that rank 1's step then fails at once) and rank 1,
   which waits for that file, leaves its stall.
2. **killed**: a fresh compile loads the checkpoint written before the stall and takes the step
   after it; every rank records that state (``resumed<rank>.pt``: equal to the reference bit for
   bit; where loading fails, the error in ``resumed<rank>.err``). Then rank 1 dies
   (``os._exit(3)``) where its next step begins; rank 0 writes what its step raised to
   ``killed.txt``, and torchrun exits non-zero.

torchrun's agent stops the workers that are left (SIGTERM, SIGKILL 30 s later) within its
monitor interval (0.1 s) of a worker's death; rank 0 lets SIGTERM wait until it has written
what its step raised, as a script that saves on SIGTERM would. A text is
:func:`fault_cases.outcome`'s.
"""
import contextlib
import datetime
import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import tidal
from tidal.runtime.distributed import init_rank_group

if __package__:   # imported (pytest --doctest-modules), not run by torchrun
    from .fault_cases import PG_TIMEOUT_S, compiled, fault_at_next_bind, outcome, wait_for, \
        write_atomically
else:
    from fault_cases import PG_TIMEOUT_S, compiled, fault_at_next_bind, outcome, wait_for, \
        write_atomically


@contextlib.contextmanager
def fresh_group(base, name):
    """A default process group of torchrun's ranks over ``base`` under the prefix ``name``,
    with the fault jobs' timeout, for the block (left at its end unless the block left it)."""
    init_rank_group(None, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                    timeout_s=PG_TIMEOUT_S, store=dist.PrefixStore(name, base))
    try:
        yield dist.get_rank()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def checkpoint_state(c, template_of=None):
    """What the checkpoint holds: model, optimizer and runtime state (every rank calls it)."""
    model, optim = tidal.checkpoint.get_state_dict(c, c.optimizer)
    runtime = tidal.checkpoint.get_runtime_state_dict(c, checkpoint_id=template_of)
    return {"model": model, "optim": optim, "runtime": runtime}


def load_checkpoint(c, path):
    state = checkpoint_state(c, template_of=path)
    dcp.load(state, checkpoint_id=path)
    tidal.checkpoint.set_state_dict(c, c.optimizer, model_state_dict=state["model"],
                                    optim_state_dict=state["optim"])
    tidal.checkpoint.set_runtime_state_dict(c, state["runtime"])


def tensors_of(obj, path="", out=None):
    """Every tensor (and number) in the nested ``obj``, by its path, cloned."""
    out = {} if out is None else out
    if isinstance(obj, dict):
        for k, v in obj.items():
            tensors_of(v, f"{path}/{k}", out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            tensors_of(v, f"{path}/{i}", out)
    elif isinstance(obj, torch.Tensor):
        out[path] = obj.detach().clone()
    elif isinstance(obj, (int, float)):
        out[path] = torch.tensor(obj)
    return out


def record(c, loss, path):
    """The loss and the whole checkpoint state after a step, to ``path`` (``torch.save``)."""
    torch.save({"/loss": loss.detach().clone(), **tensors_of(checkpoint_state(c))}, path)


def stalled(pass_name, out, rank, ckpt):
    c, x, y = compiled(pass_name)
    c.step((x,), y)
    dcp.save(checkpoint_state(c), checkpoint_id=ckpt)
    torch.save(tensors_of(checkpoint_state(c)), os.path.join(out, f"saved{rank}.pt"))
    record(c, c.step((x,), y), os.path.join(out, f"reference{rank}.pt"))
    flag = os.path.join(out, "stalled.txt")
    if rank == 1:
        fault_at_next_bind(c, lambda: wait_for(flag))
    what = outcome(lambda: c.step((x,), y))
    dist.destroy_process_group()   # rank 1's step then fails at once
    write_atomically(flag if rank == 0 else os.path.join(out, "stalled-rank1.txt"), what)


def resumed(pass_name, out, rank, ckpt):
    """A fresh compile loaded from ``ckpt``, after the step it takes and records; if loading
    fails on any rank, the error in ``resumed<rank>.err`` and, on every rank, a fresh compile
    after one step instead (so that the kill still comes where a step begins)."""
    c, x, y = compiled(pass_name)
    error = ""
    try:
        load_checkpoint(c, ckpt)
    except Exception as e:   # noqa: BLE001 - the test reports it
        error = f"{type(e).__name__}: {e}"
        write_atomically(os.path.join(out, f"resumed{rank}.err"), error)
    failed = torch.tensor([float(bool(error))])
    dist.all_reduce(failed)
    if failed.item():
        c, x, y = compiled(pass_name)
        c.step((x,), y)
    else:
        record(c, c.step((x,), y), os.path.join(out, f"resumed{rank}.pt"))
    return c, x, y


def killed(pass_name, out, rank, ckpt):
    c, x, y = resumed(pass_name, out, rank, ckpt)
    if rank == 1:
        fault_at_next_bind(c, lambda: os._exit(3))
    else:
        signal.signal(signal.SIGTERM, lambda signum, frame: None)
    what = outcome(lambda: c.step((x,), y))
    write_atomically(os.path.join(out, "killed.txt"), what)


def main(pass_name, out):
    torch.set_num_threads(1)
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                         int(os.environ["WORLD_SIZE"]), is_master=False,
                         timeout=datetime.timedelta(seconds=60))
    ckpt = os.path.join(out, "checkpoint")
    with fresh_group(base, "stalled") as rank:
        stalled(pass_name, out, rank, ckpt)
    with fresh_group(base, "killed") as rank:
        killed(pass_name, out, rank, ckpt)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
