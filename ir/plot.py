"""SVG charts for plans, schedules and simulations: the one drawing module of tidal.

Three charts cover what tidal draws:

- ``gantt_chart``: rows of labelled bars on a time axis (schedules per rank and lane, the
  transfer/execute lanes of a weight-loading pipeline); a row may be a bold section heading;
- ``line_chart``: series on linear or logarithmic axes with labelled ticks, markers, dashed
  guide lines (a reference level, linear scaling) and a legend (memory curves, elbow curves,
  scaling curves);
- ``bar_chart``: one column per category with its value above and its (rotated) name below, y
  ticks with grid lines and a legend (GPUs per layer).

They share ``Canvas`` (an SVG element list that escapes every text and attribute), ``Axis`` (a
data range mapped onto pixels, with 1-2-5 ticks from ``linear_ticks`` / ``log_ticks``), ``Key``
(a legend entry) and the colour palette (``color``, ``palette``). Every chart is a well-formed
SVG document (``xml.etree`` parses it) whose marks lie inside its ``0 0 width height`` view box;
values outside an axis are clamped to its ends. Legend swatches are short lines, so a chart's
``<rect>`` elements are exactly its bars (and, where asked, the gantt's row tracks).

Example:
    >>> import xml.etree.ElementTree as ET
    >>> from tidal.ir.plot import Bar, Key, Row, color, gantt_chart
    >>> svg = gantt_chart([Row("rank 0", (Bar(0, 2, color(0), "F0"), Bar(2, 5, color(1), "B0"))),
    ...                    Row("rank 1", (Bar(1, 3, color(0), "F1"),))],
    ...                   title="toy <schedule>", legend=[Key("forward", color(0))])
    >>> root = ET.fromstring(svg)
    >>> sum(el.tag.endswith("}rect") for el in root.iter())
    3
    >>> texts = [t.text for t in root.iter() if t.tag.endswith("}text")]
    >>> texts[:2], [t for t in texts if t.startswith(("rank", "F", "B"))]
    (['toy <schedule>', 'forward'], ['rank 0', 'F0', 'B0', 'rank 1', 'F1'])
"""
from __future__ import annotations

import html
import math
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf")
"""The categorical colours (matplotlib's tab10), in the order ``color(i)`` hands them out."""

_GRID = "#e5e5e5"
_CHAR_W = 0.6  # a character's advance as a fraction of the font size (sans-serif, rough)
_LINE_H = 14  # the height of a legend row


def color(i: int) -> str:
    """The ``i``-th categorical colour (cycling through ``PALETTE``).

    >>> color(0), color(len(PALETTE)) == color(0)
    ('#1f77b4', True)
    """
    return PALETTE[i % len(PALETTE)]


def palette(n: int) -> tuple[str, ...]:
    """``n`` distinct colours: the first ``n`` of ``PALETTE``, or ``n`` evenly spaced hues when
    there are more categories than it holds.

    >>> palette(2), palette(12)[0]
    (('#1f77b4', '#ff7f0e'), 'hsl(0,65%,42%)')
    """
    if n <= len(PALETTE):
        return PALETTE[:max(n, 0)]
    return tuple(f"hsl({360 * i // n},65%,42%)" for i in range(n))


def escape(text: object) -> str:
    """``text`` made safe for SVG text content and attribute values.

    >>> escape('a <b> & "c"')
    'a &lt;b&gt; &amp; &quot;c&quot;'
    """
    return html.escape(str(text), quote=True)


def text_width(text: str, size: float = 10) -> float:
    """A rough rendered width in pixels of ``text`` at font ``size`` (layout only)."""
    return _CHAR_W * size * len(text)


def _num(v: float) -> str:
    """A coordinate: at most two decimals, no trailing zeros."""
    s = f"{v:.2f}".rstrip("0").rstrip(".")
    return "0" if s in ("-0", "") else s


def _attr(value: object) -> str:
    if isinstance(value, float):
        return _num(value)
    return escape(value)


# ------------------------------------------------------------------------------- ticks


