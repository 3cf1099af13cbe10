"""Accordion (dissertation ch. 3, Algorithm 1): low compression in critical regimes, high elsewhere.

The gradients are accumulated over a window (an epoch, or some steps). At the end of a window,
per key (a layer; a tensor for PowerSGD), with ``Delta_curr`` this window's accumulated gradient
and ``Delta_prev`` the previous window's::

    critical  iff  | ||Delta_prev|| - ||Delta_curr|| | / ||Delta_prev|| >= eta   (eta = 0.5)
              or   the learning rate decays next window (gamma_next < gamma_curr)

and a critical key gets ``low`` compression (e.g. PowerSGD rank 4), the others ``high`` (rank 1).
The first window, with no previous one, is critical (early training is). The decision is made
on rank 0 and broadcast, so all ranks switch together. :class:`AccordionBatch` is the batch-size
variant: the whole model's norm picks ``B_low`` (critical) or ``B_high``, with the learning rate
scaled linearly with the batch. "A decay ahead" needs the schedule: :class:`LrLookahead` reads
it from a function ``step -> lr``, peeks a torch scheduler without advancing it, or replays the
decays a ``CompressionPlan`` recorded from the schedule given to the ``compression`` pass.

Example:
    >>> from tidal.runtime.comm.accordion import Accordion
    >>> acc = Accordion(low=4, high=1)
    >>> [acc.decide_from_norms({"w": n})["w"] for n in (10.0, 4.0, 3.5, 3.4)]
    [4, 4, 1, 1]
    >>> acc.decide_from_norms({"w": 3.3}, lr_now=0.1, lr_next=0.01)["w"]   # decay ahead
    4
"""
from __future__ import annotations

import copy
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from tidal.runtime.distributed import collective_device, group_size

DEFAULT_ETA = 0.5


def is_critical(prev_norm: Optional[float], curr_norm: float, eta: float = DEFAULT_ETA,
                lr_now: Optional[float] = None, lr_next: Optional[float] = None) -> bool:
    """Algorithm 1's test: ``|prev - curr| / prev >= eta`` or a learning-rate decay ahead. No
    previous window (None) is critical; a previous norm of 0 is critical iff ``curr`` is not."""
    if lr_now is not None and lr_next is not None and lr_next < lr_now:
        return True
    if prev_norm is None:
        return True
    if prev_norm == 0:
        return curr_norm != 0
    return abs(prev_norm - curr_norm) / prev_norm >= eta


def _check_eta(eta: float) -> float:
    if not (isinstance(eta, (int, float)) and eta > 0):
        raise ValueError(f"Accordion eta={eta!r}: the detection threshold must be > 0")
    return float(eta)


def _broadcast_flags(flags: list[bool], group: Optional[dist.ProcessGroup]) -> list[bool]:
    """Rank 0's flags on every rank (unchanged with no process group); the flags travel on
    the group's device (NCCL: the current GPU)."""
    if group_size(group) == 1:
        return flags
    t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32,
                     device=collective_device(group))
    dist.broadcast(t, src=dist.get_global_rank(group, 0) if group is not None else 0,
                   group=group)
    return [bool(v) for v in t.tolist()]


def peek_scheduler_lrs(scheduler: Any, calls: int) -> list[float]:
    """The learning rate (first parameter group) after each of the next ``calls`` calls of
    ``scheduler.step()``, found by stepping it and restoring its state and its optimizer's
    parameter groups: the scheduler and the optimizer are left as they were. Raises
    ``ValueError`` for ``ReduceLROnPlateau``, whose future depends on metrics not yet seen."""
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ValueError("Accordion cannot look ahead of ReduceLROnPlateau (its decays depend "
                         "on future metrics); give a schedule function instead")
    optimizer = getattr(scheduler, "optimizer", None)
    if optimizer is None or not hasattr(scheduler, "state_dict"):
        raise TypeError(f"Accordion lookahead: {type(scheduler).__name__} is not a torch "
                        "learning-rate scheduler (no .optimizer / .state_dict)")
    saved = copy.deepcopy(scheduler.state_dict())
    groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
              for g in optimizer.param_groups]
    lrs = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")       # "scheduler.step() before optimizer.step()"
            for _ in range(calls):
                scheduler.step()
                lrs.append(float(optimizer.param_groups[0]["lr"]))
    finally:
        scheduler.load_state_dict(saved)
        for g, kept in zip(optimizer.param_groups, groups):
            g.update(kept)
    return lrs


