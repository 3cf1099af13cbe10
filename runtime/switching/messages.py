"""What crosses between the controller and its workers, checked in the sender before it is
queued.

A ``torch.multiprocessing`` queue pickles a message later, in a feeder thread: a message that
cannot cross (an object that does not pickle, a CUDA tensor received from another process, which
torch refuses to share again, a host tensor whose memory cannot be moved into shared memory) is
lost there with a traceback on stderr, and the receiver waits until its timeout. :func:`send`
checks the message first: every tensor in host memory (move it with
:func:`~tidal.runtime.switching.device.to_host`) and moved into shared memory now, in the sender
(what the feeder thread would do; a full ``/dev/shm`` fails here), everything else picklable. A
message that fails raises ``SwitchingError`` at once, naming the sender and the message's kind.

Example:
    >>> import queue, torch
    >>> from tidal.runtime.switching.messages import send
    >>> q = queue.Queue()
    >>> send(q, ("done", 1, "bert", 3), "worker 1")
    >>> q.get()
    ('done', 1, 'bert', 3)
    >>> send(q, ("stopped", 1, "bert", 3, {"m": torch.ones(2, device="meta")}, 0.0), "worker 1")
    Traceback (most recent call last):
    ...
    tidal.runtime.switching.errors.SwitchingError: worker 1: message 'stopped' cannot cross ...
"""
from __future__ import annotations

import pickle
from multiprocessing.reduction import ForkingPickler
from typing import Any, Optional

import torch

from tidal.runtime.switching.errors import SwitchingError


class _Sink:
    """A file that keeps nothing."""

    def write(self, data: bytes) -> int:
        return len(data)


class _Probe(ForkingPickler):
    """Pickles a message the way the queue will, except its tensors and storages, which it only
    checks and moves into shared memory (pickling them here would hand out their memory twice;
    moving them is what the queue's feeder thread would do first, where a failure is lost)."""

    def __init__(self) -> None:
        super().__init__(_Sink(), pickle.HIGHEST_PROTOCOL)
        self.problem: Optional[str] = None

    def persistent_id(self, obj: Any) -> Optional[int]:
        if isinstance(obj, torch.Tensor):
            self._note(_tensor_problem(obj))
            return id(obj)
        if isinstance(obj, (torch.UntypedStorage, torch.TypedStorage)):
            self._note(_storage_problem(obj))
            return id(obj)
        return None

    def _note(self, problem: Optional[str]) -> None:
        if self.problem is None:
            self.problem = problem


def _tensor_problem(t: torch.Tensor) -> Optional[str]:
    """Why tensor ``t`` cannot cross (after moving its memory into shared memory), or None."""
    what = f"a tensor of shape {tuple(t.shape)}"
    if t.device.type != "cpu":
        return (f"it holds {what} on {t.device} (tensors cross in host memory: move it with "
                "to_host)")
    if t.requires_grad and not t.is_leaf:
        return f"it holds {what} that requires grad and is not a leaf (detach it)"
    storage = t.untyped_storage()
    if storage.device.type != "cpu":  # a fake tensor (a test's stand-in) has no memory
        return None
    problem = _storage_problem(storage)
    return None if problem is None else f"{problem} (of {what})"


def _storage_problem(storage: Any) -> Optional[str]:
    """Why ``storage`` cannot cross, or None once it lies in shared memory."""
    if storage.device.type != "cpu":
        return f"it holds a storage on {storage.device}"
    if storage.nbytes() == 0 or storage.is_shared():
        return None
    try:
        storage.share_memory_()
    except Exception as e:  # noqa: BLE001 - what the allocator raises varies (OSError, ...)
        return (f"its memory ({storage.nbytes()} bytes) cannot be moved into shared memory: "
                f"{type(e).__name__}: {e}")
    return None


def unsendable(msg: Any) -> Optional[str]:
    """Why ``msg`` cannot cross processes, or None if it can (its host tensors are then in
    shared memory)."""
    probe = _Probe()
    try:
        probe.dump(msg)
    except Exception as e:  # noqa: BLE001 - what pickling raises varies by object
        return f"it does not pickle: {type(e).__name__}: {e}"
    return probe.problem


def send(queue: Any, msg: tuple, sender: str) -> None:
    """Put ``msg`` on ``queue`` once it is known to cross; raise ``SwitchingError`` naming
    ``sender`` and the message's kind (its first element) otherwise."""
    why = unsendable(msg)
    if why is not None:
        raise SwitchingError(f"{sender}: message {msg[0]!r} cannot cross processes: {why}")
    queue.put(msg)
