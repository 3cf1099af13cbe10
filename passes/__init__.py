"""The registered passes, one file each.

``registry()`` maps pass names to pass classes; ``tidal passes`` lists them. A pass added to
``passes/`` is registered by adding its class to ``_PASS_CLASSES``.

Example:
    >>> import tidal
    >>> sorted(tidal.passes.registry())[:2]
    ['burst_parallel', 'clustered_attention']
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

from tidal.ir.pass_api import Pass
from tidal.passes.burst_parallel import BurstParallel
from tidal.passes.clustered_attention import ClusteredAttention
from tidal.passes.compression import CompressionPass
from tidal.passes.layer_groups import LayerGroups
from tidal.passes.round_robin import RoundRobin
from tidal.passes.tick_tock import TickTock

_PASS_CLASSES: tuple[type[Pass], ...] = (BurstParallel, TickTock, RoundRobin, CompressionPass,
                                         LayerGroups, ClusteredAttention)


def registry() -> Mapping[str, type[Pass]]:
    """Registered pass classes by name (read-only)."""
    return MappingProxyType({cls.name: cls for cls in _PASS_CLASSES})
