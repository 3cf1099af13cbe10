"""The device of task switching: resolved once to an indexed device, entered by each worker, and
what moves to it (a job's batches) or off it (what crosses between processes).

A bare ``"cuda"`` is resolved to the current CUDA device (``cuda:0`` unless set otherwise) by
:func:`resolve_device`, once, where the :class:`~tidal.runtime.switching.switcher.Switcher` is
built; the arena, the host copies, the workers and their tasks all get that indexed device
(``torch.cuda.set_device`` refuses a device without an index). :func:`to_host` moves every tensor
of a message off the device before it crosses processes: a CUDA tensor received over IPC cannot
be shared again, so optimizer state and outputs travel in host memory.

Example:
    >>> import torch
    >>> from tidal.runtime.switching.device import resolve_device, to_device, to_host
    >>> resolve_device("cpu")
    device(type='cpu')
    >>> out = to_host({"state": {0: {"momentum_buffer": torch.ones(2)}}, "lr": 0.1})
    >>> out["state"][0]["momentum_buffer"].device, out["lr"]
    (device(type='cpu'), 0.1)
    >>> to_device(((torch.ones(1),), 3), "meta")[0][0].device
    device(type='meta')
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map

from tidal.runtime.switching.errors import SwitchingError


def resolve_device(device: Any) -> torch.device:
    """``device`` as a ``torch.device``; a CUDA device without an index becomes the current
    CUDA device (raises ``SwitchingError`` when CUDA is not available)."""
    dev = torch.device(device)
    if dev.type != "cuda" or dev.index is not None:
        return dev
    if not torch.cuda.is_available():
        raise SwitchingError(f"device {str(device)!r}: CUDA is not available on this machine")
    return torch.device("cuda", torch.cuda.current_device())


def enter_device(device: Any) -> torch.device:
    """Make ``device`` (resolved) this process's current device and create its context (a
    worker does it once at start, off the switch's path); returns the resolved device."""
    dev = resolve_device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        torch.cuda.init()
    return dev


def to_device(tree: Any, device: Any) -> Any:
    """Every tensor of ``tree`` (any nesting of tuples, lists and dicts) on ``device``."""
    dev = torch.device(device)
    return tree_map(lambda t: t.to(dev) if isinstance(t, torch.Tensor) else t, tree)


def to_host(tree: Any) -> Any:
    """Every tensor of ``tree`` in host memory, detached: one on another device is copied, one
    already on the CPU is kept as it is (it crosses processes by shared memory). Not pinned:
    pinning is per process, and a queue moves a tensor's storage into (unpinned) shared memory
    anyway; the receiving worker copies it to its device once, at activation."""
    return tree_map(lambda t: t.detach().to("cpu")
                    if isinstance(t, torch.Tensor) and t.device.type != "cpu" else t, tree)
