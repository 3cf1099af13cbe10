"""The ``compression`` pass: data-parallel training whose gradient sync runs through a compressor.

The pass leaves the graph as it is and emits a
:class:`~tidal.ir.plans.compression.CompressionPlan`: the compressor (a spec such as
``"powersgd:4"`` or ``"topk:0.01"``, see :mod:`tidal.ir.compression_model`), the buckets
(parameters in reverse order, 25 MiB buckets like DDP), the bytes sent, and Accordion's
settings. The runtime runs the plan
(:func:`tidal.runtime.programs.compression.compression_executor`): ``Compiled.step`` then does
data-parallel training on the default process group (gloo on CPU, NCCL on GPU): every rank
passes the same global batch and takes its shard of dim 0, runs forward and backward, and the
gradients are synchronized bucket by bucket with the chosen compressor (PowerSGD, Top-K,
random-K, signSGD, QSGD) after the backward (compression is not overlapped, §4.2.1; with
compression off each bucket's all-reduce overlaps the rest of backward, as DDP's does).
Parameters and buffers are broadcast from rank 0 like DDP. With ``accordion=(low, high)``
Accordion switches each tensor's level every ``accordion_interval`` steps; a learning-rate
decay within the next window counts as critical when the schedule is known
(``accordion_lr_schedule=step -> lr``, read here over the first ``accordion_lr_horizon`` steps
and recorded in the plan as the window ends with a decay ahead; or a torch scheduler given to
the executor's ``watch_scheduler`` after ``compile()``), else a drop is seen one window late.

After a parallelism pass (``passes=["tick_tock", "compression"]``) the plan wraps that pass's
gradient sync instead (``wraps`` names it; the runtime hands a compressor per process group to
that executor's ``use_grad_sync``: ``tick_tock`` keeps one compressor state per wave,
``burst_parallel`` one per set of ranks that syncs a layer, ``round_robin`` one per partition).

``mode``: ``"on"`` compresses; ``"off"`` runs plain all-reduce (sync SGD); ``"auto"`` asks the
performance model (:mod:`tidal.ir.perf_model`, Eq. 4.1) for the cluster in the context and
compresses only when it predicts a speedup, saying which in the notes. The model needs the
compressor's encode+decode time: ``encode_decode_ms``, else the measurer ``compile()`` puts in
``PassContext.encode_decode_s`` (it times the runtime's compressor on the model's gradient
shapes on this machine); the pass itself never runs a compressor.

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

from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx

from tidal.ir import compression_model, cost, perf_model
from tidal.ir.comm_cost import ddp_buckets
from tidal.ir.compression_model import CompressorSpec, SpecLike
from tidal.ir.param_owners import trainable
from tidal.ir.pass_api import Pass, PassContext, PassResult
from tidal.ir.plans.compression import CompressionPlan

__all__ = ["CompressionPass", "CompressionPlan", "HOSTS", "MODES", "lr_decays", "make_buckets"]

MODES = ("on", "off", "auto")
HOSTS = ("tick_tock", "burst_parallel", "round_robin")
"""Parallelism passes whose gradient sync this pass wraps when it runs after one of them
(their executor must take ``use_grad_sync``; all three do)."""

DEFAULT_LR_HORIZON = 100_000
"""Optimizer steps of ``accordion_lr_schedule`` read into the plan by default."""


def make_buckets(model: torch.nn.Module, cap_bytes: float) -> tuple[tuple[str, ...], ...]:
    """Parameter names in reverse registration order (roughly the order the backward produces
    gradients, as DDP assumes), grouped into buckets closed at ``cap_bytes``: the gradient
    sync's own buckets (``tidal.ir.comm_cost.ddp_buckets``)."""
    return ddp_buckets([(n, p.numel() * 4) for n, p in trainable(model).items()], cap_bytes)


