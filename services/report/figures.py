"""Reusable figure bodies: time heat maps, time line charts and horizontal bar charts.

Each takes plain numbers and returns SVG text (see :mod:`services.report.svg` for the
``data-*`` attribute convention). Layout is fixed-width (``WIDTH`` px) so pictures stacked in
one panel share their time axis pixel for pixel.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from html import escape

from services.report.svg import (
    PALETTE,
    LinearScale,
    TimeScale,
    attrs,
    legend,
    polyline,
    ramp,
    ramp_legend,
    short,
    svg,
    time_axis,
    value_axis,
)

WIDTH = 1120
LEFT, RIGHT = 76, 24


def time_scale(t0: int, t1: int, left: float = LEFT, width: float | None = None) -> TimeScale:
    """The time scale of a full-width figure."""
    return TimeScale(t0, t1, left, width if width is not None else WIDTH - left - RIGHT)


@dataclass
class Series:
    """One line: points ``(t_ns, value)`` in time order, optional error band half-widths."""

    name: str
    points: list[tuple[int, float]]
    colour: str = ""
    dash: bool = False
    band: list[float] | None = None
    marks: bool = True
    extra: dict[str, object] = field(default_factory=dict)


def line_chart(
    ts: TimeScale,
    series: Sequence[Series],
    *,
    y_title: str,
    height: float = 220,
    bucket_ns: int,
    hlines: Sequence[tuple[float, str, str]] = (),
    fig: str,
    unit: str,
) -> str:
    """Lines over time; a line breaks where a bucket is missing. Each point is a small
    circle carrying ``data-series``, ``data-t`` and ``data-value``; ``band`` draws a shaded
    ±band; ``hlines`` are dashed reference lines ``(value, colour, label)``."""
    top, plot_h = 10.0, height
    vals = [v for s in series for _, v in s.points]
    vals += [v + b for s in series if s.band for (_, v), b in zip(s.points, s.band, strict=True)]
    vals += [v - b for s in series if s.band for (_, v), b in zip(s.points, s.band, strict=True)]
    vals += [h[0] for h in hlines]
    sc = LinearScale.fit(vals, top, plot_h, zero=False)
    body = [value_axis(sc, ts.x0, ts.width, y_title)]
    for value, colour, label in hlines:
        y = sc.y(value)
        body.append(
            f'<line x1="{ts.x0:.1f}" y1="{y:.1f}" x2="{ts.x0 + ts.width:.1f}" y2="{y:.1f}" '
            f'stroke="{colour}" stroke-dasharray="6 4" stroke-width="1.2"/>'
            f'<text class="lg" x="{ts.x0 + ts.width - 4:.1f}" y="{y - 4:.1f}" '
            f'text-anchor="end" fill="{colour}">{escape(label)}</text>'
        )
    for i, s in enumerate(series):
        colour = s.colour or PALETTE[i % len(PALETTE)]
        pts = s.points
        if s.band:
            up = [(ts.x(t), sc.y(v + b)) for (t, v), b in zip(pts, s.band, strict=True)]
            lo = [(ts.x(t), sc.y(v - b)) for (t, v), b in zip(pts, s.band, strict=True)]
            d = " ".join(f"{x:.1f},{y:.1f}" for x, y in up + lo[::-1])
            body.append(f'<polygon points="{d}" fill="{colour}" fill-opacity="0.15"/>')
        run: list[tuple[float, float]] = []
        prev: int | None = None
        for t, v in pts:
            if prev is not None and t - prev > bucket_ns * 1.5:
                body.append(polyline(run, colour, s.dash))
                run = []
            run.append((ts.x(t + bucket_ns / 2), sc.y(v)))
            prev = t
        body.append(polyline(run, colour, s.dash))
        if s.marks:
            g = [f"<g {attrs(data_series=s.name, **{f'data_{k}': v for k, v in s.extra.items()})}>"]
            for j, (t, v) in enumerate(pts):
                band = s.band[j] if s.band else None
                tip = f"{s.name}: {short(v)} {unit}" + (f" ± {short(band)}" if band else "")
                g.append(
                    f'<circle class="pt" cx="{ts.x(t + bucket_ns / 2):.1f}" cy="{sc.y(v):.1f}" '
                    f'r="2.4" fill="{colour}" '
                    f"{attrs(data_series=s.name, data_t=t, data_value=v, data_band=band)} "
                    f"{attrs(data_tip=f'{tip} @ {ts.label(t)}')}/>"
                )
            g.append("</g>")
            body.append("".join(g))
    body.append(time_axis(ts, top + plot_h))
    items = [
        (s.colour or PALETTE[i % len(PALETTE)], s.name, "dash" if s.dash else "line")
        for i, s in enumerate(series)
    ]
    body.append(legend(items, ts.x0, top + plot_h + 52, ts.width))
    rows = 1 + int(sum(26 + 6.2 * len(s.name) for s in series) // max(ts.width, 1))
    return svg(WIDTH, top + plot_h + 48 + 18 * rows, "".join(body), data_figure=fig)


@dataclass(frozen=True)
class HeatCell:
    row: int
    t: int
    value: float


def heat_map(
    ts: TimeScale,
    rows: Sequence[str],
    cells: Sequence[HeatCell],
    *,
    bucket_ns: int,
    series: str,
    title: str,
    unit: str,
    gid: str,
    row_h: float = 14,
    overlays: str = "",
    labels: bool = True,
) -> str:
    """Rows x time buckets, colour by value (square-root scale from 0 to the maximum).
    Cells carry ``data-series``, ``data-row``, ``data-t`` (bucket start) and ``data-value``.
    ``overlays`` is SVG drawn on top (e.g. storm outlines)."""
    top = 22.0
    vmax = max((c.value for c in cells), default=0.0)
    body = [f'<text class="ft" x="{ts.x0:.1f}" y="14">{escape(title)}</text>']
    if labels:
        for i, name in enumerate(rows):
            y = top + i * row_h + row_h * 0.75
            body.append(
                f'<text class="tl" x="{ts.x0 - 4:.1f}" y="{y:.1f}" text-anchor="end">'
                f"{escape(name)}</text>"
            )
    body.append(
        f'<rect x="{ts.x0:.1f}" y="{top:.1f}" width="{ts.width:.1f}" '
        f'height="{row_h * len(rows):.1f}" fill="#f4f4f4"/>'
    )
    cw = max(ts.x(ts.t0 + bucket_ns) - ts.x0, 1.0)
    for c in cells:
        frac = math.sqrt(c.value / vmax) if vmax > 0 else 0.0
        fill = ramp(frac) if c.value > 0 else "#ffffff"
        tip = f"{rows[c.row]} @ {ts.label(c.t)}: {short(c.value)} {unit}"
        body.append(
            f'<rect class="cell" x="{ts.x(c.t):.1f}" y="{top + c.row * row_h:.1f}" '
            f'width="{cw:.2f}" height="{row_h - 1:.1f}" fill="{fill}" '
            f"{attrs(data_series=series, data_row=rows[c.row], data_t=c.t, data_value=c.value)} "
            f"{attrs(data_tip=tip)}/>"
        )
    body.append(overlays)
    base = top + row_h * len(rows)
    body.append(time_axis(ts, base))
    body.append(ramp_legend(gid, ts.x0, base + 52, min(ts.width, 220), "0", short(vmax), unit))
    return svg(ts.x0 + ts.width + 8, base + 82, "".join(body), data_figure=series)


def bar_chart(
    bars: Sequence[tuple[str, Sequence[float], dict[str, object]]],
    *,
    stack: Sequence[tuple[str, str]],
    title: str,
    unit: str,
    fig: str,
    width: float = 360,
    label_w: float = 130,
) -> str:
    """Horizontal bars, one per ``(label, values, data)``; ``values`` stack in the order of
    ``stack`` ``(name, colour)``. Each segment carries ``data-series``, ``data-label`` and
    ``data-value``; ``data`` lands on the bar's group."""
    top, bar_h = 24.0, 16.0
    total = max((sum(v) for _, v, _ in bars), default=0.0) or 1.0
    plot_w = width - label_w - 50
    body = [f'<text class="ft" x="4" y="14">{escape(title)}</text>']
    for i, (label, values, data) in enumerate(bars):
        y = top + i * (bar_h + 4)
        body.append(f"<g {attrs(data_label=label, **{f'data_{k}': v for k, v in data.items()})}>")
        body.append(
            f'<text class="tl" x="{label_w - 4:.1f}" y="{y + bar_h * 0.75:.1f}" '
            f'text-anchor="end">{escape(label)}</text>'
        )
        x = label_w
        for (name, colour), v in zip(stack, values, strict=True):
            w = v / total * plot_w
            body.append(
                f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(w, 0):.2f}" height="{bar_h}" '
                f'fill="{colour}" {attrs(data_series=name, data_label=label, data_value=v)} '
                f"{attrs(data_tip=f'{label} {name}: {short(v)} {unit}')}/>"
            )
            x += w
        body.append(
            f'<text class="tl" x="{x + 4:.1f}" y="{y + bar_h * 0.75:.1f}">'
            f"{short(sum(values))}</text></g>"
        )
    base = top + len(bars) * (bar_h + 4)
    body.append(
        f'<line class="axis" x1="{label_w}" y1="{base:.1f}" x2="{label_w + plot_w:.1f}" '
        f'y2="{base:.1f}"/><text class="at" x="{label_w + plot_w / 2:.1f}" y="{base + 16:.1f}" '
        f'text-anchor="middle">{escape(unit)}</text>'
    )
    height = base + 26
    if len(stack) > 1:
        body.append(legend([(c, n, "box") for n, c in stack], 4, base + 40, width - 8))
        height += 22 + 18 * int(sum(26 + 6.2 * len(n) for n, _ in stack) // (width - 8))
    return svg(width, height, "".join(body), data_figure=fig)


EMPTY = '<div class="empty">no data in this range</div>'


def panel(pid: str, title: str, caption: str, body: str, empty: bool, **data: object) -> str:
    """A ``<section class="panel" id="panel-{pid}">`` with a title, a one-line caption and
    ``body``, or the "no data in this range" box when ``empty`` (``data-state`` says which)."""
    return (
        f'<section class="panel" id="panel-{pid}" '
        f"{attrs(data_state='empty' if empty else 'data', **data)}>"
        f'<h2>{escape(title)}</h2><p class="caption">{escape(caption)}</p>'
        f"{EMPTY if empty else body}</section>"
    )
