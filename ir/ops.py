"""Custom ops tidal inserts into graphs, registered with ``torch.library`` in the ``tidal``
namespace.

Each op has a fake (meta) kernel so shape propagation and ``make_fx`` capture work, and is
marked side-effectful so fx's dead-code elimination keeps it even though nothing consumes it.
Without a process group every op is the identity on the values it touches, so a transformed
graph always runs in one process with the original semantics. Passes add their own ops here.

``tidal::group_boundary(k)`` waits for layer group ``k``'s weights when a weight loader is
active in the calling context (:func:`loading`); otherwise it does nothing. The active loader
lives in a :class:`contextvars.ContextVar`, so it is per thread/task and never global.

Example:
    >>> import torch
    >>> from tidal.ir import ops
    >>> torch.ops.tidal.group_boundary(3)   # a marker: does nothing in one process
    >>> class Loader:
    ...     def __init__(self): self.waited = []
    ...     def wait(self, group): self.waited.append(group)
    >>> loader = Loader()
    >>> with ops.loading(loader):
    ...     torch.ops.tidal.group_boundary(0)
    >>> loader.waited
    [0]
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, Optional, Protocol

import torch
from torch.fx.node import has_side_effect


class GroupWaiter(Protocol):
    """What ``group_boundary`` waits on: ``wait(group)`` returns once the group's weights are
    resident (and raises if loading them failed)."""

    def wait(self, group: int) -> None: ...


_ACTIVE_LOADER: contextvars.ContextVar[Optional[GroupWaiter]] = contextvars.ContextVar(
    "tidal_active_loader", default=None)


@contextlib.contextmanager
def loading(loader: GroupWaiter) -> Iterator[GroupWaiter]:
    """Make ``loader`` the one ``group_boundary`` waits on inside the ``with`` block (in this
    thread/context only)."""
    token = _ACTIVE_LOADER.set(loader)
    try:
        yield loader
    finally:
        _ACTIVE_LOADER.reset(token)


def active_loader() -> Optional[GroupWaiter]:
    """The loader ``group_boundary`` waits on in this context, or None."""
    return _ACTIVE_LOADER.get()


@torch.library.custom_op("tidal::group_boundary", mutates_args=())
def group_boundary(group: int) -> None:
    """Marks the start of layer group ``group`` (PipeSwitch weight transmission): waits until
    the group's weights are resident when a loader is active (:func:`loading`), else a no-op."""
    loader = _ACTIVE_LOADER.get()
    if loader is not None:
        loader.wait(group)


@group_boundary.register_fake
def _group_boundary_fake(group: int) -> None:
    return None


GROUP_BOUNDARY = torch.ops.tidal.group_boundary.default
"""The op overload a pass inserts as an fx ``call_function`` target."""

has_side_effect(GROUP_BOUNDARY)


def is_tidal_op(target: object) -> bool:
    """True if an fx node target is one of tidal's custom ops."""
    return isinstance(target, torch._ops.OpOverload) and target.namespace == "tidal"
