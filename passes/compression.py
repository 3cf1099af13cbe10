"""The ``compression`` pass: data-parallel training whose gradient sync runs through a compressor.

The pass leaves the graph as it is and sets an executor: ``Compiled.step`` then does
data-parallel training on the default process group (gloo on CPU, NCCL on GPU): every rank
passes the same global batch and takes its shard of dim 0, runs forward and backward, and the
gradients are synchronized bucket by bucket (parameters in reverse order, 25 MiB buckets like
DDP) with the chosen compressor (PowerSGD, Top-K, random-K, signSGD, QSGD; see
:mod:`tidal.passes.compressors`), after the backward (compression is not overlapped, §4.2.1).
Parameters and buffers are broadcast from rank 0 like DDP. With ``accordion=(low, high)`` an
:class:`~tidal.passes.accordion.Accordion` controller switches each tensor's level every
``accordion_interval`` steps; a learning-rate decay within the next window counts as critical
when the schedule is known (``accordion_lr_schedule=step -> lr``, or a torch scheduler given to
``DataParallelExecutor.watch_scheduler`` after ``compile()``), else a drop is seen one window late.

After a parallelism pass (``passes=["tick_tock", "compression"]``) the pass sets no executor of
its own: it wraps that pass's gradient sync instead (a
:class:`~tidal.runtime.grad_sync.GradSyncRequest` that ``compile()`` hands to the earlier
executor's ``use_grad_sync``: ``tick_tock`` keeps one compressor state per wave,
``burst_parallel`` one per set of ranks that syncs a layer, ``round_robin`` one per partition).

``mode``: ``"on"`` compresses; ``"off"`` runs plain all-reduce (sync SGD); ``"auto"`` asks the
performance model (:mod:`tidal.ir.perf_model`, Eq. 4.1) for the cluster in the context and
compresses only when it predicts a speedup, saying which in the notes.

Reference semantics: with compression off, or effectively off (PowerSGD at full rank, Top-K at
100 %), a step equals one step of the model on the global batch (all-reduce average).

Example:
    >>> import torch, tidal
    >>> from tidal.passes.compression import CompressionPass
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    >>> x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 0])
    >>> c = tidal.compile(model, x, passes=[CompressionPass(compressor="topk:0.1")],
    ...                   loss_fn=torch.nn.functional.cross_entropy,
    ...                   optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    >>> c.step((x,), y).dim(), c.plan.get("compression").summary()
    (0, 'topk:0.1: 1 bucket, 195 -> 42 floats/step (4.6x)')
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.fx as fx

from tidal.ir import cost, perf_model
from tidal.ir.pass_api import Pass, PassContext, PassResult
from tidal.ir.plan import Plan
from tidal.passes.accordion import Accordion, LrLookahead
from tidal.passes.compressors import Compressor, NoCompression, make_compressor
from tidal.passes.compressors.modeling import compressor_cost, measure_encode_decode_s
from tidal.runtime.grad_sync import GradSync, GradSyncRequest

MODES = ("on", "off", "auto")
HOSTS = ("tick_tock", "burst_parallel", "round_robin")
"""Parallelism passes whose gradient sync this pass wraps when it runs after one of them
(their executor must take ``use_grad_sync``; all three do)."""


@dataclass(frozen=True)
class CompressionPlan(Plan):
    """What the pass chose: the compressor (``"none"`` when off), the buckets (parameter names
    in sync order), gradient and payload bytes per step per rank, and the model's prediction."""

    compressor: str
    mode: str
    enabled: bool
    bucket_bytes: int
    buckets: tuple[tuple[str, ...], ...]
    grad_bytes: int
    payload_bytes: int
    predicted_sync_ms: Optional[float] = None
    predicted_compressed_ms: Optional[float] = None
    accordion: Optional[tuple[float, float, float, int]] = None

    @property
    def ratio(self) -> float:
        """Gradient bytes over bytes sent."""
        return self.grad_bytes / max(1, self.payload_bytes)

    def summary(self) -> str:
        name = self.compressor if self.enabled else "off (plain all-reduce)"
        n = len(self.buckets)
        return (f"{name}: {n} bucket{'s' if n != 1 else ''}, {self.grad_bytes // 4} -> "
                f"{self.payload_bytes // 4} floats/step ({self.ratio:.2g}x)")

    def table(self) -> str:
        lines = [self.summary()]
        if self.predicted_sync_ms is not None:
            lines.append(f"predicted step: sync SGD {self.predicted_sync_ms:.3g} ms, "
                         f"{self.compressor} {self.predicted_compressed_ms:.3g} ms")
        lines += [f"bucket {i}: {', '.join(b)}" for i, b in enumerate(self.buckets)]
        return "\n".join(lines)


