"""Tests for tidal.compiler.viz: DOT drawing, rendering, the HTML index, collapsing."""
from __future__ import annotations

import copy
import doctest
import os
import re
import shutil
from pathlib import Path

import pydot
import pytest
import torch
import torch.fx as fx
from torch import nn

from tidal.compiler import viz
from tidal.ir import cost, meta

# pydot's DOT parser (used here to check the output parses) trips pyparsing deprecation warnings.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:pydot.dot_parser")


class Residual(nn.Module):
    def __init__(self, ch: int):
        super().__init__()
        self.conv = nn.Conv2d(ch, ch, 3, padding=1)
        self.bn = nn.BatchNorm2d(ch)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)) + x)


class TinyCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.layer1 = nn.Sequential(Residual(8), Residual(8))
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        return self.fc(self.layer1(self.stem(x)).mean((2, 3)))


@pytest.fixture
def gm() -> fx.GraphModule:
    torch.manual_seed(0)
    traced = fx.symbolic_trace(TinyCNN())
    cost.annotate(traced, (torch.randn(2, 3, 8, 8),))
    return traced


def _add_toy_relu(gm: fx.GraphModule) -> fx.Node:
    """Insert a relu after the stem, as a pass would, and mark it added by 'toy'."""
    stem = next(n for n in gm.graph.nodes if n.target == "stem")
    with gm.graph.inserting_after(stem):
        new = gm.graph.call_function(torch.relu, (stem,))
    stem.replace_all_uses_with(new, delete_user_cb=lambda user: user is not new)
    meta.set_added_by(new, "toy")
    gm.recompile()
    return new


def _parse(dot: pydot.Dot) -> pydot.Dot:
    graphs = pydot.graph_from_dot_data(dot.to_string())
    assert graphs and len(graphs) == 1
    return graphs[0]


def _walk(graph, parent_label=None):
    """Yield (node, enclosing cluster label) and ('cluster', label, parent label) items."""
    for node in graph.get_nodes():
        if node.get_name() not in ("node", "edge", "graph"):
            yield "node", node, parent_label
    for sub in graph.get_subgraphs():
        label = sub.get("label").strip("<>")
        yield "cluster", label, parent_label
        yield from _walk(sub, label)


def _nodes(dot: pydot.Graph) -> dict[str, tuple[pydot.Node, str | None]]:
    """Drawn node name (the bold first label line) -> (DOT node, cluster label)."""
    out = {}
    for kind, node, cluster in _walk(dot):
        if kind == "node":
            name = re.match(r"<<b>(.*?)</b>", node.get("label")).group(1)
            assert name not in out
            out[name] = (node, cluster)
    return out


def _clusters(dot: pydot.Graph) -> dict[str, str | None]:
    return {label: parent for kind, label, parent in _walk(dot) if kind == "cluster"}


def test_one_dot_node_per_fx_node_in_its_scope_cluster(gm):
    dot = _parse(viz.graph_to_dot(gm.graph, title="tiny", batch=8))  # also checks DOT syntax
    nodes = _nodes(dot)
    assert set(nodes) == {n.name for n in gm.graph.nodes}
    assert _clusters(dot) == {"layer1": None, "layer1.0": "layer1", "layer1.1": "layer1"}
    for n in gm.graph.nodes:
        layer = meta.get_layer(n)
        assert nodes[n.name][1] == (layer.scope or None if layer else None), n.name
    assert nodes["layer1_0_conv"][1] == "layer1.0" and nodes["add_1"][1] == "layer1.1"
    edges = {(e.get_source(), e.get_destination()) for e in dot.get_edges()}
    uid = {name: node.get_name() for name, (node, _) in nodes.items()}
    expected = {(uid[i.name], uid[n.name]) for n in gm.graph.nodes for i in n.all_input_nodes}
    assert edges == expected


def test_labels_show_kind_shape_and_cost_only_with_batch(gm):
    with_cost = _nodes(viz.graph_to_dot(gm.graph, title="t", batch=8))
    label = with_cost["layer1_0_conv"][0].get("label")
    assert "Conv2d" in label and "2×8×8×8" in label
    conv_flops = meta.get_cost(next(n for n in gm.graph.nodes if n.name == "layer1_0_conv")).at(8)
    assert f"{conv_flops['fwd_flops'] / 1e9:.3g} GFLOP" in label and "param" in label
    assert "add" in with_cost["add"][0].get("label")
    no_cost = _nodes(viz.graph_to_dot(gm.graph, title="t"))
    assert "GFLOP" not in no_cost["layer1_0_conv"][0].get("label")


def test_added_and_named_nodes_are_highlighted(gm):
    new = _add_toy_relu(gm)
    nodes = _nodes(viz.graph_to_dot(gm.graph, title="after", batch=8, highlight=["fc"]))
    filled = {name for name, (node, _) in nodes.items()
              if node.get("fillcolor").strip('"') not in ("white", "#dbeafe", "#dcfce7")}
    assert filled == {new.name, "fc"}
    assert "added by toy" in nodes[new.name][0].get("label")


def test_labels_and_title_are_escaped(gm):
    dot = viz.graph_to_dot(gm.graph, title='a <b> & "c"', batch=8)
    text = dot.to_string()
    assert "a &lt;b&gt; &amp; &quot;c&quot;" in text
    assert "a <b>" not in text and "<b> &" not in text
    _parse(dot)


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz 'dot' not installed")
def test_render_writes_svg_with_dot(gm, tmp_path, capsys):
    _add_toy_relu(gm)
    dot = viz.graph_to_dot(gm.graph, title="t <x>", batch=8)
    files = viz.render(dot, tmp_path / "sub" / "g.after")
    assert files == [tmp_path / "sub" / "g.after.dot", tmp_path / "sub" / "g.after.svg"]
    svg = files[1].read_text(encoding="utf-8")
    assert svg.startswith("<?xml") and "<svg" in svg and "2×8×8×8" in svg
    assert capsys.readouterr().err == ""
    assert not list(tmp_path.rglob("*.tmp"))


