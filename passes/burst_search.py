"""The burst planner's DP (DeepPool §4, Algorithm 1): the best GPU count per layer under the
amplification limit, for per-layer costs, by :func:`search_plan`.

A chain's DP runs layer by layer over the count the previous layer ran on; a fork/join block
is reduced to one transition fork count -> join count (``tidal.passes.burst_dp``), its
branches searched with the fork fixed. :class:`PlainSearch` is the straightforward DP, either
``"exact"`` (the limit on each edge ``(i-1, h) -> (i, g)``: an exact constrained shortest
path) or ``"paper"`` (Algorithm 1 as printed: a predecessor is eligible when
``Amp(i-1, h) <= max(bestAmp, AmpLimit)``, scanned in increasing ``h``);
``tidal.passes.burst_search_fast.FastSearch`` gives ``"exact"``'s plan faster. Both walk the
path back with ``tidal.passes.burst_dp.backtrack_chain``.

Example:
    >>> import numpy as np
    >>> from tidal.passes.burst_problem import BurstProblem
    >>> comp = np.array([[400., 200., 100.], [40., 38., 37.], [300., 150., 75.]])
    >>> sync = np.array([[0., 5., 8.], [0., 50., 80.], [0., 5., 8.]])
    >>> p = BurstProblem(("conv", "fc", "head"), ((), (0,), (1,)), comp, sync,
    ...                  np.array([64., 64., 64.]), (1, 2, 4), 8, 1e4, 1.0)
    >>> ks, par, time = search_plan(p, 2.0, "exact", 0.0, True, fast=False)
    >>> ks.tolist(), ks.tolist() == search_plan(p, 2.0, "exact", 0.0, True, fast=True)[0].tolist()
    ([2, 0, 2], True)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from tidal.passes.burst_dp import (INF, BlockResult, SearchEngine, backtrack_chain, block_caps,
                                   combine_branch_dicts, local_costs)
from tidal.passes.burst_problem import Block, BurstProblem, Chain
from tidal.passes.burst_search_fast import FastSearch


@dataclass(eq=False)
class _Tables:
    """A chain's DP over an outer index ``h`` (the fork's count, or one row at top level)."""

    backs: list  # per position: (H, K) best previous count index (None at position 0)
    S: np.ndarray  # (H, K) shortest time to finish the chain's last layer on counts[k]
    amp: np.ndarray  # (H, K) amplification of the last layer's state (paper rule)
    cap: int  # largest count index the chain may use
    out_back: Optional[np.ndarray] = None  # (H, Kjoin) last layer's count into the join



class PlainSearch:
    """The straightforward DP, ``"exact"`` or ``"paper"`` (see the module docstring): a
    chain's tables over the fork's count (:class:`_Tables`, back pointers kept), each block
    reduced once per count cap (:meth:`block`)."""

    def __init__(self, p: BurstProblem, amp_limit: float, algorithm: str, amp_min_us: float,
                 parallel_branches: bool, sync: Optional[np.ndarray] = None):
        self.p, self.limit, self.algo = p, amp_limit, algorithm
        self.parallel = parallel_branches
        self.ampf, self.local = local_costs(p, amp_min_us, sync)
        self.blocks: dict[tuple[int, int], BlockResult] = {}

    def step(self, S: np.ndarray, amp: np.ndarray, E: np.ndarray, C: Optional[np.ndarray],
             i: Optional[int]) -> tuple[np.ndarray, np.ndarray]:
        """Best previous state per (h, g) over edges E (K', K): returns (best S, back)."""
        if self.algo == "exact":
            if i is not None and C is not None:
                allowed = (C + self.local[i][None, :]) * self.ampf[i][None, :] <= self.limit
                E = np.where(allowed, E, INF)
            cand = S[:, :, None] + E[None, :, :]
            return cand.min(axis=1), cand.argmin(axis=1)
        H, Kp = S.shape
        Kn = E.shape[1]
        bestS = np.full((H, Kn), INF)
        bestAmp = np.full((H, Kn), INF)
        back = np.zeros((H, Kn), dtype=np.int64)
        for kp in range(Kp):  # Algorithm 1's scan over h, vectorised over (outer h, g)
            s = S[:, kp, None] + E[None, kp, :]
            a = amp[:, kp, None]
            ok = (a <= np.maximum(bestAmp, self.limit)) & (s <= bestS)
            bestS = np.where(ok, s, bestS)
            back = np.where(ok, kp, back)
            bestAmp = np.where(ok, np.minimum(bestAmp, a), bestAmp)
        return bestS, back

    def chain(self, chain: Chain, entry: np.ndarray, cap: int) -> _Tables:
        """DP over a chain whose first layer is reached by ``entry`` (H, K) comm times, using
        counts up to index ``cap``."""
        p = self.p
        K = len(p.counts)
        over = np.arange(K) > cap
        backs: list = []
        S = amp = None
        prev = None
        for pos, i in enumerate(chain.layers):
            local = np.where(over, INF, self.local[i])
            if pos == 0:
                C = entry
                S = entry + local[None, :]
                if self.algo == "exact":
                    bad = (C + self.local[i][None, :]) * self.ampf[i][None, :] > self.limit
                    S = np.where(bad, INF, S)
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

    def block(self, blk: Block, cap: int) -> BlockResult:
        """Reduce a block to its transition matrix, using counts up to index ``cap``: the
        branches that stay share up to counts[s] GPUs for s in (cap, cap-1, cap-2), each branch
        moved to GPUs of its own gets up to counts[c] of the rest (c < cap)."""
        key = (blk.join, cap)
        if key not in self.blocks:
            with np.errstate(invalid="ignore"):
                self.blocks[key] = self._reduce(blk, cap)
        return self.blocks[key]

    def _branch(self, blk: Block, b: int, cap: int, kind: str) -> tuple[_Tables, np.ndarray]:
        p = self.p
        br = blk.branches[b]
        tab = self.chain(br, p.comm(blk.fork, kind), cap)
        arrival, tab.out_back = self.step(tab.S, tab.amp, p.comm(br.layers[-1], kind), None, None)
        return tab, arrival

    def _reduce(self, blk: Block, cap: int) -> BlockResult:
        p = self.p
        nb = len(blk.branches)
        caps = block_caps(cap, self.parallel and nb > 1)
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
        best, flags, bcap = combine_branch_dicts(ts, tp, [cap], self.parallel and nb > 1, nb,
                                                 p.counts)[cap]
        return BlockResult(best, serial, par, bcap, flags)

    # ---- the path (tidal.passes.burst_dp.SearchEngine)

    def top_path(self) -> tuple[_Tables, int, int, float]:
        """The top chain's tables, row, last layer's count index and time of the best plan
        (inf when none respects the limit)."""
        K = len(self.p.counts)
        top = self.chain(self.p.top, np.zeros((1, K)), K - 1)
        if self.algo == "exact":
            k = int(np.argmin(top.S[0]))
        else:  # check the last layer's amplification with a zero-cost step into a sink
            _, back = self.step(top.S, top.amp, np.zeros((K, 1)), None, None)
            k = int(back[0, 0])
        return top, 0, k, float(top.S[0, k])

    def previous(self, tab: _Tables, pos: int, at: int, k: int) -> int:
        return int(tab.backs[pos][at, k])

    def cap_of(self, tab: _Tables, at: int) -> int:
        return tab.cap

    def branch_exit(self, res: BlockResult, blk: Block, b: int, own: bool, cap: int, hf: int,
                    gj: int) -> tuple[_Tables, int, int]:
        tab = (res.par if own else res.serial)[b, cap]
        return tab, hf, int(tab.out_back[hf, gj])


def search_plan(p: BurstProblem, amp_limit: float, algorithm: str, amp_min_us: float,
                parallel_branches: bool, fast: bool, sync: Optional[np.ndarray] = None
                ) -> Optional[tuple[np.ndarray, set, float]]:
    """The best plan the search finds when each layer costs ``comp + sync`` (``sync``: the
    problem's unless given) besides its transfers: ``(count indices, parallel branches, its
    time)``, or None when no plan respects the limit. ``algorithm`` ``"exact"`` with ``fast``
    runs :class:`~tidal.passes.burst_search_fast.FastSearch`, else :class:`PlainSearch`
    (the module docstring has an example)."""
    engine: SearchEngine
    if algorithm == "exact" and fast:
        engine = FastSearch(p, amp_limit, amp_min_us, parallel_branches, sync)
    else:
        engine = PlainSearch(p, amp_limit, algorithm, amp_min_us, parallel_branches, sync)
    tab, at, k, time = engine.top_path()
    if not np.isfinite(time):
        return None
    ks = np.zeros(len(p.names), dtype=np.int64)
    par: set = set()
    backtrack_chain(engine, p.top, tab, at, k, ks, par)
    return ks, par, time
