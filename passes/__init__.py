"""The registered passes, one file each.

``registry()`` maps pass names to pass classes (importing them, and so torch, on first call);
``descriptions()`` names and describes them without importing any pass, so ``tidal passes``
stays fast. A pass added to ``passes/`` is registered by adding a row to ``_PASSES``.

Example:
    >>> import tidal
    >>> sorted(tidal.passes.registry())[:2]
    ['burst_parallel', 'clustered_attention']
    >>> tidal.passes.descriptions()["layer_groups"].split(" (")[0]
    'Groups layers for pipelined weight transmission'
"""
from __future__ import annotations

import importlib
from types import MappingProxyType
from typing import TYPE_CHECKING, Mapping, NamedTuple

if TYPE_CHECKING:
    from tidal.ir.pass_api import Pass


class PassEntry(NamedTuple):
    """Where a registered pass lives, and its description: the summary (first paragraph) of its
    class docstring, whole sentences (``summary(cls.__doc__)``)."""

    name: str
    module: str
    class_name: str
    description: str


_PASSES: tuple[PassEntry, ...] = (
    PassEntry("burst_parallel", "tidal.passes.burst_parallel", "BurstParallel",
              "Burst-parallel training: per-layer GPU counts from DeepPool's planner, "
              "scatter/gather where the count changes, per-layer gradient sync on the layer's "
              "ranks."),
    PassEntry("tick_tock", "tidal.passes.tick_tock", "TickTock",
              "Wavelet tick-tock data parallelism: tick and tock waves with separate replicas, "
              "the tock one forward behind, cross-wave gradient averaging (Eq. 1) and a per-wave "
              "all-reduce."),
    PassEntry("round_robin", "tidal.passes.round_robin", "RoundRobin",
              "Wavelet round-robin model parallelism: N time-balanced partitions, every rank "
              "runs partition c on batch (i − c) mod N at cycle c, one all-reduce per "
              "partition."),
    PassEntry("compression", "tidal.passes.compression", "CompressionPass",
              "Gradient compression for data-parallel training (PowerSGD, Top-K, random-K, "
              "signSGD, QSGD), Accordion switching, and a performance model that says whether "
              "it pays."),
    PassEntry("layer_groups", "tidal.passes.layer_groups", "LayerGroups",
              "Groups layers for pipelined weight transmission (PipeSwitch) and marks each "
              "group's first node with ``tidal::group_boundary(k)``."),
    PassEntry("clustered_attention", "tidal.passes.clustered_attention", "ClusteredAttention",
              "CHAI: heads clustered per layer, scores shared within a cluster after the first "
              "tokens."),
    PassEntry("embedding_cache", "tidal.passes.embedding_cache", "EmbeddingCache",
              "Bagpipe: embedding lookups whose ids come from the inputs read a cached working "
              "set (``tidal::cached_embedding``); the tables move to embedding servers, an "
              "Oracle Cacher looks ``lookahead`` batches ahead."),
)


def summary(doc: str | None) -> str:
    """The first paragraph of a docstring on one line: the whole sentences that describe it."""
    paragraph = (doc or "").strip().split("\n\n")[0]
    return " ".join(paragraph.split())


def entries() -> tuple[PassEntry, ...]:
    """The registered passes' table rows, in registration order."""
    return _PASSES


def descriptions() -> Mapping[str, str]:
    """One-sentence description of each registered pass by name, without importing any pass."""
    return MappingProxyType({e.name: e.description for e in _PASSES})


def registry() -> Mapping[str, type[Pass]]:
    """Registered pass classes by name (read-only)."""
    return MappingProxyType({e.name: getattr(importlib.import_module(e.module), e.class_name)
                             for e in _PASSES})
