"""DeepPool's burst-parallel planner (§4): per-layer GPU counts under a GPU-sec amplification
limit, as a pure function of numpy cost arrays.

Inputs (a :class:`BurstProblem`): the layer DAG (names in topological order and each layer's
predecessors), ``comp[i, k]`` (forward + backward µs of layer ``i`` at the per-GPU batch
``ceil(B / counts[k])``), ``sync[i, k]`` (gradient all-reduce µs of its parameters on
``counts[k]`` GPUs), the bytes per sample of each layer's output, the link bandwidth and
latency. The time model (DeepPool §4.1):

* a layer on ``g`` GPUs costs ``comm_in + comp(i, g) + sync(i, g)``; its GPU-sec amplification
  is ``Amp(i, g) = T(i, g) * g / comp(i, 1)`` with ``T`` that sum;
* moving a layer's output between GPU sets (``comm``) costs, forward and backward, the largest
  number of samples one GPU sends or receives times the bytes per sample over the bandwidth,
  plus the latency. Nested sets share their first ranks (``g -> h`` moves
  ``max(ceil(B/s) - ceil(B/b), ceil(B/b))`` samples per GPU, ``s``/``b`` the smaller/bigger
  count); a branch placed on other GPUs moves every sample (``ceil(B / min(g, h))``);
* a branch/join block (``tidal.ir.layer_graph.branch_blocks``) is reduced to one transition
  ``tr(fork, h) -> (join, g)``: each branch is searched with the fork fixed at ``h``, the
  critical (longest) branch stays on the fork's GPUs and each other branch moves to GPUs of its
  own (after those the branches that stay use) when that shortens the block and the GPUs fit
  (DeepPool's multi-chain graph reduction);
  branches on the same GPUs run one after another, branches on other GPUs overlap. Blocks
  nested inside a branch run serially. Communication into a join is charged to the block.

Two searches: ``algorithm="paper"`` is Algorithm 1 as printed (tables S and T, a predecessor
state is eligible when ``Amp(i-1, h) <= max(bestAmp, AmpLimit)``, scanned in increasing ``h``;
the last layer is checked by a final zero-cost step). ``algorithm="exact"`` (default) enforces
``Amp(i, g) <= limit`` on each edge ``(i-1, h) -> (i, g)``, which makes the chain DP an exact
constrained shortest path (it equals exhaustive search). Either way data parallelism (every
layer on all ``G`` GPUs) is the baseline: a plan that does not beat it is replaced by it
(``BurstPlan.fallback``). The plan is data in ``tidal.ir.plans.burst``, where the runtime
reads it.

Gradient sync that overlaps backward (``BurstProblem(overlap=OverlapSync(...))``, what
``burst_parallel``'s default ``sync="overlap"`` builds): a plan's time is that of the runtime's
execution, where each bucket's all-reduce runs beside the rest of backward and only what runs
past its end counts (:class:`OverlapSync`); the data-parallel baseline is DDP's. That time is
not a sum of per-layer terms, so the search runs the DP above on per-layer costs linearised at
a reference plan and corrects them from the plan it finds (``_plan_overlap``); the plan
returned is never predicted slower than data parallelism, nor than the no-overlap search's
plan, under that execution.

Example:
    >>> import numpy as np
    >>> from tidal.passes.burst_planner import BurstProblem, plan_burst
    >>> counts = (1, 2, 4)
    >>> comp = np.array([[400., 200., 100.], [40., 38., 37.], [300., 150., 75.]])
    >>> sync = np.array([[0., 5., 8.], [0., 50., 80.], [0., 5., 8.]])
    >>> p = BurstProblem(("conv", "fc", "head"), ((), (0,), (1,)), comp, sync,
    ...                  act_bytes=np.array([64., 64., 64.]), counts=counts, batch=8,
    ...                  bytes_per_us=1e4, latency_us=1.0)
    >>> plan = plan_burst(p, amp_limit=2.0)
    >>> [l.gpus for l in plan.layers], plan.time_us < plan.dp_time_us
    ([4, 1, 4], True)

    The same layers when sync overlaps backward (backward is 2/3 of each layer's time; fc syncs
    300 kB): in buckets of 100 kB, fc's all-reduce runs beside conv's backward and data
    parallelism wins; in one bucket (DDP's 25 MiB), issued after the last backward, it does not.

    >>> from tidal.passes.burst_planner import OverlapSync
    >>> for cap in (1e5, 25 * 2**20):
    ...     ov = OverlapSync(comp * 2 / 3, np.array([2e4, 3e5, 2e4]), bucket_bytes=cap)
    ...     q = BurstProblem(p.names, p.preds, comp, sync, p.act_bytes, counts, 8, 1e4, 1.0,
    ...                      overlap=ov)
    ...     plan = plan_burst(q, amp_limit=2.0)
    ...     print([l.gpus for l in plan.layers], round(plan.time_us), round(plan.dp_time_us))
    [4, 4, 4] 221 221
    [4, 1, 4] 228 269
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Optional, Sequence, Union

import networkx as nx
import numpy as np

from tidal.ir import layer_graph
from tidal.ir.comm_cost import DDP_BUCKET_BYTES, bucket_partition, ring_allreduce_us
from tidal.ir.plans.burst import BurstPlan, LayerPlacement

_INF = np.inf
_ALGORITHMS = ("exact", "paper")


# --------------------------------------------------------------------------- cost helpers


def candidate_counts(gpus: int, power_of_two: bool = True) -> tuple[int, ...]:
    """GPU counts the planner considers: 1, 2, 4, ..., ``gpus`` (or every count 1..gpus).
    Raises ``ValueError`` when ``gpus`` is not a power of two in power-of-two mode."""
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus={gpus!r}: must be a positive integer")
    if not power_of_two:
        return tuple(range(1, gpus + 1))
    if gpus & (gpus - 1):
        raise ValueError(f"gpus={gpus}: not a power of two (power_of_two=True); use a power of "
                         f"two or power_of_two=False")
    return tuple(1 << k for k in range(gpus.bit_length()))


def per_gpu_batch(batch: int, gpus: int) -> int:
    """Samples the busiest of ``gpus`` GPUs gets when ``batch`` is split evenly."""
    return -(-batch // gpus)


def split_batch(batch: int, gpus: int) -> tuple[tuple[int, int], ...]:
    """Contiguous sample ranges ``[lo, hi)`` of ``batch`` over ``gpus`` GPUs (the first
    ``batch % gpus`` get one more)."""
    q, r = divmod(batch, gpus)
    out, lo = [], 0
    for k in range(gpus):
        hi = lo + q + (1 if k < r else 0)
        out.append((lo, hi))
        lo = hi
    return tuple(out)


def allreduce_us(nbytes: float, gpus: int, bytes_per_us: float, latency_us: float) -> float:
    """sync(i, g): ring all-reduce of a layer's gradients on ``gpus`` GPUs
    (``tidal.ir.comm_cost.ring_allreduce_us``); 0 on one GPU or no bytes."""
    return ring_allreduce_us(nbytes, gpus, bytes_per_us, latency_us)


# --------------------------------------------------------------------------- the problem


@dataclass(frozen=True, eq=False)
class OverlapSync:
    """What ``sync="overlap"`` needs beside a problem's costs: each layer's backward µs at each
    candidate count (``bwd``, ``(L, K)``, the part of ``comp`` that runs in backward), the
    bytes of gradient it syncs (``param_bytes``, ``(L,)``) and the bucket cap (DDP's 25 MiB).

    The execution it models is the runtime's (``tidal.runtime.programs.burst``): all forwards,
    then all backwards in reverse layer order (each layer's backward plus the return half of
    its incoming transfer; a block's branches on GPUs of their own beside the others); in
    backward order, the gradients of consecutive layers on the same two or more ranks (a run
    ends where the GPU set changes) go into buckets of at most ``bucket_bytes``; a bucket's
    ring all-reduce (``tidal.ir.comm_cost.ring_allreduce_us``, one latency per bucket) is
    issued when the backward of its last layer has ended and runs on its ranks' communication
    stream, one collective after another in issue order, beside the rest of backward. The
    iteration ends when backward and the last all-reduce have ended. On data parallelism this
    is the simulator's DDP (``tidal.sim.programs.data_parallel``); on other plans, its
    ``burst_execution(..., sync="overlap")`` but for transfers and all-reduces sharing a link
    there.

    >>> import numpy as np
    >>> OverlapSync(np.ones((2, 3)), np.array([4e6, 0.0])).bucket_bytes == 25 * 2**20
    True
    """

    bwd: np.ndarray
    param_bytes: np.ndarray
    bucket_bytes: float = DDP_BUCKET_BYTES


@dataclass(eq=False)
class _Chain:
    """Layers run one after another; ``blocks`` maps a join layer to the block before it."""

    layers: list[int]
    blocks: dict[int, "_Block"] = field(default_factory=dict)


@dataclass(eq=False)
class _Block:
    fork: int
    join: int
    branches: list[Optional[_Chain]]  # None: a skip connection fork -> join


class BurstProblem:
    """Costs and structure the planner searches over (see the module docstring).

    ``names``: layers in topological order; ``preds[i]``: indices of the layers whose output
    layer ``i`` reads (empty for a layer that reads only model inputs); ``comp``/``sync``:
    arrays of shape ``(L, len(counts))`` in µs; ``act_bytes``: output bytes per sample of each
    layer; ``counts``: candidate GPU counts, increasing, starting at 1 (the last is ``G``);
    ``batch``: the global batch, at least ``G`` unless ``allow_idle`` (then counts above the
    batch give some GPUs no sample; used to time the search at DeepPool's 1024-GPU scale).
    ``overlap``: gradient sync overlaps backward (an :class:`OverlapSync`); ``sync`` is then
    what a layer's all-reduce costs before any of it is hidden, and a plan's time is that of
    the execution :class:`OverlapSync` describes. Without it every layer pays ``sync`` in full
    after its compute (DeepPool §4). Raises ``ValueError`` naming the value at fault, including
    a cycle or a branch shape that is not a nest of fork/join blocks.
    """

    def __init__(self, names: Sequence[str], preds: Sequence[Sequence[int]], comp: np.ndarray,
                 sync: np.ndarray, act_bytes: np.ndarray, counts: Sequence[int], batch: int,
                 bytes_per_us: float, latency_us: float, *, allow_idle: bool = False,
                 overlap: Optional[OverlapSync] = None):
        self.allow_idle = allow_idle
        self.overlap = overlap
        self.names = tuple(str(n) for n in names)
        self.preds = tuple(tuple(int(p) for p in ps) for ps in preds)
        self.counts = np.asarray(counts, dtype=np.int64)
        self.comp = np.asarray(comp, dtype=np.float64)
        self.sync = np.asarray(sync, dtype=np.float64)
        self.act_bytes = np.asarray(act_bytes, dtype=np.float64)
        self.batch = batch
        self.bytes_per_us = float(bytes_per_us)
        self.latency_us = float(latency_us)
        self._check()
        self.top = _parse(self.names, self.preds)
        src, dst, self._branch_entries = [], [], []
        for chain in _all_chains(self.top):
            src += [a for a, b in zip(chain.layers, chain.layers[1:]) if b not in chain.blocks]
            dst += [b for b in chain.layers[1:] if b not in chain.blocks]
            for j, blk in chain.blocks.items():
                self._branch_entries += [(br.layers[0], blk.fork, (j, b))
                                         for b, br in enumerate(blk.branches) if br is not None]
        # (previous layer, layer) of every step inside a chain, a join's block excluded
        self._chain_edges = (np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64))
        pb = np.array([per_gpu_batch(batch, int(c)) for c in self.counts], dtype=np.float64)
        lo = np.minimum.outer(np.arange(len(pb)), np.arange(len(pb)))
        hi = np.maximum.outer(np.arange(len(pb)), np.arange(len(pb)))
        self._moved = {
            "overlap": np.where(lo == hi, 0.0, np.maximum(pb[lo] - pb[hi], pb[hi])),
            "disjoint": pb[lo],
        }
        self._edges: dict[str, np.ndarray] = {}

    @property
    def gpus(self) -> int:
        """``G``: the largest candidate count."""
        return int(self.counts[-1])

    @property
    def dp_counts(self) -> np.ndarray:
        """The data-parallel baseline as count indices: each layer on the most GPUs it can run
        on (all ``G``, except a layer whose ``comp`` is inf above some count, such as one that
        must see the whole batch on one GPU)."""
        ok = np.isfinite(self.comp) & np.isfinite(self.sync)
        return (ok.shape[1] - 1 - np.argmax(ok[:, ::-1], axis=1)).astype(np.int64)

    def _check(self) -> None:
        L, K = len(self.names), len(self.counts)
        if L == 0:
            raise ValueError("BurstProblem: no layers")
        if len(set(self.names)) != L:
            raise ValueError("BurstProblem(names=...): layer names must be unique")
        if len(self.preds) != L:
            raise ValueError(f"BurstProblem(preds=...): {len(self.preds)} entries for {L} layers")
        c = self.counts
        if K == 0 or c[0] != 1 or np.any(np.diff(c) <= 0):
            raise ValueError(f"BurstProblem(counts={tuple(c.tolist())}): must increase from 1")
        if isinstance(self.batch, bool) or not isinstance(self.batch, (int, np.integer)) \
                or self.batch < 1:
            raise ValueError(f"BurstProblem(batch={self.batch!r}): must be a positive int")
        self.batch = int(self.batch)
        if self.batch < c[-1] and not self.allow_idle:
            raise ValueError(f"BurstProblem(batch={self.batch}): global batch smaller than the "
                             f"{int(c[-1])} GPUs; every GPU needs at least one sample")
        for name, arr, shape in (("comp", self.comp, (L, K)), ("sync", self.sync, (L, K)),
                                 ("act_bytes", self.act_bytes, (L,))):
            if arr.shape != shape:
                raise ValueError(f"BurstProblem({name}=...): shape {arr.shape}, expected {shape}")
            first = arr if arr.ndim == 1 else arr[:, 0]
            if np.any(np.isnan(arr)) or np.any(arr < 0) or not np.all(np.isfinite(first)):
                raise ValueError(f"BurstProblem({name}=...): values must be >= 0, finite on one "
                                 f"GPU (inf only for a count a layer cannot run on)")
        if self.overlap is not None:
            self._check_overlap(L, K)
        if not self.bytes_per_us > 0 or self.latency_us < 0:
            raise ValueError(f"BurstProblem: bytes_per_us={self.bytes_per_us} must be > 0 and "
                             f"latency_us={self.latency_us} >= 0")
        for i, ps in enumerate(self.preds):
            for p in ps:
                if not 0 <= p < L:
                    raise ValueError(f"layer {self.names[i]!r} reads layer index {p}: "
                                     f"no such layer")
                if p >= i:
                    raise ValueError(f"layer {self.names[i]!r} reads {self.names[p]!r}, which "
                                     f"comes later: layers must be in topological order "
                                     f"(a cycle?)")

    def _check_overlap(self, L: int, K: int) -> None:
        ov = self.overlap
        if not isinstance(ov, OverlapSync):
            raise ValueError(f"BurstProblem(overlap=...): expected an OverlapSync, got "
                             f"{type(ov).__name__}")
        bwd, pb = np.asarray(ov.bwd, dtype=np.float64), np.asarray(ov.param_bytes, np.float64)
        if bwd.shape != (L, K) or pb.shape != (L,):
            raise ValueError(f"BurstProblem(overlap=...): bwd shape {bwd.shape} and param_bytes "
                             f"shape {pb.shape}, expected {(L, K)} and {(L,)}")
        finite = np.isfinite(self.comp)
        if np.any(np.isnan(bwd)) or np.any(bwd < 0) or np.any(bwd[finite] > self.comp[finite]) \
                or np.any(np.isnan(pb)) or np.any(pb < 0) or not np.all(np.isfinite(pb)):
            raise ValueError("BurstProblem(overlap=...): bwd must be >= 0 and at most comp "
                             "(backward is part of forward + backward), param_bytes finite "
                             "and >= 0")
        if not ov.bucket_bytes > 0:
            raise ValueError(f"BurstProblem(overlap=...): bucket_bytes={ov.bucket_bytes!r} must "
                             f"be > 0")
        self.overlap = OverlapSync(bwd, pb, float(ov.bucket_bytes))

    def branches(self) -> tuple[tuple[str, int], ...]:
        """``(join layer, branch index)`` of every non-empty branch of every block (the names
        ``plan_from_counts(parallel=...)`` takes)."""
        return tuple((self.names[j], b) for j, blk in _all_blocks(self.top)
                     for b, br in enumerate(blk.branches) if br is not None)

    def branch_layers(self, join: str, branch: int) -> tuple[str, ...]:
        """Names of every layer inside branch ``branch`` of the block joining at ``join``
        (nested blocks included)."""
        for j, blk in _all_blocks(self.top):
            if self.names[j] == join and 0 <= branch < len(blk.branches):
                br = blk.branches[branch]
                return () if br is None else tuple(self.names[i] for i in sorted(_members(br)))
        raise ValueError(f"no branch {branch} of a block joining at {join!r}")

    def comm(self, layer: int, kind: str = "overlap") -> np.ndarray:
        """``(K, K)`` forward + backward time to move layer ``layer``'s output from ``counts[h]``
        GPUs (row) to ``counts[g]`` GPUs (column); ``kind`` ``"disjoint"`` for another GPU set."""
        return self.comm_all(kind)[layer]

    def comm_all(self, kind: str = "overlap") -> np.ndarray:
        """``comm`` of every layer at once: an ``(L, K, K)`` array (computed once per kind)."""
        if kind not in self._edges:
            moved = self._moved[kind][None, :, :]
            a = self.act_bytes[:, None, None]
            self._edges[kind] = np.where(moved * a > 0, 2.0 * (moved * a / self.bytes_per_us
                                                               + self.latency_us), 0.0)
        return self._edges[kind]


def _parse(names: tuple[str, ...], preds: tuple[tuple[int, ...], ...]) -> _Chain:
    """The nested chain/block structure of the layer DAG (ValueError if it is not one)."""
    g = nx.DiGraph(inputs=[i for i, ps in enumerate(preds) if not ps], outputs=[])
    for i in range(len(names)):
        g.add_node(i, order=i)
    for i, ps in enumerate(preds):
        for p in ps:
            g.add_edge(p, i)
    sinks = [i for i in g.nodes if g.out_degree(i) == 0]
    if len(sinks) != 1:
        raise ValueError(f"layer graph has {len(sinks)} output layers "
                         f"{[names[i] for i in sinks[:4]]}: unsupported branch shape (need one)")
    try:
        blocks = layer_graph.branch_blocks(g, label=names.__getitem__)
    except layer_graph.NotSeriesParallel as e:
        raise layer_graph.NotSeriesParallel(f"unsupported branch shape: {e}", e.fork,
                                            e.join) from None
    return _build_chain(list(range(len(names))), blocks, None, names, preds)


def check_structure(names: Sequence[str], preds: Sequence[Sequence[int]]) -> None:
    """Raise ``tidal.ir.layer_graph.NotSeriesParallel`` (with the offending fork and join
    indices) when the layer DAG is not a chain of nested fork/join blocks the planner can
    search, ``ValueError`` when it has several output layers."""
    _parse(tuple(names), tuple(tuple(p) for p in preds))


def _build_chain(members: list[int], blocks, entry: Optional[int], names, preds) -> _Chain:
    inside = {i for b in blocks for br in b.branches for i in br}
    layers = [i for i in members if i not in inside]
    chain = _Chain(layers)
    pos = {i: k for k, i in enumerate(layers)}
    for b in blocks:
        f, j = b.fork, b.join
        if f not in pos or j not in pos or pos[j] != pos[f] + 1:
            raise layer_graph.NotSeriesParallel(
                f"unsupported branch shape: block from {names[f]!r} to {names[j]!r} is not a "
                f"fork followed by its join", f, j)
        branches: list[Optional[_Chain]] = []
        for br in b.branches:
            if not br:
                branches.append(None)
                continue
            nested = [n for n in b.nested if n.fork in set(br)]
            branches.append(_build_chain(list(br), nested, f, names, preds))
        chain.blocks[j] = _Block(f, j, branches)
    for k, i in enumerate(layers):
        if i in chain.blocks:
            blk = chain.blocks[i]
            want = {br.layers[-1] for br in blk.branches if br is not None}
            if any(br is None for br in blk.branches):
                want.add(blk.fork)
        elif k > 0:
            want = {layers[k - 1]}
        else:
            want = set() if entry is None else {entry}
        if set(preds[i]) != want:
            extra = sorted(names[p] for p in set(preds[i]) ^ want)
            outside = sorted(set(preds[i]) - want)
            raise layer_graph.NotSeriesParallel(
                f"unsupported branch shape at layer {names[i]!r}: its inputs "
                f"{sorted(names[p] for p in preds[i])} are not the previous layer of a chain or "
                f"the branches of one block (mismatch: {extra})",
                outside[0] if outside else None, i)
    return chain


# --------------------------------------------------------------------------- evaluation


def _eval_chain(p: BurstProblem, chain: _Chain, ks: np.ndarray, par: set, terms: list) -> float:
    t = 0.0
    for i in chain.layers:
        if i in chain.blocks:
            t += _eval_block(p, chain.blocks[i], ks, par, terms)
        t += terms[i]
    return t


def _eval_block(p: BurstProblem, blk: _Block, ks: np.ndarray, par: set, terms: list) -> float:
    kf, kj = ks[blk.fork], ks[blk.join]
    serial, par_t = 0.0, 0.0
    for b, br in enumerate(blk.branches):
        if br is None:
            serial += p.comm(blk.fork)[kf, kj]
            continue
        kind = "disjoint" if (blk.join, b) in par else "overlap"
        t = _eval_chain(p, br, ks, par, terms)
        t += p.comm(br.layers[-1], kind)[ks[br.layers[-1]], kj]
        if kind == "disjoint":
            par_t = max(par_t, t)
        else:
            serial += t
    return max(serial, par_t)


@dataclass(frozen=True, eq=False)
class _Eval:
    """A plan's predicted ``time``, each layer's incoming communication (``comm``) and the sync
    time it adds to the iteration (``sync``: in full, or under overlap the part of its share of
    a bucket that runs after backward has ended) and, under overlap, each layer's ``budget``:
    how long before the end of backward its gradients start moving (or would, were the layer
    synced), the time behind which its all-reduce hides."""

    time: float
    comm: np.ndarray
    sync: np.ndarray
    budget: Optional[np.ndarray] = None


def _evaluate(p: BurstProblem, ks: np.ndarray, par: set,
              offset: Optional[np.ndarray] = None) -> _Eval:
    """:class:`_Eval` of a plan (``offset``: each layer's first rank, if known)."""
    comm = np.zeros(len(p.names))
    src, dst = p._chain_edges
    comm[dst] = p.comm_all()[src, ks[src], ks[dst]]
    for first, fork, key in p._branch_entries:  # a branch's first layer reads the fork
        comm[first] = p.comm(fork, "disjoint" if key in par else "overlap")[ks[fork], ks[first]]
    ar = np.arange(len(ks))
    if p.overlap is not None:
        return _overlap_eval(p, ks, _assign(p, ks, par) if offset is None else offset, par,
                             comm)
    sync = p.sync[ar, ks]
    terms = (comm + p.comp[ar, ks] + sync).tolist()
    return _Eval(_eval_chain(p, p.top, ks, par, terms), comm, sync)


def evaluate(problem: BurstProblem, counts: Sequence[int],
             parallel: Iterable[tuple[int, int]] = ()) -> tuple[float, np.ndarray]:
    """Predicted iteration time (µs) of a plan given as count *indices* per layer and the
    ``(join index, branch index)`` pairs run on GPUs of their own, and each layer's incoming
    communication time. An independent re-computation of the time model the search uses; for a
    problem with ``overlap``, the time of the execution :class:`OverlapSync` describes."""
    e = _evaluate(problem, np.asarray(counts, dtype=np.int64), set(parallel))
    return e.time, e.comm


def _backward(p: BurstProblem, chain: _Chain, ks: np.ndarray, par: set, back: list,
              ends: list, t: float) -> float:
    """Walk ``chain``'s backward from time ``t``: layers in reverse order, each taking
    ``back[i]``; a block's branches on the fork's GPUs one after another, those on GPUs of their
    own beside them. Records when each layer's backward ends (``ends``); returns the end."""
    for i in reversed(chain.layers):
        t += back[i]
        ends[i] = t
        if i in chain.blocks:
            blk = chain.blocks[i]
            kf, kj = ks[blk.fork], ks[blk.join]
            serial = last = t
            for b in reversed(range(len(blk.branches))):
                br = blk.branches[b]
                if br is None:  # a skip connection: the fork's gradient arrives
                    serial += p.comm(blk.fork)[kf, kj] / 2
                    continue
                own = (blk.join, b) in par
                out = p.comm(br.layers[-1], "disjoint" if own else "overlap")[
                    ks[br.layers[-1]], kj] / 2
                if own:
                    last = max(last, _backward(p, br, ks, par, back, ends, t + out))
                else:
                    serial = _backward(p, br, ks, par, back, ends, serial + out)
            t = max(serial, last)
    return t


def _sync_buckets(p: BurstProblem, ks: np.ndarray, offset: np.ndarray
                  ) -> list[tuple[int, int, list]]:
    """``(first rank, GPUs, layers in backward order)`` of each gradient bucket of a plan under
    :class:`OverlapSync`, in issue order: as ``tidal.runtime.programs.burst.sync_buckets``
    cuts them, a run ends wherever the GPU set changes (a layer on another set, one GPU
    included, ends it; a layer without parameters on the same set does not)."""
    ov = p.overlap
    offset, gpus = offset.tolist(), p.counts[ks].tolist()
    runs: list[tuple[tuple[int, int], list[int]]] = []
    for i in range(len(ks) - 1, -1, -1):
        if not runs or runs[-1][0] != (offset[i], gpus[i]):
            runs.append(((offset[i], gpus[i]), []))
        if ov.param_bytes[i] > 0 and gpus[i] > 1:
            runs[-1][1].append(i)
    return [(o, g, [run[k] for k in part]) for (o, g), run in runs if run
            for part in bucket_partition(ov.param_bytes[run].tolist(), ov.bucket_bytes)]


def _overlap_eval(p: BurstProblem, ks: np.ndarray, offset: np.ndarray, par: set,
                  comm: np.ndarray) -> _Eval:
    """:func:`_evaluate` under :class:`OverlapSync`: the critical path of transfers and
    compute, plus what the last all-reduce runs past the end of backward. Each rank's
    communication stream takes the buckets one after another in issue order."""
    ov, L = p.overlap, len(ks)
    ar = np.arange(L)
    time = _eval_chain(p, p.top, ks, par, (comm + p.comp[ar, ks]).tolist())
    ends = [0.0] * L
    tb = _backward(p, p.top, ks, par, (ov.bwd[ar, ks] + comm / 2).tolist(), ends, 0.0)
    free = np.zeros(p.gpus)  # when each rank's communication stream is next free
    sync, start = np.zeros(L), np.full(L, np.nan)
    last, first_rank = tb, []  # (issued, ended) of the buckets on rank 0
    for o, g, layers in _sync_buckets(p, ks, offset):
        nbytes = float(ov.param_bytes[layers].sum())
        d = ring_allreduce_us(nbytes, g, p.bytes_per_us, p.latency_us)
        issued = max(ends[i] for i in layers)
        s = max(issued, float(free[o:o + g].max()))
        free[o:o + g] = s + d
        last = max(last, s + d)
        if o == 0:
            first_rank.append((issued, s + d))
        for i in layers:  # each layer's share of the bucket, in order
            di = d * float(ov.param_bytes[i]) / nbytes
            start[i] = s
            sync[i] = max(0.0, min(di, s + di - tb))
            s += di
    end = np.array(ends)
    if first_rank:  # a layer not synced would wait for rank 0's stream as it is then
        issued, ended = np.array(first_rank).T
        queued = np.where(issued[None, :] <= end[:, None], ended[None, :], 0.0).max(axis=1)
    else:
        queued = np.zeros(L)
    wait = np.where(np.isnan(start), np.maximum(end, queued), start)
    return _Eval(time + last - tb, comm, sync, np.maximum(tb - wait, 0.0))


def _assign(p: BurstProblem, counts: np.ndarray, parallel: set) -> np.ndarray:
    """First rank of each layer: serial layers start at their parent's offset; the branches of a
    block on GPUs of their own come after the GPUs the branches that stay use."""
    offset = [0] * len(p.names)
    gpus = p.counts[np.asarray(counts)].tolist()

    def walk(chain: _Chain, base: int) -> int:
        """Place ``chain`` from rank ``base``; return how many GPUs it spans."""
        span = 0
        for i in chain.layers:
            offset[i] = base
            if gpus[i] > span:
                span = gpus[i]
        for blk in chain.blocks.values():
            used = 0  # GPUs of the branches that run one after another (fork/join run apart)
            for b, br in enumerate(blk.branches):
                if br is not None and (blk.join, b) not in parallel:
                    used = max(used, walk(br, base))
            nxt = base + used
            for b, br in enumerate(blk.branches):
                if br is not None and (blk.join, b) in parallel:
                    nxt += walk(br, nxt)
            span = max(span, nxt - base)
        return span

    walk(p.top, 0)
    return np.array(offset, dtype=np.int64)


def plan_from_counts(problem: BurstProblem, counts: Union[Mapping[str, int], Sequence[int]],
                     parallel: Iterable[tuple[str, int]] = (), *, amp_limit: float = 2.0,
                     algorithm: str = "given", amp_min_us: float = 0.0) -> BurstPlan:
    """A :class:`BurstPlan` for GPU ``counts`` chosen by hand (per layer, by name or in layer
    order; each one of ``problem.counts``) with the branches ``parallel`` (``(join name,
    branch index)``) on GPUs of their own. Raises ``ValueError`` for a count that is not a
    candidate or a placement that needs more than ``G`` GPUs."""
    p = problem
    if isinstance(counts, Mapping):
        missing = [n for n in p.names if n not in counts]
        if missing:
            raise ValueError(f"plan_from_counts: no GPU count for layer {missing[0]!r}")
        values = [counts[n] for n in p.names]
    else:
        values = list(counts)
        if len(values) != len(p.names):
            raise ValueError(f"plan_from_counts: {len(values)} counts for {len(p.names)} layers")
    index = {int(c): k for k, c in enumerate(p.counts)}
    ks = []
    for n, v in zip(p.names, values):
        if v not in index:
            raise ValueError(f"plan_from_counts: layer {n!r} on {v!r} GPUs; candidates are "
                             f"{tuple(index)}")
        ks.append(index[v])
    joins = {p.names[j]: (j, blk) for j, blk in _all_blocks(p.top)}
    par = set()
    for name, b in parallel:
        if name not in joins or not 0 <= b < len(joins[name][1].branches) \
                or joins[name][1].branches[b] is None:
            raise ValueError(f"plan_from_counts: parallel branch ({name!r}, {b}) is not a "
                             f"non-empty branch of a block joining at {name!r}")
        par.add((joins[name][0], b))
    return _make_plan(p, np.array(ks), par, amp_limit, algorithm, amp_min_us)


def _all_blocks(chain: _Chain):
    for j, blk in chain.blocks.items():
        yield j, blk
        for br in blk.branches:
            if br is not None:
                yield from _all_blocks(br)


def _make_plan(p: BurstProblem, ks: np.ndarray, par: set, amp_limit: float, algorithm: str,
               amp_min_us: float, fallback: bool = False,
               dp: Optional[_Eval] = None) -> BurstPlan:
    ev = _evaluate(p, ks, par)
    offset = _assign(p, ks, par)
    G, B = p.gpus, p.batch
    ar = np.arange(len(p.names))
    gpus = p.counts[ks]
    beyond = np.nonzero(offset + gpus > G)[0]
    if len(beyond):
        i = int(beyond[0])
        raise ValueError(f"layer {p.names[i]!r}: placed on ranks {offset[i]}.."
                         f"{offset[i] + gpus[i] - 1}, beyond the {G} GPUs (too many branches "
                         f"in parallel)")
    comp = p.comp[ar, ks]
    gpu_sec = 0.0
    for x in ((ev.comm + comp + ev.sync) * gpus).tolist():
        gpu_sec += x
    amp = _amplification(p, ks, ev, amp_min_us)
    in_parallel = _parallel_layers(p, par)
    splits: dict[int, tuple[tuple[int, int], ...]] = {}
    ranks: dict[tuple[int, int], tuple[int, ...]] = {}
    layers = []
    for i, (name, g, o, cp, cm, sy, a) in enumerate(zip(
            p.names, gpus.tolist(), offset.tolist(), comp.tolist(), ev.comm.tolist(),
            ev.sync.tolist(), amp.tolist())):
        if g not in splits:
            splits[g] = split_batch(B, g)
        if (o, g) not in ranks:
            ranks[o, g] = tuple(range(o, o + g))
        layers.append(LayerPlacement(name, g, ranks[o, g], splits[g], cp, cm, sy, a,
                                     i in in_parallel))
    dp_ks = p.dp_counts
    dp = dp if dp is not None else _evaluate(p, dp_ks, set())
    dp_sec = float(np.sum((dp.comm + p.comp[ar, dp_ks] + dp.sync) * p.counts[dp_ks]))
    return BurstPlan(
        world=G, batch=B, amp_limit=float(amp_limit), algorithm=algorithm, layers=tuple(layers),
        parallel_branches=tuple(sorted((p.names[j], b) for j, b in par)),
        time_us=float(ev.time), gpu_sec_us=float(gpu_sec), dp_time_us=float(dp.time),
        dp_gpu_sec_us=dp_sec, single_gpu_us=float(np.sum(p.comp[:, 0])), fallback=fallback)


def _amplification(p: BurstProblem, ks: np.ndarray, ev: _Eval, amp_min_us: float) -> np.ndarray:
    """Each layer's GPU-sec amplification ``(comm + comp + sync) * g / comp(i, 1)`` (0 for a
    layer whose one-GPU time is at most ``amp_min_us``: not checked)."""
    c1 = p.comp[:, 0]
    t = ev.comm + p.comp[np.arange(len(ks)), ks] + ev.sync
    return np.where(c1 <= amp_min_us, 0.0, t * p.counts[ks] / np.maximum(c1, 1e-12))


def _all_chains(chain: _Chain):
    yield chain
    for blk in chain.blocks.values():
        for br in blk.branches:
            if br is not None:
                yield from _all_chains(br)


def _members(chain: _Chain) -> Iterable[int]:
    yield from chain.layers
    for blk in chain.blocks.values():
        for br in blk.branches:
            if br is not None:
                yield from _members(br)


def _parallel_layers(p: BurstProblem, par: set) -> set:
    out: set = set()
    for j, blk in _all_blocks(p.top):
        for b, br in enumerate(blk.branches):
            if (j, b) in par:
                out |= set(_members(br))
    return out


# --------------------------------------------------------------------------- the search


def _block_caps(cap: int, multi: bool) -> list[int]:
    """Count-index caps a block at ``cap`` is searched with: the branches that stay share up to
    ``counts[s]`` GPUs for s in (cap, cap-1, cap-2) when branches may move (``multi``)."""
    return [c for c in (cap, cap - 1, cap - 2) if c >= 0] if multi else [cap]


def _rows(bcaps: Sequence[int], multi: bool) -> list[tuple[int, int]]:
    """``(block cap c, stay cap s)`` pairs :func:`_combine` evaluates, grouped by ``c``."""
    return [(c, s) for c in bcaps for s in _block_caps(c, multi)]


def _combine_dicts(ts: dict, tp: dict, bcaps: Sequence[int], multi: bool, nb: int,
                   counts: np.ndarray) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """:func:`_combine` from ``ts[b, s]``/``tp[b, c]`` ``(K, K)`` arrays (missing: never)."""
    K = len(counts)
    rows = _rows(bcaps, multi)
    none = np.full((K, K), _INF)
    tsb = np.stack([ts[b, s] for _, s in rows for b in range(nb)]).reshape(-1, nb, K, K)
    own = [np.stack([tp.get((b, c - j), none) for c, _ in rows for b in range(nb)])
           .reshape(-1, nb, K, K) for j in (1, 2)]
    return _combine(tsb, own, bcaps, multi, counts)[0]


def _combine(tsb: np.ndarray, own: list[np.ndarray], bcaps: Sequence[int], multi: bool,
             counts: np.ndarray) -> list[dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]]:
    """DeepPool's multi-chain reduction of one block from its branches' arrival times, for each
    block cap ``c`` in ``bcaps`` at once.

    Row ``r`` of ``tsb`` (``(R, nb, K, K)``, rows ``_rows(bcaps, multi)`` = ``(c, s)``) holds
    each branch's time (fork count h -> join count g) on the fork's GPUs with counts up to
    index ``s``; row ``r`` of ``own[j - 1]`` its time on GPUs of its own with counts up to
    ``c - j`` (inf where that is not searched). For each row the critical branch stays and the
    others, longest first, move when that shortens the block and the GPUs fit in
    ``counts[c]`` (never when ``s == c``); per ``c`` the best ``s`` wins (the first on a tie).
    Several blocks with the same number of branches may be stacked (their rows one after the
    other). Returns per block, per ``c``: the block time ``(K, K)`` and per-branch moved flags
    and caps ``(nb, K, K)``."""
    R, nb, K, _ = tsb.shape
    one = _rows(bcaps, multi)
    rows = one * (R // len(one))
    cr = np.array([c for c, _ in rows])
    sr = np.array([s for _, s in rows])
    sv = sr[:, None, None]
    ser, pmax, pgpu = tsb.sum(axis=1), np.zeros((R, K, K)), np.zeros((R, K, K))
    ii = np.arange(K)[:, None]
    jj = np.arange(K)
    fl = np.zeros((R, nb, K, K), dtype=bool)
    bc = np.broadcast_to(sv[:, None], (R, nb, K, K)).copy()
    if nb > 1 and np.any(sr < cr):
        order = np.argsort(-tsb, axis=1, kind="stable")  # branches longest first
        # flat positions of (r, order[r, pos, h, g], h, g): gather/scatter in sorted order
        flat = ((np.arange(R)[:, None, None, None] * nb + order) * K + ii) * K + jj
        t_sorted = tsb.reshape(-1).take(flat)
        may_move = (sr < cr)[:, None, None]  # with s == c every branch stays
        # slot j: a moved branch on up to counts[c - j] GPUs of its own (j = 1, then 2), if
        # they fit: GPUs left after it (exact in floats: small integers)
        cj = np.stack([cr - 1, cr - 2])[:, :, None, None]
        room = (counts[cr] - counts[sr] - counts[np.maximum(cj[:, :, 0, 0], 0)])[:, :, None, None]
        tps = np.stack([tp.reshape(-1).take(flat) for tp in own])  # (2, R, nb, K, K)
        fls = np.zeros((R, nb, K, K), dtype=bool)
        bcs = bc.copy()
        for pos in range(1, nb):  # the critical branch (pos 0) stays
            t_ser = t_sorted[:, pos]
            tc = np.where(pgpu <= room, tps[:, :, pos], _INF)
            slot = tc.argmin(axis=0)  # the first best slot (its cap matters only if finite)
            t_par = np.minimum(tc[0], tc[1])
            c_par = np.where(slot == 0, cj[0], cj[1])
            new = np.maximum(ser - t_ser, np.maximum(pmax, t_par))
            ok = may_move & np.isfinite(t_par) & (new < np.maximum(ser, pmax))
            ser = np.where(ok, ser - t_ser, ser)
            pmax = np.where(ok, np.maximum(pmax, t_par), pmax)
            pgpu = np.where(ok, pgpu + counts[c_par], pgpu)
            fls[:, pos] = ok
            bcs[:, pos] = np.where(ok, c_par, sv)
        fl.reshape(-1)[flat] = fls
        bc.reshape(-1)[flat] = bcs
    total = np.maximum(ser, pmax)
    out = []
    r0 = 0
    bi = np.arange(nb)[:, None, None]
    for _ in range(R // len(one)):
        res = {}
        for c in bcaps:
            r1 = r0 + len(_block_caps(c, multi))
            pick = total[r0:r1].argmin(axis=0) + r0  # the first best s
            res[c] = (total[pick, ii, jj], fl[pick, bi, ii, jj], bc[pick, bi, ii, jj])
            r0 = r1
        out.append(res)
    return out


@dataclass(eq=False)
class _Tables:
    """A chain's DP over an outer index ``h`` (the fork's count, or one row at top level)."""

    backs: list  # per position: (H, K) best previous count index (None at position 0)
    S: np.ndarray  # (H, K) shortest time to finish the chain's last layer on counts[k]
    amp: np.ndarray  # (H, K) amplification of the last layer's state (paper rule)
    cap: int  # largest count index the chain may use
    out_back: Optional[np.ndarray] = None  # (H, Kjoin) last layer's count into the join


@dataclass(eq=False)
class _BlockResult:
    tr: np.ndarray  # (K, K) block time fork h -> join g
    serial: dict  # (branch, cap) -> _Tables of the branch on the fork's GPUs
    par: dict  # (branch, cap) -> _Tables of the branch on GPUs of its own
    cap: np.ndarray  # (nb, K, K) cap index each branch was searched with
    flags: np.ndarray  # (nb, K, K) branch b runs on GPUs of its own


def _local_costs(p: BurstProblem, amp_min_us: float, sync: Optional[np.ndarray]
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Per layer and count: the factor turning a layer's time T into its amplification (0 where
    it is not checked), and the time it costs besides its incoming transfer (``comp`` plus
    ``sync``, the problem's unless given)."""
    c1 = p.comp[:, 0]
    ampf = np.where(c1[:, None] > amp_min_us, p.counts[None, :] / np.maximum(c1, 1e-12)[:, None],
                    0.0)
    return ampf, p.comp + (p.sync if sync is None else sync)


class _Search:
    def __init__(self, p: BurstProblem, amp_limit: float, algorithm: str, amp_min_us: float,
                 parallel_branches: bool, sync: Optional[np.ndarray] = None):
        self.p, self.limit, self.algo = p, amp_limit, algorithm
        self.parallel = parallel_branches
        self.ampf, self.local = _local_costs(p, amp_min_us, sync)
        self.blocks: dict[tuple[int, int], _BlockResult] = {}

    def step(self, S: np.ndarray, amp: np.ndarray, E: np.ndarray, C: Optional[np.ndarray],
             i: Optional[int]) -> tuple[np.ndarray, np.ndarray]:
        """Best previous state per (h, g) over edges E (K', K): returns (best S, back)."""
        if self.algo == "exact":
            if i is not None and C is not None:
                allowed = (C + self.local[i][None, :]) * self.ampf[i][None, :] <= self.limit
                E = np.where(allowed, E, _INF)
            cand = S[:, :, None] + E[None, :, :]
            return cand.min(axis=1), cand.argmin(axis=1)
        H, Kp = S.shape
        Kn = E.shape[1]
        bestS = np.full((H, Kn), _INF)
        bestAmp = np.full((H, Kn), _INF)
        back = np.zeros((H, Kn), dtype=np.int64)
        for kp in range(Kp):  # Algorithm 1's scan over h, vectorised over (outer h, g)
            s = S[:, kp, None] + E[None, kp, :]
            a = amp[:, kp, None]
            ok = (a <= np.maximum(bestAmp, self.limit)) & (s <= bestS)
            bestS = np.where(ok, s, bestS)
            back = np.where(ok, kp, back)
            bestAmp = np.where(ok, np.minimum(bestAmp, a), bestAmp)
        return bestS, back

    def chain(self, chain: _Chain, entry: np.ndarray, cap: int) -> _Tables:
        """DP over a chain whose first layer is reached by ``entry`` (H, K) comm times, using
        counts up to index ``cap``."""
        p = self.p
        K = len(p.counts)
        over = np.arange(K) > cap
        backs: list = []
        S = amp = None
        prev = None
        for pos, i in enumerate(chain.layers):
            local = np.where(over, _INF, self.local[i])
            if pos == 0:
                C = entry
                S = entry + local[None, :]
                if self.algo == "exact":
                    bad = (C + self.local[i][None, :]) * self.ampf[i][None, :] > self.limit
                    S = np.where(bad, _INF, S)
                backs.append(None)
            else:
                if i in chain.blocks:
                    res = self.block(chain.blocks[i], cap)
                    E, C = res.tr, np.zeros_like(res.tr)
                else:
                    E = C = p.comm(prev)
                best, back = self.step(S, amp, E, C, i)
                S = best + local[None, :]
                C = C[back, np.arange(K)[None, :]]
                backs.append(back)
            amp = (C + self.local[i][None, :]) * self.ampf[i][None, :]
            prev = i
        return _Tables(backs, S, amp, cap)

    def block(self, blk: _Block, cap: int) -> _BlockResult:
        """Reduce a block to its transition matrix, using counts up to index ``cap``: the
        branches that stay share up to counts[s] GPUs for s in (cap, cap-1, cap-2), each branch
        moved to GPUs of its own gets up to counts[c] of the rest (c < cap)."""
        key = (blk.join, cap)
        if key not in self.blocks:
            with np.errstate(invalid="ignore"):
                self.blocks[key] = self._reduce(blk, cap)
        return self.blocks[key]

    def _branch(self, blk: _Block, b: int, cap: int, kind: str) -> tuple[_Tables, np.ndarray]:
        p = self.p
        br = blk.branches[b]
        tab = self.chain(br, p.comm(blk.fork, kind), cap)
        arrival, tab.out_back = self.step(tab.S, tab.amp, p.comm(br.layers[-1], kind), None, None)
        return tab, arrival

    def _reduce(self, blk: _Block, cap: int) -> _BlockResult:
        p = self.p
        nb = len(blk.branches)
        caps = _block_caps(cap, self.parallel and nb > 1)
        serial: dict = {}
        par: dict = {}
        ts: dict = {}
        tp: dict = {}
        for b, br in enumerate(blk.branches):
            for c in caps:
                if br is None:
                    ts[b, c] = p.comm(blk.fork)
                    continue
                serial[b, c], ts[b, c] = self._branch(blk, b, c, "overlap")
                if c < cap:
                    par[b, c], tp[b, c] = self._branch(blk, b, c, "disjoint")
        best, flags, bcap = _combine_dicts(ts, tp, [cap], self.parallel and nb > 1, nb,
                                           p.counts)[cap]
        return _BlockResult(best, serial, par, bcap, flags)

    # ---- backtracking

    def backtrack(self, chain: _Chain, tab: _Tables, h: int, k: int, ks: np.ndarray,
                  par: set) -> None:
        for pos in range(len(chain.layers) - 1, -1, -1):
            i = chain.layers[pos]
            ks[i] = k
            if pos == 0:
                return
            kp = int(tab.backs[pos][h, k])
            if i in chain.blocks:
                self.backtrack_block(chain.blocks[i], tab.cap, kp, k, ks, par)
            k = kp

    def backtrack_block(self, blk: _Block, cap: int, hf: int, gj: int, ks: np.ndarray,
                        par: set) -> None:
        res = self.blocks[blk.join, cap]
        for b, br in enumerate(blk.branches):
            if br is None:
                continue
            c = int(res.cap[b, hf, gj])
            if res.flags[b, hf, gj]:
                par.add((blk.join, b))
                tab = res.par[b, c]
            else:
                tab = res.serial[b, c]
            self.backtrack(br, tab, hf, int(tab.out_back[hf, gj]), ks, par)


@dataclass(eq=False)
class _Batch:
    """A chain's DP for a batch of variants ``v`` (a count cap and, for a branch, whether it
    runs on the fork's GPUs or GPUs of its own) over the fork's count index ``h``. States are
    laid out ``(K, V, H)`` (count index first) so that a step's minimum runs over the outer
    axis of a contiguous array."""

    caps: np.ndarray  # (V,) largest count index variant v may use
    index: dict  # (cap, kind) -> v
    prev: list  # per position: (K, V, H) state before the step into it (None at position 0)
    edges: list  # per position: (K, K, V or 1, 1) transition into it (None at position 0)
    S: np.ndarray  # (K, V, H) shortest time to finish the last layer on counts[k]
    exit: Optional[np.ndarray] = None  # (K, K, V, 1) last layer -> join transition
    backs: Optional[list] = None  # one-row chains: per position, the best previous count


class _FastSearch:
    """``algorithm="exact"`` with the same result as :class:`_Search`, faster: every variant a
    branch is searched with (count caps x same/own GPUs) runs as one batched numpy DP, nested
    blocks are reduced for all the caps their branch needs at once, the amplification-masked
    transitions of all layers are built in one vectorised step, and back pointers are not
    stored but recomputed along the chosen path only (same sums, same first-minimum ties)."""

    def __init__(self, p: BurstProblem, amp_limit: float, amp_min_us: float,
                 parallel_branches: bool, sync: Optional[np.ndarray] = None):
        self.p, self.limit, self.parallel = p, amp_limit, parallel_branches
        self.ampf, self.local = _local_costs(p, amp_min_us, sync)
        self.K = K = len(p.counts)
        self.cols = np.arange(K)
        self.blocks: dict[tuple[int, int], _BlockResult] = {}
        self.tabs: dict[tuple[int, int], _Batch] = {}
        # transition into each layer from the previous layer of its chain, masked where the
        # layer would exceed the amplification limit (a join's block: only the mask `fits`)
        src, dst = p._chain_edges
        self.fits = self.local * self.ampf <= amp_limit
        edge = np.empty((len(p.names), K, K))
        C = p.comm_all()[src]
        edge[dst] = np.where((C + self.local[dst, None, :]) * self.ampf[dst, None, :]
                             <= amp_limit, C, _INF)
        self.edge = edge[:, :, :, None, None]
        self.moves: Optional[np.ndarray] = None  # (L, K, K, 2): both kinds of move, if blocks

    def chain(self, chain: _Chain, entry: np.ndarray, caps: np.ndarray, index: dict) -> _Batch:
        """DP over ``chain`` for the variants ``caps`` reached by ``entry`` (K, V, H)."""
        limit, blocks, edge, reduce = self.limit, chain.blocks, self.edge, np.minimum.reduce
        layers = chain.layers
        over = np.arange(self.K)[:, None] > caps[None, :]  # (K, V)
        local = self.local[layers][:, :, None, None]  # (n, K, 1, 1)
        if over.any():
            local = np.where(over[None, :, :, None], _INF, local)
        if blocks:
            self.reduce_blocks(list(blocks.values()), caps)
        i = layers[0]
        li, fi = self.local[i][:, None, None], self.ampf[i][:, None, None]
        S = np.where((entry + li) * fi > limit, _INF, entry + local[0])
        prev: list = [None]
        edges: list = [None]
        if S.shape[1] * S.shape[2] == 1:  # one row (the top chain): keep back pointers
            return self._single(chain, S, local, caps, index)
        for pos in range(1, len(layers)):
            i = layers[pos]
            if i in blocks:  # (V, K, K) -> (K, K, V, 1)
                tr = np.stack([self.blocks[i, c].tr for c in caps.tolist()])
                E = np.where(self.fits[i], tr, _INF).transpose(1, 2, 0)[:, :, :, None]
            else:
                E = edge[i]
            prev.append(S)
            edges.append(E)
            S = reduce(S[:, None] + E, 0) + local[pos]
        return _Batch(caps, index, prev, edges, S)

    def _single(self, chain: _Chain, S: np.ndarray, local: np.ndarray, caps: np.ndarray,
                index: dict) -> _Batch:
        """:meth:`chain` for one variant and one row: the steps are small, so the back
        pointers are kept (``argmin`` of the same sums) instead of recomputed."""
        blocks, edge = chain.blocks, self.edge
        backs: list = [None]
        S = S[:, 0, 0]
        for pos in range(1, len(chain.layers)):
            i = chain.layers[pos]
            if i in blocks:
                E = np.where(self.fits[i], self.blocks[i, int(caps[0])].tr, _INF)
            else:
                E = edge[i, :, :, 0, 0]
            cand = S[:, None] + E
            back = cand.argmin(0)
            backs.append(back.tolist())
            S = cand[back, self.cols] + local[pos, :, 0, 0]
        return _Batch(caps, index, [], [], S[:, None, None], backs=backs)

    def reduce_blocks(self, blocks: list[_Block], caps: np.ndarray) -> None:
        """Reduce ``blocks`` (those of one chain) for every cap in ``caps``: the branches of
        each are searched, then the blocks with the same number of branches are combined in
        one vectorised :func:`_combine`."""
        bcaps = sorted({int(c) for c in caps})
        if self.moves is None:
            self.moves = np.stack([self.p.comm_all("overlap"), self.p.comm_all("disjoint")], -1)
        groups: dict[int, list] = {}
        with np.errstate(invalid="ignore"):
            for blk in blocks:
                groups.setdefault(len(blk.branches), []).append((blk, self._branches(blk, bcaps)))
            multi = self.parallel
            for nb, items in groups.items():
                tsb = np.concatenate([t for _, (t, _) in items])
                own = [np.concatenate([o[j] for _, (_, o) in items]) for j in range(2)]
                for (blk, _), res in zip(items, _combine(tsb, own, bcaps, multi and nb > 1,
                                                         self.p.counts)):
                    for c, (best, flags, bcap) in res.items():
                        self.blocks[blk.join, c] = _BlockResult(best, {}, {}, bcap, flags)

    def _branches(self, blk: _Block, bcaps: list[int]) -> tuple[np.ndarray, list[np.ndarray]]:
        """Search every branch of ``blk`` for all the variants ``bcaps`` need; return their
        arrival times as :func:`_combine` rows."""
        p, K = self.p, self.K
        nb = len(blk.branches)
        multi = self.parallel and nb > 1
        rows = _rows(bcaps, multi)
        serial = sorted({s for _, s in rows})
        own = sorted({s for c in bcaps for s in _block_caps(c, multi)[1:]})
        variants = [(c, "overlap") for c in serial] + [(c, "disjoint") for c in own]
        index = {v: k for k, v in enumerate(variants)}
        V = len(variants)
        caps = np.array([c for c, _ in variants])
        kinds = np.array([kind == "disjoint" for _, kind in variants], dtype=np.int64)
        entry = self.moves[blk.fork].transpose(1, 2, 0)[:, kinds, :]  # (K, V, H)
        # arrival[b, g, v, h]; variant V: never (a skip connection cannot move)
        arrival = np.full((nb, K, V + 1, K), _INF)
        for b, br in enumerate(blk.branches):
            if br is None:
                arrival[b, :, :len(serial)] = p.comm(blk.fork).T[:, None, :]
                continue
            tab = self.chain(br, entry, caps, index)
            tab.exit = self.moves[br.layers[-1]][:, :, kinds, None]  # (K, K, V, 1)
            arrival[b, :, :V] = np.minimum.reduce(tab.S[:, None] + tab.exit, 0)
            self.tabs[blk.join, b] = tab
        # rows (c, s): (R, nb, h, g)
        tsb = arrival[:, :, [index[s, "overlap"] for _, s in rows]].transpose(2, 0, 3, 1)
        moved = [arrival[:, :, [index.get((c - j, "disjoint"), V) for c, _ in rows]]
                 .transpose(2, 0, 3, 1) for j in (1, 2)]
        return tsb, moved

    def backtrack(self, chain: _Chain, tab: _Batch, v: int, h: int, k: int, ks: np.ndarray,
                  par: set) -> None:
        for pos in range(len(chain.layers) - 1, -1, -1):
            i = chain.layers[pos]
            ks[i] = k
            if pos == 0:
                return
            if tab.backs is not None:
                kp = tab.backs[pos][k]
            else:
                E = tab.edges[pos]
                kp = int((tab.prev[pos][:, v, h] + E[:, k, v if E.shape[2] > 1 else 0, 0])
                         .argmin())
            if i in chain.blocks:
                self.backtrack_block(chain.blocks[i], int(tab.caps[v]), kp, k, ks, par)
            k = kp

    def backtrack_block(self, blk: _Block, cap: int, hf: int, gj: int, ks: np.ndarray,
                        par: set) -> None:
        res = self.blocks[blk.join, cap]
        for b, br in enumerate(blk.branches):
            if br is None:
                continue
            own = bool(res.flags[b, hf, gj])
            if own:
                par.add((blk.join, b))
            tab = self.tabs[blk.join, b]
            v = tab.index[int(res.cap[b, hf, gj]), "disjoint" if own else "overlap"]
            last = int((tab.S[:, v, hf] + tab.exit[:, gj, v, 0]).argmin())
            self.backtrack(br, tab, v, hf, last, ks, par)


def plan_burst(problem: BurstProblem, amp_limit: float = 2.0, *, algorithm: str = "exact",
               amp_min_us: float = 0.0, parallel_branches: bool = True,
               fast: bool = True, rounds: int = 8) -> BurstPlan:
    """The burst-parallel plan minimising predicted iteration time under ``amp_limit``.

    ``algorithm``: ``"exact"`` (per-edge amplification check, an exact DP) or ``"paper"``
    (Algorithm 1 as printed). ``amp_min_us``: layers whose single-GPU time is at most this are
    not amplification-checked (DeepPool's code uses 300 µs). ``parallel_branches``: allow
    branches on GPUs of their own. ``fast=False`` runs the straightforward (unbatched) search
    of ``"exact"``, which gives the same plan more slowly. Falls back to data parallelism
    (``fallback=True``) when the search does not beat it. ``rounds``: searches from each
    starting point of a problem with ``overlap`` (see :func:`_plan_overlap`). Raises
    ``ValueError`` for ``amp_limit < 1`` or an unknown algorithm."""
    if isinstance(amp_limit, bool) or not isinstance(amp_limit, (int, float)) \
            or not amp_limit >= 1:
        raise ValueError(f"amp_limit={amp_limit!r}: the amplification limit must be >= 1")
    if algorithm not in _ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r}: expected one of {_ALGORITHMS}")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"plan_burst(rounds={rounds!r}): must be a positive int")
    p = problem
    dp_ks = p.dp_counts
    if len(p.counts) == 1:
        return _make_plan(p, dp_ks, set(), amp_limit, algorithm, amp_min_us)
    search = functools.partial(_search, p, float(amp_limit), algorithm, float(amp_min_us),
                               parallel_branches, fast)
    dp = _evaluate(p, dp_ks, set())
    if p.overlap is not None:
        found = _plan_overlap(p, search, dp, float(amp_limit), float(amp_min_us), rounds)
    else:
        found = search()
        if found is not None and not found[2] < dp.time * (1 - 1e-12):
            found = None
    if found is None:
        return _make_plan(p, dp_ks, set(), amp_limit, algorithm, amp_min_us, fallback=True)
    return _make_plan(p, found[0], found[1], amp_limit, algorithm, amp_min_us, dp=dp)


def _search(p: BurstProblem, amp_limit: float, algorithm: str, amp_min_us: float,
            parallel_branches: bool, fast: bool, sync: Optional[np.ndarray] = None
            ) -> Optional[tuple[np.ndarray, set, float]]:
    """The best plan the search finds when each layer costs ``comp + sync`` (``sync``: the
    problem's unless given) besides its transfers: ``(count indices, parallel branches, its
    time)``, or None when no plan respects the limit."""
    K = len(p.counts)
    if algorithm == "exact" and fast:
        fs = _FastSearch(p, amp_limit, amp_min_us, parallel_branches, sync)
        top = fs.chain(p.top, np.zeros((K, 1, 1)), np.array([K - 1]), {})
        final = top.S[:, 0, 0]
        k = int(np.argmin(final))
        search, walk = fs, (p.top, top, 0, 0, k)
    else:
        search = _Search(p, amp_limit, algorithm, amp_min_us, parallel_branches, sync)
        top = search.chain(p.top, np.zeros((1, K)), K - 1)
        if algorithm == "exact":
            final = top.S[0]
            k = int(np.argmin(final))
        else:  # check the last layer's amplification with a zero-cost step into a sink
            _, back = search.step(top.S, top.amp, np.zeros((K, 1)), None, None)
            final, k = top.S[0], int(back[0, 0])
        walk = (p.top, top, 0, k)
    if not np.isfinite(final[k]):
        return None
    ks = np.zeros(len(p.names), dtype=np.int64)
    par: set = set()
    search.backtrack(*walk, ks, par)
    return ks, par, float(final[k])


def _plan_overlap(p: BurstProblem, search: Callable[..., Optional[tuple]], dp: _Eval,
                  amp_limit: float, amp_min_us: float, rounds: int
                  ) -> Optional[tuple[np.ndarray, set]]:
    """The search under :class:`OverlapSync`: the best plan found, or None when none beats
    data parallelism (``dp``) under that execution.

    Why not one DP: the communication stream takes the buckets one after another, so what an
    all-reduce adds to the iteration depends on every bucket issued before it and on all the
    backward after it; the exposed time is a running maximum over buckets, not a sum of
    per-layer terms, and no state of (layer, GPU count) carries it. So the DP is run on a
    linearisation, then corrected: at a reference plan each layer gets a budget, the time
    between when its gradients start moving and the end of backward (:class:`_Eval`); the DP
    (exact for these costs, amplification limit included) charges a layer on ``g`` GPUs
    ``max(0, sync(i, g) - budget)``, which at the reference plan sums to exactly the time its
    syncs run past backward. The plan found is evaluated under the execution model and
    becomes the next reference, up to ``rounds`` searches or until a plan repeats. Two starting
    points: zero budgets (every sync in full: the no-overlap search) and data parallelism's
    budgets. The best plan evaluated that keeps every layer's amplification (with its exposed
    sync) within the limit is then improved one layer's count at a time (:func:`_polish`),
    and wins if it beats data parallelism: never slower than data parallelism, nor than the
    no-overlap plan, under the execution model. Not exact: on seeded random chains it finds
    the optimum of exhaustive search in most cases and stays within a few per cent of it
    (``tests/test_burst_planner.py``)."""
    best: Optional[tuple[np.ndarray, set, float]] = None
    seen: set = set()
    for budget in (np.zeros(len(p.names)), dp.budget):
        for _ in range(rounds):
            with np.errstate(invalid="ignore"):  # inf - budget stays inf
                found = search(np.maximum(p.sync - budget[:, None], 0.0))
            if found is None:
                break
            ks, par, _ = found
            key = (tuple(ks.tolist()), tuple(sorted(par)))
            if key in seen:
                break
            seen.add(key)
            ev = _evaluate(p, ks, par)
            if (best is None or ev.time < best[2]) and _fits(p, ks, ev, amp_limit, amp_min_us):
                best = (ks, par, ev.time)
            budget = ev.budget
    if best is None:
        return None
    ks, par, time = _polish(p, *best, amp_limit, amp_min_us)
    return (ks, par) if time < dp.time * (1 - 1e-12) else None


def _fits(p: BurstProblem, ks: np.ndarray, ev: _Eval, amp_limit: float, amp_min_us: float
          ) -> bool:
    """Every layer's amplification is within ``amp_limit``."""
    return bool(np.all(_amplification(p, ks, ev, amp_min_us) <= amp_limit * (1 + 1e-9)))


def _polish(p: BurstProblem, ks: np.ndarray, par: set, time: float, amp_limit: float,
            amp_min_us: float, sweeps: int = 2, evaluations: int = 2000
            ) -> tuple[np.ndarray, set, float]:
    """Local search under the execution model: each layer that computes or syncs in turn moves
    to the next smaller or larger count when that shortens the iteration (the better of the
    two; within the amplification limit and the GPUs), up to ``sweeps`` passes over those
    layers and ``evaluations`` plans evaluated."""
    ks = ks.copy()
    left = evaluations
    movable = np.nonzero((p.comp[:, 0] > 0) | (p.overlap.param_bytes > 0))[0].tolist()
    for _ in range(sweeps):
        moved = False
        for i in movable:
            best = None
            for k in (ks[i] - 1, ks[i] + 1):
                if not 0 <= k < len(p.counts) or left <= 0 or not np.isfinite(p.comp[i, k]):
                    continue
                trial = ks.copy()
                trial[i] = k
                offset = _assign(p, trial, par)
                if np.any(offset + p.counts[trial] > p.gpus):
                    continue
                left -= 1
                ev = _evaluate(p, trial, par, offset)
                if ev.time < time * (1 - 1e-12) and _fits(p, trial, ev, amp_limit, amp_min_us):
                    best, time = k, ev.time
            if best is not None:
                ks[i], moved = best, True
        if not moved or left <= 0:
            break
    return ks, par, time
