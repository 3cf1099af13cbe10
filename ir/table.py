"""Plain-text tables for reports and the CLI."""
from __future__ import annotations

from typing import Sequence


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Columns padded to their widest cell; numbers right-aligned, text left-aligned.

    Example:
        >>> print(format_table(["pass", "ms"], [["trace", 12.5], ["annotate", 3]]))
        pass      ms  
        --------  ----
        trace     12.5
        annotate     3
    """
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in r] for r in rows]
    numeric = [all(_is_num(r[i]) for r in rows) and bool(rows) for i in range(len(headers))]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for k, r in enumerate(cells):
        parts = [c.rjust(w) if numeric[i] and k > 0 else c.ljust(w)
                 for i, (c, w) in enumerate(zip(r, widths))]
        lines.append("  ".join(parts))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.3e}"
    return str(v)
