"""Which Bagpipe process failed, named by the processes that waited for it.

A process that waits for another (a trainer in a gloo collective with the other trainers or
in an RPC to an embedding server, the Oracle Cacher waiting for the trainers or delivering them
batches) and sees it fail or time out raises a
:class:`~tidal.runtime.bagpipe.errors.BagpipePeerFailure` naming that process
(:func:`process_failure`, :func:`wait_rpc`, :func:`wait_all`). Every process writes its first
error as a report in the run's work directory (:func:`write_report`); the parent reads them
(:func:`read_reports`) and names the process at fault (:func:`run_failure`): one that died
without a report (killed), else the author of the first report when that is its own error,
else the process the first reports blame (alive: it stalled), else the slowest trainer.

Ranks: 0 is the Oracle Cacher, ``1..T`` the trainers, ``T+1..`` the embedding servers.

Example:
    >>> role(0, 2), role(2, 2), role(3, 2)
    ('oracle cacher', 'trainer 1', 'embedding server 0')
    >>> rank_of("trainer 1", 2), rank_of("embedding server 0", 2), rank_of("", 2)
    (2, 3, None)
    >>> at_fault([None, None, None, None], {}, [4, 2])    # no report: the slowest trainer
    2
"""
from __future__ import annotations

import json
import os
import signal
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from tidal.runtime.bagpipe.errors import BagpipeError, BagpipePeerFailure
from tidal.runtime.peer_failures import PeerFailureError, is_peer_failure

__all__ = ["ORACLE", "role", "rank_of", "progress_mark", "rpc_failed", "process_failure",
           "wait_rpc", "wait_all", "Report", "write_report", "read_reports", "at_fault",
           "run_failure"]

ORACLE = "oracle cacher"

RPC_SIGNS = ("ran for more than set timeout", "tensorpipe", "connection", "pipe closed",
             "broken pipe", "eof (this error originated", "timed out", "rpc agent")
"""Text (lower case) of an RPC that failed in transport (the callee died or stalled), as
opposed to an error the callee raised (re-raised by RPC after "On WorkerInfo(...)")."""


def role(rank: int, trainers: int) -> str:
    """The process of RPC rank ``rank`` in a run of ``trainers`` trainers, in words."""
    if rank == 0:
        return ORACLE
    if rank <= trainers:
        return f"trainer {rank - 1}"
    return f"embedding server {rank - trainers - 1}"


def rank_of(name: str, trainers: int) -> Optional[int]:
    """The RPC rank of the process :func:`role` calls ``name`` (None for '' or unknown)."""
    if name == ORACLE:
        return 0
    for prefix, first in (("trainer ", 1), ("embedding server ", trainers + 1)):
        if name.startswith(prefix) and name[len(prefix):].isdigit():
            return first + int(name[len(prefix):])
    return None


def progress_mark(progress_dir: Optional[str], trainer: int) -> Optional[int]:
    """The iteration ``trainer`` last started (its progress file in ``progress_dir``), None
    when unknown.

    Example:
        >>> progress_mark(None, 0) is None
        True
    """
    try:
        return int(Path(progress_dir, f"trainer{trainer}").read_text())
    except (OSError, TypeError, ValueError):
        return None


def rpc_failed(exc: BaseException) -> bool:
    """Whether ``exc`` (from an RPC's future) is the RPC failing in transport or timing out,
    not an error the called process raised.

    Example:
        >>> rpc_failed(RuntimeError("RPC ran for more than set timeout (20000 ms)"))
        True
        >>> rpc_failed(RuntimeError("On WorkerInfo(id=3, name=server0):\\nKeyError: 't'"))
        False
    """
    text = str(exc)
    if isinstance(exc, PeerFailureError) or "On WorkerInfo(" in text:
        return False
    return isinstance(exc, RuntimeError) and any(s in text.lower() for s in RPC_SIGNS)


def process_failure(message: str, *, what: str, peer_name: str, timeout_s: Optional[float],
                    exc: Optional[BaseException] = None, iteration: Optional[int] = None
                    ) -> BagpipePeerFailure:
    """The error of a process that waited for ``peer_name`` (a name :func:`role` gives): ``what``
    did not complete; ``exc`` (the RPC's or collective's error) chained."""
    trainer = None
    if peer_name.startswith("trainer ") and peer_name[8:].isdigit():
        trainer = int(peer_name[8:])
    seen = ""
    if exc is not None:
        seen = f": {type(exc).__name__}: {_first_line(exc)[:200]}"
    error = BagpipePeerFailure(f"{message}{seen}", what=what, peer_name=peer_name,
                               trainer=trainer, iteration=iteration, timeout_s=timeout_s)
    error.__cause__ = exc
    return error


