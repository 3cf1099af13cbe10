"""Launch a Bagpipe run: the Oracle Cacher (also the data processor), trainers and embedding
servers as processes (torch.multiprocessing, spawn) talking over torch.distributed.rpc
(TensorPipe); the trainers form a gloo process group for their all-reduces. Every group and
RPC has a timeout; a process that dies or stalls ends the run with a
:class:`~tidal.runtime.bagpipe.errors.BagpipePeerFailure` (a ``BagpipeError`` and a
``PeerFailureError``) naming it, told by the processes that waited for it
(:mod:`tidal.runtime.bagpipe.faults`), within the timeout plus a few seconds, and no process is
left behind.

Ranks in RPC: 0 = ``oracle``, 1..T = ``trainer<r>``, T+1..T+S = ``server<s>``. The oracle creates
the servers and trainers as remote objects, starts every trainer's loop, then reads batches,
splits each into T equal shards, runs the lookahead per table and dispatches each trainer its
shard and the decisions (async RPC, as soon as a decision's window is read). Several runs
(:class:`RunSpec`) share one spawn with :func:`train_many`.

Example:
    >>> RunSpec(model=None, data=None, iterations=4).policy
    'bagpipe'
"""
from __future__ import annotations

import datetime
import importlib
import os
import pickle
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from tidal.ir.portable_graph import PortableGraph
from tidal.runtime.bagpipe.errors import BagpipeError
from tidal.runtime.bagpipe.faults import (process_failure, progress_mark, read_reports, role,
                                          run_failure, wait_all, wait_rpc, write_report)
from tidal.runtime.bagpipe.stats import IterationStats

__all__ = ["RunSpec", "Result", "train", "train_many", "load_checkpoint"]

POLICIES = ("bagpipe", "lru", "none")


@dataclass(frozen=True)
class RunSpec:
    """One training run: ``model`` is ``(gm, plan, weights)`` (the rewritten graph module, its
    ``EmbeddingCachePlan`` and the initial full tables by name) or an object with
    ``graph_module``, ``plan`` and ``weights`` attributes; ``data`` has ``.batch(i) -> (inputs,
    targets)`` or is such a callable. ``fail_at=(trainer, iteration)`` is a test hook that makes
    that trainer exit at the start of that iteration (``(trainer, iteration, "stall")``: stop
    there, alive, as a hung machine does: SIGSTOP)."""

    model: Any
    data: Any
    iterations: int
    lookahead: int = 1
    policy: str = "bagpipe"
    lru_rows: int = 0
    lr: float = 0.1
    loss_fn: Optional[Callable] = None
    checkpoint_every: Optional[int] = None
    checkpoint_dir: Optional[str] = None
    resume: Optional[str] = None
    fail_at: Optional[tuple] = None


@dataclass
class Result:
    """Final full tables (name -> tensor, gathered from the servers after every cache was
    flushed), the dense ``state_dict`` (trainer 0's; every trainer holds the same), and the
    per-iteration stats summed over trainers (``per_trainer``: each trainer's own)."""

    tables: dict
    dense: dict
    stats: list
    per_trainer: list = field(default_factory=list)