def test_render_without_dot_writes_dot_and_one_line(gm, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(viz.shutil, "which", lambda name: None)
    files = viz.render(viz.graph_to_dot(gm.graph, title="t"), tmp_path / "g")
    assert files == [tmp_path / "g.dot"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.dot"]
    assert files[0].read_text(encoding="utf-8").startswith("digraph")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "graphviz 'dot' not found" in err and "g.dot" in err


@pytest.mark.skipif(os.name != "posix", reason="uses a shell script as a fake dot")
def test_render_with_failing_dot_keeps_dot(gm, tmp_path, monkeypatch, capsys):
    fake = tmp_path / "fake_dot"
    fake.write_text("#!/bin/sh\necho 'syntax error in line 1' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setattr(viz.shutil, "which", lambda name: str(fake))
    out = tmp_path / "out"
    files = viz.render(viz.graph_to_dot(gm.graph, title="t"), out / "g")
    assert files == [out / "g.dot"]
    assert sorted(p.name for p in out.iterdir()) == ["g.dot"]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "failed" in err and "syntax error" in err


def test_write_index_lists_sections_in_order_and_escapes(tmp_path):
    sections = [
        viz.DumpSection("trace", [("nodes", "13")], [Path("trace.svg"), Path("trace.dot")]),
        viz.DumpSection("tick_tock", [("wall time", "<1 ms")], [tmp_path / "b c.svg"],
                        "plan <table> & co"),
        viz.DumpSection("layer_groups"),
    ]
    html = viz.write_index(tmp_path, "dump <of> model", sections).read_text(encoding="utf-8")
    body = html[html.index("<body>"):]
    names = ["trace", "tick_tock", "layer_groups"]
    positions = [body.index(f"{i}. {name}") for i, name in enumerate(names, 1)]
    assert positions == sorted(positions)
    assert "dump &lt;of&gt; model" in html and "&lt;1 ms" in html
    assert "plan &lt;table&gt; &amp; co" in html
    assert "<of>" not in html and "<table> &" not in html
    assert '<img src="trace.svg"' in html and '<a href="trace.dot">' in html
    assert '<img src="b%20c.svg"' in html  # absolute path made relative, URL-quoted


def test_large_graph_collapses_to_deepest_fitting_depth(gm):
    n_nodes = len(gm.graph.nodes)
    assert len(_nodes(viz.graph_to_dot(gm.graph, title="t", max_nodes=n_nodes))) == n_nodes

    depth2 = viz.graph_to_dot(gm.graph, title="t", batch=8, max_nodes=n_nodes - 1)
    nodes = _nodes(depth2)
    assert set(nodes) == {"x", "stem", "layer1.0", "layer1.1", "mean", "fc", "output"}
    assert nodes["layer1.0"][1] == "layer1" and _clusters(depth2) == {"layer1": None}
    assert "collapsed to module depth 2" in depth2.get("label")
    assert "GFLOP" in nodes["layer1.0"][0].get("label")
    uid = {name: node.get_name() for name, (node, _) in nodes.items()}
    edges = {(e.get_source(), e.get_destination()) for e in depth2.get_edges()}
    assert (uid["stem"], uid["layer1.0"]) in edges and (uid["layer1.0"], uid["layer1.1"]) in edges
    assert all(src != dst for src, dst in edges)

    depth1 = _nodes(viz.graph_to_dot(gm.graph, title="t", max_nodes=6))
    assert set(depth1) == {"x", "stem", "layer1", "mean", "fc", "output"}

    truncated = viz.graph_to_dot(gm.graph, title="t", max_nodes=3)
    assert len(_nodes(truncated)) == 3 and "showing the first 3" in truncated.get("label")


def test_collapsed_group_with_added_node_is_highlighted(gm):
    relu = next(n for n in gm.graph.nodes if n.name == "relu")
    with gm.graph.inserting_after(relu):
        marker = gm.graph.call_function(torch.relu, (relu,))
    meta.set_layer(marker, meta.LayerRef(marker.name, "relu", "layer1.0"))
    meta.set_added_by(marker, "toy")
    nodes = _nodes(viz.graph_to_dot(gm.graph, title="t", max_nodes=8))
    assert "added: toy×1" in nodes["layer1.0"][0].get("label")
    fill = {name: nodes[name][0].get("fillcolor").strip('"') for name in ("layer1.0", "layer1.1")}
    assert fill["layer1.0"] != fill["layer1.1"]


def test_dump_graph_pair(gm, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(viz.shutil, "which", lambda name: None)
    before = copy.deepcopy(gm.graph)
    new = _add_toy_relu(gm)
    files = viz.dump_graph_pair(before, gm.graph, tmp_path, "03_toy", batch=8, added=[new.name])
    assert files == [tmp_path / "03_toy.before.dot", tmp_path / "03_toy.after.dot"]
    assert capsys.readouterr().err.count("\n") == 2
    after = files[1].read_text(encoding="utf-8")
    assert "added by toy" in after and "added by toy" not in files[0].read_text(encoding="utf-8")
    assert "penwidth" in after


def test_module_docstring_example_runs(monkeypatch):
    monkeypatch.setattr(viz.shutil, "which", lambda name: None)
    result = doctest.testmod(viz, verbose=False)
    assert result.attempted > 0 and result.failed == 0
