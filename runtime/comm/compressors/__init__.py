"""Gradient compressors (PowerSGD, Top-K, random-K, signSGD, QSGD) behind one interface.

``make_compressor("powersgd:4")`` builds one from a spec ``name[:level][,option=value...]``
(:mod:`tidal.ir.compression_model`: PowerSGD rank, Top-K/random-K fraction, QSGD levels; signSGD
has no level). :func:`synchronize` runs
encode -> collective -> decode over a dict of gradients on a process group (or in one process);
:func:`synchronize_async` returns a future instead, its collectives issued with
``async_op=True`` and decoded in chained callbacks (the DDP hooks use it). Compressors work on
the gradients' device and in float32 whatever the gradients' dtype (bf16/fp16 gradients work).
Each compressor declares ``all_reduce_compatible`` and ``payload_bytes(shape)`` (the bytes one
rank sends per step), both from :mod:`tidal.ir.compression_model` (the pass plans with the same
numbers), and checkpoints with ``state_dict``/``load_state_dict``. ``spec()`` gives back the
spec, options included, so ``make_compressor(c.spec())`` rebuilds ``c`` (without its state).

Example:
    >>> import torch
    >>> from tidal.runtime.comm.compressors import make_compressor, synchronize
    >>> c = make_compressor("randomk:0.5")
    >>> c.all_reduce_compatible, c.payload_bytes((10,))
    (True, 20)
    >>> out = synchronize(c, {"g": torch.arange(10.0)})
    >>> int((out["g"] != 0).sum())
    5
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Any, Union

from tidal.ir.compression_model import CompressorSpec, parse_spec
from tidal.runtime.comm.compressors.base import (ALL_GATHER, ALL_REDUCE, Compressor, Message,
                                           NoCompression, World, seeded_generator, stable_seed)
from tidal.runtime.comm.compressors.comm import (WIRE_DTYPES, Comm, Lane, LocalComm, check_wire_dtype,
                                           synchronize, synchronize_async)
from tidal.runtime.comm.compressors.powersgd import PowerSGD, orthogonalize
from tidal.runtime.comm.compressors.quantize import QSGD, SignSGD, pack_bits, unpack_bits
from tidal.runtime.comm.compressors.sparsify import RandomK, TopK

COMPRESSORS = MappingProxyType({c.name: c for c in (PowerSGD, TopK, RandomK, SignSGD, QSGD,
                                                   NoCompression)})
"""Compressor classes by name (``none``: plain all-reduce, the sync SGD baseline)."""

__all__ = ["ALL_GATHER", "ALL_REDUCE", "COMPRESSORS", "Comm", "Compressor", "Lane", "LocalComm",
           "Message", "NoCompression", "PowerSGD", "QSGD", "RandomK", "SignSGD", "TopK",
           "WIRE_DTYPES", "World", "check_wire_dtype", "make_compressor", "orthogonalize",
           "pack_bits", "parse_spec", "seeded_generator", "stable_seed", "synchronize",
           "synchronize_async", "unpack_bits"]


def make_compressor(spec: Union[str, CompressorSpec], **options: Any) -> Compressor:
    """A compressor from a spec ``name[:level][,option=value...]`` (parsed by
    :func:`tidal.ir.compression_model.parse_spec`) and keyword ``options`` of its class
    (``seed``, ``error_feedback``, PowerSGD's ``min_compression_rate``/``warm_start``), which
    override the spec's."""
    parsed = parse_spec(spec) if isinstance(spec, str) else spec
    cls = COMPRESSORS[parsed.name]
    options = {**dict(parsed.options), **options}
    if parsed.level is None:
        return cls(**options)
    return cls(parsed.level, **options)
