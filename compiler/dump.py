"""Write the dump of a compilation: per pass, the graph before and after, its artifacts, and an
``index.html`` that lists the passes in order with their report rows."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

from tidal.compiler.pass_manager import PassRecord


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def scaling_section(out_dir: Path, gm, cluster, global_batch: int, steps_table,
                    title: str):
    """Simulate weak, strong and batch-optimal scaling of ``gm`` on ``cluster`` (DeepPool
    Figure 1; ``steps_table`` a ``StepsTable`` or the path of its CSV), write
    ``scaling.svg`` and ``scaling.txt`` into ``out_dir`` and return the index section."""
    from tidal.compiler import viz
    from tidal.sim.scaling import StepsTable, scaling_svg, scaling_text, simulate_scaling

    table = steps_table if isinstance(steps_table, StepsTable) else StepsTable.load(steps_table)
    gpus, per_gpu, speedups = simulate_scaling(gm, cluster, table, global_batch)
    out_dir.mkdir(parents=True, exist_ok=True)
    svg, txt = out_dir / "scaling.svg", out_dir / "scaling.txt"
    svg.write_text(scaling_svg(gpus, speedups, f"{title}: simulated scaling"))
    text = scaling_text(gpus, speedups)
    txt.write_text(text + "\n")
    source = steps_table if not isinstance(steps_table, StepsTable) else "given StepsTable"
    rows = (("kind", "simulated (not measured): data parallelism on the compile's cluster"),
            ("GPUs", ", ".join(map(str, gpus))),
            ("weak scaling", f"{per_gpu} samples per GPU"),
            ("strong scaling", f"global batch {global_batch}"),
            ("steps to accuracy", f"{source} ({len(table.rows)} rows)"))
    return viz.DumpSection(name="scaling (DeepPool Fig. 1)", summary_rows=rows,
                           files=(Path(svg.name), Path(txt.name)), text=text)


def _graph_files(r: PassRecord, out_dir: Path, stem: str, title: str, batch: int) -> list[Path]:
    """Render the record's graphs: before and after when the pass changed nodes, else the graph
    after it; the after graph carries the overlay of the pass's plan
    (:mod:`tidal.compiler.viz_passes`)."""
    from tidal.compiler import viz
    from tidal.compiler.viz_passes import overlay_for

    if r.graph_after is None:
        return []
    overlay = overlay_for(r.plan, r.graph_before, r.graph_after)
    if r.graph_before is not None and (r.added or r.removed):
        return viz.dump_graph_pair(r.graph_before, r.graph_after, out_dir, stem, batch=batch,
                                   added=r.added, overlay=overlay)
    dot = viz.graph_to_dot(r.graph_after, title=f"{r.name} ({title})", batch=batch,
                           overlay=overlay)
    return viz.render(dot, out_dir / stem)


def write_dump(out_dir: Path, title: str, records: Sequence[PassRecord], batch: int,
               extra: Sequence = ()) -> Path:
    """Render every record into ``out_dir``, then the ``extra`` index sections (e.g.
    :func:`scaling_section`); return the path of ``index.html``."""
    from tidal.compiler import viz

    out_dir.mkdir(parents=True, exist_ok=True)
    sections = []
    for i, r in enumerate(records):
        stem = f"{i:02d}-{_safe(r.name)}"
        files = _graph_files(r, out_dir, stem, title, batch)
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
    return viz.write_index(out_dir, f"tidal: {title}", sections + list(extra))