def load_checkpoint(path: str) -> dict:
    """The checkpoint saved in directory ``path`` (``tables``, ``dense``, ``next``), loaded
    with ``weights_only=True``: a checkpoint holds tensors, dicts and ints only, so one that
    would unpickle anything else (a callable, an object that runs code) is a ``BagpipeError``
    naming the file, and nothing in it runs."""
    import pickle

    from tidal.runtime.bagpipe.trainer import CHECKPOINT_FILE

    f = Path(path) / CHECKPOINT_FILE
    if not f.exists():
        raise BagpipeError(f"bagpipe: no checkpoint in {path!r} (expected {CHECKPOINT_FILE})")
    try:
        ck = torch.load(f, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise BagpipeError(f"bagpipe: resume checkpoint {str(f)!r} is not a Bagpipe checkpoint "
                           f"of tensors, dicts and ints (refused to load it: {first})") from e
    if not isinstance(ck, dict) or not {"tables", "dense", "next"} <= set(ck):
        raise BagpipeError(f"bagpipe: resume checkpoint {str(f)!r} lacks tables, dense and "
                           "next; write it with checkpoint_dir=")
    return ck


def _unpack(model: Any) -> tuple:
    if isinstance(model, tuple) and len(model) == 3:
        return model
    try:
        return model.graph_module, model.plan, model.weights
    except AttributeError:
        raise BagpipeError("bagpipe.train: model must be (gm, plan, weights) or have "
                           "graph_module, plan and weights attributes") from None


def _portable(spec: RunSpec) -> RunSpec:
    """``spec`` with its graph as a :class:`~tidal.ir.portable_graph.PortableGraph`: fx's own
    pickling re-traces the graph's code, which fails on graphs that only run on concrete values
    (Hugging Face models slicing by a shape) and on string type annotations."""
    gm, plan, weights = _unpack(spec.model)
    return replace(spec, model=(PortableGraph.of(gm), plan, dict(weights)))


def _batch(data: Any, i: int):
    return data.batch(i) if hasattr(data, "batch") else data(i)


def _check(spec: RunSpec, trainers: int) -> None:
    if spec.policy not in POLICIES:
        raise BagpipeError(f"bagpipe.train: policy must be one of {POLICIES}, got "
                           f"{spec.policy!r}")
    if spec.iterations < 0 or spec.lookahead < 0 or spec.lru_rows < 0:
        raise BagpipeError("bagpipe.train: iterations, lookahead and lru_rows must be >= 0")
    if spec.checkpoint_every is not None and (spec.checkpoint_every < 1
                                              or not spec.checkpoint_dir):
        raise BagpipeError("bagpipe.train: checkpoint_every needs a value >= 1 and a "
                           "checkpoint_dir")
    if spec.fail_at is not None and not 0 <= spec.fail_at[0] < trainers:
        raise BagpipeError(f"bagpipe.train: fail_at names trainer {spec.fail_at[0]} of "
                           f"{trainers}")
    if spec.fail_at is not None and tuple(spec.fail_at[2:]) not in ((), ("exit",), ("stall",)):
        raise BagpipeError(f"bagpipe.train: fail_at is (trainer, iteration[, 'exit' or "
                           f"'stall']), got {spec.fail_at!r}")


def _shard(x: Any, T: int, r: int, what: str):
    if not isinstance(x, torch.Tensor):
        raise BagpipeError(f"bagpipe: batch {what} must be tensors, got {type(x).__name__}")
    B = x.shape[0]
    if B % T:
        raise BagpipeError(f"bagpipe: batch size {B} is not divisible by {T} trainers")
    n = B // T
    return x[r * n:(r + 1) * n]


def _same_batch(inputs: tuple, targets: Any, x: int) -> None:
    """Every input and the targets are batch-first with one batch size: each trainer takes its
    share by slicing dim 0 (flattened ids with offsets cannot be split that way)."""
    sizes = [getattr(a, "shape", (None,))[0] if getattr(a, "dim", lambda: 0)() else None
             for a in (*inputs, targets)]
    if len(set(sizes)) != 1:
        raise BagpipeError(f"bagpipe: batch {x}: inputs and targets must all be batch-first with "
                           f"one batch size (dim-0 sizes {sizes}); flattened ids with offsets "
                           "cannot be split across trainers: pass ids as a [batch, n] tensor")


# -- process bodies ---------------------------------------------------------------------------
def _rpc_options(port: int, timeout_s: float):
    import torch.distributed.rpc as rpc

    return rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}",
                                           rpc_timeout=timeout_s, num_worker_threads=16)


