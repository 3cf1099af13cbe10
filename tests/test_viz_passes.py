"""Dumps of what passes did, checked as drawings: clusters, labels, edges and (with graphviz)
the laid-out coordinates; the simulated scaling chart and the burst plan chart stay on canvas."""
from __future__ import annotations

import re
import shutil
import subprocess
import xml.etree.ElementTree as ET

import pydot
import pytest
import torch
from torch import nn

import tidal
from tidal.compiler import viz
from tidal.compiler.dump import write_dump
from tidal.compiler.viz_passes import overlay_for
from examples import models
from tidal.ir import cost
from tidal.passes.burst_parallel import BurstParallel, build_problem
from tidal.passes.burst_planner import plan_from_counts
from tidal.passes.layer_groups import LayerGroups
from tidal.sim.scaling import scaling_svg

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:pydot.dot_parser")
needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz 'dot' not installed")


# ----------------------------------------------------------------------------- helpers


def _burst(model, x, counts):
    """``model`` compiled by burst_parallel with a hand plan: layer i on ``counts(i)`` GPUs."""
    cluster = tidal.Cluster(gpus=4, bandwidth_gbps=100, latency_us=5)
    gm = tidal.trace(model, x)
    cost.annotate(gm, x)
    problem = build_problem(gm, cluster, x[0].shape[0])
    plan = plan_from_counts(problem, [counts(i) for i in range(len(problem.names))])
    return tidal.compile(model, x, passes=[BurstParallel(plan=plan)], cluster=cluster)


def _after_dot(compiled) -> pydot.Dot:
    """The after graph of the compile's last pass, drawn with that pass's overlay."""
    r = compiled.records[-1]
    dot = viz.graph_to_dot(r.graph_after, title="after", batch=8, highlight=r.added,
                           overlay=overlay_for(r.plan, r.graph_before, r.graph_after))
    return pydot.graph_from_dot_data(dot.to_string())[0]


def _boxes(graph, clusters=()):
    """fx node name (bold first label line) -> (DOT node, enclosing cluster labels)."""
    out = {}
    for node in graph.get_nodes():
        label = node.get("label")
        if label:
            out[re.match(r"<<b>(.*?)</b>", label).group(1)] = (node, clusters)
    for sub in graph.get_subgraphs():
        out.update(_boxes(sub, clusters + (sub.get("label"),)))
    return out


def _plain_y(dot: pydot.Dot) -> dict[str, float]:
    """DOT node id -> y of its centre as laid out by ``dot -Tplain`` (y grows upwards)."""
    text = subprocess.run(["dot", "-Tplain"], input=dot.to_string(), capture_output=True,
                          text=True, check=True).stdout
    return {f[1]: float(f[3]) for f in (line.split() for line in text.splitlines())
            if f[0] == "node"}


def _data_edges(dot: pydot.Dot) -> list[tuple[str, str]]:
    return [(e.get_source(), e.get_destination()) for e in dot.get_edges()
            if e.get("style") != "dashed"]


# ----------------------------------------------------------------------------- burst_parallel


@needs_dot
def test_burst_after_keeps_the_chain_reading_top_down():
    m = models.vgg16_small()
    x = m.example_inputs(8)
    dot = _after_dot(_burst(m, x, lambda i: 4 if i < 10 else (2 if i < 25 else 1)))
    boxes = _boxes(dot)
    # the gather between features_9 (4 GPUs) and features_10 (2 GPUs) is drawn in "features"
    assert boxes["gather_default"][1] == ("<features>",)
    y = _plain_y(dot)
    edges = _data_edges(dot)
    assert len(edges) >= 40
    assert all(y[a] > y[b] for a, b in edges), [(a, b) for a, b in edges if y[a] <= y[b]]


@needs_dot
def test_burst_after_of_a_plain_sequential_is_one_column():
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    dot = _after_dot(_burst(m, (torch.randn(8, 16),), lambda i: [4, 1, 2][i % 3]))
    y = _plain_y(dot)
    assert all(y[a] > y[b] for a, b in _data_edges(dot))


