"""The markdown table of a ``make gpu-check`` run, from its JSON lines alone.

Example:
    >>> from benchmarks.gpu_check.table import render
    >>> env = {"name": "environment", "ok": True, "seconds": 2.0, "error": None,
    ...        "summary": ["torch"],
    ...        "figures": {"gpu": "NVIDIA H100", "torch": "2.11.0", "cuda": "13.0"}}
    >>> step = {"name": "train_step", "ok": False, "seconds": 9.5, "error": "b1: differs",
    ...         "summary": ["b1.tidal.ms"], "figures": {"b1.tidal.ms": 1.23456, "other": 3}}
    >>> print(render([env, step], date="2026-01-02", device="cuda"))
    GPU: NVIDIA H100; torch 2.11.0 (CUDA 13.0); device cuda; 2026-01-02
    <BLANKLINE>
    | check | result | s | figures |
    |---|---|---|---|
    | environment | ok | 2 | torch=2.11.0 |
    | train_step | FAILED: b1: differs | 9.5 | b1.tidal.ms=1.23 |
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Optional, Union


def fmt(value: Any) -> str:
    """A figure as the table shows it: floats to 3 significant digits."""
    if isinstance(value, bool) or not isinstance(value, float):
        return str(value)
    return f"{value:.3g}"


def summary(rec: dict) -> str:
    """``key=value`` for the figures the check names in ``summary`` (else every figure that is
    a number or a short string)."""
    figures = rec.get("figures") or {}
    keys = [k for k in rec.get("summary") or () if k in figures] or [
        k for k, v in figures.items()
        if k != "failures" and (isinstance(v, (int, float)) or len(str(v)) <= 24)]
    return ", ".join(f"{k}={fmt(figures[k])}" for k in keys)


def _cell(text: str, limit: int = 160) -> str:
    text = " ".join(str(text).split()).replace("|", "/")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def render(records: Iterable[dict], *, date: str, device: str, quick: bool = False) -> str:
    """The header (GPU name, torch and CUDA versions, device, date) from the ``environment``
    record and one row per check: its result (``ok``, or ``FAILED:`` and the error), seconds
    and its key figures."""
    records = list(records)
    env = next((r.get("figures") or {} for r in records if r.get("name") == "environment"), {})
    cuda = f" (CUDA {env['cuda']})" if env.get("cuda", "none") != "none" else ""
    head = (f"GPU: {env.get('gpu', 'unknown')}; torch {env.get('torch', 'unknown')}{cuda}; "
            f"device {device}; {date}" + ("; quick (tiny sizes)" if quick else ""))
    rows = ["| check | result | s | figures |", "|---|---|---|---|"]
    for r in records:
        result = "ok" if r.get("ok") else f"FAILED: {r.get('error') or 'no error text'}"
        rows.append(f"| {r.get('name')} | {_cell(result)} | {fmt(float(r.get('seconds', 0.0)))}"
                    f" | {_cell(summary(r), 400)} |")
    return head + "\n\n" + "\n".join(rows)


def read_jsonl(path: Union[str, Path]) -> list[dict]:
    """The records of a ``checks.jsonl`` (one JSON object a line)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def render_file(path: Union[str, Path], *, date: str, device: str,
                quick: bool = False, out: Optional[Union[str, Path]] = None) -> str:
    """Render ``path``'s JSON lines; write the table to ``out`` when given."""
    text = render(read_jsonl(path), date=date, device=device, quick=quick)
    if out is not None:
        Path(out).write_text(text + "\n")
    return text
