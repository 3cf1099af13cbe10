"""Executor of the ``round_robin`` schedule: Wavelet's round-robin model parallelism.

Runs the per-rank action list of a ``RoundRobinPlan``'s schedule on a graph split into
``submod_0 .. submod_{N-1}``: ``S p`` switches the rank to partition p (counted, with the
weight bytes it loads), ``F p,b`` runs partition p on batch b with the activations received
from the previous rank, ``X`` moves activations to the next rank (forward) or their gradients
to the previous rank (backward) with ``torch.distributed`` point-to-point ops, ``B p,b`` runs
partition p's backward, ``A p`` all-reduces partition p's gradients (sum over the N batches;
each micro-batch loss is divided by N, so the result is the global-batch mean gradient) and
``U`` steps the optimizer. After the ``compression`` pass, each partition's gradients go
through a compressor of their own instead (``use_grad_sync``). With a process group of N ranks
each rank runs its own list; with none, all N ranks run in this process (the all-reduce is then
the shared ``.grad`` accumulation, and no compressor runs), so the schedule runs anywhere.

Example:
    >>> import torch, tidal
    >>> from tidal.passes.round_robin import RoundRobin
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    >>> c = tidal.compile(model, (torch.randn(4, 4),), passes=[RoundRobin(partitions=2)],
    ...                   loss_fn=torch.nn.functional.cross_entropy,
    ...                   optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    >>> _ = c.step((torch.randn(4, 4),), torch.tensor([0, 1, 1, 0]))
    >>> c.executor.stats["switches"]
    3
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.fx as fx

from tidal.ir.errors import PlanError
from tidal.ir.schedule import split_batch
from tidal.runtime.distributed import all_reduce_tensors, rank_and_size
from tidal.runtime.grad_sync import GradSync, GradSyncFactory


@dataclass
class _Stage:
    module: torch.nn.Module
    args: tuple[fx.Node, ...]
    produced: tuple[str, ...]      # names of the top-level values this partition outputs
    sends: tuple[str, ...]         # names live after this partition (sent to the next rank)


@dataclass
class _RankState:
    inbox: list = field(default_factory=list)
    fwd: dict = field(default_factory=dict)   # (p, b) -> (leaves: dict, out: dict | loss)
    done_bwd: set = field(default_factory=set)
    grad_out: dict = field(default_factory=dict)  # (p, b) -> grads list for out floats
    loss: float = 0.0


def _attr(root: torch.nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def check_all_owned(root: torch.nn.Module, owned_ids: set[int]) -> None:
    """Raise ``PlanError`` naming the trainable parameters of ``root`` whose ids are not in
    ``owned_ids``: no partition would all-reduce them, so the ranks' copies would drift apart
    while the loss still looks right."""
    left = [k for k, prm in root.named_parameters()
            if prm.requires_grad and id(prm) not in owned_ids]
    if left:
        raise PlanError(f"round_robin: parameter(s) {', '.join(map(repr, left[:5]))}"
                        f"{' and more' if len(left) > 5 else ''} belong to no partition, so "
                        "their gradients would never be all-reduced and the ranks would drift "
                        "apart")


def _recv_buffer(like: torch.Tensor) -> torch.Tensor:
    """A contiguous buffer to receive a tensor shaped like ``like`` (point-to-point ops need
    contiguous buffers; ``empty_like`` keeps a transposed tensor's strides)."""
    return torch.empty(like.shape, dtype=like.dtype, device=like.device)


def _floats(values: dict[str, torch.Tensor]) -> list[str]:
    return [k for k, v in values.items() if v.is_floating_point()]


def from_plan(gm: fx.GraphModule, plan: Any) -> "RoundRobinExecutor":
    """The executor of a ``round_robin`` plan on the graph the pass split into partitions."""
    return RoundRobinExecutor(gm, plan)


class RoundRobinExecutor:
    """Runs a round-robin plan's schedule on the split graph ``split`` (see module doc).
    ``model``: the module whose trainable parameters must each be owned by one partition
    (the traced graph before the split, which shares the model's parameters; default
    ``split``).
    ``stats`` accumulates ``steps``, ``switches`` and ``switch_bytes`` (per rank); ``syncs``
    holds each partition's gradient sync once ``use_grad_sync`` set one and a step ran."""

    def __init__(self, split: fx.GraphModule, plan: Any,
                 model: Optional[torch.nn.Module] = None):
        self.split = split
        self._model = model if model is not None else split
        self.plan = plan
        self.n = plan.partitions
        self.stats = {"steps": 0, "switches": 0, "switch_bytes": 0}
        self._sync_factory: Optional[GradSyncFactory] = None
        self.syncs: dict[int, GradSync] = {}
        self._stages = self._build_stages()
        self._placeholders = [x for x in split.graph.nodes if x.op == "placeholder"]
        self._output = next(x for x in split.graph.nodes if x.op == "output")
        self._owned = self._param_owners()
        self._buffers = self._buffer_owners()

    def _build_stages(self) -> list[_Stage]:
        g = self.split.graph
        calls = [x for x in g.nodes if x.op == "call_module"]
        if len(calls) != self.n:
            raise ValueError(f"round_robin: the split graph has {len(calls)} partitions, "
                             f"the plan {self.n}")
        part_of: dict[str, int] = {}
        produced: list[list[str]] = [[] for _ in calls]
        for p, call in enumerate(calls):
            for u in call.users:
                part_of[u.name] = p
                produced[p].append(u.name)
        last_use: dict[str, int] = {}
        for p, call in enumerate(calls):
            for a in call.args:
                if isinstance(a, fx.Node) and a.op != "placeholder":
                    last_use[a.name] = max(last_use.get(a.name, -1), p)
        out_node = next(x for x in g.nodes if x.op == "output")
        for a in out_node.all_input_nodes:
            if a.op != "placeholder":
                last_use[a.name] = self.n
        order = [x.name for x in g.nodes]
        stages = []
        for p, call in enumerate(calls):
            sends = tuple(nm for nm in order if nm in part_of and part_of[nm] <= p
                          and last_use.get(nm, -1) > p)
            stages.append(_Stage(self.split.get_submodule(call.target), tuple(call.args),
                                 tuple(produced[p]), sends))
        return stages

    def _partition_params(self, p: int) -> list[tuple[str, torch.nn.Parameter]]:
        """The trainable parameters partition ``p`` uses: its submodule's and those the top
        level hands it through ``get_attr`` (``x + self.pos_embedding``, a ``cls_token``,
        weights used through ``addmm``)."""
        st = self._stages[p]
        named = [(f"submod_{p}.{k}", prm) for k, prm in st.module.named_parameters()]
        for a in st.args:
            value = _attr(self.split, a.target) if a.op == "get_attr" else None
            if isinstance(value, torch.nn.Parameter):
                named.append((str(a.target), value))
        return [(k, prm) for k, prm in named if prm.requires_grad]

    def _param_owners(self) -> list[list[tuple[str, torch.nn.Parameter]]]:
        """Each trainable parameter's owning partition, the one whose all-reduce syncs it: the
        lowest partition using it (its last backward). Raises ``PlanError`` naming any
        trainable parameter of the graph that no partition owns."""
        owned: list[list[tuple[str, torch.nn.Parameter]]] = [[] for _ in range(self.n)]
        seen: set[int] = set()
        for p in range(self.n):
            for name, prm in self._partition_params(p):
                if id(prm) not in seen:
                    seen.add(id(prm))
                    owned[p].append((name, prm))
        check_all_owned(self._model, seen)
        return owned

    def use_grad_sync(self, factory: GradSyncFactory) -> None:
        """Sync each partition's gradients through its own ``factory(None)`` (a
        :class:`~tidal.runtime.grad_sync.GradSync`, e.g. the ``compression`` pass's
        compressor, with its own error-feedback state) instead of a plain all-reduce."""
        if self.syncs:
            raise RuntimeError("round_robin: the gradient sync is fixed after the first step")
        self._sync_factory = factory

    def _buffer_owners(self) -> list[list[torch.Tensor]]:
        """Per partition, its floating-point buffers (each in its first partition only)."""
        owned: list[list[torch.Tensor]] = [[] for _ in range(self.n)]
        seen: set[int] = set()
        for p, st in enumerate(self._stages):
            for b in st.module.buffers():
                if id(b) not in seen and b.is_floating_point():
                    seen.add(id(b))
                    owned[p].append(b)
        return owned

    # -- the Executor protocol ------------------------------------------------------------
    def forward(self, gm: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
        """Inference: the split graph in this process."""
        return self.split(*args, **kwargs)

    def step(self, gm: fx.GraphModule, model: torch.nn.Module, inputs: tuple, targets: Any,
             loss_fn: Callable, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """One training step of the global batch under the round-robin schedule."""
        rank, world = rank_and_size()
        if world > 1 and world != self.n:
            raise ValueError(f"round_robin: planned for {self.n} ranks but the world size is "
                             f"{world}; compile with partitions={world}")
        here = [rank] if world > 1 else list(range(self.n))
        batches = split_batch(tuple(inputs), self.n, "round_robin global batch")
        tgts = split_batch(targets, self.n, "round_robin targets")
        optimizer.zero_grad(set_to_none=True)
        states = {r: _RankState() for r in here}
        sched = self.plan.schedule
        length = len(sched.ranks[0])
        for k in range(length):
            outgoing: list[tuple[int, Any, list[torch.Tensor]]] = []
            for r in here:
                a = sched.ranks[r][k]
                st = states[r]
                if a.kind == "S":
                    self.stats["switches"] += r == here[0]
                    self.stats["switch_bytes"] += (r == here[0]) * self.plan.param_bytes[
                        a.partition]
                elif a.kind == "F":
                    self._forward(st, a.partition, a.batch, batches[a.batch], tgts[a.batch],
                                  loss_fn)
                elif a.kind == "B":
                    self._backward(st, a.partition, a.batch)
                elif a.kind == "X":
                    outgoing.append(self._exchange(r, st, a.partition, a.batch, world))
                elif a.kind == "A":
                    self._all_reduce(a.partition, world)
            if world == 1:
                for dest, key, tensors in outgoing:
                    if key is None:
                        states[dest].inbox = tensors
                    else:
                        states[dest].grad_out[key] = tensors
        loss = torch.tensor(sum(s.loss for s in states.values()))
        if world > 1:
            dist.all_reduce(loss)
        optimizer.step()
        self.stats["steps"] += 1
        return loss

    # -- actions --------------------------------------------------------------------------
    def _forward(self, st: _RankState, p: int, b: int, inputs: tuple, target: Any,
                 loss_fn: Callable) -> None:
        stage = self._stages[p]
        names = self._stages[p - 1].sends if p > 0 else ()
        if len(st.inbox) != len(names):
            raise RuntimeError(f"round_robin: partition {p} batch {b} expected {len(names)} "
                               f"activations, received {len(st.inbox)}")
        leaves = {}
        for nm, t in zip(names, st.inbox):
            leaves[nm] = t.detach().requires_grad_(True) if t.is_floating_point() else t
        st.inbox = []
        # a clone, so that an in-place first op (ReLU(inplace=True)) does not touch the leaf
        args = [self._input(x, inputs) if x.op in ("placeholder", "get_attr") else
                (leaves[x.name].clone() if leaves[x.name].requires_grad else leaves[x.name])
                for x in stage.args]
        out = stage.module(*args)
        env = dict(leaves)
        env.update(zip(stage.produced, out))
        if p < self.n - 1:
            sent = {nm: env[nm] for nm in stage.sends}
            for nm, v in sent.items():
                if not isinstance(v, torch.Tensor):
                    raise TypeError(f"round_robin: value {nm!r} crossing from partition {p} "
                                    f"is a {type(v).__name__}, not a tensor")
            st.fwd[(p, b)] = (leaves, sent)
        else:
            result = torch.fx.node.map_arg(self._output.args[0], lambda x: env[x.name]
                                           if x.op not in ("placeholder", "get_attr")
                                           else self._input(x, inputs))
            loss = loss_fn(result, target) / self.n
            st.loss += float(loss.detach())
            st.fwd[(p, b)] = (leaves, loss)

    def _input(self, node: fx.Node, inputs: tuple) -> Any:
        """The value of a model-input placeholder (the batch slice, or its pinned default) or
        of a top-level attribute."""
        if node.op == "get_attr":
            return _attr(self.split, node.target)
        i = self._placeholders.index(node)
        if i < len(inputs):
            return inputs[i]
        return node.args[0] if node.args else None

    def _backward(self, st: _RankState, p: int, b: int) -> None:
        leaves, out = st.fwd[(p, b)]
        if p == self.n - 1:
            out.backward()
        else:
            grads = dict(zip(_floats(out), st.grad_out.pop((p, b))))
            produced = set(self._stages[p].produced)
            tensors, gts = [], []
            for nm, g in grads.items():
                if nm in produced:
                    if out[nm].requires_grad:
                        tensors.append(out[nm])
                        gts.append(g)
                else:  # passed through this partition unchanged
                    leaf = leaves[nm]
                    leaf.grad = g.clone() if leaf.grad is None else leaf.grad + g
            if tensors:
                torch.autograd.backward(tensors, gts)
        st.done_bwd.add((p, b))

    def _exchange(self, r: int, st: _RankState, p: int, b: int, world: int
                  ) -> tuple[int, Any, list[torch.Tensor]]:
        """Forward: send F p,b's activations to rank r+1 and receive partition p+1's input
        from r−1. Backward: send B p,b's input gradients to r−1 and receive the gradients of
        partition p−1's outputs (batch b's successor on this rank) from r+1. Returns
        (destination, key at the destination or None for its inbox, tensors sent)."""
        n = self.n
        forward = (p, b) not in st.done_bwd
        if forward:
            send = [t.detach().contiguous() for t in st.fwd[(p, b)][1].values()]
            recv = [_recv_buffer(t) for t in send]
            dest, src, key = (r + 1) % n, (r - 1) % n, None
        else:
            leaves = st.fwd[(p, b)][0]
            send = [(leaves[k].grad if leaves[k].grad is not None
                     else torch.zeros_like(leaves[k])).contiguous() for k in _floats(leaves)]
            mine = (p - 1, (r - p + 1) % n)
            prev_out = st.fwd[mine][1]
            recv = [_recv_buffer(prev_out[k]) for k in _floats(prev_out)]
            dest, src, key = (r - 1) % n, (r + 1) % n, (p - 1, b)
        if world > 1:
            ops = [dist.P2POp(dist.isend, t, dest) for t in send]
            ops += [dist.P2POp(dist.irecv, t, src) for t in recv]
            if ops:
                for req in dist.batch_isend_irecv(ops):
                    req.wait()
            if forward:
                st.inbox = recv
            else:
                st.grad_out[mine] = recv
        return dest, key, send

    def _all_reduce(self, p: int, world: int) -> None:
        """Sum partition ``p``'s gradients over the ranks and average its floating-point
        buffers (BatchNorm's running statistics: every rank ran ``p`` on its own batch)."""
        if world == 1:
            return
        named = [(k, prm) for k, prm in self._owned[p] if prm.grad is not None]
        if self._sync_factory is None:
            all_reduce_tensors([prm.grad for _, prm in named])
        elif named:
            if p not in self.syncs:
                self.syncs[p] = self._sync_factory(None)
            synced = self.syncs[p]({k: prm.grad for k, prm in named})
            for k, prm in named:  # the sync averages; a round-robin step sums the N batches
                prm.grad.copy_(synced[k] * world)
        all_reduce_tensors(self._buffers[p], average=True)
