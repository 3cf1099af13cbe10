"""tick_tock's reference for a training loop, in plain PyTorch: Wavelet's Eq. 1 with two model
copies and the user's optimizers on each.

A global batch is cut in two halves: the tick copy trains on the first, the tock copy on the
second (on N ranks each half is N equal shards, and the mean over a wave's ranks of its
shards' mean-loss gradients is the gradient of the half's mean loss). ``backward(x, y, scale,
sync)`` accumulates each copy's gradient of ``scale * loss``; at a synchronized call the tick's
accumulated gradient is averaged with the tock's of the previous synchronized call, the tock's
with the tick's of this one (Eq. 1; the very first tick alone), and each is *added* to its
copy's ``.grad``, as ``Compiled.backward`` under tick_tock does. The loop builds its
optimizers on both copies (:meth:`Eq1Reference.both`) and steps and zeroes all of them; it
clips each copy by its own norm (:meth:`Eq1Reference.clip_grad_norm_`).

Freezing (:meth:`Eq1Reference.change`, applied to both copies, as tick_tock's tock replica
follows the model's ``requires_grad``): a frozen parameter gets no gradient in either copy, so
it keeps its value in both replicas (the optimizers skip a parameter whose ``.grad`` is None).
Gradients are kept by parameter name: a wave averages a parameter with the other wave's kept
gradient where that has one, and a parameter trained again after being frozen takes its own
gradient alone at its first tick (the tock gradient kept from the frozen steps has none for
it), as every parameter does on the very first tick.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable, Optional

import torch


class Eq1Reference:
    """Eq. 1 over two copies of ``model`` (see the module docstring); ``tick`` is the one a
    compiled model's parameters are compared with, ``tock`` its tock replica's."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable, shards: int = 1):
        self.tick, self.tock = copy.deepcopy(model), copy.deepcopy(model)
        self.loss_fn = loss_fn
        self.shards = shards
        """The ranks: each half is cut into this many shards, each shard's mean-loss gradient
        computed alone and the shards' averaged, as the wave's ranks do (equal in exact
        arithmetic to the half's; in bf16 the rounding is the ranks')."""
        self.prev_tock: Optional[dict[str, torch.Tensor]] = None
        self.acc: dict[str, Optional[dict[str, torch.Tensor]]] = {"T": None, "K": None}
        self._sync = True

    def parameters(self):
        return self.tick.parameters()

    def change(self, what: Callable[[torch.nn.Module], Any]) -> None:
        """``what(copy)`` on both copies (freezing, unfreezing, ``eval()``)."""
        for model in (self.tick, self.tock):
            what(model)

    def both(self, make: Callable[[Any], list]) -> list:
        """``make(parameters)`` (a list of optimizers) on the tick copy, then on the tock's."""
        return make(self.tick.parameters()) + make(self.tock.parameters())

    @contextlib.contextmanager
    def no_sync(self):
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def _grads(self, model, x, y, scale) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The gradients of ``scale * loss`` by name (trainable parameters), and the loss (the
        mean over :attr:`shards`)."""
        named = {n: p for n, p in model.named_parameters() if p.requires_grad}
        sums, losses = None, []
        for xs, ys in zip(x.tensor_split(self.shards), y.tensor_split(self.shards)):
            loss = self.loss_fn(model(xs), ys)
            grads = torch.autograd.grad(loss if scale is None else loss * scale,
                                        list(named.values()))
            sums = list(grads) if sums is None else [a + g for a, g in zip(sums, grads)]
            losses.append(loss.detach())
        return ({n: g / self.shards for n, g in zip(named, sums)},
                sum(losses) / self.shards)

    def backward(self, x, y, scale=None, sync=None) -> torch.Tensor:
        """One (micro-)batch; ``sync`` (default: outside :meth:`no_sync`) applies Eq. 1.
        Returns the batch's loss (the mean of the halves')."""
        half = x.shape[0] // 2
        losses = []
        for wave, model, rows in (("T", self.tick, slice(0, half)),
                                  ("K", self.tock, slice(half, None))):
            grads, loss = self._grads(model, x[rows], y[rows], scale)
            kept = self.acc[wave]
            self.acc[wave] = grads if kept is None else _mean_with(grads, kept, 1.0)
            losses.append(loss)
        if self._sync if sync is None else sync:
            self._apply()
        return sum(losses) / 2

    def _apply(self) -> None:
        tick, tock = self.acc["T"], self.acc["K"]
        prev = self.prev_tock
        g_tick = _mean_with(tick, prev or {}, 0.5)
        g_tock = _mean_with(tock, tick, 0.5)
        for model, grads in ((self.tick, g_tick), (self.tock, g_tock)):
            for n, p in model.named_parameters():
                if p.requires_grad and n in grads:
                    g = grads[n]
                    p.grad = g.clone() if p.grad is None else p.grad + g
        self.prev_tock = tock
        self.acc = {"T": None, "K": None}

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Each copy clipped by its own norm; the tick's norm."""
        norm = torch.nn.utils.clip_grad_norm_(self.tick.parameters(), max_norm, norm_type)
        torch.nn.utils.clip_grad_norm_(self.tock.parameters(), max_norm, norm_type)
        return norm


def _mean_with(grads: dict[str, torch.Tensor], other: dict[str, torch.Tensor],
               weight: float) -> dict[str, torch.Tensor]:
    """``weight * (g + other[n])`` for each ``grads[n]`` that ``other`` has, ``g`` where it
    has none (weight 0.5: Eq. 1's average; 1.0: a sum)."""
    return {n: weight * (g + other[n]) if n in other else g for n, g in grads.items()}