def linear_ticks(lo: float, hi: float, target: int = 5) -> tuple[float, ...]:
    """About ``target`` ticks at 1-2-5 steps inside ``[lo, hi]`` (just ``lo`` when the range is
    empty).

    >>> linear_ticks(0, 1)
    (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
    >>> linear_ticks(3, 3)
    (3.0,)
    """
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError(f"tidal.ir.plot.linear_ticks: lo={lo!r}, hi={hi!r} must be finite")
    if hi <= lo:
        return (float(lo),)
    raw = (hi - lo) / max(target, 1)
    mag = 10.0 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw * (1 - 1e-9))
    first = math.ceil(lo / step - 1e-9)
    ticks = []
    k = first
    while k * step <= hi * (1 + 1e-12) + 1e-12:
        ticks.append(round(k * step, 12) + 0.0)
        k += 1
    return tuple(ticks)


def log_ticks(lo: float, hi: float) -> tuple[float, ...]:
    """1-2-5 ticks covering ``[lo, hi]`` on a log axis (only powers of ten when that gives over
    8), starting at or below ``lo`` and ending at or above ``hi``.

    >>> log_ticks(0.6, 9)
    (0.5, 1.0, 2.0, 5.0, 10.0)
    """
    if not (lo > 0 and hi > 0 and math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError(f"tidal.ir.plot.log_ticks: lo={lo!r}, hi={hi!r} must be positive "
                         f"and finite")
    lo, hi = min(lo, hi), max(lo, hi)
    ticks: list[float] = []
    for mantissas in ((1, 2, 5), (1,)):
        first, last = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
        ticks = sorted(m * 10.0 ** e for e in range(first, last + 1) for m in mantissas)
        below = [t for t in ticks if t <= lo * (1 + 1e-9)]
        above = [t for t in ticks if t >= hi * (1 - 1e-9)]
        ticks = [t for t in ticks if below[-1] <= t <= above[0]]
        if len(ticks) <= 8:
            break
    return tuple(ticks)


@dataclass(frozen=True)
class Axis:
    """A data range ``[lo, hi]`` drawn along one side of a chart: ``label`` its title, ``log`` a
    logarithmic scale (``lo`` > 0), ``ticks`` the labelled values (empty: 1-2-5 ticks inside the
    range) and ``fmt`` their format (``str.format`` with one value).

    >>> a = Axis(1, 100, log=True)
    >>> a.frac(10), a.frac(1000), a.tick_values()
    (0.5, 1.0, (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0))
    """

    lo: float
    hi: float
    label: str = ""
    log: bool = False
    ticks: tuple[float, ...] = ()
    fmt: str = "{:g}"

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lo) and math.isfinite(self.hi)) or self.hi < self.lo:
            raise ValueError(f"tidal.ir.plot.Axis(label={self.label!r}): lo={self.lo!r}, "
                             f"hi={self.hi!r} must be finite with lo <= hi")
        if self.log and self.lo <= 0:
            raise ValueError(f"tidal.ir.plot.Axis(label={self.label!r}): a log axis needs "
                             f"lo > 0, got lo={self.lo!r}")

    def frac(self, v: float) -> float:
        """Where ``v`` lies along the axis, from 0 (``lo``) to 1 (``hi``), clamped; a value that
        cannot be placed (NaN, or <= 0 on a log axis) goes to the low end, +inf to the high."""
        if self.hi <= self.lo:
            return 0.5 if v == self.lo else (1.0 if v > self.lo else 0.0)
        if not math.isfinite(v) or (self.log and v <= 0):
            return 1.0 if v == math.inf else 0.0
        if self.log:
            f = (math.log(v) - math.log(self.lo)) / (math.log(self.hi) - math.log(self.lo))
        else:
            f = (v - self.lo) / (self.hi - self.lo)
        return min(max(f, 0.0), 1.0)

    def tick_values(self) -> tuple[float, ...]:
        """The labelled ticks: ``ticks`` if given, else 1-2-5 steps inside the range."""
        if self.ticks:
            return tuple(self.ticks)
        made = log_ticks(self.lo, self.hi) if self.log else linear_ticks(self.lo, self.hi)
        eps = 1e-9 * max(abs(self.lo), abs(self.hi), 1e-300)
        return tuple(t for t in made if self.lo - eps <= t <= self.hi + eps)

    def tick_label(self, v: float) -> str:
        return self.fmt.format(v)


