"""Burst-parallel training as a program (DeepPool §4–§5): each rank's forward and backward on
the compute stream, each gradient bucket's sync on the comm stream as soon as backward has
finished its layers, and on every rank only the state of the layers it runs.

Every rank passes the same global batch. Each layer runs on its ranks' sample ranges; a rank
outside a layer's set skips it, running the graph specialised for its rank. The model output is
gathered to every rank, so every rank computes the same global loss, and backward sends each
row's gradient back to the rank that computed the row. A skipped layer gives an empty tensor of
the dtype the layer gives under the step's autocast state, so every rank hands each transfer the
same kind of tensor (checked before it moves: ``tidal.runtime.programs.burst_transfers``).
Without a process group (one process) the ops are the identity and a step is plain training.

The rank graphs and step layouts are keyed by the input shapes, so each batch size is laid out
once. :meth:`BurstProgram.runtime_state` keeps what changes the next steps beside the model and
the optimizer (the compressors' state after the ``compression`` pass, the ``no_sync``
gradients), by parameter name.

The parts, one module each:

* the rank's Program, built from the graph, the plan and the rank alone (:func:`build_program`;
  ``tidal.runtime.programs.burst_layout``): forward pieces between the scatter/gather
  transfers, backward in stages cut where each gradient bucket is final
  (``tidal.runtime.programs.burst_stages``), each bucket's all-reduce on its ranks only
  (the buckets: ``tidal.ir.burst_sync``, by the one bucket rule the planner and the simulator
  use), buffer syncs, the optimizer;
* the forward on a batch (``tidal.runtime.programs.burst_forward``): this rank's graph per input
  shapes, a last, smaller batch's rows split among each layer's ranks, and
  ``compile(batch="local")``'s forward (:meth:`BurstProgram.forward_local`);
* **owner-only state**: a rank holds, updates and checkpoints only what it owns, the parameters
  and buffers of the layers it runs and those of every rank (the base class ``RankShare``,
  ``tidal.runtime.programs.burst_share``: :meth:`BurstProgram.own_optimizer`,
  :meth:`BurstProgram.state_bytes`; :func:`state_table` for the ranks' rows); the others'
  ``.grad`` stays ``None``. A rank's copy of a layer it does not run is stale after the first
  step and never read (``tidal.runtime.programs.burst_refresh``).
  :meth:`BurstProgram.state_dict` checkpoints the rank's share
  (``tidal.runtime.programs.burst_state``). BatchNorm normalizes each rank's rows with their
  own statistics, as data parallelism without ``SyncBatchNorm`` does;
* the binding that runs the pieces (:class:`BurstStep`, ``tidal.runtime.programs.burst_step``):
  a bucket is summed over its ranks by a subgroup all-reduce, or a ``GradSync`` when the
  ``compression`` pass wraps the sync (:meth:`BurstProgram.use_grad_sync`); one tiny
  all-reduce, issued once the loss is computed and waited for by the last piece, checks that
  every rank is on the same step (``StepMismatchError`` on every rank otherwise).

The open step (``Compiled.backward``, :meth:`BurstProgram.bind_backward`) adds the rank's
synced gradients of what it owns to ``.grad`` (the others get none, so the user's optimizer
skips them). :meth:`BurstProgram.clip_grad_norm_` counts each parameter once over the ranks,
non-finite on every rank when any rank's is; fp16: ``ShardedGradScaler`` (``unscale_`` agrees
on ``found_inf`` across ranks), as ``compiled.backward(x, y, scale=scaler)``.

The comm stream is one FIFO in program order and every rank issues its buckets in the same
order, so the collectives match; they run on process groups of their own (a world-wide copy and
the sets' subgroups), so they overlap the scatter/gather transfers of backward, which use the
default group. The compute pieces run eagerly (``fallback_reason`` says why: the scatter/gather
collectives inside the graph), not as captured segments. The program is the same object the
simulator runs: a comm piece of the same name on several ranks is one collective across them.

Example:
    >>> import torch, torch.fx as fx
    >>> from tidal.runtime.program import ProgramExecutor
    >>> from tidal.runtime.programs.burst import BurstProgram
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    >>> gm = fx.symbolic_trace(model)
    >>> ex = ProgramExecutor(BurstProgram(world=1, batch=4,
    ...                                   param_ranks=(("0.weight", (0,)), ("0.bias", (0,)))))
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> x, y = torch.randn(4, 3), torch.tensor([0, 1, 0, 1])
    >>> float(ex.step(gm, model, (x,), y, torch.nn.functional.cross_entropy, opt)) > 0
    True
    >>> [(p.name, p.stream, p.deps) for p in ex.last_program.pieces]   # one process
    [('forward', 'compute', ()), ('backward 0', 'compute', (0,)), ('optimizer', 'compute', (1,))]
    >>> ex.close()
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist
import torch.fx as fx

from tidal.ir.burst_ownership import StateBytes, state_note, state_table
from tidal.ir.burst_sync import Bucket, sync_buckets
from tidal.ir.collectives import SubgroupCache, check_layer_ranks, new_group
from tidal.ir.comm_cost import DDP_BUCKET_BYTES
from tidal.ir.errors import PlanError
from tidal.ir.program import Program
from tidal.runtime.batch_data import global_batch
from tidal.runtime.comm.grad_sync import GradSync, GradSyncFactory
from tidal.runtime.distributed import is_distributed, rank_and_size
from tidal.runtime.program import OpenStepError
from tidal.runtime.programs.burst_forward import RankForward
from tidal.runtime.programs.burst_graph import RankGraph
from tidal.runtime.programs.burst_refresh import (StaleGuard, refresh_replicas,
                                                  replicated_elsewhere)
from tidal.runtime.programs.burst_layout import BurstSpec, StepLayout, spec_from_plan, step_layout
from tidal.runtime.programs.burst_share import RankShare
from tidal.runtime.programs.burst_state import (load_rank_state, load_runtime_state,
                                                rank_state_dict, runtime_state, saved_tensors)
from tidal.runtime.programs.burst_step import BurstStep
from tidal.runtime.programs.grad_clip import clip_by_global_norm_
from tidal.runtime.programs.optimizer_wiring import ACCUMULATE, GRADS, LocalGrads, remove_params
from tidal.runtime.programs.step_capture import shape_key

__all__ = ["PLAN_KIND", "BurstProgram", "BurstStep", "Bucket", "StateBytes", "StepLayout",
           "build_program", "from_plan", "state_table", "sync_buckets"]

PLAN_KIND = "BurstPlan"

Ranks = tuple[int, ...]


def build_program(gm: fx.GraphModule, plan: Any, rank: int,
                  bucket_bytes: float = DDP_BUCKET_BYTES) -> Program:
    """Rank ``rank``'s Program of a ``burst_parallel`` plan on the graph the pass rewrote
    (``tidal.runtime.programs.burst_layout.step_layout`` on the plan's world): no process
    group, no state."""
    return step_layout(gm, spec_from_plan(gm, plan, bucket_bytes), rank, plan.world).program


def from_plan(gm: fx.GraphModule, plan: Any,
              bucket_bytes: float = DDP_BUCKET_BYTES) -> "BurstProgram":
    """The rank program of a ``burst_parallel`` plan (a ``BurstPlan``: ``world``, ``batch`` and
    per layer its ``layer`` name and ``ranks``) on the graph the pass rewrote, whose nodes carry
    their placement (``tidal.ir.meta.BurstPlacement``); gradient buckets closed at
    ``bucket_bytes`` (as DDP closes them)."""
    spec = spec_from_plan(gm, plan, bucket_bytes)
    return BurstProgram(spec.world, spec.batch, tuple(spec.param_ranks.items()),
                        tuple(spec.layer_ranks.items()), tuple(spec.unit_members.items()),
                        bucket_bytes=bucket_bytes)


class BurstProgram(RankShare):
    """The rank program of ``burst_parallel`` (see the module docstring): ``world`` ranks, the
    plan's global ``batch``, per parameter (and buffer) name of the graph module the ranks of
    the layer that owns it (``param_ranks``), per layer name its ranks (``layer_ranks``; ranks
    outside a layer's set skip it) and, for a layer of several nodes, their names
    (``unit_members``). Gradient buckets close at ``bucket_bytes`` (read when a step's
    layout is built). ``overlap=False`` runs backward as one stage, every sync after it.
    ``groups`` holds the subgroups (created on the first distributed step, on every rank in
    the same order). What the rank owns: the base class (``burst_share.RankShare``)."""

    recaptures_autocast = True  # its eager pieces run under the binding thread's autocast
    runtime_state_by_name = True
    """:meth:`runtime_state` keeps each set's compressor state and the ``no_sync`` gradients
    by parameter name: it carries over to another set of trainable parameters."""
    recaptures_state = True
    """A step after freezing or unfreezing gets a layout of its own (keyed by the trainable
    set: its gradient buckets follow it); its stages run eagerly, reading the modules'
    ``training`` flags: ``Compiled`` keeps this program over a change of state."""

    def __init__(self, world: int, batch: int, param_ranks: tuple[tuple[str, Ranks], ...],
                 layer_ranks: tuple[tuple[str, Ranks], ...] = (),
                 unit_members: tuple[tuple[str, tuple[str, ...]], ...] = (),
                 overlap: bool = True, bucket_bytes: float = DDP_BUCKET_BYTES):
        if not bucket_bytes > 0:
            raise ValueError(f"BurstProgram(bucket_bytes={bucket_bytes!r}): must be > 0")
        super().__init__(world, dict(param_ranks))
        self.batch = batch
        self.layer_ranks = dict(layer_ranks)
        self.unit_members = dict(unit_members)
        self.overlap = overlap
        self.bucket_bytes = bucket_bytes
        self.groups = SubgroupCache()
        self.comm_group: Optional[dist.ProcessGroup] = None
        self.fallback_reason = ""
        self._ready = False
        self.forwards = RankForward(self.spec, self._check)
        """The forward on a batch: this rank's graphs (:meth:`local_graph`)."""
        self._layouts: dict[tuple, StepLayout] = {}
        self._sync_factory: Optional[GradSyncFactory] = None
        self._syncs: dict[Ranks, GradSync] = {}
        self.last_state: Optional[StateBytes] = None
        self._stale: list[str] = []  # this rank's stale copies since its latest step
        self._stale_guard = StaleGuard(lambda: bool(self._stale), lambda: self._stale)
        self._graph: Optional[fx.GraphModule] = None  # the graph of the latest step
        self.local_grads = LocalGrads()
        """What the open step accumulated inside ``no_sync`` on this rank, not yet synced."""

    @property
    def spec(self) -> BurstSpec:
        """What this rank's programs are built from, as it is now."""
        return BurstSpec(self.world, self.batch, self.param_ranks, self.layer_ranks,
                         self.unit_members, self.overlap, self.bucket_bytes)

    def use_grad_sync(self, factory: GradSyncFactory) -> None:
        """Sync each bucket's gradients through ``factory(group)`` (one :class:`GradSync` per
        set of ranks, e.g. a compressor from the ``compression`` pass; each bucket goes through
        its ``bucket``) instead of a plain all-reduce."""
        self._sync_factory = factory
        self._syncs = {}

    def _check(self) -> Optional[dist.ProcessGroup]:
        """The job's world against the plan's; on the first distributed call, the plan's
        layers against the world and the process groups (a collective: every rank calls it
        in the same order). Returns the comm stream's world-wide group."""
        size = dist.get_world_size()
        if size != self.world:
            raise PlanError(f"burst_parallel: the plan is for {self.world} GPUs but the job has "
                            f"{size} ranks; compile with tidal.Cluster(gpus={size})")
        if not self._ready:  # the plan is fixed: its ranks are checked against the world once
            check_layer_ranks(self.layer_ranks.items(), size)
            self.groups.create(r for r in self.param_ranks.values() if 1 < len(r) < size)
            self.comm_group = new_group()  # the comm stream's world-wide collectives
            self._ready = True
        return self.comm_group

    def batch_rows(self, inputs: tuple) -> int:
        """The global batch of ``inputs`` (``RankForward.batch_rows``)."""
        return self.forwards.batch_rows(inputs)

    def local_graph(self, gm: fx.GraphModule, inputs: tuple) -> RankGraph:
        """``gm`` specialised for this rank on ``inputs`` (``RankForward.local_graph``: built
        once per graph, input keys and autocast state; a collective then)."""
        return self.forwards.local_graph(gm, inputs, self.comm_group)

    def forward(self, gm: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
        """The global output on every rank (each layer's rows from the ranks that own it),
        from the same global batch on every rank: on several ranks one small all-gather
        checks that first (``tidal.runtime.batch_data.global_batch``, a ``BatchError`` naming
        the input and the ranks that differ; under ``compile(batch="local")`` each rank passes
        its own rows: :meth:`forward_local`); each transfer's input is checked too
        (``burst_transfers.TransferChecker``)."""
        if is_distributed():
            global_batch((args, kwargs), None, "global", check=True)
        return self.forwards.run(gm, args, kwargs)

    def forward_local(self, gm: fx.GraphModule, args: tuple, kwargs: Mapping[str, Any],
                      group: Optional[dist.ProcessGroup] = None, check: bool = True) -> Any:
        """The forward under ``compile(batch="local")``: each rank passes its own rows and gets
        its rows of the outputs back (``RankForward.run_local``; ``group`` and ``check`` as
        ``tidal.runtime.batch_data.global_batch`` takes them)."""
        return self.forwards.run_local(gm, args, kwargs, group, check)

    # -- owner-only state (what the rank owns: ``RankShare``) -------------------------------
    def state_dict(self, gm: fx.GraphModule,
                   optimizer: Optional[torch.optim.Optimizer] = None) -> dict[str, Any]:
        """This rank's checkpoint (``burst_state.rank_state_dict``): its ``rank`` and
        ``world``, the entries of ``gm``'s ``state_dict`` it owns (``model``, copies), the
        state of ``optimizer`` (owner-only once a step has run, or after
        :meth:`own_optimizer`) and each gradient sync's compressor state by its ranks."""
        rank = self.this_rank(None)
        return rank_state_dict(0 if rank is None else rank, self.world,
                               saved_tensors(gm, self.owned(gm)), optimizer, self._syncs)

    def load_state_dict(self, gm: fx.GraphModule, state: Mapping[str, Any],
                        optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        """Restore what :meth:`state_dict` returned on the same rank of a job of the same
        world: the owned tensors in place, ``optimizer`` (made owner-only first) and the
        compressors. Raises ``ValueError`` naming the checkpoint's rank, world or tensor that
        does not fit."""
        rank = self.this_rank(None)
        own = (lambda opt: self.own_optimizer(opt, gm)) if is_distributed() else None
        load_rank_state(state, 0 if rank is None else rank, self.world,
                        saved_tensors(gm, self.owned(gm)), optimizer, own, self.sync_of)

    def runtime_state(self, gm: fx.GraphModule) -> dict[str, Any]:
        """What this rank's program holds beside the model and the optimizer that changes the
        next steps, for a checkpoint (``Compiled.runtime_state_dict``) and a re-capture: each
        set's compressor state after the ``compression`` pass (error feedback, warm starts)
        and the open step's ``no_sync`` gradients, by parameter name
        (``burst_state.runtime_state``); ``{}`` when it holds neither (one process: no
        compressor runs)."""
        return runtime_state(self._syncs, self.local_grads)

    def load_runtime_state(self, gm: fx.GraphModule, optimizer: Any,
                           state: Mapping[str, Any]) -> None:
        """Restore what :meth:`runtime_state` returned (after the model and the optimizer):
        the next step continues the saved training bit for bit. On several ranks, a
        collective the first time (the sets' process groups are made)."""
        if state and is_distributed():
            self._check()
        foreign = set(self.foreign(gm))
        params = {n: p for n, p in gm.named_parameters() if p.requires_grad and n not in foreign}
        load_runtime_state(state, self.sync_of, self.local_grads, params)

    def refresh_state(self, gm: fx.GraphModule) -> None:
        """Bring this rank's stale copies (of layers it does not run) up to date from their
        owners, in place (``burst_refresh.refresh_replicas``; a collective on several ranks,
        a no-op before a step): ``Compiled.state_dict()`` calls it, so the model's state is
        current on every rank."""
        if is_distributed() and self._ready:
            refresh_replicas(gm, self.param_ranks, self.world, self.comm_group)
            self._stale = []

    # -- the step --------------------------------------------------------------------------
    def layout(self, gm: fx.GraphModule, rank: int, size: int,
               run: Optional[fx.GraphModule] = None) -> StepLayout:
        """This rank's step on ``size`` ranks (``burst_layout.step_layout``): its Program and
        what each piece does. ``run`` is the graph the rank runs (default: ``gm`` specialised
        for ``rank``)."""
        return step_layout(gm, self.spec, rank, size, run)

    def step_notes(self) -> list[str]:
        """After a distributed step: the training state this rank holds against data
        parallelism (``Compiled.report()`` shows it)."""
        return [] if self.last_state is None else [state_note(self.last_state)]

    def uncaptured(self) -> list[tuple[str, str]]:
        """What the latest step ran uncaptured: the whole step (its compute pieces are eager
        forward/backward stages), with ``fallback_reason`` naming the collective node."""
        return [("-", self.fallback_reason)] if self.fallback_reason else []

    def bind(self, gm: fx.GraphModule, model: torch.nn.Module, inputs: tuple, targets: Any,
             loss_fn: Callable, optimizer: torch.optim.Optimizer) -> BurstStep:
        """One training step on the global batch (see the module docstring); its program is
        built once per graph, rank, input shapes and bucket cap. On several ranks, the
        optimizer is made owner-only first (as :meth:`own_optimizer` does)."""
        layout, local = self._prepare(gm, model, inputs, targets, "optimizer")
        if is_distributed():
            remove_params(optimizer, gm, layout.foreign)
        return BurstStep(self, layout, gm, local.module, inputs, targets, loss_fn, optimizer,
                         expected=local.expected)

    def bind_backward(self, gm: fx.GraphModule, model: torch.nn.Module, inputs: tuple,
                      targets: Any, loss_fn: Callable, scale: Any, sync: bool) -> BurstStep:
        """The open step on the global batch (``Compiled.backward``; the module docstring):
        the step's program ending in ``grads`` (``sync``) or ``accumulate`` (inside
        ``no_sync``), backward of ``scale * loss``. The user's optimizer is left as it is.

        >>> import torch.nn.functional as F
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2))
        >>> gm = fx.symbolic_trace(model)
        >>> program = BurstProgram(1, 4, (("0.weight", (0,)), ("0.bias", (0,))))
        >>> x, y = torch.randn(4, 3), torch.tensor([0, 1, 0, 1])
        >>> for sync in (False, True):              # two halves of one accumulation
        ...     step = program.bind_backward(gm, model, (x,), y, F.cross_entropy, 0.5, sync)
        ...     for i, piece in enumerate(step.program.pieces):
        ...         step.work(i, piece)()
        >>> [p.name for p in step.program.pieces], model[0].bias.grad is not None
        (['forward', 'backward 0', 'grads'], True)
        """
        layout, local = self._prepare(gm, model, inputs, targets,
                                      GRADS if sync else ACCUMULATE)
        return BurstStep(self, layout, gm, local.module, inputs, targets, loss_fn, None,
                         scale=scale, local=self.local_grads, expected=local.expected)

    def _prepare(self, gm: fx.GraphModule, model: torch.nn.Module, inputs: tuple,
                 targets: Any, finish: str) -> tuple[StepLayout, RankGraph]:
        """This step's layout (built once per graph, rank, input shapes, autocast state, bucket
        cap, trainable set and last piece) and the graph the rank runs (:meth:`local_graph`;
        one process: ``gm``); on several ranks, the stale copies it will hold are watched
        (``model.state_dict()`` refuses them)."""
        distributed = is_distributed()
        if distributed:
            self._check()
        rank, size = rank_and_size()
        key = (id(gm), rank, size, self.bucket_bytes, self.overlap, finish,
               tuple(p.requires_grad for p in gm.parameters())) + shape_key(inputs, targets)
        local = self.local_graph(gm, inputs) if distributed else RankGraph(gm, {})
        if key not in self._layouts:
            self._layouts[key] = step_layout(gm, self.spec, rank, size, local.module, finish)
        layout = self._layouts[key]
        self.fallback_reason = layout.reason
        self._graph = gm
        if distributed:
            self._stale_guard.watch(model)
            self._stale = [n for n, src in replicated_elsewhere(gm, self.param_ranks, size)
                           if rank not in self.param_ranks[n]]
        return layout, local

    def clip_grad_norm_(self, model: torch.nn.Module, max_norm: float,
                        norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of ``model``'s parameters by their norm over every rank
        (``grad_clip.clip_by_global_norm_``): a parameter counts once, on its layer's first
        rank (one all-reduce); every rank scales the gradients it holds by the same factor.
        Returns the total norm, the same on every rank (non-finite on every rank when some
        rank's gradients are). Raises ``OpenStepError`` before this rank's first step.

        >>> model = torch.nn.Linear(3, 1)                 # 4 gradients of 2.0: norm 4
        >>> for p in model.parameters():
        ...     p.grad = torch.full_like(p, 2.0)
        >>> BurstProgram(1, 4, ()).clip_grad_norm_(model, 1.0).item()
        4.0
        """
        held = [p for p in model.parameters() if p.grad is not None]
        grads = [p.grad for p in held]
        if not is_distributed():
            return clip_by_global_norm_(grads, grads, max_norm, norm_type)
        if self._graph is None:
            raise OpenStepError(f"Compiled.clip_grad_norm_ under burst_parallel on rank "
                                f"{dist.get_rank()} before any Compiled.backward: which rank "
                                f"counts each gradient is known once a step has run")
        counted = self.counted(self._graph, held, dist.get_rank())
        return clip_by_global_norm_(counted, grads, max_norm, norm_type, self.comm_group)

    def sync_of(self, ranks: Ranks) -> Optional[GradSync]:
        """The gradient sync of the set ``ranks`` (made on first use by the factory
        :meth:`use_grad_sync` gave; None: a plain all-reduce)."""
        if self._sync_factory is None:
            return None
        if ranks not in self._syncs:
            self._syncs[ranks] = self._sync_factory(self.group_of(ranks))
        return self._syncs[ranks]

    def group_of(self, ranks: Ranks) -> Optional[dist.ProcessGroup]:
        """The group a set's collectives run on (the comm stream's own, never the default
        group that backward's scatter/gather transfers use)."""
        return self.comm_group if len(ranks) == dist.get_world_size() else self.groups.get(ranks)
