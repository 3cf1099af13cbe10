"""Graph dumps: fx graphs as Graphviz DOT/SVG, and an HTML index of a pass pipeline.

``graph_to_dot`` draws one box per fx node, clustered by the module scope the node was traced
in (nested clusters follow the module path: ``layer1`` contains ``layer1.0``). Labels show the
node name, its op kind, its output shapes and, when the graph was annotated by
``tidal.ir.cost.annotate``, its cost at a chosen batch size. Nodes a pass inserted (``added_by``
meta, or named in ``highlight``) are filled with a colour per pass. Graphs above ``max_nodes``
collapse each module scope at the deepest depth that fits into a single box. A node a pass
inserted outside any module (a scatter, a gather) is drawn in the innermost cluster that holds
both its producers and its consumers, so the data path keeps its reading order. An ``Overlay``
(built by :mod:`tidal.compiler.viz_passes` from a pass's plan) adds label lines and fills per
node, outer clusters (e.g. one per weight-transfer group) and dashed ordering edges.

``render`` writes the ``.dot`` file and, when Graphviz's ``dot`` binary is installed, an ``.svg``
next to it; ``write_index`` writes a self-contained ``index.html`` that lists the passes in order.

Example:
    >>> import pathlib, tempfile, torch, torch.fx as fx
    >>> from tidal.ir import cost
    >>> from tidal.compiler import viz
    >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU()))
    >>> cost.annotate(gm, (torch.randn(2, 8),))
    >>> dot = viz.graph_to_dot(gm.graph, title="mlp", batch=32)
    >>> out = pathlib.Path(tempfile.mkdtemp())
    >>> files = viz.render(dot, out / "mlp")  # mlp.dot, plus mlp.svg when graphviz is installed
    >>> files[0].name
    'mlp.dot'
    >>> section = viz.DumpSection("trace", [("nodes", "4")], [f.relative_to(out) for f in files])
    >>> viz.write_index(out, "mlp dumps", [section]).name
    'index.html'
"""
from __future__ import annotations

import html
import os
import shutil
import subprocess
import sys
import urllib.parse
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence

import pydot
import torch
import torch.fx as fx

from tidal.ir import meta

_PASS_COLORS = ("#ffd27f", "#a6e3a1", "#f5b3c7", "#9fd3ff", "#d9b8ff", "#ffe680")
_HIGHLIGHT_COLOR = "#ffb347"
_CLUSTER_FILLS = ("#f4f6fa", "#e8edf5")
_SHAPES = {"placeholder": "invhouse", "output": "house", "get_attr": "note"}
_FILLS = {"placeholder": "#dbeafe", "output": "#dcfce7"}


@dataclass(frozen=True)
class DumpSection:
    """One pass (or stage) in the HTML index.

    ``summary_rows`` are key/value rows (wall time, nodes added/removed, plan summary);
    ``files`` paths relative to the index directory (SVGs are shown inline, other files linked);
    ``text`` pre-formatted extra text such as a plan table.
    """

    name: str
    summary_rows: Sequence[tuple[str, str]] = ()
    files: Sequence[Path] = ()
    text: str = ""


@dataclass(frozen=True)
class Overlay:
    """What a pass's plan adds to the drawing of a graph, keyed by fx node name.

    ``lines``: extra plain-text label lines; ``fills``: fill colours (a node a pass added keeps
    its pass colour); ``groups``: the outer cluster a node is drawn in (its label, lines split
    at ``\\n``; module clusters nest inside it); ``order_edges``: dashed ``(src, dst)`` edges
    that place a node with no data inputs (a marker) on the data path; ``legend``:
    ``(text, colour)`` title lines, a coloured square before the text when ``colour`` is set.
    """

    lines: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    fills: Mapping[str, str] = field(default_factory=dict)
    groups: Mapping[str, str] = field(default_factory=dict)
    order_edges: tuple[tuple[str, str], ...] = ()
    legend: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class _Frame:
    """One level of cluster nesting: an overlay group (``outer``) or a module scope."""

    label: str
    outer: bool = False


@dataclass(frozen=True)
class _Unit:
    """One box of the drawing: a single fx node, or a collapsed module scope (``group``),
    drawn inside the clusters ``frames`` (outermost first)."""

    uid: str
    members: tuple[fx.Node, ...]
    frames: tuple[_Frame, ...]
    group: Optional[str] = None


# ----------------------------------------------------------------------------- text helpers