def lr_decays(schedule: Callable[[int], float], interval: int, horizon: int
              ) -> tuple[tuple[int, float, float], ...]:
    """Accordion's "decay ahead" read from ``schedule(step) -> lr`` (``step``: 0-based optimizer
    step) as data: ``(steps done, lr of the last step, lowest lr of the next window)`` at each
    window end (a multiple of ``interval``) whose next window ends within ``horizon`` steps and
    runs at a lower rate than the last step.

    Example:
        >>> lr_decays(lambda step: 0.1 if step < 6 else 0.01, interval=3, horizon=12)
        ((6, 0.1, 0.01),)
    """
    out = []
    last: Optional[float] = None
    window: list[float] = []
    for step in range(horizon):
        try:
            window.append(float(schedule(step)))
        except Exception as e:
            raise ValueError(f"compression: accordion_lr_schedule({step}) failed ({e}); give "
                             f"accordion_lr_horizon <= the steps it covers") from e
        if len(window) == interval:
            if last is not None and min(window) < last:
                out.append((step + 1 - interval, last, min(window)))
            last, window = window[-1], []
    return tuple(out)


def _check_interval(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"compression: {name}={value!r} must be an integer >= 1")


class CompressionPass(Pass):
    """Gradient compression for data-parallel training (PowerSGD, Top-K, random-K, signSGD,
    QSGD), Accordion switching, and a performance model that says whether it pays.

    Options: ``compressor`` (a spec ``name[:level][,option=value...]`` like ``"powersgd:4"``,
    ``"topk:0.01"`` or ``"powersgd:2,min_compression_rate=0"``; anything with a ``.spec()``
    giving one, such as a runtime compressor, is read through its spec, never run here),
    ``mode`` (``"on"``, ``"off"``, ``"auto"``), ``bucket_mb`` (25), ``accordion`` (``(low,
    high)`` levels or None), ``accordion_eta`` (0.5), ``accordion_interval`` (steps per window),
    ``accordion_lr_schedule`` (``step -> lr``, so that a decay ahead is seen; read into the plan
    over the first ``accordion_lr_horizon`` steps, 100,000 by default; a torch scheduler goes to
    the executor's ``watch_scheduler`` after compile), ``gamma`` (backward slowdown under
    overlap), ``encode_decode_ms`` (for ``auto``; default: measured by ``compile()`` on the
    model's gradient shapes, through ``PassContext.encode_decode_s``).
    """

    name = "compression"
    training_only = True
    after = HOSTS
    changes_update = "it compresses the gradients (lossy, so the update differs from the batch's)"

    def __init__(self, compressor: SpecLike = "powersgd:4", *, mode: str = "on",
                 bucket_mb: float = 25.0, accordion: Optional[tuple[Any, Any]] = None,
                 accordion_eta: float = 0.5, accordion_interval: int = 100,
                 accordion_lr_schedule: Optional[Callable[[int], float]] = None,
                 accordion_lr_horizon: int = DEFAULT_LR_HORIZON,
                 gamma: float = perf_model.DEFAULT_GAMMA,
                 encode_decode_ms: Optional[float] = None):
        try:
            self.compressor: CompressorSpec = compression_model.as_spec(compressor)
        except TypeError as e:
            raise TypeError(f"compression: {e}") from None
        if mode not in MODES:
            raise ValueError(f"compression: mode {mode!r} is not one of {MODES}")
        if not bucket_mb > 0:
            raise ValueError(f"compression: bucket_mb={bucket_mb!r} must be > 0")
        _check_interval("accordion_interval", accordion_interval)
        _check_interval("accordion_lr_horizon", accordion_lr_horizon)
        if accordion is not None:
            low, high = accordion
            accordion = (compression_model.check_level(self.compressor.name, low),
                         compression_model.check_level(self.compressor.name, high))
        if not (isinstance(accordion_eta, (int, float)) and accordion_eta > 0):
            raise ValueError(f"compression: accordion_eta={accordion_eta!r} must be > 0")
        if accordion_lr_schedule is not None and not callable(accordion_lr_schedule):
            raise TypeError(f"compression: accordion_lr_schedule must be callable step -> lr, "
                            f"got {type(accordion_lr_schedule).__name__}")
        self.mode = mode
        self.bucket_bytes = int(bucket_mb * perf_model.MIB)
        self.accordion = accordion
        self.accordion_eta = float(accordion_eta)
        self.accordion_interval = accordion_interval
        self.accordion_lr_schedule = accordion_lr_schedule
        self.accordion_lr_horizon = accordion_lr_horizon
        self.gamma = gamma
        self.encode_decode_ms = encode_decode_ms

    def requires(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        if ctx.model is None:
            self.fail("needs the model (compile() passes it)")
        if not trainable(ctx.model):
            self.fail("the model has no trainable parameters")

    def _encode_decode_s(self, ctx: PassContext, shapes: Sequence[tuple[int, ...]]) -> float:
        """Encode+decode seconds per step: the option, else the context's measurer."""
        if self.encode_decode_ms is not None:
            return self.encode_decode_ms * 1e-3
        if ctx.encode_decode_s is None:
            self.fail(f"mode='auto' needs the encode+decode time of {self.compressor}: give "
                      "encode_decode_ms=..., or run the pass through tidal.compile(), which "
                      "measures it on this machine (PassContext.encode_decode_s)")
        return float(ctx.encode_decode_s(str(self.compressor), list(shapes)))

    def _predict(self, gm: fx.GraphModule, ctx: PassContext,
                 buckets: tuple[tuple[str, ...], ...]) -> tuple[float, float]:
        """(sync SGD, compressed) predicted step seconds on ``ctx.cluster``."""
        cluster = ctx.cluster
        per_gpu = max(1, ctx.batch_size // cluster.gpus)
        fwd = bwd = 0.0
        for f, b in cost.node_times_us(gm, per_gpu, cluster).values():
            fwd, bwd = fwd + f * 1e-6, bwd + b * 1e-6
        params = trainable(ctx.model)
        shapes = [[tuple(params[n].shape) for n in b] for b in buckets]
        work = perf_model.Workload(fwd, bwd, tuple(
            float(sum(4 * params[n].numel() for n in b)) for b in buckets))
        enc_s = self._encode_decode_s(ctx, [s for b in shapes for s in b])
        comp = compression_model.compressor_cost(self.compressor, shapes, enc_s)
        return (perf_model.sync_sgd_step(work, cluster, self.gamma).total_s,
                perf_model.compressed_step(work, comp, cluster).total_s)

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        model = ctx.model
        buckets = make_buckets(model, self.bucket_bytes)
        params = trainable(model)
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
                f"ms/step for {self.compressor}: compression "
                + ("on" if enabled else "off (no predicted speedup)"))
        sent = self.compressor if enabled else compression_model.parse_spec("none")
        payload = sum(sent.payload_bytes(tuple(p.shape)) for p in params.values())
        host = next((h for h in HOSTS if h in ctx.plans), None)
        accordion = self.accordion if enabled else None
        decays: tuple[tuple[int, float, float], ...] = ()
        horizon = 0
        if accordion is not None:
            if host is not None:
                self.fail(f"accordion switching runs in this pass's own data-parallel "
                          f"executor; it is not available on top of {host!r}")
            notes.append(f"accordion: levels {accordion[0]} (critical) / {accordion[1]}, eta "
                         f"{self.accordion_eta:g}, window {self.accordion_interval} steps")
            if self.accordion_lr_schedule is not None:
                horizon = self.accordion_lr_horizon
                decays = lr_decays(self.accordion_lr_schedule, self.accordion_interval, horizon)
                notes.append(f"accordion: learning-rate schedule read for {horizon} steps, "
                             f"{len(decays)} window(s) with a decay ahead; beyond, a decay is "
                             "seen one window late")
        if host is not None:
            notes.append(f"wraps the gradient sync of {host} ({sent}, "
                         f"{self.bucket_bytes / perf_model.MIB:g} MiB buckets)")
        plan = CompressionPlan(
            compressor=str(self.compressor), mode=self.mode, enabled=enabled,
            bucket_bytes=self.bucket_bytes, buckets=buckets, grad_bytes=grad_bytes,
            payload_bytes=payload,
            predicted_sync_ms=None if predicted[0] is None else predicted[0] * 1e3,
            predicted_compressed_ms=None if predicted[1] is None else predicted[1] * 1e3,
            accordion=None if accordion is None else (
                float(accordion[0]), float(accordion[1]), self.accordion_eta,
                self.accordion_interval),
            accordion_lr_decays=decays, accordion_lr_horizon=horizon, wraps=host)
        return PassResult(gm, plan=plan, notes=tuple(notes))
