"""The registered passes, one file each.

``PASSES`` is the registry (``tidal.ir.registry.Registry``) of pass classes by name, one row per
pass: ``registry()`` maps the names to the classes (importing them, and so torch, on first
call); ``descriptions()`` names and describes them without importing any pass, so ``tidal
passes`` stays fast. A pass added to ``passes/`` is registered by adding a row to ``PASSES``.

Example:
    >>> import tidal
    >>> sorted(tidal.passes.registry())[:2]
    ['burst_parallel', 'clustered_attention']
    >>> tidal.passes.descriptions()["layer_groups"].split(" (")[0]
    'Groups layers for pipelined weight transmission'
    >>> tidal.passes.PASSES.get("tick_tock").__name__
    'TickTock'
"""
from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING, Mapping

from tidal.ir.registry import Entry, Registry

if TYPE_CHECKING:
    from tidal.ir.pass_api import Pass

PASSES: Registry[type[Pass]] = Registry("pass", (
    Entry("burst_parallel", "tidal.passes.burst_parallel:BurstParallel",
          "Burst-parallel training: per-layer GPU counts from DeepPool's planner, "
          "scatter/gather where the count changes, per-layer gradient sync on the layer's "
          "ranks."),
    Entry("tick_tock", "tidal.passes.tick_tock:TickTock",
          "Wavelet tick-tock data parallelism: tick and tock waves with separate replicas, "
          "the tock one forward behind, cross-wave gradient averaging (Eq. 1) and a per-wave "
          "all-reduce."),
    Entry("round_robin", "tidal.passes.round_robin:RoundRobin",
          "Wavelet round-robin model parallelism: N time-balanced partitions, every rank "
          "runs partition c on batch (i − c) mod N at cycle c, one all-reduce per "
          "partition."),
    Entry("compression", "tidal.passes.compression:CompressionPass",
          "Gradient compression for data-parallel training (PowerSGD, Top-K, random-K, "
          "signSGD, QSGD), Accordion switching, and a performance model that says whether "
          "it pays."),
    Entry("layer_groups", "tidal.passes.layer_groups:LayerGroups",
          "Groups layers for pipelined weight transmission (PipeSwitch) and marks each "
          "group's first node with ``tidal::group_boundary(k)``."),
    Entry("clustered_attention", "tidal.passes.clustered_attention:ClusteredAttention",
          "CHAI: heads clustered per layer, scores shared within a cluster after the first "
          "tokens."),
    Entry("embedding_cache", "tidal.passes.embedding_cache:EmbeddingCache",
          "Bagpipe: embedding lookups whose ids come from the inputs read a cached working "
          "set (``tidal::cached_embedding``); the tables move to embedding servers, an "
          "Oracle Cacher looks ``lookahead`` batches ahead."),
))


def summary(doc: str | None) -> str:
    """The first paragraph of a docstring on one line: the whole sentences that describe it."""
    paragraph = (doc or "").strip().split("\n\n")[0]
    return " ".join(paragraph.split())


def entries() -> tuple[Entry, ...]:
    """The registered passes' table rows, in registration order."""
    return PASSES.entries


def descriptions() -> Mapping[str, str]:
    """One-sentence description of each registered pass by name, without importing any pass:
    the summary (first paragraph) of its class docstring, whole sentences
    (``summary(cls.__doc__)``)."""
    return PASSES.descriptions()


def registry() -> Mapping[str, type[Pass]]:
    """Registered pass classes by name, in registration order (read-only)."""
    return MappingProxyType(dict(PASSES.items()))