def _h(text: object) -> str:
    """Escape text for an HTML-like Graphviz label (also safe for HTML pages)."""
    return html.escape(str(text), quote=True)


def _dot_str(text: object) -> str:
    """A plain DOT string value: pydot quotes it and escapes '"', we escape backslashes."""
    return str(text).replace("\\", "\\\\").replace("\n", " ")


def _html_label(lines: Sequence[str]) -> str:
    """An HTML-like DOT label from already-escaped lines."""
    return "<" + '<br align="center"/>'.join(lines) + ">"


def _small(text: str, size: int = 9, color: str = "#444444") -> str:
    return f'<font point-size="{size}" color="{color}">{text}</font>'


def _num(x: float) -> str:
    return "0" if x == 0 else f"{x:.3g}"


def format_shape(info: meta.TensorInfo) -> str:
    """A tensor's shape as ``8×64×56×56`` (dtype appended unless float32)."""
    text = "×".join(str(d) for d in info.shape) if info.shape else "scalar"
    if info.dtype != torch.float32:
        text += " " + str(info.dtype).removeprefix("torch.")
    return text


def _shapes_text(tensors: Sequence[meta.TensorInfo], limit: int = 3) -> str:
    text = ", ".join(format_shape(t) for t in tensors[:limit])
    if len(tensors) > limit:
        text += f", +{len(tensors) - limit}"
    return text


def _cost_text(cost: dict[str, float]) -> str:
    parts = [f"{_num(cost['fwd_flops'] / 1e9)} GFLOP", f"out {_num(cost['out_bytes'] / 1e6)} MB"]
    if cost["param_bytes"]:
        parts.append(f"param {_num(cost['param_bytes'] / 1e6)} MB")
    return " · ".join(parts)


# ----------------------------------------------------------------------------- node facts


def _scope(node: fx.Node) -> str:
    """Module path of the cluster a node is drawn in ('' for the top level)."""
    layer = meta.get_layer(node)
    return layer.scope if layer is not None else meta.module_scope(node)


def _parts(scope: str) -> tuple[str, ...]:
    return tuple(scope.split(".")) if scope else ()


def _target_name(target: object) -> str:
    if isinstance(target, str):
        return target
    return getattr(target, "__name__", None) or str(target)


def _kind(node: fx.Node) -> str:
    """Module class or function name of a node (``input``/``output`` for graph boundaries)."""
    if node.op in ("placeholder", "output"):
        return "input" if node.op == "placeholder" else "output"
    layer = meta.get_layer(node)
    if layer is not None:
        return layer.kind
    if node.op == "call_module" and node.graph.owning_module is not None:
        try:
            return type(node.graph.owning_module.get_submodule(node.target)).__name__
        except AttributeError:
            pass
    return _target_name(node.target)


def kind_summary(nodes: Iterable[fx.Node], top: int = 3) -> str:
    """The most common kinds among ``nodes`` (graph inputs and outputs left out), as
    ``Conv2d×5, ReLU×5, MaxPool2d×2, …``."""
    kinds = Counter(_kind(n) for n in nodes if n.op not in ("placeholder", "output"))
    text = ", ".join(k if c == 1 else f"{k}×{c}" for k, c in kinds.most_common(top))
    return text + (", …" if len(kinds) > top else "")


def _node_cost(node: fx.Node, batch: Optional[int]) -> Optional[dict[str, float]]:
    cost = meta.get_cost(node)
    return None if cost is None or batch is None else cost.at(batch)


def _added(node: fx.Node, highlight: frozenset[str]) -> Optional[str]:
    """Name of the pass that added a node ('' if only listed in ``highlight``), else None."""
    by = meta.get_added_by(node)
    if by is not None:
        return by
    return "" if node.name in highlight else None


def _fill(pass_name: str) -> str:
    if not pass_name:
        return _HIGHLIGHT_COLOR
    return _PASS_COLORS[zlib.crc32(pass_name.encode()) % len(_PASS_COLORS)]


# ----------------------------------------------------------------------------- placement


def _common_scope(scopes: Sequence[str]) -> str:
    """The longest module path that prefixes every scope in ``scopes`` ('' if none)."""
    return ".".join(os.path.commonprefix([_parts(s) for s in scopes])) if scopes else ""


