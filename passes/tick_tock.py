"""``tick_tock``: Wavelet's tick-tock scheduling of data-parallel training (§3.2, App. B.1).

Data-parallel training is duplicated into a tick wave and a tock wave, each with its own
parameter replica on every rank. The tock wave starts one forward after the tick wave (the
offset is the predicted forward time from the memory timeline of the captured training step,
``tidal.ir.memory_timeline``), so the tock's forward — memory climbing to its peak — runs while
the tick's backward frees memory, and vice versa. Each wave averages its local gradient with
the other wave's latest one, ``g_m = (g_m + g_{m-1}) / 2`` (Eq. 1), all-reduces it within its
wave and updates its own replica; by Lemma 1 this is synchronous SGD over 2N shards.

The schedule is explicit data (``T:F0 T:B0 T:A0 T:U0`` in the tick lane, ``K:F1 K:B1 ...``
in the tock lane), executed by the program ``tidal.runtime.programs.tick_tock`` (tick and tock
compute streams, the waves' syncs on the comm stream); the
dump draws the memory timeline (tick, tock and their sum) and a Gantt chart.

Under a memory budget (``tidal.Cluster(memory_gb=...)``; a model on a GPU: the device's free
memory) the pass also sizes the batches
(``tidal.ir.memory_fit``): data parallelism's largest per-rank batch that fits (one replica's
parameters, gradients and optimizer state plus the activation peak), and tick-tock's largest
per-wave batch (two replicas plus the interleaved peak: the tock's peak lands while the tick's
activations are freed); it measures one wave step at the plan's batch (its state after a real
step, the activations autograd saves) beside the prediction, and says in its notes when the
batch it was given does not fit.

Example:
    >>> import torch, tidal
    >>> from tidal.passes.tick_tock import tick_tock_schedule
    >>> s = tick_tock_schedule(ranks=1, fwd_us=1.0, bwd_us=2.0, steps=2)
    >>> s.line(0)
    'T:F0 T:B0 K:F1 K:B1 T:A0 T:U0 T:F2 T:B2 K:A1 K:U1 K:F3 K:B3 T:A2 T:U2 K:A3 K:U3'
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx as fx

from tidal.ir import cost
from tidal.ir.capture import buffer_writes, refuse_buffer_writes
from tidal.ir.memory_fit import (MemoryFit, StepBytes, fit_batches, gradient_bytes,
                                 measure_step_bytes, optional_budget, predicted_state_bytes,
                                 rows_at)
from tidal.ir.memory_timeline import interleave, memory_timeline, timeline_svg
from tidal.ir.pass_api import Pass, PassContext, PassResult
from tidal.ir.plans.tick_tock import TickTockPlan
from tidal.ir.schedule import Action, Schedule, split_batch

_NAME = "tick_tock"


def tick_tock_schedule(ranks: int, fwd_us: float, bwd_us: float, allreduce_us: float = 0.0,
                       steps: int = 1) -> Schedule:
    """The tick-tock schedule of ``steps`` steps (2 iterations each) on ``ranks`` ranks: the
    tick lane runs even iterations, the tock lane odd ones; a tock forward starts when the
    tick's forward of the same step ends, a tick forward when the previous tock forward ended
    and its own last update is done (App. B.1.1); ``A m`` (Eq. 1 averaging and the wave's
    all-reduce) waits for the other wave's gradient."""
    if ranks < 1:
        raise ValueError(f"tick_tock_schedule(ranks={ranks!r}): need at least one rank")
    if steps < 1:
        raise ValueError(f"tick_tock_schedule(steps={steps!r}): need at least one step")
    acts: list[Action] = []
    f_end = {-1: 0.0}
    b_end: dict[int, float] = {-1: 0.0}
    u_end = {"T": 0.0, "K": 0.0}
    for m in range(2 * steps):
        wave = "T" if m % 2 == 0 else "K"
        f0 = max(f_end[m - 1], u_end[wave])
        acts.append(Action("F", m, wave=wave, lane=wave, start_us=f0, dur_us=fwd_us))
        f_end[m] = f0 + fwd_us
        # the backward may only start once the other lane's forward of the pair is issued
        b0 = f_end[m]
        acts.append(Action("B", m, wave=wave, lane=wave, start_us=b0, dur_us=bwd_us))
        b_end[m] = b0 + bwd_us
        a0 = max(b_end[m], b_end[m - 1] if m > 0 else 0.0)
        acts.append(Action("A", m, wave=wave, lane=wave, start_us=a0, dur_us=allreduce_us))
        acts.append(Action("U", m, wave=wave, lane=wave, start_us=a0 + allreduce_us))
        u_end[wave] = a0 + allreduce_us
    acts.sort(key=lambda a: (a.start_us, a.lane != "T", a.batch))
    sched_ranks = tuple(tuple(acts) for _ in range(ranks))
    gang = 2 * steps * (fwd_us + bwd_us + allreduce_us)
    return Schedule(name=_NAME, ranks=sched_ranks, partitions=1, batches=2 * steps,
                    data_parallel=True,
                    notes=(("offset_us", float(fwd_us)), ("gang_us", float(gang))))


