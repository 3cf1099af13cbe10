"""Custom ops tidal inserts into graphs, registered with ``torch.library`` in the ``tidal``
namespace.

Each op has a fake (meta) kernel so shape propagation and ``make_fx`` capture work, and is
marked side-effectful so fx's dead-code elimination keeps it even though nothing consumes it.
Without a process group every op is the identity on the values it touches, so a transformed
graph always runs in one process with the original semantics. Passes add their own ops here.

``tidal::group_boundary(k)`` marks where layer group ``k`` starts; it computes nothing. The
runtime's layer-group program (``tidal.runtime.programs.layer_groups``) cuts the graph at these
markers and runs group ``k`` after the piece that loads its weights.

Example:
    >>> import torch
    >>> from tidal.ir import ops
    >>> torch.ops.tidal.group_boundary(3)   # a marker: does nothing
"""
from __future__ import annotations

import torch
from torch.fx.node import has_side_effect


@torch.library.custom_op("tidal::group_boundary", mutates_args=())
def group_boundary(group: int) -> None:
    """Marks the start of layer group ``group`` (PipeSwitch weight transmission)."""


@group_boundary.register_fake
def _group_boundary_fake(group: int) -> None:
    return None


GROUP_BOUNDARY = torch.ops.tidal.group_boundary.default
"""The op overload a pass inserts as an fx ``call_function`` target."""

has_side_effect(GROUP_BOUNDARY)


def is_tidal_op(target: object) -> bool:
    """True if an fx node target is one of tidal's custom ops."""
    return isinstance(target, torch._ops.OpOverload) and target.namespace == "tidal"
