"""A Bagpipe trainer: the rewritten graph on its shard of each batch, fed by the Oracle Cacher,
with an LRPP cache per table, prefetch, delayed synchronization and write-back.

Per iteration ``x`` (SGD without momentum, the reference arithmetic kept exactly):

1. if the prefetch for ``x`` was not issued ahead (``L = 0``, first batch of a segment): wait
   for this trainer's write-backs, barrier with the other trainers, issue it; wait for the rows;
2. forward and backward of ``gm(*shard, **working)`` on the cached rows (leaves);
3. LOCAL rows: ``row.add_(g / T, alpha=-lr)`` at once (no communication);
4. the background sync of ``x - 1`` is waited for and applied, then the write-backs of ``x - 1``
   that waited for it are issued (asynchronous RPCs);
5. dense gradients all-reduced (sum) / T, ``p.add_(g, alpha=-lr)``;
6. once this trainer's write-backs are complete, the critical all-reduce: shared rows that
   ``x + 1`` uses (gradient sums) and the values of ids promoted to shared for ``x + 1`` (owner's
   value, zeros elsewhere), in one flat buffer. Completing it proves every trainer's write-backs
   up to ``x - 1`` are done, so prefetches whose ``written_through`` allows it are issued now;
7. the other shared rows of ``x`` are all-reduced in the background (async gloo work);
   evictions of ``x`` are written back now, or after that background sync (step 4 of ``x + 1``).

A collective or RPC that fails or times out (a peer stalled or died) raises a
``BagpipePeerFailure`` naming the trainer, embedding server or Oracle Cacher it waited for, and
the trainer reports its error before it reaches the Oracle Cacher
(:mod:`tidal.runtime.bagpipe.faults`).

Example:
    >>> from tidal.runtime.bagpipe.trainer import flat_rows
    >>> import torch
    >>> flat_rows(torch.tensor([2, 5, 9]), torch.tensor([5, 9]),
    ...           torch.tensor([[1.], [2.]]), dim=1).tolist()
    [[0.0], [1.0], [2.0]]
"""
from __future__ import annotations

import contextlib
import os
import queue
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist

from tidal.ir.errors import TidalError
from tidal.ir.portable_graph import PortableGraph
from tidal.runtime.bagpipe.cache import TableCache
from tidal.runtime.bagpipe.errors import BagpipeError
from tidal.runtime.bagpipe.faults import (ORACLE, process_failure, progress_mark, role,
                                          wait_rpc, write_report)
from tidal.runtime.bagpipe.oracle import TableDecision
from tidal.runtime.bagpipe.server import merge_rows, split_by_server
from tidal.runtime.bagpipe.stats import IterationStats
from tidal.runtime.peer_failures import is_peer_failure, peer_of

__all__ = ["BatchWork", "TrainerConfig", "Trainer", "flat_rows", "CHECKPOINT_FILE"]

CHECKPOINT_FILE = "bagpipe_checkpoint.pt"


@dataclass(frozen=True)
class BatchWork:
    """What the Oracle Cacher sends a trainer for one batch: its shard of the inputs and
    targets and the decision of every table."""

    batch: int
    inputs: tuple
    targets: Any
    decisions: dict  # table name -> TableDecision


@dataclass(frozen=True)
class TrainerConfig:
    """Settings every trainer shares."""

    trainers: int
    lr: float
    lookahead: int
    start: int
    stop: int
    timeout_s: float
    checkpoint_every: Optional[int] = None
    checkpoint_dir: Optional[str] = None
    progress_dir: Optional[str] = None
    fail_at: Optional[tuple] = None   # (trainer, iteration[, "exit" or "stall"]): a test hook
    report_dir: Optional[str] = None   # where a failing trainer writes its report (faults)


