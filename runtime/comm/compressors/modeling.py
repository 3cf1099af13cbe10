"""A compressor's encode+decode time, measured on this machine, for the performance model.

:func:`encode_decode_s` is what ``tidal.compile`` hands to the ``compression`` pass as
``PassContext.encode_decode_s`` (``(spec, parameter shapes) -> seconds``), so that ``mode="auto"``
weighs a measured time: the pass plans from :mod:`tidal.ir.compression_model` and never runs a
compressor itself. :func:`measure_encode_decode_s` times encode and decode (no communication: one
process) on random gradients of the given shapes; :func:`encode_decode_fn` is the timed step.
The payload side of the model, :func:`~tidal.ir.compression_model.compressor_cost`, lives in
``ir`` (re-exported here).

Example:
    >>> from tidal.runtime.comm.compressors.modeling import compressor_cost, encode_decode_s
    >>> encode_decode_s("powersgd:4", [(256, 512), (512,)]) > 0
    True
    >>> from tidal.runtime.comm.compressors import PowerSGD
    >>> compressor_cost(PowerSGD(4), [[(256, 512), (512,)]], 0.01).payload_bytes  # .spec() read
    (7168.0,)
"""
from __future__ import annotations

import copy
import time
from typing import Callable, Optional, Sequence, Union

import torch

from tidal.ir.compression_model import compressor_cost
from tidal.runtime.comm.compressors import make_compressor
from tidal.runtime.comm.compressors.base import Compressor
from tidal.runtime.comm.compressors.comm import LocalComm, synchronize

Shape = tuple[int, ...]

__all__ = ["compressor_cost", "encode_decode_fn", "encode_decode_s", "measure_encode_decode_s"]


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


def measure_encode_decode_s(compressor: Union[str, Compressor], shapes: Sequence[Shape], *,
                            repeats: int = 3, device: Optional[torch.device] = None,
                            seed: int = 0) -> float:
    """Median seconds of encode + decode of all ``shapes`` in one process, on a copy of
    ``compressor`` (a spec or a compressor; its state is not touched); the first (warm-up) run
    is not counted."""
    if isinstance(compressor, str):
        compressor = make_compressor(compressor)
    run = encode_decode_fn(compressor, shapes, device=device, seed=seed)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    times = sorted(times[1:])
    return times[len(times) // 2]


def encode_decode_s(spec: str, shapes: Sequence[Shape], *,
                    device: Optional[torch.device] = None) -> float:
    """Seconds of encode + decode per step of compressor ``spec`` on gradients of ``shapes``
    (the model's parameter shapes) on ``device`` (default CPU): the measurer
    ``PassContext.encode_decode_s`` expects (``(spec, shapes) -> seconds``)."""
    return measure_encode_decode_s(spec, [tuple(s) for s in shapes], device=device)