# ------------------------------------------------------------------------------- canvas


class Canvas:
    """An SVG document being drawn: elements appended in order, text and attributes escaped,
    coordinates written with two decimals. Attribute names take ``_`` for ``-`` (``stroke_width``)
    and a trailing ``_`` is dropped (``class_``); ``None`` values are left out.

    >>> c = Canvas(100, 40)
    >>> c.text(4, 14, "a & b", cls="note")
    >>> c.svg().splitlines()[1]
    '<text x="4" y="14" class="note">a &amp; b</text>'
    """

    def __init__(self, width: float, height: float, *, font_size: float = 10,
                 font: str = "sans-serif"):
        if not (width > 0 and height > 0):
            raise ValueError(f"tidal.ir.plot.Canvas: width={width!r} and height={height!r} must "
                             f"be positive")
        self.width, self.height = int(math.ceil(width)), int(math.ceil(height))
        self._parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.width}" '
                       f'height="{self.height}" viewBox="0 0 {self.width} {self.height}" '
                       f'font-family="{escape(font)}" font-size="{_num(font_size)}">']
        self._open: list[str] = []

    @staticmethod
    def _attrs(attrs: dict) -> str:
        return "".join(f' {k.rstrip("_").replace("_", "-")}="{_attr(v)}"'
                       for k, v in attrs.items() if v is not None)

    def element(self, tag: str, text: Optional[str] = None, *, title: Optional[str] = None,
                **attrs: object) -> None:
        """One element; ``text`` its content and ``title`` a tooltip (``<title>`` child)."""
        inner = (f"<title>{escape(title)}</title>" if title is not None else "") + \
            (escape(text) if text is not None else "")
        head = f"<{tag}{self._attrs(attrs)}"
        self._parts.append(f"{head}>{inner}</{tag}>" if inner else f"{head}/>")

    def open(self, tag: str = "g", **attrs: object) -> None:
        """Start a container element (a ``<g>`` group by default); ``close`` ends it."""
        self._parts.append(f"<{tag}{self._attrs(attrs)}>")
        self._open.append(tag)

    def close(self) -> None:
        if not self._open:
            raise ValueError("tidal.ir.plot.Canvas.close: no open element to close")
        self._parts.append(f"</{self._open.pop()}>")

    def text(self, x: float, y: float, text: str, *, anchor: Optional[str] = None,
             size: Optional[float] = None, bold: bool = False, fill: Optional[str] = None,
             rotate: Optional[float] = None, cls: Optional[str] = None) -> None:
        """A text at baseline ``(x, y)``; ``rotate`` degrees about that point."""
        self.element("text", text, x=float(x), y=float(y), class_=cls, text_anchor=anchor,
                     font_size=None if size is None else float(size),
                     font_weight="bold" if bold else None, fill=fill,
                     transform=None if rotate is None else
                     f"rotate({_num(rotate)} {_num(x)} {_num(y)})")

    def rect(self, x: float, y: float, w: float, h: float, fill: str, *,
             title: Optional[str] = None, **attrs: object) -> None:
        self.element("rect", title=title, x=float(x), y=float(y), width=float(max(w, 0.0)),
                     height=float(max(h, 0.0)), fill=fill, **attrs)

    def line(self, x1: float, y1: float, x2: float, y2: float, stroke: str = "#000", *,
             width: Optional[float] = None, dashed: bool = False) -> None:
        self.element("line", x1=float(x1), y1=float(y1), x2=float(x2), y2=float(y2),
                     stroke=stroke, stroke_width=None if width is None else float(width),
                     stroke_dasharray="4 3" if dashed else None)

    def polyline(self, points: Iterable[tuple[float, float]], stroke: str, *,
                 width: float = 1.5) -> None:
        pts = " ".join(f"{_num(x)},{_num(y)}" for x, y in points)
        self.element("polyline", points=pts, fill="none", stroke=stroke,
                     stroke_width=float(width))

    def svg(self) -> str:
        """The finished document (open groups are closed)."""
        return "\n".join(self._parts + [f"</{t}>" for t in reversed(self._open)] + ["</svg>"])


# ------------------------------------------------------------------------------- legend


