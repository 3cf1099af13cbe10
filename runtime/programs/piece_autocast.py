"""Autocast for the pieces of a bound step: the state of the thread that bound it, on any thread.

Autocast is thread-local, and a program's pieces run on a stream's worker thread
(``tidal.runtime.backend.CpuStream``) or inline on the thread that launched them. A bound step
reads the autocast state of the thread that binds it (``tidal.ir.step_state.autocast_state``)
and runs each piece that computes eagerly (a forward, a backward) under it
(:func:`under_autocast`), wherever the piece runs; every other piece (a captured segment, whose
casts are in its graph; a gradient sync; the optimizer) runs with autocast off
(:data:`NO_AUTOCAST`), as eager PyTorch runs a DDP comm hook and ``optimizer.step()`` outside
autocast. Casts are not cached across a piece (``cache_enabled=False``): every step casts the
parameters' current values (one ``torch.autocast`` around several eager steps reuses the
first step's casts: torch's cast cache; tidal's steps do not).

Example:
    >>> import threading, torch
    >>> from tidal.ir.step_state import autocast_state
    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     state = autocast_state()                       # at bind time
    >>> seen = []
    >>> piece = under_autocast(state, lambda: seen.append(torch.is_autocast_enabled("cpu")))
    >>> t = threading.Thread(target=piece); t.start(); t.join()   # a stream's worker thread
    >>> seen
    [True]
    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     under_autocast(NO_AUTOCAST, lambda: torch.is_autocast_enabled("cpu"))()
    False
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from tidal.ir.step_state import AUTOCAST_DEVICES

AutocastState = tuple[tuple[str, bool, str], ...]
"""(device type, enabled, dtype name) per device type, as ``autocast_state()`` returns it."""

NO_AUTOCAST: AutocastState = tuple((device, False, "") for device in AUTOCAST_DEVICES)
"""Autocast off on every device type."""


@contextlib.contextmanager
def autocast_as(state: AutocastState) -> Iterator[None]:
    """Run the block under ``state``: autocast on (its dtype, no cast cache) for each device
    type enabled in it, off for each other one that is on in this thread now.

    Example:
        >>> with autocast_as((("cpu", True, "bfloat16"),)):
        ...     torch.get_autocast_dtype("cpu"), torch.is_autocast_enabled("cpu")
        (torch.bfloat16, True)
    """
    with contextlib.ExitStack() as stack:
        for device, enabled, dtype in state:
            if enabled:
                stack.enter_context(torch.autocast(device, dtype=getattr(torch, dtype),
                                                   cache_enabled=False))
            elif torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        yield


def under_autocast(state: AutocastState, fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` (a piece's work) made to run under ``state`` (:func:`autocast_as`) on whichever
    thread calls it (see the module docstring)."""
    def run() -> Any:
        with autocast_as(state):
            return fn()

    return run
