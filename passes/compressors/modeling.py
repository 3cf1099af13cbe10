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
from typing import Optional, Sequence

import torch

from tidal.ir.perf_model import CompressorCost
from tidal.passes.compressors.base import ALL_REDUCE, Compressor, World

Shape = tuple[int, ...]


def compressor_cost(compressor: Compressor, bucket_shapes: Sequence[Sequence[Shape]],
                    encode_decode_s: float) -> CompressorCost:
    """The model's view of ``compressor`` on buckets of gradient shapes (payload split evenly
    over the compressor's rounds)."""
    payload = tuple(sum(compressor.payload_bytes(tuple(s)) for s in b) / compressor.rounds
                    for b in bucket_shapes)
    return CompressorCost(compressor.spec(), payload, float(encode_decode_s),
                          compressor.all_reduce_compatible, compressor.rounds)


def measure_encode_decode_s(compressor: Compressor, shapes: Sequence[Shape], *,
                            repeats: int = 3, device: Optional[torch.device] = None,
                            seed: int = 0) -> float:
    """Median seconds of encode + decode of all ``shapes`` in one process, on a copy of
    ``compressor`` (its state is not touched); the first (warm-up) run is not counted."""
    c = copy.deepcopy(compressor)
    gen = torch.Generator().manual_seed(seed)
    grads = {f"t{i}": torch.randn(s, generator=gen).to(device or "cpu")
             for i, s in enumerate(shapes)}
    world = World(0, 1)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        for k, g in grads.items():
            msg = c.encode(k, g, world)
            while True:
                reduced = tuple(t if msg.op == ALL_REDUCE else t.unsqueeze(0)
                                for t in msg.tensors)
                out = c.decode(k, msg, reduced, world)
                if isinstance(out, torch.Tensor):
                    break
                msg = out
        if device is not None and torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    times = sorted(times[1:])
    return times[len(times) // 2]
