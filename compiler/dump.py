"""Write the dump of a compilation: per pass, the graph before and after, its artifacts, and an
``index.html`` that lists the passes in order with their report rows."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

from tidal.compiler.pass_manager import PassRecord


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def write_dump(out_dir: Path, title: str, records: Sequence[PassRecord], batch: int) -> Path:
    """Render every record into ``out_dir``; return the path of ``index.html``."""
    from tidal.compiler import viz

    out_dir.mkdir(parents=True, exist_ok=True)
    sections = []
    for i, r in enumerate(records):
        stem = f"{i:02d}-{_safe(r.name)}"
        files: list[Path] = []
        if r.graph_after is not None:
            if r.graph_before is not None and (r.added or r.removed):
                files += viz.dump_graph_pair(r.graph_before, r.graph_after, out_dir, stem,
                                             batch=batch, added=r.added)
            else:
                dot = viz.graph_to_dot(r.graph_after, title=f"{r.name} ({title})", batch=batch)
                files += viz.render(dot, out_dir / stem)
        for name, text in r.artifacts.items():
            path = out_dir / f"{stem}.{_safe(name)}"
            path.write_text(text)
            files.append(path)
        rows = [("wall time", f"{r.seconds * 1e3:.1f} ms"),
                ("nodes", f"{r.nodes_before} -> {r.nodes_after}"),
                ("added", f"{len(r.added)}"), ("removed", f"{len(r.removed)}"),
                ("plan", r.plan.summary() if r.plan else "-")]
        rows += [("note", n) for n in r.notes]
        sections.append(viz.DumpSection(
            name=r.name, summary_rows=tuple(rows),
            files=tuple(Path(f.name) for f in files),
            text=r.plan.table() if r.plan else ""))
    return viz.write_index(out_dir, f"tidal: {title}", sections)
