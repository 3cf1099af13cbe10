"""A compressor as the performance model sees it: payload per bucket and encode+decode time.

:func:`compressor_cost` turns a compressor and a model's bucketed gradient shapes into a
:class:`tidal.ir.perf_model.CompressorCost`; :func:`measure_encode_decode_s` times encode and
decode (no communication: one process) on random gradients of those shapes on this machine.

Example:
    >>> from tidal.passes.compressors import PowerSGD
    >>> from tidal.passes.compressors.modeling import compressor_cost
    >>> cost = compressor_cost(PowerSGD(4), [[(256, 512), (512,)]], encode_decode_s=0.01)
    >>> cost.payload_bytes, cost.rounds, cost.all_reduce   # per round: (256+512)*4*4/2 + 512*4/2
    ((7168.0,), 2, True)
"""
from __future__ import annotations

import copy
import time
from typing import Callable, Optional, Sequence

import torch

from tidal.ir.perf_model import CompressorCost
from tidal.passes.compressors.base import Compressor
from tidal.passes.compressors.comm import LocalComm, synchronize

Shape = tuple[int, ...]


def compressor_cost(compressor: Compressor, bucket_shapes: Sequence[Sequence[Shape]],
                    encode_decode_s: float) -> CompressorCost:
    """The model's view of ``compressor`` on buckets of gradient shapes (payload split evenly
    over the compressor's rounds)."""
    payload = tuple(sum(compressor.payload_bytes(tuple(s)) for s in b) / compressor.rounds
                    for b in bucket_shapes)
    return CompressorCost(compressor.spec(), payload, float(encode_decode_s),
                          compressor.all_reduce_compatible, compressor.rounds)


def encode_decode_fn(compressor: Compressor, shapes: Sequence[Shape], *,
                     buckets: Optional[Sequence[Sequence[int]]] = None,
                     device: Optional[torch.device] = None, seed: int = 0) -> Callable[[], None]:
    """A function that runs one step of ``compressor``'s local work over random gradients of
    ``shapes``: :func:`synchronize` bucket by bucket (``buckets``: indices into ``shapes``;
    default one bucket) on a :class:`LocalComm`, i.e. encode, packing into one buffer per
    round and decode, with no communication. Runs on a copy of ``compressor``."""
    c = copy.deepcopy(compressor)
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(s, generator=gen).to(device or "cpu") for s in shapes]
    parts = [list(range(len(shapes)))] if buckets is None else [list(b) for b in buckets]
    comm = LocalComm()
    cuda = device is not None and torch.device(device).type == "cuda"

    def run() -> None:
        for b in parts:
            synchronize(c, {f"t{i}": grads[i] for i in b}, comm)
        if cuda:
            torch.cuda.synchronize(device)

    return run


def measure_encode_decode_s(compressor: Compressor, shapes: Sequence[Shape], *,
                            repeats: int = 3, device: Optional[torch.device] = None,
                            seed: int = 0) -> float:
    """Median seconds of encode + decode of all ``shapes`` in one process, on a copy of
    ``compressor`` (its state is not touched); the first (warm-up) run is not counted."""
    run = encode_decode_fn(compressor, shapes, device=device, seed=seed)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    times = sorted(times[1:])
    return times[len(times) // 2]
