"""What the burst planner's two DP engines share (``tidal.passes.burst_search``, the
straightforward one, and ``tidal.passes.burst_search_fast``, the batched one): each layer's
local cost and amplification factor, DeepPool's multi-chain reduction of a fork/join block
(:func:`combine_branches`: the critical branch stays on the fork's GPUs, the others move to
GPUs of their own when that shortens the block and the GPUs fit) and the walk back along the
chosen path (:func:`backtrack_chain`, :func:`backtrack_block`), which both engines take
through the :class:`SearchEngine` methods that differ.

Example:
    >>> block_caps(2, multi=True), cap_rows([2], multi=True)
    ([2, 1, 0], [(2, 2), (2, 1), (2, 0)])
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence

import numpy as np

from tidal.passes.burst_problem import Block, BurstProblem, Chain

INF = np.inf


def block_caps(cap: int, multi: bool) -> list[int]:
    """Count-index caps a block at ``cap`` is searched with: the branches that stay share up to
    ``counts[s]`` GPUs for s in (cap, cap-1, cap-2) when branches may move (``multi``)."""
    return [c for c in (cap, cap - 1, cap - 2) if c >= 0] if multi else [cap]


def cap_rows(bcaps: Sequence[int], multi: bool) -> list[tuple[int, int]]:
    """``(block cap c, stay cap s)`` pairs :func:`combine_branches` evaluates, grouped by
    ``c``."""
    return [(c, s) for c in bcaps for s in block_caps(c, multi)]


Reduced = dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]
"""Per block cap: the block time ``(K, K)`` and per-branch moved flags and caps ``(nb, K, K)``."""


def combine_branch_dicts(ts: dict, tp: dict, bcaps: Sequence[int], multi: bool, nb: int,
                         counts: np.ndarray) -> Reduced:
    """:func:`combine_branches` from ``ts[b, s]``/``tp[b, c]`` ``(K, K)`` arrays (missing:
    never)."""
    K = len(counts)
    rows = cap_rows(bcaps, multi)
    none = np.full((K, K), INF)
    tsb = np.stack([ts[b, s] for _, s in rows for b in range(nb)]).reshape(-1, nb, K, K)
    own = [np.stack([tp.get((b, c - j), none) for c, _ in rows for b in range(nb)])
           .reshape(-1, nb, K, K) for j in (1, 2)]
    return combine_branches(tsb, own, bcaps, multi, counts)[0]


def combine_branches(tsb: np.ndarray, own: list[np.ndarray], bcaps: Sequence[int],
                     multi: bool, counts: np.ndarray) -> list[Reduced]:
    """DeepPool's multi-chain reduction of one block from its branches' arrival times, for each
    block cap ``c`` in ``bcaps`` at once.

    Row ``r`` of ``tsb`` (``(R, nb, K, K)``, rows ``cap_rows(bcaps, multi)`` = ``(c, s)``) holds
    each branch's time (fork count h -> join count g) on the fork's GPUs with counts up to
    index ``s``; row ``r`` of ``own[j - 1]`` its time on GPUs of its own with counts up to
    ``c - j`` (inf where that is not searched). For each row the critical branch stays and the
    others, longest first, move when that shortens the block and the GPUs fit in
    ``counts[c]`` (never when ``s == c``); per ``c`` the best ``s`` wins (the first on a tie).
    Several blocks with the same number of branches may be stacked (their rows one after the
    other). Returns per block, per ``c``: the block time ``(K, K)`` and per-branch moved flags
    and caps ``(nb, K, K)``."""
    R, nb, K, _ = tsb.shape
    one = cap_rows(bcaps, multi)
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
            tc = np.where(pgpu <= room, tps[:, :, pos], INF)
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
            r1 = r0 + len(block_caps(c, multi))
            pick = total[r0:r1].argmin(axis=0) + r0  # the first best s
            res[c] = (total[pick, ii, jj], fl[pick, bi, ii, jj], bc[pick, bi, ii, jj])
            r0 = r1
        out.append(res)
    return out

@dataclass(eq=False)
class BlockResult:
    """A block reduced at one count cap: its transition times and, per branch and (fork
    count, join count), whether the branch moves to GPUs of its own and the cap it was
    searched with (the straightforward engine also keeps each branch's tables here)."""

    tr: np.ndarray  # (K, K) block time fork h -> join g
    serial: dict  # (branch, cap) -> the DP tables of the branch on the fork's GPUs
    par: dict  # (branch, cap) -> the DP tables of the branch on GPUs of its own
    cap: np.ndarray  # (nb, K, K) cap index each branch was searched with
    flags: np.ndarray  # (nb, K, K) branch b runs on GPUs of its own


def local_costs(p: BurstProblem, amp_min_us: float, sync: Optional[np.ndarray]
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Per layer and count: the factor turning a layer's time T into its amplification (0 where
    it is not checked), and the time it costs besides its incoming transfer (``comp`` plus
    ``sync``, the problem's unless given)."""
    c1 = p.comp[:, 0]
    ampf = np.where(c1[:, None] > amp_min_us, p.counts[None, :] / np.maximum(c1, 1e-12)[:, None],
                    0.0)
    return ampf, p.comp + (p.sync if sync is None else sync)




class SearchEngine(Protocol):
    """What :func:`backtrack_chain` needs of a DP engine: its reduced ``blocks`` (by join index
    and cap) and where its tables keep the path. ``at`` is the engine's row in a chain's
    tables (the fork's count index; the batched engine: ``(variant, fork count index)``)."""

    blocks: dict[tuple[int, int], BlockResult]

    def top_path(self) -> tuple[Any, Any, int, float]:
        """The top chain's tables, row, last layer's count index and time of the best plan
        (inf when none respects the limit)."""

    def previous(self, tab: Any, pos: int, at: Any, k: int) -> int:
        """The count index of the layer before position ``pos`` on the best path to
        ``counts[k]`` there."""

    def cap_of(self, tab: Any, at: Any) -> int:
        """The largest count index the chain of ``tab`` was searched with at row ``at``."""

    def branch_exit(self, res: BlockResult, blk: Block, b: int, own: bool, cap: int, hf: int,
                    gj: int) -> tuple[Any, Any, int]:
        """Branch ``b`` of ``blk`` from fork count ``hf`` to join count ``gj``, on GPUs of its
        own or not (``own``) with counts up to ``cap``: its tables, row and last layer's count
        index."""


def backtrack_chain(engine: SearchEngine, chain: Chain, tab: Any, at: Any, k: int,
                    ks: np.ndarray, par: set) -> None:
    """Walk ``chain``'s best path back from its last layer on ``counts[k]`` (row ``at`` of
    ``tab``): each layer's count index into ``ks``, each branch on GPUs of its own into
    ``par`` (as ``(join, branch)``), blocks walked by :func:`backtrack_block`."""
    for pos in range(len(chain.layers) - 1, -1, -1):
        i = chain.layers[pos]
        ks[i] = k
        if pos == 0:
            return
        kp = engine.previous(tab, pos, at, k)
        if i in chain.blocks:
            backtrack_block(engine, chain.blocks[i], engine.cap_of(tab, at), kp, k, ks, par)
        k = kp


def backtrack_block(engine: SearchEngine, blk: Block, cap: int, hf: int, gj: int,
                    ks: np.ndarray, par: set) -> None:
    """Walk the best path through ``blk`` (reduced at ``cap``) from fork count index ``hf`` to
    join count index ``gj``: which branches moved to GPUs of their own (into ``par``) and
    each branch's path (:func:`backtrack_chain`)."""
    res = engine.blocks[blk.join, cap]
    for b, br in enumerate(blk.branches):
        if br is None:
            continue
        own = bool(res.flags[b, hf, gj])
        if own:
            par.add((blk.join, b))
        tab, at, k = engine.branch_exit(res, blk, b, own, int(res.cap[b, hf, gj]), hf, gj)
        backtrack_chain(engine, br, tab, at, k, ks, par)
