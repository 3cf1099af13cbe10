"""Memory-bound batch sizing for data parallelism and tick-tock (Wavelet §3.2's premise).

Wavelet's tick wave leaves memory idle while its backward frees activations; the tock wave,
offset by one forward, uses it. Under a per-rank memory budget (``Cluster(memory_gb=...)``)
this module finds data parallelism's largest per-rank batch that fits (one model's training
state plus the activation peak of the memory timeline at that batch) and tick-tock's largest
per-wave batch (two replicas' training state plus the *interleaved* activation peak of two
waves, the tock offset by the forward: ``tidal.ir.memory_timeline.interleave``).

Training state is parameters, gradients and optimizer state. The optimizer's state is predicted
per parameter byte from its class (:func:`optimizer_state_factor`: SGD with momentum one copy,
Adam two) and measured after a real step by :func:`measure_step_bytes`, which also measures the
activation bytes eager autograd saves for backward (``saved_tensors_hooks``) and, on CUDA, the
allocator's peak: the predicted and measured figures sit side by side in :class:`StepBytes`.

Example:
    >>> import torch
    >>> from tidal.ir.capture import capture_train_step
    >>> from tidal.ir.memory_timeline import memory_timeline
    >>> from tidal.ir.memory_fit import fit_batches
    >>> m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
    >>> loss = torch.nn.functional.cross_entropy
    >>> def timeline(b):
    ...     x, y = torch.randn(b, 64), torch.zeros(b, dtype=torch.long)
    ...     return memory_timeline(capture_train_step(m, (x,), y, loss))
    >>> fit = fit_batches(timeline, state_bytes=3 * 67_600, budget_bytes=600_000, limit=256)
    >>> fit.dp_batch > 0 and fit.wave_batch > 0 and fit.dp_peak <= fit.budget_bytes
    True
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from tidal.ir.memory_timeline import MemoryTimeline, interleave, saved_activations
from tidal.ir.param_owners import trainable
from tidal.ir.plan import Plan

_STATE_COPIES = {"SGD": 0.0, "Adam": 2.0, "AdamW": 2.0, "Adamax": 2.0, "NAdam": 2.0,
                 "RAdam": 2.0, "Adagrad": 1.0, "Adadelta": 2.0, "RMSprop": 1.0, "Rprop": 2.0}
"""State tensors per parameter each optimizer keeps (before options that add one)."""


def optimizer_state_factor(optimizer: torch.optim.Optimizer) -> float:
    """Bytes of optimizer state per byte of parameters it updates, from its class and options
    (SGD: 1 with momentum, else 0; Adam and AdamW: 2, 3 with ``amsgrad``; RMSprop: 1, plus 1
    each for ``momentum`` and ``centered``); unknown classes count 2 (Adam-like).

    >>> import torch
    >>> p = [torch.nn.Parameter(torch.zeros(3))]
    >>> optimizer_state_factor(torch.optim.SGD(p, lr=0.1, momentum=0.9))
    1.0
    >>> optimizer_state_factor(torch.optim.Adam(p))
    2.0
    """
    name = type(optimizer).__name__
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    copies = _STATE_COPIES.get(name, 2.0)
    if name == "SGD" and group.get("momentum", 0):
        copies += 1
    if group.get("amsgrad"):
        copies += 1
    if name == "RMSprop":
        copies += bool(group.get("momentum", 0)) + bool(group.get("centered"))
    return copies


def gradient_bytes(model: torch.nn.Module) -> int:
    """One gradient of every trainable parameter (bytes)."""
    return sum(p.numel() * p.element_size() for p in trainable(model).values())


def predicted_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """One replica's training state: parameters and buffers, a gradient per trainable
    parameter and the optimizer's state (:func:`optimizer_state_factor`)."""
    trainable = gradient_bytes(model)
    held = sum(t.numel() * t.element_size() for t in list(model.parameters()) +
               list(model.buffers()))
    return int(held + trainable + optimizer_state_factor(optimizer) * trainable)


