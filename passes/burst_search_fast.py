"""The burst planner's ``"exact"`` DP, batched (:class:`FastSearch`): the same plan as
``tidal.passes.burst_search.PlainSearch`` gives, faster. Every variant a branch is searched
with (count caps x same/own GPUs) runs as one numpy DP, nested blocks are reduced for all the
caps their branch needs at once, the amplification-masked transitions of all layers are built
in one vectorised step, and back pointers are not stored but recomputed along the chosen path
only (same sums, same first-minimum ties).

Example:
    >>> import numpy as np
    >>> from tidal.passes.burst_problem import BurstProblem
    >>> comp = np.array([[400., 200., 100.], [40., 38., 37.], [300., 150., 75.]])
    >>> p = BurstProblem(("conv", "fc", "head"), ((), (0,), (1,)), comp, np.zeros((3, 3)),
    ...                  np.array([64., 64., 64.]), (1, 2, 4), 8, 1e4, 1.0)
    >>> tab, at, k, time = FastSearch(p, 2.0, 0.0, True).top_path()
    >>> k, round(time, 1)          # the head on 4 GPUs
    (2, 219.2)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from tidal.passes.burst_dp import INF, BlockResult, block_caps, cap_rows, combine_branches, \
    local_costs
from tidal.passes.burst_problem import Block, BurstProblem, Chain


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


class FastSearch:
    """``algorithm="exact"`` with the same result as
    :class:`~tidal.passes.burst_search.PlainSearch`, faster (see the module docstring)."""

    def __init__(self, p: BurstProblem, amp_limit: float, amp_min_us: float,
                 parallel_branches: bool, sync: Optional[np.ndarray] = None):
        self.p, self.limit, self.parallel = p, amp_limit, parallel_branches
        self.ampf, self.local = local_costs(p, amp_min_us, sync)
        self.K = K = len(p.counts)
        self.cols = np.arange(K)
        self.blocks: dict[tuple[int, int], BlockResult] = {}
        self.tabs: dict[tuple[int, int], _Batch] = {}
        # transition into each layer from the previous layer of its chain, masked where the
        # layer would exceed the amplification limit (a join's block: only the mask `fits`)
        src, dst = p.chain_edges
        self.fits = self.local * self.ampf <= amp_limit
        edge = np.empty((len(p.names), K, K))
        C = p.comm_all()[src]
        edge[dst] = np.where((C + self.local[dst, None, :]) * self.ampf[dst, None, :]
                             <= amp_limit, C, INF)
        self.edge = edge[:, :, :, None, None]
        self.moves: Optional[np.ndarray] = None  # (L, K, K, 2): both kinds of move, if blocks

    def chain(self, chain: Chain, entry: np.ndarray, caps: np.ndarray, index: dict) -> _Batch:
        """DP over ``chain`` for the variants ``caps`` reached by ``entry`` (K, V, H)."""
        limit, blocks, edge, reduce = self.limit, chain.blocks, self.edge, np.minimum.reduce
        layers = chain.layers
        over = np.arange(self.K)[:, None] > caps[None, :]  # (K, V)
        local = self.local[layers][:, :, None, None]  # (n, K, 1, 1)
        if over.any():
            local = np.where(over[None, :, :, None], INF, local)
        if blocks:
            self.reduce_blocks(list(blocks.values()), caps)
        i = layers[0]
        li, fi = self.local[i][:, None, None], self.ampf[i][:, None, None]
        S = np.where((entry + li) * fi > limit, INF, entry + local[0])
        prev: list = [None]
        edges: list = [None]
        if S.shape[1] * S.shape[2] == 1:  # one row (the top chain): keep back pointers
            return self._single(chain, S, local, caps, index)
        for pos in range(1, len(layers)):
            i = layers[pos]
            if i in blocks:  # (V, K, K) -> (K, K, V, 1)
                tr = np.stack([self.blocks[i, c].tr for c in caps.tolist()])
                E = np.where(self.fits[i], tr, INF).transpose(1, 2, 0)[:, :, :, None]
            else:
                E = edge[i]
            prev.append(S)
            edges.append(E)
            S = reduce(S[:, None] + E, 0) + local[pos]
        return _Batch(caps, index, prev, edges, S)

    def _single(self, chain: Chain, S: np.ndarray, local: np.ndarray, caps: np.ndarray,
                index: dict) -> _Batch:
        """:meth:`chain` for one variant and one row: the steps are small, so the back
        pointers are kept (``argmin`` of the same sums) instead of recomputed."""
        blocks, edge = chain.blocks, self.edge
        backs: list = [None]
        S = S[:, 0, 0]
        for pos in range(1, len(chain.layers)):
            i = chain.layers[pos]
            if i in blocks:
                E = np.where(self.fits[i], self.blocks[i, int(caps[0])].tr, INF)
            else:
                E = edge[i, :, :, 0, 0]
            cand = S[:, None] + E
            back = cand.argmin(0)
            backs.append(back.tolist())
            S = cand[back, self.cols] + local[pos, :, 0, 0]
        return _Batch(caps, index, [], [], S[:, None, None], backs=backs)

    def reduce_blocks(self, blocks: list[Block], caps: np.ndarray) -> None:
        """Reduce ``blocks`` (those of one chain) for every cap in ``caps``: the branches of
        each are searched, then the blocks with the same number of branches are combined in
        one vectorised :func:`combine_branches`."""
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
                for (blk, _), res in zip(items, combine_branches(tsb, own, bcaps, multi and nb > 1,
                                                         self.p.counts)):
                    for c, (best, flags, bcap) in res.items():
                        self.blocks[blk.join, c] = BlockResult(best, {}, {}, bcap, flags)

    def _branches(self, blk: Block, bcaps: list[int]) -> tuple[np.ndarray, list[np.ndarray]]:
        """Search every branch of ``blk`` for all the variants ``bcaps`` need; return their
        arrival times as :func:`combine_branches` rows."""
        p, K = self.p, self.K
        nb = len(blk.branches)
        multi = self.parallel and nb > 1
        rows = cap_rows(bcaps, multi)
        serial = sorted({s for _, s in rows})
        own = sorted({s for c in bcaps for s in block_caps(c, multi)[1:]})
        variants = [(c, "overlap") for c in serial] + [(c, "disjoint") for c in own]
        index = {v: k for k, v in enumerate(variants)}
        V = len(variants)
        caps = np.array([c for c, _ in variants])
        kinds = np.array([kind == "disjoint" for _, kind in variants], dtype=np.int64)
        entry = self.moves[blk.fork].transpose(1, 2, 0)[:, kinds, :]  # (K, V, H)
        # arrival[b, g, v, h]; variant V: never (a skip connection cannot move)
        arrival = np.full((nb, K, V + 1, K), INF)
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


    # ---- the path (tidal.passes.burst_dp.SearchEngine)

    def top_path(self) -> tuple[_Batch, tuple[int, int], int, float]:
        """The top chain's tables, row ``(variant, fork count)``, last layer's count index and
        time of the best plan (inf when none respects the limit)."""
        K = self.K
        top = self.chain(self.p.top, np.zeros((K, 1, 1)), np.array([K - 1]), {})
        final = top.S[:, 0, 0]
        k = int(np.argmin(final))
        return top, (0, 0), k, float(final[k])

    def previous(self, tab: _Batch, pos: int, at: tuple[int, int], k: int) -> int:
        if tab.backs is not None:
            return tab.backs[pos][k]
        v, h = at
        E = tab.edges[pos]
        return int((tab.prev[pos][:, v, h] + E[:, k, v if E.shape[2] > 1 else 0, 0]).argmin())

    def cap_of(self, tab: _Batch, at: tuple[int, int]) -> int:
        return int(tab.caps[at[0]])

    def branch_exit(self, res: BlockResult, blk: Block, b: int, own: bool, cap: int, hf: int,
                    gj: int) -> tuple[_Batch, tuple[int, int], int]:
        tab = self.tabs[blk.join, b]
        v = tab.index[cap, "disjoint" if own else "overlap"]
        return tab, (v, hf), int((tab.S[:, v, hf] + tab.exit[:, gj, v, 0]).argmin())
