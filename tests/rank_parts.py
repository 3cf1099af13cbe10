"""Several multi-rank cases of a test module in one spawned job (the ranks start once, not once
per case; each start costs seconds of process start-up and imports).

    results = spawn_parts(2, [("bn", _bn_buffers, ()), ("composed", _composed, ())])
    (mean0, ...), (mean1, ...) = results["bn"]      # what spawn(_bn_buffers, 2) returned

Each part is a module-level function ``fn(rank, world, *args)`` (as ``spawn`` takes); they run
in the order given, each from torch's default dtype (float32) and grad mode, as a fresh process
would. A part that raises on a rank ends the whole job with ``RankError`` naming the part and
the rank (the other ranks are terminated, as ``spawn`` does): the job never hangs, and every test
reading it fails with that error.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from tidal.runtime.distributed import spawn

Part = tuple  # (name, fn, args)


def run_parts(rank: int, world: int, parts: Sequence[Part]) -> dict:
    """On every rank: {name: fn(rank, world, *args)} for each part, in order."""
    out = {}
    for name, fn, args in parts:
        torch.set_default_dtype(torch.float32)
        torch.set_grad_enabled(True)
        try:
            out[name] = fn(rank, world, *args)
        except Exception as e:
            raise RuntimeError(f"part {name!r} ({fn.__name__}): {type(e).__name__}: {e}") from e
    return out


def spawn_parts(world: int, parts: Sequence[Part], **spawn_kw: Any) -> dict[str, list]:
    """Run ``parts`` in one ``spawn`` of ``world`` ranks: {name: the ranks' results, in rank
    order} (per part, what ``spawn(fn, world, *args)`` returned)."""
    names = [name for name, _, _ in parts]
    assert len(set(names)) == len(names), names
    results = spawn(run_parts, world, list(parts), **spawn_kw)
    return {name: [r[name] for r in results] for name in names}


def part(fn: Callable, *args: Any, name: str | None = None) -> Part:
    """A part running ``fn(rank, world, *args)``, named after ``fn`` unless ``name`` is given."""
    return (name or fn.__name__, fn, args)