class LrLookahead:
    """Where Accordion learns of a learning-rate decay *ahead*: the lowest learning rate the
    next window of ``interval`` optimizer steps will use. Built from a schedule function
    ``step -> lr`` (``step``: the 0-based index of an optimizer step) with
    :meth:`from_function`, from a torch scheduler that is stepped once every
    ``steps_per_call`` optimizer steps with :meth:`from_scheduler` (peeked without being
    advanced, :func:`peek_scheduler_lrs`), or from the decays a plan recorded with
    :meth:`from_decays` (which sees no further than the plan's horizon).

    Example:
        >>> ahead = LrLookahead.from_function(lambda step: 0.1 if step < 6 else 0.01)
        >>> ahead.now_and_next(steps_done=3, interval=3, current_lr=0.1)
        (0.1, 0.1)
        >>> ahead.now_and_next(6, 3, 0.1)       # steps 6-8 run at 0.01: a decay ahead
        (0.1, 0.01)
        >>> planned = LrLookahead.from_decays([(6, 0.1, 0.01)], horizon=12)   # the same, as data
        >>> planned.now_and_next(3, 3, 0.1), planned.now_and_next(6, 3, 0.1)
        ((0.1, 0.1), (0.1, 0.01))
        >>> planned.now_and_next(12, 3, 0.01) is None        # beyond the horizon: unknown
        True
    """

    def __init__(self, ahead: Callable[[int, int], Sequence[float]],
                 now: Optional[Callable[[int], float]] = None):
        self._ahead, self._now = ahead, now
        self.horizon: Optional[int] = None
        self._decays: Optional[dict[int, tuple[float, float]]] = None

    @classmethod
    def from_function(cls, schedule: Callable[[int], float]) -> "LrLookahead":
        """Look ahead in ``schedule(step) -> lr`` (which the training loop also applies)."""
        if not callable(schedule):
            raise TypeError(f"Accordion lr schedule must be callable step -> lr, got "
                            f"{type(schedule).__name__}")
        return cls(lambda done, n: [float(schedule(s)) for s in range(done, done + n)],
                   lambda done: float(schedule(max(0, done - 1))))

    @classmethod
    def from_scheduler(cls, scheduler: Any, steps_per_call: int = 1) -> "LrLookahead":
        """Look ahead in a torch scheduler stepped once per ``steps_per_call`` optimizer
        steps (1: after every step; an epoch's steps for a per-epoch scheduler)."""
        if isinstance(steps_per_call, bool) or not isinstance(steps_per_call, int) \
                or steps_per_call < 1:
            raise ValueError(f"Accordion lookahead: steps_per_call={steps_per_call!r} must be "
                             "an integer >= 1")
        peek_scheduler_lrs(scheduler, 0)      # type check now, not at the first window
        return cls(lambda done, n: peek_scheduler_lrs(scheduler,
                                                      max(1, math.ceil(n / steps_per_call))))

    @classmethod
    def from_decays(cls, decays: Sequence[tuple[int, float, float]], horizon: int
                    ) -> "LrLookahead":
        """Replay a schedule recorded as data (``CompressionPlan.accordion_lr_decays``): at
        each window end ``steps_done`` listed, ``(steps_done, lr_now, lr_next)`` with a decay
        ahead; at the others up to ``horizon`` optimizer steps, no decay ahead."""
        ahead = cls(lambda done, n: [])
        ahead._decays = {int(done): (float(now), float(nxt)) for done, now, nxt in decays}
        ahead.horizon = int(horizon)
        return ahead

    def now_and_next(self, steps_done: int, interval: int, current_lr: float
                     ) -> Optional[tuple[float, float]]:
        """``(lr_now, lr_next)`` for Algorithm 1 at the end of a window: the rate of the last
        step (the schedule's, else ``current_lr``, the optimizer's) and the lowest rate of
        optimizer steps ``steps_done .. steps_done + interval - 1``; None when that window
        lies beyond the lookahead's horizon (a recorded schedule)."""
        if self.horizon is not None and steps_done + interval > self.horizon:
            return None
        if self._decays is not None:
            return self._decays.get(steps_done, (float(current_lr), float(current_lr)))
        now = self._now(steps_done) if self._now is not None else float(current_lr)
        return now, min(self._ahead(steps_done, interval))


