"""Bringing a burst rank's stale copies up to date: the state a user saves is the model's.

Under ``burst_parallel`` a rank updates only the layers it runs; its copies of the others are
stale and never read by its steps (``tidal.runtime.programs.burst``). :func:`refresh_replicas`
brings every copy up to date from the layer's first owner, in place (a collective: every rank
calls it, in the same order), so ``model.state_dict()`` is the model's current state on every
rank and a forward traced again (in another training mode) reads current weights.
:class:`StaleGuard` makes ``model.state_dict()`` raise, naming the way out, while a rank holds
stale copies, instead of returning them.

Example:
    >>> import torch
    >>> from tidal.runtime.programs.burst_refresh import replicated_elsewhere
    >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    >>> replicated_elsewhere(gm, {"0.weight": (0,), "0.bias": (0, 1)}, world=2)
    [('0.weight', 0)]
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist
import torch.fx as fx

from tidal.ir.errors import TidalError

Ranks = tuple[int, ...]


class StaleStateError(TidalError, RuntimeError):
    """``state_dict()`` of a model whose copies on this rank are stale."""


def replicated_elsewhere(gm: fx.GraphModule, param_ranks: Mapping[str, Ranks],
                         world: int) -> list[tuple[str, int]]:
    """(name, source rank) of each parameter and buffer of ``gm`` that not every rank holds
    current (owned by fewer than ``world`` ranks), in ``gm``'s order; the source is its first
    owner."""
    seen: set[int] = set()
    out = []
    for name, t in [*gm.named_parameters(), *gm.named_buffers()]:
        if id(t) in seen:
            continue
        seen.add(id(t))
        ranks = param_ranks.get(name)
        if ranks is not None and len(ranks) < world:
            out.append((name, min(ranks)))
    return out


def refresh_replicas(gm: fx.GraphModule, param_ranks: Mapping[str, Ranks], world: int,
                     group: Optional[dist.ProcessGroup] = None) -> int:
    """Broadcast each tensor :func:`replicated_elsewhere` names from its first owner into
    every rank's copy, in place (collective); returns the bytes this rank received or sent."""
    tensors = dict([*gm.named_parameters(), *gm.named_buffers()])
    moved = 0
    for name, source in replicated_elsewhere(gm, param_ranks, world):
        t = tensors[name]
        dist.broadcast(t.data, src=source, group=group)
        moved += t.numel() * t.element_size()
    return moved


class StaleGuard:
    """A ``state_dict`` pre-hook on the user's model that raises :class:`StaleStateError`
    while ``stale()`` says this rank holds stale copies (``names()``: which)."""

    def __init__(self, stale: Callable[[], bool], names: Callable[[], list[str]]):
        self.stale, self.names = stale, names
        self._watched: Optional[int] = None

    def watch(self, model: torch.nn.Module) -> None:
        """Hook ``model`` (once)."""
        if self._watched != id(model):
            model.register_state_dict_pre_hook(self)
            self._watched = id(model)

    def __call__(self, module: torch.nn.Module, prefix: str, keep_vars: bool) -> Any:
        if prefix == "" and self.stale():
            names = self.names()
            rank = dist.get_rank() if dist.is_initialized() else 0
            raise StaleStateError(
                f"model.state_dict() on rank {rank} after a burst_parallel step: this rank "
                f"does not run {len(names)} tensors' layers, so its copies of them are stale "
                f"(e.g. {', '.join(repr(n) for n in names[:3])}). Call compiled.state_dict() "
                f"on every rank (a collective: it brings the copies up to date from their "
                f"owners, then returns the model's state), or save this rank's owner-only "
                f"share with compiled.executor.state_dict(compiled.graph_module, optimizer)")
        return None