def _shard(value: Any, rank: int, size: int, batch: int) -> Any:
    """This rank's slice of dim 0 of every tensor whose dim 0 is the global batch."""
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch:
        per = batch // size
        return value[rank * per:(rank + 1) * per]
    if isinstance(value, (tuple, list)):
        return type(value)(_shard(v, rank, size, batch) for v in value)
    if isinstance(value, Mapping):
        return {k: _shard(v, rank, size, batch) for k, v in value.items()}
    return value


def trainable(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """Parameters that get gradients, in registration order."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def make_buckets(model: torch.nn.Module, cap_bytes: float) -> tuple[tuple[str, ...], ...]:
    """Parameter names in reverse registration order (roughly the order the backward produces
    gradients, as DDP assumes), grouped into buckets of at most ``cap_bytes``."""
    params = list(reversed(trainable(model)))
    parts = perf_model.bucket_partition([p.numel() * 4 for _, p in params], cap_bytes)
    return tuple(tuple(params[i][0] for i in b) for b in parts)


class DataParallelExecutor:
    """Runs ``Compiled.step`` as data-parallel training with compressed gradient sync.
    ``state_dict``/``load_state_dict`` checkpoint the compressor and the Accordion controller."""

    def __init__(self, compressor: Compressor, buckets: Sequence[Sequence[str]], *,
                 accordion: Optional[Accordion] = None, accordion_interval: int = 100,
                 lr_lookahead: Optional[LrLookahead] = None,
                 group: Optional[dist.ProcessGroup] = None):
        self.compressor = compressor
        self.lr_lookahead = lr_lookahead
        self.buckets = tuple(tuple(b) for b in buckets)
        self.accordion = accordion
        self.accordion_interval = accordion_interval
        self.grad_sync = GradSync(compressor, buckets=self.buckets, group=group)
        self.comm = self.grad_sync.comm
        self.steps = 0
        self._window_lr: Optional[float] = None

    def watch_scheduler(self, scheduler: Any, steps_per_call: int = 1) -> None:
        """Let Accordion see learning-rate decays ahead in ``scheduler`` (a torch scheduler on
        ``Compiled.optimizer``, stepped once per ``steps_per_call`` steps); it is peeked,
        never advanced."""
        self.lr_lookahead = LrLookahead.from_scheduler(scheduler, steps_per_call)

    def forward(self, gm: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
        """Inference is not distributed: every rank runs the whole batch."""
        return gm(*args, **kwargs)

    def _broadcast_state(self, model: torch.nn.Module, params: bool) -> None:
        world = self.comm.world
        if world.size == 1:
            return
        tensors = [b for b in model.buffers()] + ([p.data for p in model.parameters()]
                                                  if params else [])
        for t in tensors:
            dist.broadcast(t, src=0, group=self.comm.group)

    def sync_gradients(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Synchronize every parameter's ``.grad`` bucket by bucket through the compressor
        (:class:`~tidal.runtime.grad_sync.GradSync`); returns the synchronized gradients."""
        params = dict(trainable(model))
        synced = self.grad_sync({n: p.grad if p.grad is not None else torch.zeros_like(p)
                                 for n, p in params.items()})
        for n, g in synced.items():
            p = params[n]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.copy_(g.reshape(p.shape))
        return synced

    def step(self, gm: fx.GraphModule, model: torch.nn.Module, inputs: tuple, targets: Any,
             loss_fn: Callable, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """One data-parallel step on this rank's shard of the global batch; returns the loss of
        the global batch (the mean of the ranks' shard losses)."""
        world = self.comm.world
        batch = cost.example_batch(inputs)
        if batch % world.size:
            raise ValueError(f"compression: global batch {batch} does not split evenly over "
                             f"{world.size} ranks")
        self._broadcast_state(model, params=self.steps == 0)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(gm(*_shard(inputs, world.rank, world.size, batch)),
                       _shard(targets, world.rank, world.size, batch))
        loss.backward()
        synced = self.sync_gradients(model)
        optimizer.step()
        self.steps += 1
        if self.accordion is not None:
            self._accordion_step(synced, optimizer)
        out = loss.detach().clone()
        if world.size > 1:
            dist.all_reduce(out, group=self.comm.group)
            out /= world.size
        return out

    def _accordion_step(self, synced: Mapping[str, torch.Tensor],
                        optimizer: torch.optim.Optimizer) -> None:
        self.accordion.accumulate(synced)
        if self.steps % self.accordion_interval == 0:
            lr = float(optimizer.param_groups[0]["lr"])
            if self.lr_lookahead is not None:      # a decay within the next window
                lr_now, lr_next = self.lr_lookahead.now_and_next(
                    self.steps, self.accordion_interval, lr)
            else:                                  # unknown schedule: a drop seen after it
                lr_now, lr_next = self._window_lr, lr
            self._window_lr = lr
            levels = self.accordion.decide(lr_now, lr_next)
            self.accordion.apply(self.compressor, levels)

    def state_dict(self) -> dict[str, Any]:
        """Compressor, Accordion and step counter."""
        return {"steps": self.steps, "window_lr": self._window_lr,
                "compressor": self.compressor.state_dict(),
                "accordion": self.accordion.state_dict() if self.accordion else None}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        self.steps = state["steps"]
        self._window_lr = state["window_lr"]
        self.compressor.load_state_dict(state["compressor"])
        if self.accordion is not None and state["accordion"] is not None:
            self.accordion.load_state_dict(state["accordion"])


class CompressionPass(Pass):
    """Gradient compression for data-parallel training (PowerSGD, Top-K, random-K, signSGD,
    QSGD), Accordion switching, and a performance model that says whether it pays.

    Options: ``compressor`` (a spec like ``"powersgd:4"``/``"topk:0.01"`` or a
    :class:`Compressor`), ``mode`` (``"on"``, ``"off"``, ``"auto"``), ``bucket_mb`` (25),
    ``accordion`` (``(low, high)`` levels or None), ``accordion_eta`` (0.5),
    ``accordion_interval`` (steps per window), ``accordion_lr_schedule`` (``step -> lr``, so
    that a decay ahead is seen; a torch scheduler goes to the executor's ``watch_scheduler``
    after compile), ``gamma`` (backward slowdown under overlap),
    ``encode_decode_ms`` (for ``auto``; default measured here on the model's gradient shapes).
    """

    name = "compression"
    training_only = True
    after = HOSTS
    changes_update = "it compresses the gradients (lossy, so the update differs from the batch's)"

    def __init__(self, compressor: Union[str, Compressor] = "powersgd:4", *, mode: str = "on",
                 bucket_mb: float = 25.0, accordion: Optional[tuple[Any, Any]] = None,
                 accordion_eta: float = 0.5, accordion_interval: int = 100,
                 accordion_lr_schedule: Optional[Callable[[int], float]] = None,
                 gamma: float = perf_model.DEFAULT_GAMMA,
                 encode_decode_ms: Optional[float] = None):
        self.compressor = make_compressor(compressor) if isinstance(compressor, str) \
            else compressor
        if not isinstance(self.compressor, Compressor):
            raise TypeError(f"compression: compressor must be a spec string or a Compressor, "
                            f"got {type(compressor).__name__}")
        if mode not in MODES:
            raise ValueError(f"compression: mode {mode!r} is not one of {MODES}")
        if not bucket_mb > 0:
            raise ValueError(f"compression: bucket_mb={bucket_mb!r} must be > 0")
        if isinstance(accordion_interval, bool) or not isinstance(accordion_interval, int) \
                or accordion_interval < 1:
            raise ValueError(f"compression: accordion_interval={accordion_interval!r} must be "
                             "an integer >= 1")
        if accordion is not None:
            low, high = accordion
            self.compressor.check_level(low)
            self.compressor.check_level(high)
        self.mode = mode
        self.bucket_bytes = int(bucket_mb * perf_model.MIB)
        self.accordion = accordion
        self.accordion_eta = accordion_eta
        self.accordion_interval = accordion_interval
        self.lr_lookahead = None if accordion_lr_schedule is None \
            else LrLookahead.from_function(accordion_lr_schedule)
        self.gamma = gamma
        self.encode_decode_ms = encode_decode_ms

    def requires(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        if ctx.model is None:
            self.fail("needs the model (compile() passes it)")
        if not trainable(ctx.model):
            self.fail("the model has no trainable parameters")

    def _predict(self, gm: fx.GraphModule, ctx: PassContext,
                 buckets: tuple[tuple[str, ...], ...]) -> tuple[float, float]:
        """(sync SGD, compressed) predicted step seconds on ``ctx.cluster``."""
        cluster = ctx.cluster
        per_gpu = max(1, ctx.batch_size // cluster.gpus)
        fwd = bwd = 0.0
        for f, b in cost.node_times_us(gm, per_gpu, cluster).values():
            fwd, bwd = fwd + f * 1e-6, bwd + b * 1e-6
        params = dict(trainable(ctx.model))
        shapes = [[tuple(params[n].shape) for n in b] for b in buckets]
        work = perf_model.Workload(fwd, bwd, tuple(
            float(sum(4 * params[n].numel() for n in b)) for b in buckets))
        if self.encode_decode_ms is not None:
            enc_s = self.encode_decode_ms * 1e-3
        else:
            enc_s = measure_encode_decode_s(self.compressor, [s for b in shapes for s in b],
                                            device=next(iter(params.values())).device)
        comp = compressor_cost(self.compressor, shapes, enc_s)
        return (perf_model.sync_sgd_step(work, cluster, self.gamma).total_s,
                perf_model.compressed_step(work, comp, cluster).total_s)

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        model = ctx.model
        buckets = make_buckets(model, self.bucket_bytes)
        params = dict(trainable(model))
        grad_bytes = sum(4 * p.numel() for p in params.values())
        notes = []
        enabled = self.mode == "on"
        predicted: tuple[Optional[float], Optional[float]] = (None, None)
        if self.mode == "auto":
            predicted = self._predict(gm, ctx, buckets)
            enabled = predicted[1] < predicted[0]
            c = ctx.cluster
            notes.append(
                f"auto: on {c.gpus} GPUs at {c.bandwidth_gbps:g} Gb/s the model predicts "
                f"{predicted[0] * 1e3:.3g} ms/step for sync SGD and {predicted[1] * 1e3:.3g} "
                f"ms/step for {self.compressor.spec()}: compression "
                + ("on" if enabled else "off (no predicted speedup)"))
        compressor = self.compressor if enabled else NoCompression()
        payload = sum(compressor.payload_bytes(tuple(p.shape)) for p in params.values())
        accordion = None
        if enabled and self.accordion is not None:
            accordion = Accordion(*self.accordion, eta=self.accordion_eta)
            notes.append(f"accordion: levels {self.accordion[0]} (critical) / "
                         f"{self.accordion[1]}, eta {self.accordion_eta}, window "
                         f"{self.accordion_interval} steps")
        host = next((h for h in HOSTS if h in ctx.plans), None)
        if host is None:
            executor: Any = DataParallelExecutor(
                copy.deepcopy(compressor), buckets, accordion=accordion,
                accordion_interval=self.accordion_interval, lr_lookahead=self.lr_lookahead)
        else:
            if accordion is not None:
                self.fail(f"accordion switching runs in this pass's own data-parallel "
                          f"executor; it is not available on top of {host!r}")
            bucket_bytes = self.bucket_bytes

            def factory(group: Optional[dist.ProcessGroup]) -> GradSync:
                return GradSync(copy.deepcopy(compressor), bucket_bytes=bucket_bytes,
                                group=group)

            executor = GradSyncRequest(self.name, factory)
            notes.append(f"wraps the gradient sync of {host} ({compressor.spec()}, "
                         f"{self.bucket_bytes / perf_model.MIB:g} MiB buckets)")
        plan = CompressionPlan(
            compressor=self.compressor.spec(), mode=self.mode, enabled=enabled,
            bucket_bytes=self.bucket_bytes, buckets=buckets, grad_bytes=grad_bytes,
            payload_bytes=payload,
            predicted_sync_ms=None if predicted[0] is None else predicted[0] * 1e3,
            predicted_compressed_ms=None if predicted[1] is None else predicted[1] * 1e3,
            accordion=None if accordion is None else (
                float(self.accordion[0]), float(self.accordion[1]), float(self.accordion_eta),
                self.accordion_interval))
        return PassResult(gm, plan=plan, notes=tuple(notes), executor=executor)