def _oracle_run(spec: RunSpec, T: int, S: int, timeout_s: float, progress_dir: str,
                report_dir: str) -> dict:
    import torch.distributed.rpc as rpc

    from tidal.ir.plans.embedding_cache import table_ids
    from tidal.runtime.bagpipe.oracle import Lookahead, LruPlanner
    from tidal.runtime.bagpipe.server import EmbeddingServer, assemble
    from tidal.runtime.bagpipe.trainer import BatchWork, Trainer, TrainerConfig

    gm, plan, weights = _unpack(spec.model)
    gm = gm.build() if isinstance(gm, PortableGraph) else gm
    start = 0
    if spec.resume:
        ck = load_checkpoint(spec.resume)
        weights, start = ck["tables"], ck["next"]
        gm.load_state_dict(ck["dense"])
    weights = {t.name: weights[t.name].detach().to(t.torch_dtype) for t in plan.tables}
    stop = spec.iterations
    servers = [rpc.remote(f"server{s}", EmbeddingServer, args=(s, S, weights))
               for s in range(S)]
    cfg = TrainerConfig(trainers=T, lr=spec.lr, lookahead=spec.lookahead, start=start,
                        stop=stop, timeout_s=timeout_s, checkpoint_every=spec.checkpoint_every,
                        checkpoint_dir=spec.checkpoint_dir, progress_dir=progress_dir,
                        fail_at=spec.fail_at, report_dir=report_dir)
    loss_fn = spec.loss_fn or _default_loss
    portable = PortableGraph.of(gm)  # RPC pickles its arguments; see _portable
    trainers = [rpc.remote(f"trainer{r}", Trainer,
                           args=(r, portable, plan, servers, loss_fn, cfg)) for r in range(T)]
    runs = [(t.rpc_async(timeout=0).run(), "the training loop", role(1 + r, T))
            for r, t in enumerate(trainers)]

    def planner():
        if spec.policy == "bagpipe":
            return Lookahead(trainers=T, lookahead=spec.lookahead, stop=stop, start=start,
                             segment=spec.checkpoint_every)
        rows = spec.lru_rows if spec.policy == "lru" else 0
        return LruPlanner(trainers=T, rows=rows, stop=stop, start=start,
                          segment=spec.checkpoint_every)

    planners = {t.name: planner() for t in plan.tables}
    held: dict[int, tuple] = {}
    ready: dict[int, dict] = {}
    sent = []
    for x in range(start, stop):
        inputs, targets = _batch(spec.data, x)
        inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        _same_batch(inputs, targets, x)
        shards = [(tuple(_shard(a, T, r, "inputs") for a in inputs),
                   _shard(targets, T, r, "targets")) for r in range(T)]
        held[x] = shards
        uses = [table_ids(gm, plan, *sh[0]) for sh in shards]
        for t in plan.tables:
            for d in planners[t.name].feed(x, [torch.unique(u[t.name]).tolist()
                                              for u in uses]):
                ready.setdefault(d.batch, {})[t.name] = d
        for b in sorted(ready):
            if len(ready[b]) < len(plan.tables):
                break
            if b - spec.lookahead - AHEAD >= start:
                _wait_trainers(progress_dir, T, b - spec.lookahead - AHEAD, timeout_s, runs)
            decisions = ready.pop(b)
            for r, tr in enumerate(trainers):
                ins, tg = held[b][r]
                sent.append((tr.rpc_async().deliver(BatchWork(b, ins, tg, decisions)),
                             f"the delivery of batch {b}", role(1 + r, T)))
            del held[b]
    outs = wait_all(sent + runs, timeout_s)[len(sent):]
    shards = [wait_rpc(s.rpc_async().shards(), "the final tables", role(1 + T + k, T),
                       timeout_s) for k, s in enumerate(servers)]
    tables = {t.name: assemble([sh[t.name] for sh in shards], t.num_rows) for t in plan.tables}
    per_trainer = [o["stats"] for o in outs]
    stats = [IterationStats.total([p[k] for p in per_trainer])
             for k in range(len(per_trainer[0]))]
    return {"tables": tables, "dense": outs[0]["dense"], "stats": stats,
            "per_trainer": per_trainer}


AHEAD = 2
"""Batches the Oracle Cacher may deliver beyond a trainer's prefetch window (``lookahead``):
it waits for the slowest trainer before sending more, so nothing piles up in a long run."""


def _wait_trainers(progress_dir: str, T: int, x: int, timeout_s: float, runs: list) -> None:
    """Wait until every trainer has started iteration ``x`` (its progress file); a trainer
    whose loop ended early raises its error, one that does not get there in ``timeout_s`` is
    named as stalled."""
    deadline = time.monotonic() + timeout_s
    while True:
        done = [progress_mark(progress_dir, r) for r in range(T)]
        if all(d is not None and d >= x for d in done):
            return
        for future, what, name in runs:
            if future.done():
                wait_rpc(future, what, name, timeout_s)
        if time.monotonic() > deadline:
            at = [-1 if d is None else d for d in done]
            slow = at.index(min(at))
            raise process_failure(
                f"bagpipe: the Oracle Cacher waited {timeout_s:g} s for trainer {slow} to reach "
                f"iteration {x} (the trainers are at {done}): it stalled or died",
                what=f"the wait for trainer {slow} to reach iteration {x}",
                peer_name=role(1 + slow, T),
                timeout_s=timeout_s, iteration=done[slow])
        time.sleep(0.002)


def _default_loss(out, targets):
    return torch.nn.functional.binary_cross_entropy_with_logits(out, targets)