def flat_rows(ids: torch.Tensor, have: torch.Tensor, rows: torch.Tensor, dim: int
              ) -> torch.Tensor:
    """A ``[len(ids), dim]`` buffer holding ``rows[k]`` at the position of ``have[k]`` in the
    sorted ``ids`` and zeros elsewhere (``have`` sorted; ids of ``have`` not in ``ids`` are
    ignored)."""
    out = torch.zeros(len(ids), dim, dtype=rows.dtype)
    if len(ids) and len(have):
        mask = torch.isin(ids, have)
        out[mask] = rows[torch.searchsorted(have, ids[mask])]
    return out


def _ids(values: Sequence[int]) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64)


class Trainer:
    """Trainer ``rank`` of ``config.trainers``: holds ``gm`` (the rewritten graph: its dense
    parameters), a cache per table of ``plan``, and RRefs of the embedding servers. Batches
    arrive through :meth:`deliver`; :meth:`run` trains and returns per-iteration stats (and,
    on trainer 0, the final dense state)."""

    def __init__(self, rank: int, gm: Union[torch.nn.Module, PortableGraph], plan: Any,
                 servers: list, loss_fn: Callable, config: TrainerConfig):
        self.rank = rank
        gm = gm.build() if isinstance(gm, PortableGraph) else gm
        self.gm = gm
        self.plan = plan
        self.servers = servers
        self.loss_fn = loss_fn
        self.cfg = config
        self.tables = {t.name: t for t in plan.tables}
        self.caches = {t.name: TableCache(t.name, t.dim, t.torch_dtype) for t in plan.tables}
        table_params = {f"{t.name}.weight" for t in plan.tables}
        self.params = [p for n, p in gm.named_parameters() if n not in table_params]
        self._inbox: queue.Queue = queue.Queue()
        self._work: dict[int, BatchWork] = {}
        self._fetches: dict[int, dict] = {}
        self._writes: list = []
        self._deferred: Optional[tuple] = None
        self._confirmed = config.start - 1
        self._next_prefetch = config.start

    # -- called by the Oracle Cacher over RPC ------------------------------------------------
    def deliver(self, work: BatchWork) -> None:
        """Queue one batch's work (RPC target)."""
        self._inbox.put(work)

    # -- helpers -------------------------------------------------------------------------------
    def _get(self, x: int) -> BatchWork:
        deadline = time.monotonic() + self.cfg.timeout_s
        while x not in self._work:
            left = deadline - time.monotonic()
            try:
                w = self._inbox.get(timeout=max(left, 0.001))
            except queue.Empty:
                raise process_failure(
                    f"bagpipe trainer {self.rank}: no work for iteration {x} from the Oracle "
                    f"Cacher within {self.cfg.timeout_s:g} s: it stalled or died",
                    what=f"the delivery of batch {x}", peer_name=ORACLE,
                    timeout_s=self.cfg.timeout_s, iteration=x) from None
            self._work[w.batch] = w
        return self._work[x]

    def _issue_prefetch(self, x: int, st: Optional[IterationStats]) -> None:
        w = self._get(x)
        S = len(self.servers)
        per_table = {}
        for name, d in w.decisions.items():
            ids = _ids(d.fetch[self.rank])
            parts = split_by_server(ids, S)
            futs = [(self.servers[s].rpc_async(timeout=self.cfg.timeout_s).fetch(name, part),
                     f"the fetch of rows of {name} for batch {x}", self._server(s))
                    if len(part) else None for s, part in enumerate(parts)]
            per_table[name] = (ids, parts, futs)
        self._fetches[x] = per_table
        self._next_prefetch = x + 1

    def _prefetch_ahead(self, upto: int) -> None:
        while self._next_prefetch <= min(upto, self.cfg.stop - 1):
            w = self._get(self._next_prefetch)
            if any(d.written_through > self._confirmed for d in w.decisions.values()):
                return
            self._issue_prefetch(self._next_prefetch, None)

    def _wait_writes(self) -> None:
        for call in self._writes:
            wait_rpc(*call, self.cfg.timeout_s)
        self._writes = []

    def _server(self, s: int) -> str:
        """Embedding server ``s``'s name (:func:`~tidal.runtime.bagpipe.faults.role`)."""
        return role(1 + self.cfg.trainers + s, self.cfg.trainers)

    @contextlib.contextmanager
    def _collective(self, what: str) -> Iterator[None]:
        """Run collective ``what`` of the trainers' group; one that fails or times out (a peer
        trainer stalled or died) raises a ``BagpipePeerFailure`` naming that trainer."""
        try:
            yield
        except (RuntimeError, dist.DistError) as e:
            if isinstance(e, TidalError) or not is_peer_failure(e):
                raise
            peer = self._failed_peer(str(e))
            raise process_failure(
                f"bagpipe trainer {self.rank}: {what} did not complete within "
                f"{self.cfg.timeout_s:g} s: {peer or 'a peer trainer'} stalled or died",
                what=what, peer_name=peer, timeout_s=self.cfg.timeout_s, exc=e) from e

    def _failed_peer(self, text: str) -> str:
        """The trainer a failed collective waited for: the rank its error ``text`` names (or
        the other one of two), else the one behind the others ('' if none is)."""
        peer = peer_of(text)
        if peer is not None and peer != self.rank:
            return f"trainer {peer}"
        marks = {r: progress_mark(self.cfg.progress_dir, r) for r in range(self.cfg.trainers)}
        marks = {r: -1 if m is None else m for r, m in marks.items()}
        low = min((m for r, m in marks.items() if r != self.rank), default=None)
        behind = [r for r, m in marks.items() if m == low and r != self.rank]
        return f"trainer {behind[0]}" if len(behind) == 1 and low < marks[self.rank] else ""

    def _barrier(self, what: str) -> None:
        """Barrier of the trainers' group (a one-element all-reduce)."""
        with self._collective(what):
            dist.all_reduce(torch.zeros(1))

    def _write_back(self, name: str, ids: Sequence[int], st: IterationStats) -> None:
        cache = self.caches[name]
        if not len(ids):
            return
        ids_t = _ids(ids)
        rows = cache.evict(ids)
        S = len(self.servers)
        for s, part in enumerate(split_by_server(ids_t, S)):
            if len(part):
                sel = rows[ids_t % S == s]
                self._writes.append((self.servers[s].rpc_async(
                    timeout=self.cfg.timeout_s).write(name, part, sel),
                    f"the write-back of rows of {name}", self._server(s)))
        st.rows_written += len(ids)
        st.bytes_written += rows.numel() * rows.element_size()

    def _drop(self, name: str, d: TableDecision, st: IterationStats, critical: bool) -> None:
        """After batch ``d.batch``'s syncs: write back this trainer's evictions, drop the
        others' copies of evicted shared rows."""
        cache = self.caches[name]
        mine = set(d.writeback[self.rank])
        before = st.bytes_written
        self._write_back(name, sorted(mine), st)
        if critical:
            st.bytes_critical += st.bytes_written - before
        others = [i for i in d.dropped if i not in mine and i in cache]
        if others:
            cache.evict(others)

    def _decisions_of(self, x: int) -> dict:
        return self._work[x].decisions

    def _finish_deferred(self, st: IterationStats) -> None:
        if self._deferred is None:
            return
        x, handle, buf, layout = self._deferred
        self._deferred = None
        if handle is not None:
            with self._collective(f"the background sync of iteration {x}"):
                handle.wait()
            self._apply(buf, layout)
        for name, d in self._decisions_of(x).items():
            self._drop(name, d, st, critical=False)
        self._work.pop(x, None)

    def _apply(self, buf: torch.Tensor, layout: list) -> None:
        """Apply an all-reduced buffer: gradient segments ``/ T`` as SGD steps, promotion
        segments as values."""
        T, lr = self.cfg.trainers, self.cfg.lr
        for name, kind, ids, lo, hi in layout:
            seg = buf[lo:hi].view(len(ids), self.tables[name].dim)
            cache = self.caches[name]
            if kind == "grad":
                cache.update(ids, seg / T, lr)
            else:
                ttl = dict(self._work[kind].decisions[name].ttl)
                have = [i for i in ids if i in cache]
                missing = [k for k, i in enumerate(ids) if i not in cache]
                if have:
                    cache.assign(have, seg[[k for k, i in enumerate(ids) if i in cache]])
                if missing:
                    cache.insert([ids[k] for k in missing], seg[missing],
                                 ttl=ttl.get(ids[missing[0]], -1))
                    for k in missing:
                        cache.set_ttl([ids[k]], ttl.get(ids[k], -1))

    def _save_checkpoint(self, x: int) -> None:
        """Trainer 0 at the start of a segment (every cache flushed, write-backs confirmed):
        the full tables from the servers, the dense state and the next iteration."""
        futs = [s.rpc_async(timeout=self.cfg.timeout_s).shards() for s in self.servers]
        shards = [wait_rpc(f, f"the tables for the checkpoint at {x}", self._server(s),
                           self.cfg.timeout_s) for s, f in enumerate(futs)]
        from tidal.runtime.bagpipe.server import assemble
        tables = {t.name: assemble([sh[t.name] for sh in shards], t.num_rows)
                  for t in self.plan.tables}
        state = {"tables": tables, "dense": {k: v.clone() for k, v in
                                             self.gm.state_dict().items()},
                 "next": x}
        d = Path(self.cfg.checkpoint_dir)
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / (CHECKPOINT_FILE + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, d / CHECKPOINT_FILE)

    def _progress(self, x: int) -> None:
        if self.cfg.progress_dir:
            p = Path(self.cfg.progress_dir) / f"trainer{self.rank}"
            p.write_text(str(x))

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> dict:
        """Train iterations ``start .. stop-1``; returns ``{"stats": [...], "dense": ...}``.
        An error is reported (the run's work directory) before it is raised to the Oracle
        Cacher."""
        try:
            stats = [self._iteration(x) for x in range(self.cfg.start, self.cfg.stop)]
            return self._finish(stats)
        except BaseException as e:
            if self.cfg.report_dir:
                write_report(self.cfg.report_dir, 1 + self.rank, self.cfg.trainers, e)
            raise

    def _iteration(self, x: int) -> IterationStats:
        """Iteration ``x``, steps 1-7 of the module docstring; its stats."""
        self._progress(x)
        fail = tuple(self.cfg.fail_at or ())
        if fail[:2] == (self.rank, x) and fail[2:] == ("stall",):
            os.kill(os.getpid(), signal.SIGSTOP)   # the test hook: hung, alive
        elif fail[:2] == (self.rank, x):
            os._exit(1)
        t0 = time.perf_counter()
        st = IterationStats(iteration=x)
        w = self._get(x)
        sync_fetch = self._next_prefetch <= x
        if sync_fetch:
            self._prefetch_now(x, st)
        kwargs, leaves = self._rows_for(x, w, st, sync_fetch)
        self._forward_backward(w, kwargs)
        grads = self._row_grads(w, leaves)
        self._finish_deferred(st)
        dense = self._all_reduce_dense()
        self._wait_writes()
        buf, layout = self._critical_sync(x, w, leaves, grads, st)
        self._step_dense(dense)
        self._apply(buf, layout)
        self._background_sync(x, w, leaves, grads, st)
        self._prefetch_ahead(x + self.cfg.lookahead)   # the window: x and the L batches beyond
        st.seconds = time.perf_counter() - t0
        return st

    def _prefetch_now(self, x: int, st: IterationStats) -> None:
        """Step 1 when ``x``'s prefetch was not issued ahead: this trainer's write-backs
        waited for, a barrier with the others (every write-back up to ``x - 1`` confirmed; at
        a checkpoint boundary trainer 0 saves, then a second barrier), then the prefetch."""
        cfg = self.cfg
        self._wait_writes()
        self._barrier(f"the barrier before the prefetch of iteration {x}")
        self._confirmed = x - 1
        if (cfg.checkpoint_every and cfg.checkpoint_dir and x > cfg.start
                and x % cfg.checkpoint_every == 0):
            if self.rank == 0:
                self._save_checkpoint(x)
            self._barrier(f"the barrier after the checkpoint at iteration {x}")
        self._issue_prefetch(x, st)

    def _rows_for(self, x: int, w: BatchWork, st: IterationStats, sync_fetch: bool
                  ) -> tuple[dict, dict]:
        """The fetched rows of ``x`` put in the caches (with their TTLs) and the rows this
        trainer's shard uses taken out as leaves: the graph's keyword inputs and, per table,
        ``(used ids, leaf)``."""
        kwargs, leaves = {}, {}
        for name, d in w.decisions.items():
            cache, table = self.caches[name], self.tables[name]
            ids, _, futs = self._fetches[x][name]
            if len(ids):
                answers = [wait_rpc(*f, self.cfg.timeout_s) if f is not None else None
                           for f in futs]
                rows = merge_rows(ids, answers, len(self.servers), table.dim,
                                  table.torch_dtype)
                cache.insert(ids.tolist(), rows)
                nb = rows.numel() * rows.element_size()
                st.rows_fetched += len(ids)
                st.bytes_fetched += nb
                if sync_fetch:
                    st.bytes_critical += nb
            for i, t in d.ttl:
                if i in cache:
                    cache.set_ttl([i], t)
            used = d.uses[self.rank]
            st.lookups += len(used)
            st.hits += len(set(used).difference(d.fetch[self.rank]))
            used_t = _ids(used)
            leaf = cache.rows(used).requires_grad_(True)
            kwargs[table.ids_input] = used_t
            kwargs[table.rows_input] = leaf
            leaves[name] = (used_t, leaf)
        del self._fetches[x]
        return kwargs, leaves

    def _forward_backward(self, w: BatchWork, kwargs: dict) -> None:
        """Step 2: forward and backward of the graph on this trainer's shard."""
        for p in self.params:
            p.grad = None
        out = self.gm(*w.inputs, **kwargs)
        loss = self.loss_fn(out, w.targets)
        loss.backward()

    def _row_grads(self, w: BatchWork, leaves: dict) -> dict:
        """Each table's gradient of the rows used (zeros where none flowed); step 3: LOCAL
        rows stepped at once."""
        T, lr = self.cfg.trainers, self.cfg.lr
        grads = {}
        for name, (used_t, leaf) in leaves.items():
            g = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            grads[name] = g
            loc = w.decisions[name].local[self.rank]
            if loc:
                self.caches[name].update(
                    loc, flat_rows(_ids(loc), used_t, g, self.tables[name].dim) / T, lr)
        return grads

    def _all_reduce_dense(self) -> Optional[torch.Tensor]:
        """Step 5's communication: the dense gradients summed over trainers, / T, flat (None
        without dense parameters)."""
        if not self.params:
            return None
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in self.params])
        with self._collective("the dense-gradient all-reduce"):
            dist.all_reduce(flat)
        return flat / self.cfg.trainers

    def _step_dense(self, dense: Optional[torch.Tensor]) -> None:
        """Step 5's update: ``p.add_(g, alpha=-lr)`` with the flat averaged gradients."""
        if dense is None:
            return
        off = 0
        for p in self.params:
            n = p.numel()
            with torch.no_grad():
                p.add_(dense[off:off + n].view_as(p), alpha=-self.cfg.lr)
            off += n

    def _grad_segments(self, w: BatchWork, leaves: dict, grads: dict,
                       ids_of: Callable[[TableDecision], Sequence[int]],
                       parts: list, layout: list) -> int:
        """Append to the buffer ``parts``/``layout`` the gradients of the rows ``ids_of`` each
        table's decision names (zeros for rows this trainer did not use); the rows added."""
        added = 0
        for name, d in w.decisions.items():
            ids = ids_of(d)
            if ids:
                flat = flat_rows(_ids(ids), leaves[name][0], grads[name], self.tables[name].dim)
                _append_segment(parts, layout, name, "grad", list(ids), flat)
                added += len(ids)
        return added

    def _promotion_segments(self, nxt: BatchWork, parts: list, layout: list) -> int:
        """Append to the buffer the values of the ids promoted to shared for ``nxt`` (this
        trainer's rows where it owns them, zeros elsewhere); the rows added."""
        added = 0
        for name, d in nxt.decisions.items():
            if d.promote:
                table = self.tables[name]
                ids = [i for i, _ in d.promote]
                mine = sorted(i for i, o in d.promote if o == self.rank)
                vals = torch.zeros(len(ids), table.dim, dtype=table.torch_dtype)
                if mine:
                    vals = flat_rows(_ids(ids), _ids(mine), self.caches[name].rows(mine),
                                     table.dim)
                _append_segment(parts, layout, name, nxt.batch, ids, vals)
                added += len(ids)
        return added

    def _critical_sync(self, x: int, w: BatchWork, leaves: dict, grads: dict,
                       st: IterationStats) -> tuple[torch.Tensor, list]:
        """Step 6: the critical all-reduce (shared rows ``x + 1`` uses, promotions for
        ``x + 1``) in one flat buffer; the reduced buffer and its layout."""
        parts: list = []
        layout: list = []
        st.rows_synced_critical += self._grad_segments(w, leaves, grads,
                                                       lambda d: d.critical, parts, layout)
        if x + 1 < self.cfg.stop:
            st.rows_promoted += self._promotion_segments(self._get(x + 1), parts, layout)
        dtype = parts[0].dtype if parts else torch.float64
        buf = torch.cat(parts) if parts else torch.zeros(1, dtype=dtype)
        with self._collective(f"the critical sync of iteration {x}"):
            dist.all_reduce(buf)
        self._confirmed = x - 1
        if parts:
            nb = buf.numel() * buf.element_size()
            st.bytes_synced += nb
            st.bytes_critical += nb
        return buf, layout

    def _background_sync(self, x: int, w: BatchWork, leaves: dict, grads: dict,
                         st: IterationStats) -> None:
        """Step 7: the other shared rows of ``x`` all-reduced in the background; the
        evictions of ``x`` written back now, or deferred until that sync is applied."""
        parts: list = []
        layout: list = []
        st.rows_synced_background += self._grad_segments(w, leaves, grads,
                                                         lambda d: d.background, parts, layout)
        handle, buf = None, None
        if parts:
            buf = torch.cat(parts)
            handle = dist.all_reduce(buf, async_op=True)
            st.bytes_synced += buf.numel() * buf.element_size()
        if any(d.deferred for d in w.decisions.values()):
            self._deferred = (x, handle, buf, layout)
            return
        if handle is not None:  # the oracle never asks for this; stay correct anyway
            with self._collective(f"the background sync of iteration {x}"):
                handle.wait()
            self._apply(buf, layout)
        for name, d in w.decisions.items():
            self._drop(name, d, st, critical=True)
        self._work.pop(x, None)

    def _finish(self, stats: list[IterationStats]) -> dict:
        """After the last iteration: the deferred sync and write-backs completed (counted in
        the last iteration's stats), every cache checked empty, a final barrier."""
        cfg = self.cfg
        final = IterationStats(iteration=cfg.stop)
        self._finish_deferred(final)
        self._wait_writes()
        left = {n: len(c) for n, c in self.caches.items() if len(c)}
        if left:
            raise BagpipeError(f"bagpipe trainer {self.rank}: rows still cached after the last "
                               f"iteration: {left}", trainer=self.rank, iteration=cfg.stop)
        self._barrier("the final barrier")
        if stats:
            stats[-1].rows_written += final.rows_written
            stats[-1].bytes_written += final.bytes_written
        out = {"stats": stats}
        if self.rank == 0:
            out["dense"] = {k: v.detach().clone() for k, v in self.gm.state_dict().items()}
        return out


def _append_segment(parts: list, layout: list, name: str, kind: Any, ids: list,
                    rows: torch.Tensor) -> None:
    """Append ``rows`` flattened to a sync buffer's ``parts`` and its entry ``(name, kind,
    ids, start, end)`` to ``layout`` (``kind``: "grad", or the batch a promotion is for)."""
    start = layout[-1][4] if layout else 0
    parts.append(rows.reshape(-1))
    layout.append((name, kind, ids, start, start + parts[-1].numel()))