@dataclass(frozen=True)
class Key:
    """A legend entry: ``text`` beside a swatch of ``color`` (a dashed line when ``dashed``)."""

    text: str
    color: str
    dashed: bool = False


def _key_width(key: Key) -> float:
    return 22 + text_width(key.text) + 14


def _legend_rows(keys: Sequence[Key], x0: float, x_max: float) -> list[list[tuple[float, Key]]]:
    """The keys flowed into rows between ``x0`` and ``x_max``: (x, key) per row."""
    rows: list[list[tuple[float, Key]]] = [[]]
    x = x0
    for key in keys:
        w = _key_width(key)
        if rows[-1] and x + w > x_max:
            rows.append([])
            x = x0
        rows[-1].append((x, key))
        x += w
    return [r for r in rows if r]


def _legend(c: Canvas, keys: Sequence[Key], x0: float, y0: float, x_max: float) -> None:
    """Draw the legend (group ``legend``) from ``(x0, y0)``, its top left corner."""
    rows = _legend_rows(keys, x0, x_max)
    if not rows:
        return
    c.open(class_="legend")
    for r, row in enumerate(rows):
        y = y0 + _LINE_H * r + 10
        for x, key in row:
            c.line(x, y - 4, x + 16, y - 4, key.color, width=2.0 if key.dashed else 4.0,
                   dashed=key.dashed)
            c.text(x + 22, y, key.text)
    c.close()


def _legend_height(keys: Sequence[Key], x0: float, x_max: float) -> float:
    rows = len(_legend_rows(keys, x0, x_max))
    return _LINE_H * rows + 4 if rows else 0.0


def _header_height(keys: Sequence[Key], right: float) -> float:
    """How far down the title and the legend (flowed up to ``right``) reach."""
    return 24 + _legend_height(keys, 8, right)


def _header(c: Canvas, title: str, keys: Sequence[Key], right: float) -> None:
    """The title and the legend at the top of ``c``."""
    c.text(8, 16, title, size=12)
    _legend(c, keys, 8, 24, right)


# ------------------------------------------------------------------------------- gantt


@dataclass(frozen=True)
class Bar:
    """One interval of a gantt row, ``start`` to ``end`` on the time axis, filled with
    ``color``; ``label`` is written inside when it fits, ``title`` is the tooltip (default: the
    label and the interval)."""

    start: float
    end: float
    color: str
    label: str = ""
    title: str = ""
    opacity: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.start) and math.isfinite(self.end)) or self.end < self.start:
            raise ValueError(f"tidal.ir.plot.Bar(label={self.label!r}): start={self.start!r}, "
                             f"end={self.end!r} must be finite with start <= end")


@dataclass(frozen=True)
class Row:
    """One row of a gantt chart: ``label`` at its left and its ``bars``; ``heading`` makes it a
    bold section title across the chart (no bars), ``track`` gives it a light background."""

    label: str
    bars: tuple[Bar, ...] = ()
    heading: bool = False
    track: bool = False