@dataclass(frozen=True)
class StepBytes(Plan):
    """One training step's memory, predicted beside measured (bytes): ``state`` (parameters,
    buffers, gradients, optimizer state), ``saved`` (activations autograd keeps for backward)
    and, on CUDA, the allocator's ``allocator_peak`` (0 elsewhere)."""

    batch: int
    predicted_state: int
    predicted_saved: int
    measured_state: int
    measured_saved: int
    allocator_peak: int = 0

    @property
    def predicted(self) -> int:
        return self.predicted_state + self.predicted_saved

    @property
    def measured(self) -> int:
        return self.measured_state + self.measured_saved

    @property
    def error(self) -> float:
        """Relative difference of the predicted total from the measured one."""
        return abs(self.predicted - self.measured) / self.measured if self.measured else 0.0

    def summary(self) -> str:
        mib = 2 ** 20
        return (f"batch {self.batch}: predicted {self.predicted / mib:.2f} MiB (state "
                f"{self.predicted_state / mib:.2f} + saved activations "
                f"{self.predicted_saved / mib:.2f}), measured {self.measured / mib:.2f} MiB "
                f"(state {self.measured_state / mib:.2f} + saved "
                f"{self.measured_saved / mib:.2f}); {self.error:.1%} apart")


def measure_step_bytes(model: torch.nn.Module, inputs: tuple, targets: Any, loss_fn: Callable,
                       make_optimizer: Callable[[Any], torch.optim.Optimizer],
                       timeline: MemoryTimeline) -> StepBytes:
    """Run one training step on a copy of ``model`` (the model itself is untouched) and
    measure its state after the step (parameters, buffers, gradients, the optimizer's state
    tensors) and the activation bytes autograd saved in the forward (each storage once,
    parameters and buffers excluded); on CUDA also the allocator's peak over the step. The
    prediction beside it: :func:`predicted_state_bytes` and ``timeline.saved_bytes``."""
    twin = copy.deepcopy(model)
    optimizer = make_optimizer(twin.parameters())
    cuda = next((p.is_cuda for p in twin.parameters()), False)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    optimizer.zero_grad(set_to_none=True)
    with saved_activations(twin) as saved:
        loss = loss_fn(twin(*inputs), targets)
    loss.backward()
    optimizer.step()
    peak = int(torch.cuda.max_memory_allocated()) if cuda else 0
    first = next((t for t in inputs if isinstance(t, torch.Tensor)), None)
    return StepBytes(batch=int(first.shape[0]) if first is not None else 0,
                     predicted_state=predicted_state_bytes(model, optimizer),
                     predicted_saved=int(timeline.saved_bytes),
                     measured_state=state_bytes(twin, optimizer, counters=False),
                     measured_saved=int(sum(saved.values())), allocator_peak=peak)


def storage_key(t: torch.Tensor) -> Optional[tuple[int, int]]:
    """(data pointer, bytes) of ``t``'s storage; None for storages without memory (fake, meta,
    empty) or tensors without a storage (sparse, subclasses)."""
    try:
        s = t.untyped_storage()
        ptr, nbytes = int(s.data_ptr()), int(s.nbytes())
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return None
    return (ptr, nbytes) if ptr and nbytes else None


def state_bytes(module: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                counters: bool = True) -> int:
    """Bytes of the training state ``module`` holds: its parameters, buffers and gradients and
    the tensors in ``optimizer.state`` (momentum, Adam's moments; ``counters``: also the
    0-dimensional step counters), each storage counted once (tied weights, a gradient that is
    a view of a flat buffer).

    >>> m = torch.nn.Linear(4, 2)                       # 10 floats
    >>> state_bytes(m)
    40
    >>> m(torch.randn(3, 4)).sum().backward()
    >>> state_bytes(m)                                  # + the gradients
    80
    """
    tensors: list[torch.Tensor] = list(module.parameters()) + list(module.buffers())
    tensors += [p.grad for p in module.parameters() if p.grad is not None]
    if optimizer is not None:
        tensors += [v for state in optimizer.state.values() for v in state.values()
                    if isinstance(v, torch.Tensor) and (counters or v.dim() > 0)]
    seen: dict[int, int] = {}
    for key in filter(None, map(storage_key, tensors)):
        seen[key[0]] = max(seen.get(key[0], 0), key[1])
    return sum(seen.values())