def test_burst_after_shows_gpu_count_per_layer():
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    compiled = _burst(m, (torch.randn(8, 16),), lambda i: [4, 1, 2][i % 3])
    dot = _after_dot(compiled)
    boxes = _boxes(dot)
    plan = compiled.plan.get("burst_parallel")
    fills = {}
    for layer in plan.layers:
        node = boxes[layer.layer][0]
        unit = "GPU" if layer.gpus == 1 else "GPUs"
        assert f"{layer.gpus} {unit} · rank" in node.get("label")
        fills.setdefault(layer.gpus, set()).add(node.get("fillcolor"))
    assert all(len(f) == 1 for f in fills.values()) and len(set().union(*fills.values())) == 3
    assert "GPUs per layer" in dot.get("label")
    scatters = [n for name, (n, _) in boxes.items() if name.startswith(("scatter", "gather"))]
    assert scatters and all("→" in n.get("label") for n in scatters)
    assert "replicated → 4 GPUs" in boxes["scatter_default"][0].get("label")


def _svg_numbers(root, attrs=("x", "y", "x1", "y1", "x2", "y2")):
    """Every coordinate in the SVG (attributes and polyline points) as floats."""
    out = []
    for el in root.iter():
        out += [float(el.get(a)) for a in attrs if el.get(a) is not None]
        if el.get("points"):
            out += [float(v) for p in el.get("points").split() for v in p.split(",")]
    return out


def _tag(el) -> str:
    return el.tag.rsplit("}", 1)[-1]


def test_burst_plan_svg_labels_every_layer_inside_the_canvas():
    m = models.vgg16_small()
    compiled = _burst(m, m.example_inputs(8), lambda i: 4 if i < 10 else 1)
    plan = compiled.plan.get("burst_parallel")
    root = ET.fromstring(plan.svg())
    width, height = float(root.get("width")), float(root.get("height"))
    labels = [t.text for t in root.iter() if _tag(t) == "text" and t.get("class") == "layer"]
    assert labels == [l.layer for l in plan.layers]
    assert all(0 <= v <= max(width, height) for v in _svg_numbers(root))
    xs = [float(t.get("x")) for t in root.iter() if t.get("class") == "layer"]
    assert all(0 < x < width for x in xs) and xs == sorted(xs)


# ----------------------------------------------------------------------------- layer_groups


def _grouped():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    return tidal.compile(m, (torch.randn(8, 16),), passes=[LayerGroups(grouping="per_layer")])


def test_layer_groups_after_draws_one_cluster_per_group_with_bytes_and_time():
    compiled = _grouped()
    plan = compiled.plan.get("layer_groups")
    dot = _after_dot(compiled)
    boxes = _boxes(dot)
    labels = [sub.get("label") for sub in dot.get_subgraphs()]
    assert len(labels) == len(plan.groups) == 5  # per_layer: Linear, ReLU, ... one group each
    for k, label in enumerate(labels):
        assert f"group {k}:" in label
        assert f"{plan.group_bytes[k] / 1e6:.3g} MB" in label
        assert f"transfer {plan.transfer_us[k]:.3g} us" in label
    members = {name: clusters[0] for name, (_, clusters) in boxes.items() if clusters}
    assert {"input_1", "output"}.isdisjoint(members)
    uid = {name: node.get_name() for name, (node, _) in boxes.items()}
    dashed = {(e.get_source(), e.get_destination()) for e in dot.get_edges()
              if e.get("style") == "dashed"}
    before = ["input_1", "_0", "_1", "_2", "_3"]
    assert dashed == {(uid[_marker(k)], uid[f"_{k}"]) for k in range(5)} | {
        (uid[before[k]], uid[_marker(k)]) for k in range(5)}
    for k in range(5):
        assert members[f"_{k}"] == members[_marker(k)] == labels[k]


def _marker(k: int) -> str:
    return "group_boundary_default" + (f"_{k}" if k else "")


@needs_dot
def test_layer_groups_markers_sit_on_the_data_path():
    dot = _after_dot(_grouped())
    boxes = _boxes(dot)
    y = _plain_y(dot)
    order = ["input_1", *(name for k in range(5) for name in (_marker(k), f"_{k}")), "output"]
    ys = [y[boxes[name][0].get_name()] for name in order]
    assert ys == sorted(ys, reverse=True) and len(set(ys)) == len(ys)


# ----------------------------------------------------------------------------- round_robin