class WindowNorms:
    """Per-key gradient accumulators over the current window, and last window's norms."""

    def __init__(self) -> None:
        self.accum: dict[str, torch.Tensor] = {}
        self.prev: dict[str, float] = {}

    def add(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Add one step's gradients (name -> tensor) to the window."""
        for k, g in grads.items():
            g = g.detach().to(torch.float32)
            if k in self.accum:
                self.accum[k] += g
            else:
                self.accum[k] = g.clone()

    def norms(self) -> dict[str, float]:
        """``||Delta_curr||`` per key."""
        return {k: float(torch.linalg.vector_norm(v)) for k, v in self.accum.items()}

    def close(self, norms: Mapping[str, float]) -> None:
        """End the window: ``norms`` become the previous ones; accumulators restart."""
        self.prev.update(norms)
        self.accum = {}

    def state_dict(self) -> dict[str, Any]:
        return {"accum": {k: v.clone() for k, v in self.accum.items()}, "prev": dict(self.prev)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.accum = {k: v.clone() for k, v in state["accum"].items()}
        self.prev = dict(state["prev"])


class Accordion:
    """Per-key switching between ``low`` and ``high`` compression levels (e.g. PowerSGD ranks
    4 and 1, or Top-K fractions 0.1 and 0.01). ``history`` lists each window's critical keys."""

    def __init__(self, low: Any, high: Any, *, eta: float = DEFAULT_ETA,
                 group: Optional[dist.ProcessGroup] = None):
        self.low, self.high = low, high
        self.eta = _check_eta(eta)
        self.group = group
        self.window = WindowNorms()
        self.history: list[tuple[str, ...]] = []

    def accumulate(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Add one step's (synchronized) gradients to the current window."""
        self.window.add(grads)

    def decide(self, lr_now: Optional[float] = None, lr_next: Optional[float] = None
               ) -> dict[str, Any]:
        """End the window: the level of every key accumulated in it (see module docstring)."""
        return self.decide_from_norms(self.window.norms(), lr_now, lr_next)

    def decide_from_norms(self, norms: Mapping[str, float], lr_now: Optional[float] = None,
                          lr_next: Optional[float] = None) -> dict[str, Any]:
        """Decide from this window's norms (key -> ``||Delta_curr||``), on rank 0, broadcast."""
        keys = sorted(norms)
        flags = [is_critical(self.window.prev.get(k), norms[k], self.eta, lr_now, lr_next)
                 for k in keys]
        flags = _broadcast_flags(flags, self.group)
        self.window.close(norms)
        self.history.append(tuple(k for k, f in zip(keys, flags) if f))
        return {k: self.low if f else self.high for k, f in zip(keys, flags)}

    def apply(self, compressor: Any, levels: Mapping[str, Any]) -> None:
        """Set each key's level on ``compressor`` (anything with ``set_level(key, level)``)."""
        for k, lvl in levels.items():
            compressor.set_level(k, lvl)

    def state_dict(self) -> dict[str, Any]:
        """Accumulators, previous norms and the decision history."""
        return {"window": self.window.state_dict(), "history": [list(h) for h in self.history]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        self.window.load_state_dict(state["window"])
        self.history = [tuple(h) for h in state["history"]]


@dataclass(frozen=True)
class BatchChoice:
    """The batch size (per step, global) and learning rate for the next window."""

    batch: int
    lr: float
    critical: bool


class AccordionBatch:
    """The batch-size variant: ``b_low`` in critical regimes, ``b_high`` elsewhere, from the
    whole model's accumulated-gradient norm; the learning rate is ``lr_low * batch / b_low``."""

    def __init__(self, b_low: int, b_high: int, lr_low: float, *, eta: float = DEFAULT_ETA,
                 group: Optional[dist.ProcessGroup] = None):
        for name, b in (("b_low", b_low), ("b_high", b_high)):
            if isinstance(b, bool) or not isinstance(b, int) or b < 1:
                raise ValueError(f"AccordionBatch({name}={b!r}): must be an integer >= 1")
        if b_high < b_low:
            raise ValueError(f"AccordionBatch(b_low={b_low}, b_high={b_high}): b_high < b_low")
        if not lr_low > 0:
            raise ValueError(f"AccordionBatch(lr_low={lr_low!r}): must be > 0")
        self.b_low, self.b_high, self.lr_low = b_low, b_high, float(lr_low)
        self._acc = Accordion(b_low, b_high, eta=eta, group=group)

    @property
    def history(self) -> list[tuple[str, ...]]:
        """Per window: ``("model",)`` when it was critical, else ``()``."""
        return self._acc.history

    def accumulate(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Add one step's gradients to the window."""
        self._acc.accumulate(grads)

    def decide(self, lr_scale_now: Optional[float] = None,
               lr_scale_next: Optional[float] = None) -> BatchChoice:
        """End the window; ``lr_scale_*``: the schedule's factor now and next window (a decay
        ahead is critical)."""
        norms = self._acc.window.norms()
        return self.decide_from_norm(math.sqrt(sum(n * n for n in norms.values())),
                                     lr_scale_now, lr_scale_next)

    def decide_from_norm(self, norm: float, lr_scale_now: Optional[float] = None,
                         lr_scale_next: Optional[float] = None) -> BatchChoice:
        """Decide from the whole model's window norm."""
        batch = self._acc.decide_from_norms({"model": norm}, lr_scale_now,
                                            lr_scale_next)["model"]
        scale = 1.0 if lr_scale_next is None else lr_scale_next
        return BatchChoice(batch, self.lr_low * scale * batch / self.b_low, batch == self.b_low)

    def state_dict(self) -> dict[str, Any]:
        """The controller's state."""
        return self._acc.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        self._acc.load_state_dict(state)
