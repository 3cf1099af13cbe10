"""Inspection of a runtime run: a Chrome trace (one row per job) and a summary table.

The JSON loads in ``chrome://tracing`` and https://ui.perfetto.dev: every dispatched piece is a
complete event ("X") on its job's row, from device start to end, with the dispatch and ready
times, iteration, collocation, slowdown and error in ``args``; the wait between ready and start
(blocked by another job on the device) is a separate "blocked" event.

Example:
    >>> from tidal.runtime.scheduler import Runtime, step_job
    >>> from tidal.runtime.backend import LogicalBackend
    >>> from tidal.runtime.trace_export import chrome_trace
    >>> rt = Runtime(backend=LogicalBackend(lambda name, collocated: 50.0))
    >>> _ = rt.submit(step_job("train", lambda: None, iterations=2), priority="high")
    >>> _ = rt.run()
    >>> [e["name"] for e in chrome_trace(rt.trace)["traceEvents"] if e["ph"] == "X"]
    ['train', 'train']
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence, Union

from tidal.runtime.scheduler import Runtime, TraceRecord


def chrome_trace(records: Sequence[TraceRecord]) -> dict:
    """The Chrome trace-event JSON object for ``records`` (one thread row per job)."""
    rows: dict[str, int] = {}
    events: list[dict] = []
    for r in records:
        if r.job not in rows:
            rows[r.job] = len(rows)
            events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": rows[r.job],
                           "args": {"name": f"{r.job} ({r.priority})"}})
        tid = rows[r.job]
        if r.start_us > r.ready_us:
            events.append({"ph": "X", "name": "blocked", "cat": "wait", "pid": 0, "tid": tid,
                           "ts": r.ready_us, "dur": r.start_us - r.ready_us})
        args = {"iteration": r.iteration, "kind": r.kind, "dispatch_us": r.dispatch_us,
                "ready_us": r.ready_us, "collocated": r.collocated}
        if r.slowdown is not None:
            args["slowdown"] = round(r.slowdown, 4)
        if r.error is not None:
            args["error"] = r.error
        events.append({"ph": "X", "name": r.piece, "cat": r.kind, "pid": 0, "tid": tid,
                       "ts": r.start_us, "dur": max(r.end_us - r.start_us, 0.0), "args": args})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(records: Sequence[TraceRecord], path: Union[str, Path]) -> Path:
    """Write ``chrome_trace(records)`` to ``path`` (parents created); return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(records)))
    return path


def summary_table(runtime: Runtime) -> str:
    """The runtime's per-job summary table followed by per-piece foreground slowdowns (mean
    and max over the run, pieces with any observation), most slowed first."""
    per: dict[tuple[str, str], list[float]] = {}
    for r in runtime.trace:
        if r.slowdown is not None and r.collocated:
            per.setdefault((r.job, r.piece), []).append(r.slowdown)
    lines = [runtime.summary()]
    if per:
        from tidal.ir.table import format_table

        rows = sorted(([f"{j}/{p}", len(v), round(sum(v) / len(v), 3), round(max(v), 3),
                        "yes" if (j, p) in runtime.sensitive else "-"]
                       for (j, p), v in per.items()), key=lambda row: -row[2])
        lines.append(format_table(["collocated fg piece", "n", "mean slowdown",
                                   "max slowdown", "sensitive"], rows[:15]))
    return "\n".join(lines)