def wait_rpc(future: Any, what: str, peer_name: str, timeout_s: Optional[float]) -> Any:
    """``future.wait()``; an RPC that failed in transport or timed out raises
    :func:`process_failure` naming ``peer_name``.

    Example:
        >>> import torch
        >>> f = torch.futures.Future()
        >>> f.set_exception(RuntimeError("RPC ran for more than set timeout (20000 ms)"))
        >>> try:
        ...     wait_rpc(f, "the fetch of table t", "embedding server 0", 20.0)
        ... except BagpipePeerFailure as e:
        ...     print(e.peer_name, "|", str(e)[:61])
        embedding server 0 | bagpipe: the fetch of table t from embedding server 0 did not
    """
    try:
        return future.wait()
    except RuntimeError as e:
        if not rpc_failed(e):
            raise
        raise process_failure(f"bagpipe: {what} from {peer_name} did not complete (it stalled "
                              f"or died; timeout {timeout_s:g} s)", what=what,
                              peer_name=peer_name, timeout_s=timeout_s, exc=e) from e


def wait_all(calls: Sequence[tuple], timeout_s: Optional[float]) -> list:
    """The results of every ``(future, what, peer_name)`` of ``calls``; the first to fail
    raises at once (not after the ones before it complete), as :func:`wait_rpc` does.

    Example:
        >>> import torch
        >>> slow, failed = torch.futures.Future(), torch.futures.Future()
        >>> failed.set_exception(RuntimeError("RPC ran for more than set timeout (9 ms)"))
        >>> try:
        ...     wait_all([(slow, "the loop", "trainer 0"), (failed, "a call", "trainer 1")], 9)
        ... except BagpipePeerFailure as e:
        ...     print(e.peer_name)
        trainer 1
    """
    pending = list(calls)
    while pending:
        for call in [c for c in pending if c[0].done()]:
            wait_rpc(*call, timeout_s)   # raises if it failed
            pending.remove(call)
        if pending:
            time.sleep(0.005)
    return [wait_rpc(*call, timeout_s) for call in calls]


@dataclass(frozen=True)
class Report:
    """The first error of process ``rank`` (``role`` in words) at time ``at``: its type
    (``kind``), first line (``message``), whether it waited for a peer that failed
    (``peer_failure``; ``peer_name`` that peer, '' if unknown; ``what`` the RPC or collective),
    the error chained to it (``cause``, 'Type: first line') and the traceback (``text``)."""

    rank: int
    role: str
    at: float
    kind: str
    message: str
    peer_failure: bool
    peer_name: str
    what: str
    timeout_s: Optional[float]
    cause: str
    text: str


def _first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (of the callee's error, for one RPC re-raised).

    Example:
        >>> _first_line(ValueError("On WorkerInfo(id=1, name=trainer0):\\nValueError('bad')"))
        "ValueError('bad')"
    """
    lines = str(exc).strip().splitlines() or [""]
    if lines[0].startswith("On WorkerInfo(") and len(lines) > 1:
        lines = lines[1:]
    return lines[0].strip()[:500]


def _report_of(rank: int, trainers: int, exc: BaseException) -> Report:
    """The :class:`Report` of process ``rank`` failing with ``exc`` (now)."""
    cause, first = exc.__cause__, _first_line(exc)
    return Report(rank=rank, role=role(rank, trainers), at=time.time(), kind=type(exc).__name__,
                  message=first if isinstance(exc, BagpipeError) else
                  f"{type(exc).__name__}: {first}",
                  peer_failure=is_peer_failure(exc) or rpc_failed(exc),
                  peer_name=getattr(exc, "peer_name", "") or "",
                  what=getattr(exc, "what", "") or "", timeout_s=getattr(exc, "timeout_s", None),
                  cause=f"{type(cause).__name__}: {_first_line(cause)}" if cause else "",
                  text="".join(traceback.format_exception(exc))[-4000:])


def write_report(workdir: str, rank: int, trainers: int, exc: BaseException) -> None:
    """Write process ``rank``'s report of ``exc`` unless it wrote one already (the first error
    is the one that tells what happened; later ones follow from it). Atomic: a reader sees the
    whole report or none. Never raises (a report that cannot be written leaves the process
    unreported: one that then dies is taken for killed)."""
    final = Path(workdir, f"error{rank}.json")
    tmp = Path(workdir, f".error{rank}.{os.getpid()}.{time.monotonic_ns()}")
    try:
        if final.exists():
            return
        tmp.write_text(json.dumps(asdict(_report_of(rank, trainers, exc))))
        os.link(tmp, final)
    except OSError:   # FileExistsError: another thread of this process reported first
        pass
    finally:
        tmp.unlink(missing_ok=True)


def read_reports(workdir: str) -> dict[int, Report]:
    """Every process's report in ``workdir``, by rank."""
    out = {}
    for f in Path(workdir).glob("error*.json"):
        try:
            report = Report(**json.loads(f.read_text()))
        except (OSError, ValueError, TypeError):
            continue
        out[report.rank] = report
    return out