def _placed_scopes(nodes: Sequence[fx.Node]) -> dict[fx.Node, str]:
    """The scope each node is drawn in: its own; for a node a pass added outside any module,
    the innermost scope holding all its producers and consumers, so that a scatter between two
    layers of ``features`` sits in ``features`` instead of outside it (a back-edge)."""
    own = {n: _scope(n) for n in nodes}
    placed = dict(own)
    for n in nodes:
        if not own[n] and meta.get_added_by(n) is not None:
            near = [own[m] for m in (*n.all_input_nodes, *n.users) if m in own]
            placed[n] = _common_scope(near)
    return placed


def _frames(outer: Optional[str], scope: str) -> tuple[_Frame, ...]:
    """The clusters a box at module ``scope`` is drawn in, inside the overlay group ``outer``."""
    parts = _parts(scope)
    scopes = tuple(_Frame(".".join(parts[:i])) for i in range(1, len(parts) + 1))
    return ((_Frame(outer, outer=True),) if outer else ()) + scopes


# ----------------------------------------------------------------------------- collapsing


def _units(nodes: Sequence[fx.Node], scopes: dict[fx.Node, str], outer: Mapping[str, str],
           level: Optional[int]) -> list[_Unit]:
    """Boxes to draw: every node alone (``level`` None), or nodes at module depth >= ``level``
    merged into one box per (overlay group, scope prefix of that depth), in first-appearance
    order."""
    members: dict[tuple, list[fx.Node]] = {}
    for n in nodes:
        parts = _parts(scopes[n])
        if level is None or len(parts) < level:
            key: tuple = ("n", n.name)
        else:
            key = ("g", outer.get(n.name), ".".join(parts[:level]))
        members.setdefault(key, []).append(n)
    units = []
    for i, (key, group) in enumerate(members.items()):
        where = outer.get(group[0].name)
        if key[0] == "n":
            units.append(_Unit(f"n{i}", tuple(group), _frames(where, scopes[group[0]])))
        else:
            parent = ".".join(_parts(key[2])[:-1])
            units.append(_Unit(f"g{i}", tuple(group), _frames(where, parent), key[2]))
    return units


def _layout(nodes: Sequence[fx.Node], scopes: dict[fx.Node, str], outer: Mapping[str, str],
            max_nodes: int) -> tuple[list[_Unit], str]:
    """The boxes to draw for at most ``max_nodes`` boxes, and a note saying what was collapsed."""
    units = _units(nodes, scopes, outer, None)
    if len(nodes) <= max_nodes:
        return units, ""
    depth = max((len(_parts(s)) for s in scopes.values()), default=0)
    for level in range(depth, 0, -1):
        units = _units(nodes, scopes, outer, level)
        if len(units) <= max_nodes:
            return units, (f"{len(nodes)} nodes > max_nodes={max_nodes}: collapsed to module "
                           f"depth {level}, {len(units)} boxes")
    note = (f"{len(nodes)} nodes > max_nodes={max_nodes}: showing the first {max_nodes} "
            f"of {len(units)} boxes")
    return units[:max_nodes], note


def _owners(units: Sequence[_Unit]) -> dict[str, str]:
    """fx node name -> uid of the box that draws it."""
    return {n.name: u.uid for u in units for n in u.members}


def _edges(units: Sequence[_Unit]) -> list[tuple[str, str]]:
    """Data-dependency edges between boxes (deduplicated, no self loops, none to dropped boxes)."""
    owner = _owners(units)
    edges: dict[tuple[str, str], None] = {}
    for u in units:
        for n in u.members:
            for src in n.all_input_nodes:
                if src.name in owner and owner[src.name] != u.uid:
                    edges[(owner[src.name], u.uid)] = None
    return list(edges)


