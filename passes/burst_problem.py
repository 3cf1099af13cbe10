"""The burst-parallel planner's problem (DeepPool §4): per-layer costs as numpy arrays, the
layer DAG as a nest of chains and fork/join blocks, and the cost helpers that fill them.

A :class:`BurstProblem` holds, per layer (topological order) and candidate GPU count, the
forward + backward µs (``comp``) and the gradient all-reduce µs (``sync``), the bytes per
sample of its output, the link, and the structure the search walks: :attr:`BurstProblem.top`,
a :class:`Chain` of layers whose joins hold the :class:`Block` before them (each branch a chain
of its own). :class:`OverlapSync` adds what sync overlapping backward needs. The time model
is ``tidal.passes.burst_evaluate``; the searches are ``tidal.passes.burst_search`` and
``tidal.passes.burst_overlap``; ``tidal.passes.burst_planner`` makes the plan.

Example:
    >>> import numpy as np
    >>> counts = candidate_counts(2)
    >>> p = BurstProblem(("a", "b"), ((), (0,)), np.array([[100., 60.], [80., 40.]]),
    ...                  np.zeros((2, 2)), np.array([8., 8.]), counts, batch=4,
    ...                  bytes_per_us=1e3, latency_us=1.0)
    >>> p.gpus, p.top.layers, float(p.comm(0)[0, 1])   # moving a's output from 1 GPU to 2
    (2, [0, 1], 2.032)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional, Sequence

import networkx as nx
import numpy as np

from tidal.ir import layer_graph
from tidal.ir.comm_cost import DDP_BUCKET_BYTES, ring_allreduce_us

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
    ends where the GPU set changes) go into buckets closed at ``bucket_bytes``; a bucket's
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
class Chain:
    """Layers run one after another; ``blocks`` maps a join layer to the block before it."""

    layers: list[int]
    blocks: dict[int, "Block"] = field(default_factory=dict)


@dataclass(eq=False)
class Block:
    """A fork layer, its join, and the branches between them (each a chain of its own)."""

    fork: int
    join: int
    branches: list[Optional[Chain]]  # None: a skip connection fork -> join


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
        src, dst, self.branch_entries = [], [], []
        for chain in all_chains(self.top):
            src += [a for a, b in zip(chain.layers, chain.layers[1:]) if b not in chain.blocks]
            dst += [b for b in chain.layers[1:] if b not in chain.blocks]
            for j, blk in chain.blocks.items():
                self.branch_entries += [(br.layers[0], blk.fork, (j, b))
                                         for b, br in enumerate(blk.branches) if br is not None]
        # (previous layer, layer) of every step inside a chain, a join's block excluded
        self.chain_edges = (np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64))
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
        return tuple((self.names[j], b) for j, blk in all_blocks(self.top)
                     for b, br in enumerate(blk.branches) if br is not None)

    def branch_layers(self, join: str, branch: int) -> tuple[str, ...]:
        """Names of every layer inside branch ``branch`` of the block joining at ``join``
        (nested blocks included)."""
        for j, blk in all_blocks(self.top):
            if self.names[j] == join and 0 <= branch < len(blk.branches):
                br = blk.branches[branch]
                return () if br is None else tuple(self.names[i] for i in sorted(chain_members(br)))
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


def _parse(names: tuple[str, ...], preds: tuple[tuple[int, ...], ...]) -> Chain:
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


def _build_chain(members: list[int], blocks, entry: Optional[int], names, preds) -> Chain:
    inside = {i for b in blocks for br in b.branches for i in br}
    layers = [i for i in members if i not in inside]
    chain = Chain(layers)
    pos = {i: k for k, i in enumerate(layers)}
    for b in blocks:
        f, j = b.fork, b.join
        if f not in pos or j not in pos or pos[j] != pos[f] + 1:
            raise layer_graph.NotSeriesParallel(
                f"unsupported branch shape: block from {names[f]!r} to {names[j]!r} is not a "
                f"fork followed by its join", f, j)
        branches: list[Optional[Chain]] = []
        for br in b.branches:
            if not br:
                branches.append(None)
                continue
            nested = [n for n in b.nested if n.fork in set(br)]
            branches.append(_build_chain(list(br), nested, f, names, preds))
        chain.blocks[j] = Block(f, j, branches)
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


def all_blocks(chain: Chain) -> Iterator[tuple[int, Block]]:
    """``(join index, block)`` of every block in ``chain``, nested ones included (outer
    first)."""
    for j, blk in chain.blocks.items():
        yield j, blk
        for br in blk.branches:
            if br is not None:
                yield from all_blocks(br)


def all_chains(chain: Chain) -> Iterator[Chain]:
    """``chain`` and every branch chain inside it, nested ones included."""
    yield chain
    for blk in chain.blocks.values():
        for br in blk.branches:
            if br is not None:
                yield from all_chains(br)


def chain_members(chain: Chain) -> Iterable[int]:
    """Every layer inside ``chain``, its blocks' branches included."""
    yield from chain.layers
    for blk in chain.blocks.values():
        for br in blk.branches:
            if br is not None:
                yield from chain_members(br)