def _worker(rank: int, T: int, S: int, ports: tuple, timeout_s: float, runs: str,
            workdir: str) -> None:
    import torch.distributed as dist
    import torch.distributed.rpc as rpc

    torch.set_num_threads(1)
    # torch's own object collectives (rpc start-up on a gloo group) warn about a deprecated
    # use inside torch; nothing a user can act on
    warnings.filterwarnings("ignore", message="You are using a Backend .* as a ProcessGroup")
    opts = _rpc_options(ports[1], timeout_s)
    world = 1 + T + S
    try:
        importlib.import_module("tidal.ir.cached_embedding_op")  # before unpickling graphs
        specs = pickle.loads(Path(runs).read_bytes())
        Path(workdir, f"up{rank}").touch()   # imported: the parent's startup allowance ends
        if 1 <= rank <= T:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0]}",
                                    rank=rank - 1, world_size=T,
                                    timeout=datetime.timedelta(seconds=timeout_s))
            rpc.init_rpc(f"trainer{rank - 1}", rank=rank, world_size=world,
                         rpc_backend_options=opts)
        elif rank > T:
            rpc.init_rpc(f"server{rank - T - 1}", rank=rank, world_size=world,
                         rpc_backend_options=opts)
        else:
            rpc.init_rpc("oracle", rank=0, world_size=world, rpc_backend_options=opts)
            for k, spec in enumerate(specs):
                out = _oracle_run(spec, T, S, timeout_s, os.path.join(workdir, f"run{k}"),
                                  workdir)
                torch.save(out, os.path.join(workdir, f"result{k}.pt"))
        rpc.shutdown()
        if 1 <= rank <= T:
            dist.destroy_process_group()
    except BaseException as e:  # report, then die: the parent turns it into a BagpipeError
        write_report(workdir, rank, T, e)
        os._exit(1)


# -- the parent ----------------------------------------------------------------------------

def _last_checkpoint(spec: RunSpec) -> Optional[str]:
    from tidal.runtime.bagpipe.trainer import CHECKPOINT_FILE

    if spec.checkpoint_dir and (Path(spec.checkpoint_dir) / CHECKPOINT_FILE).exists():
        return spec.checkpoint_dir
    return None


def _iteration_of(workdir: str, run: int, trainer: int) -> Optional[int]:
    return progress_mark(os.path.join(workdir, f"run{run}"), trainer)


def _current_run(workdir: str, n: int) -> int:
    return min(sum(Path(workdir, f"result{k}.pt").exists() for k in range(n)), n - 1)