MAX_FIT_BATCH = 1 << 14
"""The largest batch the memory-bound sizing tries."""


_BUFFER_WHY = ("each wave runs the forward on its own shard with its own replica, so the "
               "model's buffer would see only the tick wave's half of the batch (BatchNorm "
               "statistics are the one exception: averaged per wave, as data parallelism does)")


class TickTock(Pass):
    """Wavelet tick-tock data parallelism: tick and tock waves with separate replicas, the tock
    one forward behind, cross-wave gradient averaging (Eq. 1) and a per-wave all-reduce.

    Options: ``ranks`` (data-parallel ranks the plan is for; default the cluster's GPUs).
    """

    name = _NAME
    training_only = True
    exclusive = "parallelism"
    changes_update = ("its update is not the SGD step of the batch: each wave averages its "
                      "gradient with the other wave's previous one (Wavelet Eq. 1)")

    def __init__(self, ranks: Optional[int] = None):
        if ranks is not None and (not isinstance(ranks, int) or ranks < 1):
            raise ValueError(f"tick_tock: ranks={ranks!r}; need a positive integer")
        self.ranks = ranks

    def why_not(self, gm: fx.GraphModule, ctx: PassContext) -> str:
        shards = 2 * (self.ranks or ctx.cluster.gpus)
        writes = buffer_writes(gm)
        if writes:
            return f"buffer {writes[0].buffer!r} is updated in place in forward ({_BUFFER_WHY})"
        return "" if ctx.batch_size % shards == 0 else \
            f"batch {ctx.batch_size} is not divisible into {shards} wave shards"

    def _memory(self, ctx: PassContext, inputs: tuple, targets: Any, batch: int,
                notes: list) -> tuple[Optional[MemoryFit], Optional[StepBytes]]:
        """Under ``ctx.cluster.memory_gb`` (or, for a model on a GPU, the device's free
        memory): the batches the budget allows (data parallelism's
        per rank, tick-tock's per wave: :func:`tidal.ir.memory_fit.fit_batches` on memory
        timelines of the step at each batch tried) and one wave step at this plan's batch
        measured beside its prediction; notes say both, and whether this batch fits."""
        if ctx.model is None or ctx.loss_fn is None or targets is None:
            return None, None
        budget = optional_budget(ctx.cluster.memory_gb)
        device = next((t.device for t in ctx.model.parameters()), torch.device("cpu"))
        if budget is None and device.type == "cuda":  # the device's free memory
            budget = int(torch.cuda.mem_get_info(device)[0])  # pragma: no cover - needs a GPU
        if budget is None:
            return None, None
        from tidal.ir.capture import capture_train_step

        make = ctx.optimizer if callable(ctx.optimizer) else \
            (lambda ps: torch.optim.SGD(ps, lr=0.1))
        state = predicted_state_bytes(ctx.model, make(list(ctx.model.parameters())))

        def timeline_at(b: int) -> Any:
            ctx.log(f"tick_tock: memory timeline at batch {b}")
            step = capture_train_step(ctx.model, rows_at(inputs, b), rows_at(targets, b),
                                      ctx.loss_fn)
            return memory_timeline(step, ctx.cluster)

        fit = fit_batches(timeline_at, state, budget, limit=MAX_FIT_BATCH,
                          wave_extra_bytes=gradient_bytes(ctx.model))
        measured = measure_step_bytes(ctx.model, rows_at(inputs, batch),
                                      rows_at(targets, batch), ctx.loss_fn, make,
                                      timeline_at(batch))
        notes += [f"memory: {fit.summary()}", f"memory of one wave step: {measured.summary()}"]
        if batch > fit.wave_batch:
            notes.append(f"memory: this plan's {batch} samples per wave per rank exceed the "
                         f"{fit.wave_batch} the budget allows: train with a global batch of "
                         f"{2 * (self.ranks or ctx.cluster.gpus) * fit.wave_batch}")
        return fit, measured

    def _targets(self, ctx: PassContext, batch: int):
        if ctx.example_targets is not None:
            return split_batch(ctx.example_targets, ctx.batch_size // batch)[0]
        make = getattr(ctx.model, "example_targets", None)
        return make(batch) if callable(make) else None

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        from tidal.ir.capture import capture_train_step

        refuse_buffer_writes(gm, _NAME, _BUFFER_WHY)
        n = self.ranks or ctx.cluster.gpus
        shards = 2 * n
        if ctx.batch_size % shards:
            self.fail(f"batch size {ctx.batch_size} is not divisible by 2 x ranks = {shards} "
                      f"(one shard per wave per rank)")
        batch = ctx.batch_size // shards
        inputs = split_batch(ctx.example_inputs, shards)[0]
        targets = self._targets(ctx, batch)
        notes = []
        timeline = None
        if ctx.model is not None and ctx.loss_fn is not None and targets is not None:
            # the traced graph, called with its placeholders in order: keyword inputs (a
            # Hugging Face attention_mask) stay bound to their own parameters
            step = capture_train_step(gm, inputs, targets, ctx.loss_fn)
            refuse_buffer_writes(step, _NAME, _BUFFER_WHY)  # inside a module kept whole
            timeline = memory_timeline(step, ctx.cluster)
            fwd, total = timeline.forward_us, timeline.iteration_us
            bwd = total - fwd
        else:
            times = list(cost.node_times_us(gm, batch, ctx.cluster).values())
            fwd, bwd = sum(t[0] for t in times), sum(t[1] for t in times)
            notes.append("no example targets: the tock offset comes from the fx cost model "
                         "and no memory timeline is drawn")
        pbytes = cost.total_cost(gm, batch)["param_bytes"]
        ar = 2 * (n - 1) / n * ctx.cluster.transfer_us(pbytes) if n > 1 else 0.0
        schedule = tick_tock_schedule(n, fwd, bwd, ar, steps=2)
        schedule.check()
        artifacts = {"tick_tock_gantt.svg": schedule.gantt_svg()}
        if timeline is not None:
            il = interleave(timeline, timeline.forward_us)
            artifacts["tick_tock_memory.svg"] = timeline_svg(
                il, title=f"{type(ctx.model).__name__} batch {batch}")
            peaks = (timeline.saved_bytes, timeline.peak_bytes, il.peak_sum, il.peak_gang)
        else:
            peaks = (0, 0, 0, 0)
        fit, measured = self._memory(ctx, inputs, targets, batch, notes)
        plan = TickTockPlan(ranks=n, wave_batch=batch, offset_us=float(fwd),
                            iteration_us=float(fwd + bwd), saved_bytes=int(peaks[0]),
                            peak_bytes=int(peaks[1]), peak_interleaved=int(peaks[2]),
                            peak_gang=int(peaks[3]), schedule=schedule, memory=fit,
                            step_bytes=measured)
        notes += [f"tock offset {fwd:.3g} us of a {fwd + bwd:.3g} us iteration",
                  f"schedule: {schedule.line(0)}"]
        return PassResult(gm, plan=plan, notes=tuple(notes), artifacts=artifacts)