def test_round_robin_after_lists_what_each_partition_holds():
    m = models.vgg16_small()
    compiled = tidal.compile(m, m.example_inputs(8), passes=["round_robin"],
                             cluster=tidal.Cluster(gpus=2), loss_fn=m.default_loss,
                             optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    plan = compiled.plan.get("round_robin")
    boxes = _boxes(_after_dot(compiled))
    for p in range(2):
        label = boxes[f"submod_{p}"][0].get("label")
        assert f"partition {p}: {plan.layers_per_partition[p]} layers" in label
        assert plan.first_layers[p] in label and "Conv2d" in label
        assert f"fwd {plan.fwd_us[p]:.3g} us" in label and f"bwd {plan.bwd_us[p]:.3g} us" in label
        assert f"weights {plan.param_bytes[p] / 1e6:.3g} MB" in label
    assert "out 8×32×8×8" in boxes["submod_0"][0].get("label")
    assert "out 8×10" in boxes["submod_1"][0].get("label")
    assert "8×32×8×8" in boxes["getitem"][0].get("label")


# ----------------------------------------------------------------------------- fallbacks


def test_every_pass_dumps_dot_only_without_graphviz(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(viz.shutil, "which", lambda name: None)
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    x = (torch.randn(8, 16),)
    compiles = {
        "burst": _burst(m, x, lambda i: [4, 1][i % 2]),
        "groups": tidal.compile(m, x, passes=["layer_groups"]),
        "rr": tidal.compile(m, x, passes=["round_robin"], cluster=tidal.Cluster(gpus=2),
                            loss_fn=lambda out, y: ((out - y) ** 2).mean(),
                            optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1)),
    }
    for name, compiled in compiles.items():
        capsys.readouterr()
        index = write_dump(tmp_path / name, name, compiled.records, 8)
        files = {p.name for p in index.parent.iterdir()}
        dots = {f for f in files if f.endswith(".dot")}
        assert not any(f.endswith(".svg") and f[:-4] + ".dot" in dots for f in files)
        assert any(f.endswith(".after.dot") for f in dots), name
        err = capsys.readouterr().err.splitlines()
        assert len(err) == len(dots) and all("graphviz 'dot' not found" in e for e in err)


# ----------------------------------------------------------------------------- scaling chart


@pytest.mark.parametrize("speedups", [
    {"weak": [1.0, 0.01, 0.01], "strong": [1.0, 0.02, 0.01], "batch-optimal": [1.0, 0.81, 0.92]},
    {"weak": [1.0, 1.9, 3.7], "strong": [0.6, 1.1, 9.0], "batch-optimal": [1.0, 2.0, 12.0]},
])
def test_scaling_svg_stays_in_its_view_box_with_labelled_y_ticks(speedups):
    root = ET.fromstring(scaling_svg([1, 2, 4], speedups, "vgg"))
    box = root.get("viewBox") or f"0 0 {root.get('width')} {root.get('height')}"
    x0, y0, w, h = map(float, box.split())
    nums = _svg_numbers(root)
    xs = _svg_numbers(root, ("x", "x1", "x2"))
    assert all(x0 <= v <= x0 + w for v in xs)
    assert all(min(x0, y0) <= v <= max(x0 + w, y0 + h) for v in nums)
    for el in root.iter():
        for a in ("y", "y1", "y2"):
            if el.get(a) is not None:
                assert y0 <= float(el.get(a)) <= y0 + h
        for point in (el.get("points") or "").split():
            px, py = map(float, point.split(","))
            assert x0 <= px <= x0 + w and y0 <= py <= y0 + h
    ticks = next((g for g in root.iter() if g.get("class") == "y-ticks"), None)
    assert ticks is not None, "no y-axis ticks"
    labels = [t.text for t in ticks.iter() if _tag(t) == "text"]
    values = [float(t.rstrip("×")) for t in labels]
    every = [v for vals in speedups.values() for v in vals]
    assert len(labels) >= 3 and min(values) <= min(every) and max(values) >= max(every)


def test_scaling_svg_escapes_its_title():
    root = ET.fromstring(scaling_svg([1, 2], {"weak": [1.0, 1.5]}, "a <b> & c"))
    assert any(t.text == "a <b> & c" for t in root.iter() if _tag(t) == "text")