def gantt_chart(rows: Sequence[Row], *, title: str, span: Optional[float] = None,
                unit: str = "us", legend: Sequence[Key] = (), width: int = 900,
                row_h: int = 22) -> str:
    """A gantt chart: one line per ``Row`` (labelled on the left), its bars placed on a shared
    time axis from 0 to ``span`` (default: the latest bar end), tick labels and the axis title
    ``time (unit)`` below, ``title`` and ``legend`` above.

    >>> svg = gantt_chart([Row("copy", heading=True), Row("lane", (Bar(0, 1, "#000"),),
    ...                    track=True)], title="t")
    >>> svg.count("<rect"), ">copy<" in svg
    (2, True)
    """
    rows = list(rows)
    span = span if span is not None else max((b.end for r in rows for b in r.bars), default=0.0)
    span = span if span > 0 else 1.0
    indent = 16 if any(r.heading for r in rows) else 0
    label_w = max((text_width(r.label) for r in rows if not r.heading), default=0.0)
    left = min(max(8 + indent + label_w + 10, 60.0), width / 3)
    right = width - 12
    top = _header_height(legend, right) + 6
    height = top + row_h * len(rows) + 36
    c = Canvas(width, height)
    _header(c, title, legend, right)
    axis = Axis(0.0, span, label=f"time ({unit})")
    bottom = top + row_h * len(rows)
    c.open(class_="x-ticks")
    for t in axis.tick_values():
        x = left + (right - left) * axis.frac(t)
        c.line(x, top, x, bottom + 3, _GRID)
        c.text(x, bottom + 14, axis.tick_label(t), anchor="middle")
    c.close()
    c.text((left + right) / 2, height - 6, axis.label, anchor="middle")
    for i, row in enumerate(rows):
        y = top + i * row_h
        if row.heading:
            c.text(8, y + row_h * 0.7, row.label, bold=True)
            continue
        c.text(8 + indent, y + row_h * 0.65, row.label)
        if row.track:
            c.rect(left, y + 1, right - left, row_h - 2, "#f4f4f4")
        for b in row.bars:
            x = min(left + (right - left) * axis.frac(b.start), right - 1.0)
            w = max(left + (right - left) * axis.frac(b.end) - x, 1.0)
            tip = b.title or f"{b.label} {b.start:.3g}-{b.end:.3g} {unit}".strip()
            c.rect(x, y + 2, w, row_h - 4, b.color, title=tip,
                   fill_opacity=None if b.opacity == 1 else float(b.opacity),
                   stroke="#333", stroke_width=0.5)
            if b.label and text_width(b.label) + 4 <= w:
                c.text(x + 2, y + row_h * 0.65, b.label)
    return c.svg()


# ------------------------------------------------------------------------------- line chart


@dataclass(frozen=True)
class Series:
    """One line of a line chart: ``points`` (x, y) in data coordinates drawn in ``color`` and
    named ``name`` in the legend; ``circles`` and ``squares`` are points marked on it."""

    name: str
    points: tuple[tuple[float, float], ...]
    color: str
    circles: tuple[tuple[float, float], ...] = ()
    squares: tuple[tuple[float, float], ...] = ()
    width: float = 1.5


@dataclass(frozen=True)
class Guide:
    """A dashed straight reference line from ``(x1, y1)`` to ``(x2, y2)`` in data coordinates,
    named ``name`` in the legend (no entry when empty)."""

    name: str
    x1: float
    y1: float
    x2: float
    y2: float
    color: str = "#999"


def line_chart(series: Sequence[Series], x: Axis, y: Axis, *, title: str,
               guides: Sequence[Guide] = (), legend: bool = True, width: int = 720,
               height: int = 300) -> str:
    """Series on the axes ``x`` and ``y``: labelled y ticks with grid lines (group
    ``y-ticks``), x tick labels (group ``x-ticks``), axis titles, dashed ``guides``, circle and
    square markers, and a legend of the series and named guides under ``title``. The height
    grows when the legend leaves the plot less than 80 pixels.

    >>> import xml.etree.ElementTree as ET
    >>> s = Series("loss", ((0, 1.0), (1, 0.5), (2, 0.4)), color(0), circles=((1, 0.5),))
    >>> root = ET.fromstring(line_chart([s], Axis(0, 2, "step"), Axis(0, 1, "loss"), title="t"))
    >>> [el.tag.rsplit("}")[-1] for el in root.iter()].count("polyline")
    1
    """
    keys = [Key(s.name, s.color) for s in series] + \
        [Key(g.name, g.color, dashed=True) for g in guides if g.name]
    keys = keys if legend else []
    y_labels = [y.tick_label(t) for t in y.tick_values()]
    left = 8 + (16 if y.label else 0) + max((text_width(t) for t in y_labels), default=0) + 6
    right = width - 16
    top = _header_height(keys, right) + 10
    below = 22 + (16 if x.label else 0)
    height = max(height, int(math.ceil(top + 80 + below)))
    bottom = height - below
    c = Canvas(width, height)
    _header(c, title, keys, right)

    def px(v: float) -> float:
        return left + (right - left) * x.frac(v)

    def py(v: float) -> float:
        return bottom - (bottom - top) * y.frac(v)

    c.open(class_="y-ticks")
    for t, label in zip(y.tick_values(), y_labels):
        c.line(left - 4, py(t), right, py(t), _GRID)
        c.text(left - 6, py(t) + 4, label, anchor="end")
    c.close()
    c.open(class_="x-ticks")
    for t in x.tick_values():
        c.line(px(t), bottom, px(t), bottom + 4)
        c.text(px(t), bottom + 16, x.tick_label(t), anchor="middle")
    c.close()
    c.line(left, top, left, bottom)
    c.line(left, bottom, right, bottom)
    if x.label:
        c.text((left + right) / 2, height - 8, x.label, anchor="middle")
    if y.label:
        c.text(14, (top + bottom) / 2, y.label, anchor="middle", rotate=-90)
    for g in guides:
        c.line(px(g.x1), py(g.y1), px(g.x2), py(g.y2), g.color, dashed=True)
    for s in series:
        c.open(class_="series")
        c.polyline(((px(a), py(b)) for a, b in s.points), s.color, width=s.width)
        for a, b in s.circles:
            c.element("circle", cx=px(a), cy=py(b), r=3.0, fill=s.color)
        for a, b in s.squares:
            c.rect(px(a) - 3, py(b) - 3, 6, 6, "none", stroke=s.color)
        c.close()
    return c.svg()


