"""Gradient compressors (PowerSGD, Top-K, random-K, signSGD, QSGD) behind one interface.

``make_compressor("powersgd:4")`` builds one from a spec ``name[:level]`` (PowerSGD rank,
Top-K/random-K fraction, QSGD levels; signSGD has no level). :func:`synchronize` runs
encode -> collective -> decode over a dict of gradients on a process group (or in one process).
Each compressor declares ``all_reduce_compatible`` and ``payload_bytes(shape)`` (the bytes one
rank sends per step) and checkpoints with ``state_dict``/``load_state_dict``.

Example:
    >>> import torch
    >>> from tidal.passes.compressors import make_compressor, synchronize
    >>> c = make_compressor("randomk:0.5")
    >>> c.all_reduce_compatible, c.payload_bytes((10,))
    (True, 20)
    >>> out = synchronize(c, {"g": torch.arange(10.0)})
    >>> int((out["g"] != 0).sum())
    5
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Any

from tidal.passes.compressors.base import (ALL_GATHER, ALL_REDUCE, Compressor, Message,
                                           NoCompression, World, seeded_generator, stable_seed)
from tidal.passes.compressors.comm import Comm, LocalComm, synchronize
from tidal.passes.compressors.powersgd import PowerSGD, orthogonalize
from tidal.passes.compressors.quantize import QSGD, SignSGD, pack_bits, unpack_bits
from tidal.passes.compressors.sparsify import RandomK, TopK

COMPRESSORS = MappingProxyType({c.name: c for c in (PowerSGD, TopK, RandomK, SignSGD, QSGD,
                                                   NoCompression)})
"""Compressor classes by name (``none``: plain all-reduce, the sync SGD baseline)."""

__all__ = ["ALL_GATHER", "ALL_REDUCE", "COMPRESSORS", "Comm", "Compressor", "LocalComm", "Message",
           "NoCompression", "PowerSGD",
           "QSGD", "RandomK", "SignSGD", "TopK", "World", "make_compressor", "orthogonalize",
           "pack_bits", "parse_spec", "seeded_generator", "stable_seed", "synchronize",
           "unpack_bits"]


def parse_spec(spec: str) -> tuple[str, Any]:
    """``"powersgd:4"`` -> ``("powersgd", 4)``; ``"topk:0.01"`` -> ``("topk", 0.01)``;
    ``"signsgd"`` -> ``("signsgd", None)``. Raises ``ValueError`` naming an unknown compressor."""
    name, _, level = spec.strip().partition(":")
    name = name.strip().lower()
    if name not in COMPRESSORS:
        raise ValueError(f"unknown compressor {name!r} in {spec!r} "
                         f"(known: {', '.join(COMPRESSORS)})")
    if not level:
        return name, None
    try:
        value: Any = float(level) if name in ("topk", "randomk") else int(level)
    except ValueError:
        raise ValueError(f"compressor spec {spec!r}: level {level!r} is not a number") from None
    return name, value


def make_compressor(spec: str, **options: Any) -> Compressor:
    """A compressor from ``name[:level]`` and keyword ``options`` of its class (``seed``,
    ``error_feedback``, PowerSGD's ``min_compression_rate``/``warm_start``)."""
    name, level = parse_spec(spec)
    cls = COMPRESSORS[name]
    if level is not None:
        if name in ("signsgd", "none"):
            raise ValueError(f"compressor spec {spec!r}: {name} takes no level")
        return cls(level, **options)
    return cls(**options)