def at_fault(codes: Sequence[Optional[int]], reports: dict, marks: Sequence[Optional[int]]
             ) -> Optional[int]:
    """The rank at fault: one that died without a report (killed), else the author of the
    first report when that is its own error, else the first process a report blames, else the
    slowest trainer (by its iteration ``marks``), else the first that died (None: none)."""
    trainers = len(marks)
    dead = [r for r, c in enumerate(codes) if c not in (None, 0)]
    silent = [r for r in dead if r not in reports]
    if silent:
        return silent[0]
    ordered = sorted(reports.values(), key=lambda p: (p.at, p.rank))
    if ordered and not ordered[0].peer_failure:
        return ordered[0].rank
    for report in ordered:
        blamed = rank_of(report.peer_name, trainers)
        if blamed is not None and blamed != report.rank:
            return blamed
    low = [m if m is not None else -1 for m in marks]
    if low and min(low) < max(low):
        return 1 + low.index(min(low))
    return dead[0] if dead else (ordered[0].rank if ordered else None)


def _remote_error(report: Report) -> BaseException:
    """``report``'s error rebuilt in this process (its type when a peer failure, else a
    RuntimeError naming the type), its cause chained and the traceback in a note."""
    if report.peer_failure and report.kind in ("PeerFailureError", "BagpipePeerFailure"):
        error: BaseException = PeerFailureError(
            report.message, pass_name="bagpipe", what=report.what, timeout_s=report.timeout_s,
            peer_name=report.peer_name)
    else:
        error = RuntimeError(report.message)
    if report.cause:
        error.__cause__ = RuntimeError(report.cause)
    error.add_note(f"in the {report.role}:\n{report.text}")
    return error


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def run_failure(codes: Sequence[Optional[int]], reports: dict, marks: Sequence[Optional[int]],
                timeout_s: float, checkpoint: Optional[str]) -> Optional[BagpipeError]:
    """The error that ends a failed run: the process :func:`at_fault` names, with what the
    others saw (the first report chained); ``codes`` are the exit codes by rank (None: alive),
    ``marks`` each trainer's iteration. None when nothing tells (no report, no death, no
    trainer behind another).

    Example (trainer 0 timed out in an all-reduce with trainer 1, which is alive):
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     write_report(folder, 1, 2, process_failure(
        ...         "bagpipe trainer 0: all-reduce", what="the dense-gradient all-reduce",
        ...         peer_name="trainer 1", timeout_s=20.0, exc=RuntimeError("Timed out waiting")))
        ...     e = run_failure([None] * 4, read_reports(folder), [3, 2], 20.0, None)
        >>> print(type(e).__name__, e.peer, e.peer_name, e.what, "|", e)
        ... # doctest: +NORMALIZE_WHITESPACE
        BagpipePeerFailure 1 trainer 1 the dense-gradient all-reduce | bagpipe: trainer 1
        stalled at iteration 2 (alive but no progress for 20 s: trainer 0: the dense-gradient
        all-reduce did not complete: RuntimeError: Timed out waiting); last checkpoint: None
    """
    rank = at_fault(codes, reports, marks)
    if rank is None:
        return None
    name, trainer = role(rank, len(marks)), (rank - 1 if 1 <= rank <= len(marks) else None)
    iteration = marks[trainer] if trainer is not None else None
    where = f" at iteration {iteration}" if iteration is not None else ""
    code, own = codes[rank], reports.get(rank)
    if own is not None and not own.peer_failure:
        state = "died" if code not in (None, 0) else "failed"
        error: BagpipeError = BagpipeError(
            f"bagpipe: {name} {state}{where} ({own.message}); last checkpoint: {checkpoint}",
            trainer=trainer, iteration=iteration, checkpoint=checkpoint)
        error.__cause__ = _remote_error(own)
        return error
    witness = next((p for p in sorted(reports.values(), key=lambda p: (
        p.peer_name != name, not p.what, p.at)) if p.rank != rank and p.peer_failure), None)
    died = code not in (None, 0)
    seen = ""
    if witness is not None:
        seen = (f"{witness.role}: {witness.what} did not complete: "
                f"{witness.cause or witness.message}" if witness.what
                else f"{witness.role}: {witness.message}")
    why = (f"{_exit_text(code)}{'; ' if seen else ''}{seen}" if died else
           f"alive but no progress for {timeout_s:g} s{': ' if seen else ''}{seen}")
    error = BagpipePeerFailure(
        f"bagpipe: {name} {'died' if died else 'stalled'}{where} ({why}); last checkpoint: "
        f"{checkpoint}", what=witness.what if witness else "", peer_name=name, trainer=trainer,
        iteration=iteration, checkpoint=checkpoint, timeout_s=timeout_s)
    error.__cause__ = _remote_error(witness) if witness else None
    return error
