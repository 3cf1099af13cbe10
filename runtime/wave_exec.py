"""Executor of the ``tick_tock`` schedule: two data-parallel waves with their own replicas.

One ``step`` of the global batch runs one tick iteration and one tock iteration: the global
batch is cut into 2N shards (N ranks); rank i's tick wave trains on shard i with the model's
own parameters, its tock wave on shard N + i with a second replica (made from the model at the
first step). Each wave runs on its own thread (the CPU stand-in for a CUDA stream) through its
lane of the plan's schedule: ``F`` forward (the tock waits for the tick's forward to end, the
paper's ``F_end`` signal), ``B`` backward to the wave's raw local gradient ``g_m``, ``A`` the
cross-wave average of Eq. 1, ``(g_m + g_{m-1}) / 2`` with the other wave's latest raw gradient,
followed by the wave's own gradient sync (a process group per wave, so the two waves'
collectives never interleave; a :class:`~tidal.runtime.grad_sync.GradSync` per wave: a plain
averaging all-reduce, or a compressor when the ``compression`` pass wraps it), and ``U`` the wave's optimizer step on its own replica. By Lemma 1 the
gradient a wave applies is the mean over the 2N shards of iterations m−1 and m. After the sync,
a wave's floating-point buffers (BatchNorm's running statistics) are averaged over its ranks.

Example:
    >>> import torch, tidal
    >>> from tidal.passes.tick_tock import TickTock
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    >>> c = tidal.compile(model, (torch.randn(4, 4),), passes=[TickTock()],
    ...                   loss_fn=torch.nn.functional.cross_entropy,
    ...                   optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    >>> _ = c.step((torch.randn(4, 4),), torch.tensor([0, 1, 1, 0]))
    >>> sorted(c.executor.last_applied)
    ['K', 'T']
"""
from __future__ import annotations

import contextlib
import copy
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.fx as fx

from tidal.ir.collectives import new_group
from tidal.ir.errors import TidalError
from tidal.ir.schedule import Action, split_batch
from tidal.runtime.distributed import all_reduce_tensors, rank_and_size
from tidal.runtime.grad_sync import GradSync, GradSyncFactory, plain_sync

WAIT_TIMEOUT_S = 300.0


@dataclass
class _Wave:
    name: str
    gm: torch.nn.Module
    optimizer: torch.optim.Optimizer
    inputs: tuple
    targets: Any
    group: Any = None
    sync: Optional[GradSync] = None
    names: tuple[str, ...] = ()
    params: tuple[torch.nn.Parameter, ...] = ()
    loss: Optional[torch.Tensor] = None
    raw: Optional[list[torch.Tensor]] = None
    applied: dict = field(default_factory=dict)


def clone_optimizer(opt: torch.optim.Optimizer, mapping: dict[int, torch.Tensor]
                    ) -> torch.optim.Optimizer:
    """A fresh optimizer of ``opt``'s class and hyper-parameters over the tensors ``mapping``
    gives for its parameters (by ``id``); parameters not in ``mapping`` are left out."""
    groups = []
    for g in opt.param_groups:
        params = [mapping[id(p)] for p in g["params"] if id(p) in mapping]
        if params:
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": params})
    if not groups:
        raise ValueError("tick_tock: the optimizer holds none of the model's parameters")
    return type(opt)(groups, **opt.defaults)


def from_plan(gm: fx.GraphModule, plan: Any) -> "TickTockExecutor":
    """The executor of a ``tick_tock`` plan (its waves, ranks and schedule)."""
    return TickTockExecutor(plan)