@dataclass(frozen=True)
class MemoryFit(Plan):
    """The batches a per-rank memory budget allows (bytes): data parallelism's largest
    per-rank batch (``dp_batch``; ``dp_peak``: one replica's state plus its activation peak)
    and tick-tock's largest per-wave batch (``wave_batch``; ``wave_peak``: two replicas' state,
    the tock gradient kept for Eq. 1 and the interleaved activation peak of the two waves).
    0: not even one sample fits."""

    budget_bytes: int
    state_bytes: int
    dp_batch: int
    dp_peak: int
    wave_batch: int
    wave_peak: int

    def summary(self) -> str:
        mib = 2 ** 20
        return (f"budget {self.budget_bytes / mib:.1f} MiB/rank: data parallel batch "
                f"{self.dp_batch}/rank (peak {self.dp_peak / mib:.1f} MiB), tick-tock "
                f"{self.wave_batch}/wave/rank, {2 * self.wave_batch} per rank per step (peak "
                f"{self.wave_peak / mib:.1f} MiB with two replicas)")


def largest_fitting(fits: Callable[[int], bool], limit: int) -> int:
    """The largest batch in ``1..limit`` for which ``fits`` holds, assuming it holds for every
    smaller batch (memory grows with the batch): doubling, then bisection. 0 if 1 does not fit.

    >>> largest_fitting(lambda b: 3 * b <= 100, limit=1000)
    33
    """
    if limit < 1 or not fits(1):
        return 0
    lo = 1
    while lo < limit and fits(min(2 * lo, limit)):
        lo = min(2 * lo, limit)
    hi = min(2 * lo, limit + 1)  # fits(lo), not fits(hi) (or hi past the limit)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def fit_batches(timeline_at: Callable[[int], MemoryTimeline], state_bytes: int,
                budget_bytes: int, limit: int = 1 << 16, wave_extra_bytes: int = 0
                ) -> MemoryFit:
    """:class:`MemoryFit` for one replica's ``state_bytes`` under ``budget_bytes``:
    ``timeline_at(b)`` is the memory timeline of one step at batch ``b`` (computed at most a
    few dozen times: doubling and bisection per wave kind, each batch once).
    ``wave_extra_bytes``: what tick-tock keeps besides two replicas (tidal's keeps the tock's
    last gradient for the tick's Eq. 1 average: one gradient's bytes)."""
    cache: dict[int, MemoryTimeline] = {}

    def tl(b: int) -> MemoryTimeline:
        if b not in cache:
            cache[b] = timeline_at(b)
        return cache[b]

    def dp_peak(b: int) -> int:
        return state_bytes + tl(b).peak_bytes

    def wave_peak(b: int) -> int:
        t = tl(b)
        return 2 * state_bytes + wave_extra_bytes + interleave(t, t.forward_us).peak_sum

    dp = largest_fitting(lambda b: dp_peak(b) <= budget_bytes, limit)
    wave = largest_fitting(lambda b: wave_peak(b) <= budget_bytes, limit)
    return MemoryFit(budget_bytes=int(budget_bytes), state_bytes=int(state_bytes), dp_batch=dp,
                     dp_peak=dp_peak(dp) if dp else 0, wave_batch=wave,
                     wave_peak=wave_peak(wave) if wave else 0)


def rows_at(values: Any, batch: int) -> Any:
    """``values`` (tensors with the batch in dim 0, nested in tuples/lists/dicts) with
    ``batch`` rows, the example rows repeated in order (a batch of any size from an example).

    >>> rows_at((torch.arange(3),), 5)
    (tensor([0, 1, 2, 0, 1]),)
    """
    if isinstance(values, torch.Tensor):
        if values.dim() == 0:
            return values
        index = torch.arange(batch, device=values.device) % values.shape[0]
        return values.index_select(0, index)
    if isinstance(values, (tuple, list)):
        return type(values)(rows_at(v, batch) for v in values)
    if isinstance(values, dict):
        return {k: rows_at(v, batch) for k, v in values.items()}
    return values


def optional_budget(memory_gb: Optional[float]) -> Optional[int]:
    """``Cluster.memory_gb`` in bytes (None: no budget)."""
    return None if memory_gb is None else int(memory_gb * 2 ** 30)
