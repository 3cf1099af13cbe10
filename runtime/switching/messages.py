"""What crosses between the controller and its workers, checked in the sender before it is
queued.

A ``torch.multiprocessing`` queue pickles a message later, in a feeder thread: a message that
cannot cross (an object that does not pickle, a CUDA tensor received from another process, which
torch refuses to share again) is lost there with a traceback on stderr, and the receiver waits
until its timeout. :func:`send` checks the message first: every tensor in host memory (move it
with :func:`~tidal.runtime.switching.device.to_host`), everything else picklable. A message that
fails raises ``SwitchingError`` at once, naming the sender and the message's kind.

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
    checks (sharing them here would hand out their memory twice)."""

    def __init__(self) -> None:
        super().__init__(_Sink(), pickle.HIGHEST_PROTOCOL)
        self.off_host: Optional[str] = None

    def persistent_id(self, obj: Any) -> Optional[int]:
        if isinstance(obj, torch.Tensor):
            if obj.device.type != "cpu" and self.off_host is None:
                self.off_host = (f"a tensor of shape {tuple(obj.shape)} on {obj.device} "
                                 "(tensors cross in host memory: move it with to_host)")
            return id(obj)
        if isinstance(obj, (torch.UntypedStorage, torch.TypedStorage)):
            if obj.device.type != "cpu" and self.off_host is None:
                self.off_host = f"a storage on {obj.device}"
            return id(obj)
        return None


def unsendable(msg: Any) -> Optional[str]:
    """Why ``msg`` cannot cross processes, or None if it can."""
    probe = _Probe()
    try:
        probe.dump(msg)
    except Exception as e:  # noqa: BLE001 - what pickling raises varies by object
        return f"it does not pickle: {type(e).__name__}: {e}"
    return None if probe.off_host is None else f"it holds {probe.off_host}"


def send(queue: Any, msg: tuple, sender: str) -> None:
    """Put ``msg`` on ``queue`` once it is known to cross; raise ``SwitchingError`` naming
    ``sender`` and the message's kind (its first element) otherwise."""
    why = unsendable(msg)
    if why is not None:
        raise SwitchingError(f"{sender}: message {msg[0]!r} cannot cross processes: {why}")
    queue.put(msg)