class TickTockExecutor:
    """Runs a tick-tock plan (see module doc). ``tock`` is the tock replica (after the first
    step); ``last_applied[wave][name]`` the gradient each wave applied in the last step;
    ``syncs[wave]`` the wave's gradient sync (after the first step)."""

    def __init__(self, plan: Any):
        self.plan = plan
        self.tock: Optional[torch.nn.Module] = None
        self._tock_opt: Optional[torch.optim.Optimizer] = None
        self._prev_tock: Optional[list[torch.Tensor]] = None
        self._groups: Optional[tuple[Any, Any]] = None
        self._sync_factory: GradSyncFactory = plain_sync
        self.syncs: dict[str, GradSync] = {}
        self.last_applied: dict[str, dict[str, torch.Tensor]] = {}

    def use_grad_sync(self, factory: GradSyncFactory) -> None:
        """Sync each wave's gradients with ``factory(group)`` (e.g. a compressor's) instead of
        the plain all-reduce; set before the first step."""
        if self.syncs:
            raise RuntimeError("tick_tock: the gradient sync is fixed after the first step")
        self._sync_factory = factory

    def forward(self, gm: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
        """Inference runs the tick replica (the model's own parameters)."""
        return gm(*args, **kwargs)

    def _lane(self, wave: str) -> list[Action]:
        acts = self.plan.schedule.for_rank(0, lane=wave)
        first = {a.batch for a in acts if a.kind == "F"}
        step0 = min(first)
        return [a for a in acts if a.batch == step0]

    def step(self, gm: fx.GraphModule, model: torch.nn.Module, inputs: tuple, targets: Any,
             loss_fn: Callable, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """One tick iteration and one tock iteration on the global batch (2N shards)."""
        rank, world = rank_and_size()
        xs = split_batch(tuple(inputs), 2 * world, "tick_tock global batch")
        ys = split_batch(targets, 2 * world, "tick_tock targets")
        if self.tock is None:
            self.tock = copy.deepcopy(gm)
            tick_params = dict(gm.named_parameters())
            tock_params = dict(self.tock.named_parameters())
            mapping = {id(p): tock_params[k] for k, p in tick_params.items()}
            self._tock_opt = clone_optimizer(optimizer, mapping)
            if world > 1:
                self._groups = (new_group(backend="gloo"), new_group(backend="gloo"))
            groups = self._groups or (None, None)
            self.syncs = {"T": self._sync_factory(groups[0]), "K": self._sync_factory(groups[1])}
        groups = self._groups or (None, None)
        waves = {"T": _Wave("T", gm, optimizer, xs[rank], ys[rank], groups[0], self.syncs["T"]),
                 "K": _Wave("K", self.tock, self._tock_opt, xs[world + rank], ys[world + rank],
                            groups[1], self.syncs["K"])}
        for w in waves.values():
            named = [(k, p) for k, p in w.gm.named_parameters() if p.requires_grad]
            w.names, w.params = tuple(k for k, _ in named), tuple(p for _, p in named)
            w.optimizer.zero_grad(set_to_none=True)
        signals = {"F_end": threading.Event(), "g_tick": threading.Event()}
        errors: list[BaseException] = []

        def run(wave: _Wave) -> None:
            try:
                for a in self._lane(wave.name):
                    self._do(a, wave, waves, signals, loss_fn, world)
            except BaseException as e:  # hand the error to the main thread, free the other
                errors.append(e)
                for ev in signals.values():
                    ev.set()

        threads = [threading.Thread(target=run, args=(waves[w],), name=f"tidal-{w}")
                   for w in ("T", "K")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        self._prev_tock = waves["K"].raw
        self.last_applied = {w.name: w.applied for w in waves.values()}
        loss = (waves["T"].loss.detach() + waves["K"].loss.detach()) / 2
        if world > 1:
            dist.all_reduce(loss)
            loss = loss / world
        return loss

    def _do(self, a: Action, w: _Wave, waves: dict[str, _Wave], signals: dict, loss_fn: Callable,
            world: int) -> None:
        if a.kind == "F":
            if w.name == "K":
                _wait(signals["F_end"], "the tick wave's forward")
            w.loss = loss_fn(w.gm(*w.inputs), w.targets)
            if w.name == "T":
                signals["F_end"].set()
        elif a.kind == "B":
            grads = torch.autograd.grad(w.loss, w.params, allow_unused=True)
            w.raw = [torch.zeros_like(p) if g is None else g for p, g in zip(w.params, grads)]
            if w.name == "T":
                signals["g_tick"].set()
        elif a.kind == "A":
            if w.name == "K":
                _wait(signals["g_tick"], "the tick wave's gradient")
                other = waves["T"].raw
            else:
                other = self._prev_tock
            if other is None:
                avg = list(w.raw)  # the very first tick iteration has no predecessor
            else:
                avg = [(g + h) / 2 for g, h in zip(w.raw, other)]  # Eq. 1
            with _collective(w):
                synced = w.sync(dict(zip(w.names, avg)))  # the wave's all-reduce (or compressor)
                if world > 1:  # running statistics (BatchNorm): the same on every wave rank
                    all_reduce_tensors([b for b in w.gm.buffers() if b.is_floating_point()],
                                       w.group, average=True)
            avg = [synced[k] for k in w.names]
            for p, g, k in zip(w.params, avg, w.names):
                p.grad = g.clone()
                w.applied[k] = p.grad.detach().clone()
        elif a.kind == "U":
            w.optimizer.step()


@contextlib.contextmanager
def _collective(w: _Wave) -> Iterator[None]:
    """Turn a failed or timed-out collective of wave ``w`` (its group has the world's
    timeout) into one clear error instead of a deep gloo/NCCL traceback."""
    try:
        yield
    except (RuntimeError, dist.DistError) as e:
        wave = "tick" if w.name == "T" else "tock"
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise TidalError(f"tick_tock: the {wave} wave's gradient sync did not complete within "
                         f"the process group's timeout: a peer rank stalled or died "
                         f"({type(e).__name__}: {first})") from e


def _wait(ev: threading.Event, what: str) -> None:
    if not ev.wait(WAIT_TIMEOUT_S):
        raise TimeoutError(f"tick_tock: waited {WAIT_TIMEOUT_S:.0f} s for {what}")