def _order_edges(units: Sequence[_Unit], overlay: Overlay,
                 data: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """The overlay's ordering edges between drawn boxes that no data edge already joins."""
    owner, seen = _owners(units), set(data)
    pairs = dict.fromkeys((owner.get(a), owner.get(b)) for a, b in overlay.order_edges)
    return [(a, b) for a, b in pairs if a and b and a != b and (a, b) not in seen]


# ----------------------------------------------------------------------------- DOT building


def _overlay_lines(lines: Iterable[str]) -> list[str]:
    return [_small(_h(line), 9, "#0b3d2e") for line in lines]


def _node_box(unit: _Unit, batch: Optional[int], highlight: frozenset[str],
              overlay: Overlay) -> pydot.Node:
    """The DOT node for a single fx node."""
    n = unit.members[0]
    lines = [f"<b>{_h(n.name)}</b>", _h(_kind(n))]
    shapes = _shapes_text(meta.get_tensors(n))
    if shapes:
        lines.append(_small(_h(shapes), 10, "#1f3a5f"))
    cost = _node_cost(n, batch)
    if cost is not None:
        lines.append(_small(_h(_cost_text(cost))))
    lines += _overlay_lines(overlay.lines.get(n.name, ()))
    attrs = {
        "shape": _SHAPES.get(n.op, "box"),
        "style": "filled" if n.op in _SHAPES else "rounded,filled",
        "fillcolor": overlay.fills.get(n.name, _FILLS.get(n.op, "white")),
        "tooltip": _dot_str(f"{n.op}: {_target_name(n.target)}"),
    }
    added = _added(n, highlight)
    if added is not None:
        lines.append(_small(_h(f"+ added by {added}" if added else "+ highlighted"), 9, "#7a3300"))
        attrs.update(fillcolor=_fill(added), penwidth="2.5" if n.name in highlight else "1.5")
    return pydot.Node(unit.uid, label=_html_label(lines), **attrs)


def _group_box(unit: _Unit, batch: Optional[int], highlight: frozenset[str],
               overlay: Overlay) -> pydot.Node:
    """The DOT node for a collapsed module scope (overlay lines and fill shown when every
    member shares them)."""
    top = kind_summary(unit.members)
    lines = [f"<b>{_h(unit.group)}</b>", _h(f"{len(unit.members)} nodes: {top}")]
    last = unit.members[-1]
    shapes = _shapes_text(meta.get_tensors(last))
    if shapes:
        lines.append(_small(_h(shapes), 10, "#1f3a5f"))
    costs = [c for c in (_node_cost(n, batch) for n in unit.members) if c is not None]
    if costs:
        lines.append(_small(_h(_cost_text({k: sum(c[k] for c in costs) for k in costs[0]}))))
    shared = {tuple(overlay.lines.get(n.name, ())) for n in unit.members}
    lines += _overlay_lines(shared.pop() if len(shared) == 1 else ())
    fills = {overlay.fills.get(n.name, "#f8fafc") for n in unit.members}
    attrs = {"shape": "box3d", "style": "filled", "margin": "0.2,0.12",
             "fillcolor": fills.pop() if len(fills) == 1 else "#f8fafc",
             "tooltip": _dot_str(f"{unit.group}: {len(unit.members)} nodes")}
    added = Counter(a for a in (_added(n, highlight) for n in unit.members) if a is not None)
    if added:
        by = ", ".join(f"{a or 'highlighted'}×{c}" for a, c in added.most_common())
        lines.append(_small(_h(f"+ added: {by}"), 9, "#7a3300"))
        attrs.update(fillcolor=_fill(added.most_common(1)[0][0]), penwidth="2.5")
    return pydot.Node(unit.uid, label=_html_label(lines), **attrs)


def _frame_attrs(frames: tuple[_Frame, ...]) -> dict[str, str]:
    """Label and style of the innermost cluster of ``frames``."""
    frame = frames[-1]
    if frame.outer:
        head, *rest = frame.label.split("\n")
        label = _html_label([f"<b>{_h(head)}</b>", *(_small(_h(r), 10, "#7a3300") for r in rest)])
        return {"label": label, "style": "rounded,dashed,filled", "color": "#b45309",
                "fillcolor": "#fffbeb", "penwidth": "1.5"}
    depth = sum(not f.outer for f in frames)
    return {"label": _html_label([_h(frame.label)]), "style": "rounded,filled",
            "color": "#9aa5b8", "fillcolor": _CLUSTER_FILLS[depth % 2]}


def _cluster(dot: pydot.Dot, clusters: dict[tuple[_Frame, ...], pydot.Graph],
             frames: tuple[_Frame, ...]) -> pydot.Graph:
    """The (possibly new) cluster subgraph for ``frames``, nested in its parents."""
    if frames in clusters:
        return clusters[frames]
    if not frames:
        clusters[frames] = dot
        return dot
    parent = _cluster(dot, clusters, frames[:-1])
    sub = pydot.Subgraph(f"cluster_{len(clusters)}", fontsize="11", labeljust="l",
                         **_frame_attrs(frames))
    parent.add_subgraph(sub)
    clusters[frames] = sub
    return sub


def _legend_table(legend: Sequence[tuple[str, str]]) -> str:
    """A one-row HTML table of legend cells (filled with their colour when one is given)."""
    cells = "".join(f'<td bgcolor="{c}">{_h(t)}</td>' if c else f"<td>{_h(t)}</td>"
                    for t, c in legend)
    return (f'<table border="0" cellborder="1" cellspacing="3" cellpadding="3">'
            f"<tr>{cells}</tr></table>")


def _title_label(title: str, note: str, graph: fx.Graph, batch: Optional[int],
                 legend: Sequence[tuple[str, str]] = ()) -> str:
    lines = [f"<b>{_h(title)}</b>"]
    if batch is not None:
        lines.append(_small(_h(f"costs at batch {batch}; shapes at the traced example batch"), 10))
    added = Counter(a for a in (meta.get_added_by(n) for n in graph.nodes) if a is not None)
    if added:
        by = ", ".join(f"{a} ×{c}" for a, c in added.most_common())
        lines.append(_small(_h(f"added: {by}"), 10))
    if note:
        lines.append(_small(_h(note), 10, "#a00000"))
    if not legend:
        return _html_label(lines)
    text = '<br align="center"/>'.join(lines)
    return (f'<<table border="0" cellborder="0"><tr><td>{text}</td></tr>'
            f"<tr><td>{_legend_table(legend)}</td></tr></table>>")


def graph_to_dot(
    graph: fx.Graph,
    *,
    title: str,
    batch: Optional[int] = None,
    highlight: Iterable[str] = (),
    max_nodes: int = 2000,
    overlay: Optional[Overlay] = None,
) -> pydot.Dot:
    """A DOT drawing of ``graph``: one node per fx node, edges for data dependencies, clusters
    for module scopes; costs at ``batch`` when annotated (none if ``batch`` is None).

    Nodes named in ``highlight`` or carrying ``added_by`` meta are filled. With more than
    ``max_nodes`` nodes each module scope at the deepest depth that fits becomes one box (the
    title says so); if even depth 1 does not fit, only the first ``max_nodes`` boxes are drawn.
    ``overlay`` adds a pass's per-node lines and fills, outer clusters and ordering edges.
    """
    overlay = overlay or Overlay()
    names = frozenset(highlight)
    nodes = list(graph.nodes)
    scopes = _placed_scopes(nodes)
    units, note = _layout(nodes, scopes, overlay.groups, max_nodes)
    dot = pydot.Dot("tidal", graph_type="digraph", rankdir="TB", labelloc="t", fontname="Helvetica",
                    label=_title_label(title, note, graph, batch, overlay.legend))
    dot.set_node_defaults(fontname="Helvetica", fontsize="11", margin="0.12,0.05")
    dot.set_edge_defaults(color="#55606e", arrowsize="0.7")
    clusters: dict[tuple[_Frame, ...], pydot.Graph] = {}
    for unit in units:
        box = _node_box if unit.group is None else _group_box
        _cluster(dot, clusters, unit.frames).add_node(box(unit, batch, names, overlay))
    data = _edges(units)
    for src, dst in data:
        dot.add_edge(pydot.Edge(src, dst))
    for src, dst in _order_edges(units, overlay, data):
        dot.add_edge(pydot.Edge(src, dst, style="dashed", color="#b45309", arrowhead="none"))
    return dot


# ----------------------------------------------------------------------------- files


def _dot_failed(dot_path: Path, reason: str) -> None:
    print(f"tidal: graphviz 'dot' failed on {dot_path} ({reason}); kept {dot_path} only",
          file=sys.stderr)


def _run_dot(exe: str, dot_path: Path, svg_path: Path, timeout: float) -> bool:
    """Run ``dot -Tsvg``; the SVG appears only when dot succeeds (one stderr line otherwise)."""
    tmp = svg_path.with_name(svg_path.name + ".tmp")
    try:
        proc = subprocess.run([exe, "-Tsvg", "-o", str(tmp), str(dot_path)], capture_output=True,
                              text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError) as err:
        tmp.unlink(missing_ok=True)
        _dot_failed(dot_path, type(err).__name__)
        return False
    if proc.returncode != 0 or not tmp.exists():
        tmp.unlink(missing_ok=True)
        first = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[0]
        _dot_failed(dot_path, first[:200])
        return False
    os.replace(tmp, svg_path)
    return True


def render(dot: pydot.Dot, stem: Path, *, timeout: float = 120.0) -> list[Path]:
    """Write ``stem.dot`` and, when graphviz's ``dot`` is on PATH, ``stem.svg``; return the files
    written. A missing or failing ``dot`` prints one line to stderr and keeps the ``.dot`` only."""
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    dot_path = stem.with_name(stem.name + ".dot")
    dot_path.write_text(dot.to_string(), encoding="utf-8")
    exe = shutil.which("dot")
    if exe is None:
        print(f"tidal: graphviz 'dot' not found; wrote {dot_path} only "
              "(apt-get install graphviz for SVG)", file=sys.stderr)
        return [dot_path]
    svg_path = stem.with_name(stem.name + ".svg")
    return [dot_path, svg_path] if _run_dot(exe, dot_path, svg_path, timeout) else [dot_path]


_CSS = """
body{font-family:system-ui,Helvetica,Arial,sans-serif;margin:2em;color:#1f2933;max-width:110em}
h1{font-size:1.5em} h2{font-size:1.2em;border-bottom:1px solid #cbd2d9;padding-bottom:.2em}
table{border-collapse:collapse;margin:.5em 0} td{border:1px solid #e4e7eb;padding:.2em .6em}
td:first-child{font-weight:600;background:#f5f7fa}
pre{background:#f5f7fa;padding:.8em;overflow:auto;font-size:.85em}
.figs{display:flex;flex-wrap:wrap;gap:1em;align-items:flex-start}
figure{margin:0;flex:1 1 40em;border:1px solid #e4e7eb;padding:.5em;overflow:auto;max-height:90vh}
figure img{max-width:100%} figcaption{font-size:.85em;color:#52606d}
"""


def _href(path: Path, out_dir: Path) -> str:
    """A relative, URL-quoted, HTML-escaped link to ``path`` from the index directory."""
    path = Path(path)
    if path.is_absolute():
        try:
            path = path.relative_to(out_dir)
        except ValueError:
            pass
    return _h(urllib.parse.quote(path.as_posix()))


def _section_html(index: int, section: DumpSection, out_dir: Path) -> str:
    """One ``<section>`` of the index page."""
    parts = [f'<section id="s{index}">', f"<h2>{index}. {_h(section.name)}</h2>"]
    if section.summary_rows:
        rows = "".join(f"<tr><td>{_h(k)}</td><td>{_h(v)}</td></tr>"
                       for k, v in section.summary_rows)
        parts.append(f"<table>{rows}</table>")
    svgs = [f for f in section.files if Path(f).suffix.lower() == ".svg"]
    others = [f for f in section.files if Path(f).suffix.lower() != ".svg"]
    if svgs:
        figs = "".join(f'<figure><a href="{_href(f, out_dir)}"><img src="{_href(f, out_dir)}" '
                       f'alt="{_h(Path(f).name)}" loading="lazy"></a>'
                       f"<figcaption>{_h(Path(f).name)}</figcaption></figure>" for f in svgs)
        parts.append(f'<div class="figs">{figs}</div>')
    if others:
        links = " · ".join(f'<a href="{_href(f, out_dir)}">{_h(Path(f).name)}</a>' for f in others)
        parts.append(f"<p>files: {links}</p>")
    if section.text:
        parts.append(f"<pre>{_h(section.text)}</pre>")
    parts.append("</section>")
    return "\n".join(parts)


def write_index(out_dir: Path, title: str, sections: Sequence[DumpSection]) -> Path:
    """Write ``out_dir/index.html``: a self-contained page with one section per pass, in order."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    toc = "".join(f'<li><a href="#s{i}">{_h(s.name)}</a></li>' for i, s in enumerate(sections, 1))
    body = "\n".join(_section_html(i, s, out_dir) for i, s in enumerate(sections, 1))
    page = (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{_h(title)}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n"
        f"<h1>{_h(title)}</h1>\n<ol>{toc}</ol>\n{body}\n</body>\n</html>\n"
    )
    path = out_dir / "index.html"
    path.write_text(page, encoding="utf-8")
    return path


def dump_graph_pair(
    before: fx.Graph,
    after: fx.Graph,
    out_dir: Path,
    stem: str,
    *,
    batch: Optional[int] = None,
    added: Iterable[str] = (),
    max_nodes: int = 2000,
    overlay: Optional[Overlay] = None,
) -> list[Path]:
    """Render ``{stem}.before`` and ``{stem}.after`` into ``out_dir`` (``added`` highlighted and
    ``overlay`` drawn in the after graph); return the files written."""
    out_dir = Path(out_dir)
    files = render(graph_to_dot(before, title=f"{stem}: before", batch=batch, max_nodes=max_nodes),
                   out_dir / f"{stem}.before")
    after_dot = graph_to_dot(after, title=f"{stem}: after", batch=batch, highlight=added,
                             max_nodes=max_nodes, overlay=overlay)
    return files + render(after_dot, out_dir / f"{stem}.after")