def train_many(specs: Sequence[RunSpec], *, trainers: int = 2, servers: int = 1,
               timeout_s: float = 60.0, progress: bool = True) -> list[Result]:
    """Run every spec in order on one set of processes (one spawn); a :class:`Result` each.
    ``progress``: a line on stderr every 10 s while it runs."""
    import torch.multiprocessing as mp

    from tidal.runtime.distributed import free_port

    if trainers < 1 or servers < 1:
        raise BagpipeError(f"bagpipe.train: need >= 1 trainer and >= 1 server, got "
                           f"{trainers} and {servers}")
    for s in specs:
        _check(s, trainers)
    specs = [_portable(s) for s in specs]
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="bagpipe_") as workdir:
        for k in range(len(specs)):
            os.makedirs(os.path.join(workdir, f"run{k}"))
        ports = (free_port(), free_port())
        world = 1 + trainers + servers
        try:
            payload = pickle.dumps(list(specs))
        except Exception as e:
            raise BagpipeError(f"bagpipe.train: the runs cannot be sent to the worker "
                               f"processes (model, data and loss_fn must pickle): {e}") from e
        # the runs go by file: as a Process argument (hundreds of KB through a 64 KiB pipe
        # the child drains only once it has imported torch) each start blocked ~2 s, and the
        # processes started one after another
        runs = os.path.join(workdir, "runs.pkl")
        Path(runs).write_bytes(payload)
        procs = [ctx.Process(target=_worker, args=(r, trainers, servers, ports, timeout_s,
                                                   runs, workdir), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        try:
            _watch(procs, specs, trainers, timeout_s, workdir, progress)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(5)
        results = []
        for k in range(len(specs)):
            out = torch.load(os.path.join(workdir, f"result{k}.pt"), weights_only=False)
            results.append(Result(out["tables"], out["dense"], out["stats"],
                                  out["per_trainer"]))
        return results


PROGRESS_EVERY_S = 10.0
"""How often a run that goes on prints where it is (on stderr)."""


def _report(specs, T: int, workdir: str, started: float) -> None:
    run = _current_run(workdir, len(specs))
    done = [_iteration_of(workdir, run, r) for r in range(T)]
    at = min((d for d in done if d is not None), default=None)
    where = f"iteration {at} of {specs[run].iterations}" if at is not None else "starting"
    runs = f"run {run + 1} of {len(specs)}, " if len(specs) > 1 else ""
    print(f"tidal bagpipe: {runs}{where} ({time.monotonic() - started:.0f} s)",
          file=sys.stderr, flush=True)


def _watch(procs, specs, T: int, timeout_s: float, workdir: str, progress: bool = True
           ) -> None:
    """Wait for every process; a death or a stall (no progress for ``timeout_s`` plus
    ``REPORT_GRACE_S``, the processes that wait for a stalled one reporting it first; plus
    ``STARTUP_S`` while one is starting) raises, naming the process at fault
    (:func:`~tidal.runtime.bagpipe.faults.run_failure`). With ``progress``, a line on stderr
    every ``PROGRESS_EVERY_S`` seconds says where the run is."""
    last_change, seen = time.monotonic(), None
    started = next_report = last_change
    while True:
        if progress and time.monotonic() - next_report > PROGRESS_EVERY_S:
            next_report = time.monotonic()
            _report(specs, T, workdir, started)
        codes = [p.exitcode for p in procs]
        if all(c == 0 for c in codes):
            return
        if any(c not in (None, 0) for c in codes):
            time.sleep(0.3)  # let a first failure's neighbours report theirs
            codes = [p.exitcode for p in procs]
            raise _failure(codes, specs, T, workdir, timeout_s)
        marks = sorted((f.name, f.stat().st_mtime_ns) for f in Path(workdir).rglob("*")
                       if f.is_file())
        if marks != seen:
            seen, last_change = marks, time.monotonic()
        elif time.monotonic() - last_change > timeout_s + REPORT_GRACE_S + (
                0 if all(Path(workdir, f"up{r}").exists() for r in range(len(procs)))
                else STARTUP_S):
            raise _failure(codes, specs, T, workdir, timeout_s)
        time.sleep(0.05)


STARTUP_S = 60.0
"""More time without progress the parent allows while a process is still starting (importing
torch and tidal, unpickling the runs: slow on a loaded machine, and no stall of training)."""

REPORT_GRACE_S = 3.0
"""How long past the run's timeout the parent waits, with no progress, before it ends the run
itself: the processes waiting for a stalled one time out first and report whom they waited
for."""


def _failure(codes, specs, T: int, workdir: str, timeout_s: float) -> BagpipeError:
    """The error ending the run: the process at fault named (``codes``: exit codes by rank,
    None while alive)."""
    run = _current_run(workdir, len(specs))
    ck = _last_checkpoint(specs[run])
    marks = [_iteration_of(workdir, run, r) for r in range(T)]
    error = run_failure(codes, read_reports(workdir), marks, timeout_s, ck)
    if error is None:
        error = BagpipeError(f"bagpipe: no progress for {timeout_s:g} s (run {run}); last "
                             f"checkpoint: {ck}", checkpoint=ck)
    return error


def train(model: Any, data: Any, iterations: int, *, trainers: int = 2, servers: int = 1,
          lookahead: int = 1, policy: str = "bagpipe", lru_rows: int = 0, lr: float = 0.1,
          loss_fn: Optional[Callable] = None, checkpoint_every: Optional[int] = None,
          checkpoint_dir: Optional[str] = None, resume: Optional[str] = None,
          timeout_s: float = 60.0, fail_at: Optional[tuple] = None,
          progress: bool = True) -> Result:
    """Train ``iterations`` batches of ``data`` with Bagpipe (see :class:`RunSpec` for the
    arguments); ``resume=checkpoint_dir`` continues from a checkpoint to ``iterations``;
    ``progress``: a line on stderr every 10 s while it runs."""
    spec = RunSpec(model=model, data=data, iterations=iterations, lookahead=lookahead,
                   policy=policy, lru_rows=lru_rows, lr=lr, loss_fn=loss_fn,
                   checkpoint_every=checkpoint_every, checkpoint_dir=checkpoint_dir,
                   resume=resume, fail_at=fail_at)
    return train_many([spec], trainers=trainers, servers=servers, timeout_s=timeout_s,
                      progress=progress)[0]

