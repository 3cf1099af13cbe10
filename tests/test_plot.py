"""``tidal.ir.plot``: every chart is well-formed SVG (parsed with xml.etree) with one mark per
bar, series or column, its labels and legend as text, and every coordinate on the canvas."""
from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from tidal.ir.plot import (Axis, Bar, Column, Guide, Key, Row, Series, bar_chart, color,
                           gantt_chart, line_chart, linear_ticks, log_ticks, palette)


def _tag(el) -> str:
    return el.tag.rsplit("}", 1)[-1]


def _parse(svg: str):
    root = ET.fromstring(svg)
    assert _tag(root) == "svg"
    _, _, w, h = map(float, root.get("viewBox").split())
    for el in root.iter():
        for a in ("x", "x1", "x2", "cx"):
            if el.get(a) is not None:
                assert 0 <= float(el.get(a)) <= w, (a, el.attrib)
        for a in ("y", "y1", "y2", "cy"):
            if el.get(a) is not None:
                assert 0 <= float(el.get(a)) <= h, (a, el.attrib)
        for point in (el.get("points") or "").split():
            px, py = map(float, point.split(","))
            assert 0 <= px <= w and 0 <= py <= h
    return root


def _count(root, tag: str) -> int:
    return sum(_tag(el) == tag for el in root.iter())


def _texts(root) -> list[str]:
    return [el.text for el in root.iter() if _tag(el) == "text"]


def test_gantt_chart_draws_one_rect_per_bar_and_labels_rows():
    rows = [Row("phase <1>", heading=True),
            Row("rank 0", (Bar(0, 40, color(0), "F0"), Bar(40, 100, color(1), "B0", opacity=0.6))),
            Row("rank 1", (Bar(10, 12, color(0), "a label too long to fit"),), track=True)]
    root = _parse(gantt_chart(rows, title="a & b", legend=[Key("forward", color(0)),
                                                           Key("backward", color(1))]))
    assert _count(root, "rect") == 3 + 1  # three bars and one track
    texts = _texts(root)
    assert texts[0] == "a & b" and {"phase <1>", "rank 0", "rank 1", "forward", "backward",
                                    "F0", "B0", "time (us)"} <= set(texts)
    assert "a label too long to fit" not in texts  # 2 us of 100 is too narrow for it ...
    titles = [el.text for el in root.iter() if _tag(el) == "title"]
    assert "a label too long to fit 10-12 us" in titles  # ... so it is in the tooltip
    assert [el.get("fill-opacity") for el in root.iter() if _tag(el) == "rect"
            and el.get("stroke")] == [None, "0.6", None]


def test_line_chart_series_guides_markers_ticks_and_legend():
    s = [Series("up", ((1, 1.0), (4, 3.0), (16, 9.0)), color(0), circles=((4, 3.0),)),
         Series("flat", ((1, 1.0), (16, 1.5)), color(1), squares=((16, 1.5),))]
    y = Axis(0.5, 20, "speedup", log=True, ticks=log_ticks(0.5, 20), fmt="{:g}×")
    root = _parse(line_chart(s, Axis(1, 16, "GPUs", log=True, ticks=(1, 4, 16)), y,
                             title="t", guides=[Guide("linear", 1, 1, 16, 16)]))
    assert _count(root, "polyline") == 2 and _count(root, "circle") == 1
    assert _count(root, "rect") == 1  # the square marker
    dashed = [el for el in root.iter() if el.get("stroke-dasharray")]
    assert len(dashed) == 2  # the guide and its legend swatch
    groups = {g.get("class"): g for g in root.iter() if _tag(g) == "g"}
    assert [t.text for t in groups["y-ticks"].iter() if _tag(t) == "text"] == \
        ["0.5×", "1×", "2×", "5×", "10×", "20×"]
    assert [t.text for t in groups["x-ticks"].iter() if _tag(t) == "text"] == ["1", "4", "16"]
    assert [t.text for t in groups["legend"].iter() if _tag(t) == "text"] == \
        ["up", "flat", "linear"]
    assert {"GPUs", "speedup"} <= set(_texts(root))


def test_line_chart_clamps_values_outside_its_axes_and_grows_for_a_long_legend():
    many = [Series(f"layer {i}", ((0, -5.0), (1, float("inf")), (2, float("nan"))), c)
            for i, c in enumerate(palette(30))]
    svg = line_chart(many, Axis(0, 1), Axis(0, 1), title="clamped", width=300, height=100)
    root = _parse(svg)
    assert _count(root, "polyline") == 30 and float(root.get("height")) > 100
    assert len(set(palette(30))) == 30


def test_bar_chart_one_rect_per_column_with_value_and_name():
    cols = [Column("conv1", 4, color(0)), Column("fc", 1, color(1), title="fc: 1 GPU"),
            Column("x" * 40, 2, color(0))]
    root = _parse(bar_chart(cols, Axis(0, 4, ticks=(0, 1, 2, 4)), title="GPUs",
                            x_label="layers", legend=[Key("own GPUs", color(1))],
                            label_class="layer"))
    assert _count(root, "rect") == 3
    names = [t.text for t in root.iter() if t.get("class") == "layer"]
    assert names == ["conv1", "fc", "x" * 23 + "…"]
    titles = [el.text for el in root.iter() if _tag(el) == "title"]
    assert titles == ["conv1: 4", "fc: 1 GPU", "x" * 40 + ": 2"]
    assert {"4", "1", "2", "layers", "own GPUs"} <= set(_texts(root))


def test_ticks_and_bad_input_name_the_argument():
    assert linear_ticks(0, 10) == (0.0, 2.0, 4.0, 6.0, 8.0, 10.0)
    assert log_ticks(1, 1000) == (1.0, 10.0, 100.0, 1000.0)
    with pytest.raises(ValueError, match=r"Axis\(label='mem'\): a log axis needs lo > 0"):
        Axis(0, 1, "mem", log=True)
    with pytest.raises(ValueError, match=r"Bar\(label='F0'\): start=2, end=1"):
        Bar(2, 1, "#000", "F0")
    with pytest.raises(ValueError, match="log_ticks: lo=0"):
        log_ticks(0, 1)