# ------------------------------------------------------------------------------- bar chart


@dataclass(frozen=True)
class Column:
    """One bar of a bar chart: the category ``label`` (written below, rotated), its ``value``
    (bar height, written above with the y axis's format), ``color`` and tooltip ``title``."""

    label: str
    value: float
    color: str
    title: str = ""


def bar_chart(columns: Sequence[Column], y: Axis, *, title: str, x_label: str = "",
              legend: Sequence[Key] = (), width: int = 720, plot_h: int = 150,
              label_class: str = "category", max_label_chars: int = 24) -> str:
    """Columns in order on a y axis from ``y.lo`` (the baseline) to ``y.hi``, with grid lines at
    the y ticks (group ``y-ticks``), each value above its bar, each category name below it
    (rotated, class ``label_class``, cut to ``max_label_chars`` with the full name in the
    tooltip), ``x_label`` at the bottom, and ``title`` and ``legend`` above. The canvas widens
    so every bar is at least 14 pixels wide, and deepens for the longest name.

    >>> import xml.etree.ElementTree as ET
    >>> svg = bar_chart([Column("a", 1, color(0)), Column("b", 2, color(1))], Axis(0, 2),
    ...                 title="t", label_class="layer")
    >>> [t.text for t in ET.fromstring(svg).iter() if t.get("class") == "layer"]
    ['a', 'b']
    """
    n = max(len(columns), 1)
    y_labels = [y.tick_label(t) for t in y.tick_values()]
    names = [col.label if len(col.label) <= max_label_chars else
             col.label[:max_label_chars - 1] + "…" for col in columns]
    left = 8 + max((text_width(t) for t in y_labels), default=0) + 8
    bar = max(14.0, (width - left - 10) / n)
    # the first name, rotated 60 degrees about its bar's centre, reaches half its width left
    left = max(left, 0.5 * text_width(names[0], 9) - bar / 2 + 10 if names else 0)
    bar = max(14.0, (width - left - 10) / n)
    width = int(math.ceil(left + n * bar + 10))
    right = width - 10
    top = _header_height(legend, right) + 12
    base = top + plot_h
    longest = max((len(name) for name in names), default=1)
    height = int(base + 0.9 * 5.6 * longest + 30)
    c = Canvas(width, height)
    _header(c, title, legend, right)

    def py(v: float) -> float:
        return base - plot_h * y.frac(v)

    c.open(class_="y-ticks")
    for t, label in zip(y.tick_values(), y_labels):
        c.line(left - 3, py(t), right, py(t), _GRID)
        c.text(left - 5, py(t) + 3, label, anchor="end")
    c.close()
    c.line(left, base, right, base)
    for k, col in enumerate(columns):
        x, top_y = left + k * bar, py(col.value)
        cx, ly = x + bar / 2, base + 8
        value = y.tick_label(col.value)
        c.rect(x, top_y, max(bar - 1, 0.5), base - top_y, col.color,
               title=col.title or f"{col.label}: {value}")
        c.text(cx, top_y - 2, value, anchor="middle", size=8)
        c.text(cx, ly, names[k], anchor="end", size=9, rotate=-60, cls=label_class)
    if x_label:
        c.text(left, height - 8, x_label)
    return c.svg()
