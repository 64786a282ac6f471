"""Inline SVG drawing for the report: scales, axes, legends, colour ramps, escaping.

Everything returns SVG/HTML text; nothing here touches DuckDB or files. Every mark a figure
draws carries its numbers as ``data-*`` attributes (``data-t`` in epoch ns, ``data-value`` in
the unit its figure's axis names) and a ``data-tip`` line the page's tooltip shows on hover.
Numbers are written with :func:`num` so a reader can compare them with the lake.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from html import escape

NS = 1_000_000_000

# Colour-blind-safe categorical palette (Okabe-Ito, then Tableau extras).
PALETTE = (
    "#0072b2",
    "#e69f00",
    "#009e73",
    "#cc79a7",
    "#56b4e9",
    "#d55e00",
    "#f0e442",
    "#000000",
    "#8c564b",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)
_RAMP = ((255, 255, 229), (254, 227, 145), (254, 153, 41), (217, 72, 1), (127, 39, 4))
_NICE_TIME_S = (
    *(1, 2, 5, 10, 15, 30),
    *(60, 120, 300, 600, 900, 1800),
    *(3600, 7200, 10800, 21600, 43200, 86400, 172800, 604800),
)


def num(v: float | int | None) -> str:
    """A number as written into data attributes: integers exactly, floats to 10 significant
    digits, NULL as the empty string."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, int):
        return str(v)
    return f"{v:.10g}"


def short(v: float | None) -> str:
    """A number for a human: 3 significant digits with k/M/G suffixes."""
    if v is None or math.isnan(v):
        return "-"
    a = abs(v)
    for div, suf in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if a >= div:
            return f"{v / div:.3g}{suf}"
    return f"{v:.3g}"


def attrs(**kv: object) -> str:
    """``key="value"`` pairs, escaped; ``data_x`` becomes ``data-x``; None values dropped."""
    out = []
    for k, v in kv.items():
        if v is None:
            continue
        text = num(v) if isinstance(v, int | float) else str(v)
        out.append(f'{k.replace("_", "-")}="{escape(text, quote=True)}"')
    return " ".join(out)


def ramp(frac: float) -> str:
    """A sequential colour (pale yellow → dark red) for ``frac`` in 0..1."""
    f = min(max(frac, 0.0), 1.0) * (len(_RAMP) - 1)
    i = min(int(f), len(_RAMP) - 2)
    w = f - i
    c = [round(a + (b - a) * w) for a, b in zip(_RAMP[i], _RAMP[i + 1], strict=True)]
    return f"#{c[0]:02x}{c[1]:02x}{c[2]:02x}"


def nice_bucket_ns(span_ns: int, cells: int = 60) -> int:
    """A round time step (1 s, 2 s, 5 s, ... 1 week) giving at most about ``cells`` steps."""
    want = max(span_ns / max(cells, 1), 1) / NS
    for s in _NICE_TIME_S:
        if s >= want:
            return s * NS
    return _NICE_TIME_S[-1] * NS


def iso(t_ns: int) -> str:
    """``t_ns`` as ``YYYY-MM-DD HH:MM:SS.ffffff`` UTC (the form the named queries take)."""
    dt = datetime.fromtimestamp(t_ns // 1000 / 1e6, tz=UTC)
    return dt.strftime("%Y-%m-%d %H:%M:%S.%f")


@dataclass(frozen=True)
class TimeScale:
    """Maps epoch ns in ``[t0, t1)`` onto pixels ``[x0, x0 + width]``."""

    t0: int
    t1: int
    x0: float
    width: float

    def x(self, t_ns: int | float) -> float:
        span = max(self.t1 - self.t0, 1)
        return self.x0 + (t_ns - self.t0) / span * self.width

    def step(self) -> int:
        """Tick spacing (ns): a round time step, a label every ~110 px at most."""
        return nice_bucket_ns(self.t1 - self.t0, max(2, int(self.width // 110)))

    def ticks(self) -> list[int]:
        step = self.step()
        first = -(-self.t0 // step) * step
        return list(range(first, self.t1 + 1, step))

    def label(self, t_ns: int) -> str:
        dt = datetime.fromtimestamp(t_ns / NS, tz=UTC)
        return dt.strftime("%H:%M:%S" if self.step() < 60 * NS else "%H:%M")

    def title(self) -> str:
        day = datetime.fromtimestamp(self.t0 / NS, tz=UTC).strftime("%Y-%m-%d")
        return f"time (UTC, from {day})"


@dataclass(frozen=True)
class LinearScale:
    """Maps values in ``[lo, hi]`` onto pixels ``[y0 + height, y0]`` (up is larger)."""

    lo: float
    hi: float
    y0: float
    height: float

    @staticmethod
    def fit(values: Iterable[float], y0: float, height: float, zero: bool = True) -> LinearScale:
        vs = [v for v in values if v is not None and not math.isnan(v)]
        lo = min([*vs, 0.0] if zero else vs or [0.0])
        hi = max([*vs, 0.0] if zero else vs or [1.0])
        if hi - lo < 1e-12:
            lo, hi = lo - 1.0, hi + 1.0
        pad = (hi - lo) * 0.06
        return LinearScale(lo if (zero and lo == 0) else lo - pad, hi + pad, y0, height)

    def y(self, v: float) -> float:
        return self.y0 + self.height - (v - self.lo) / (self.hi - self.lo) * self.height

    def ticks(self, most: int = 5) -> list[float]:
        raw = (self.hi - self.lo) / most
        mag = 10 ** math.floor(math.log10(raw))
        step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
        first = math.ceil(self.lo / step) * step
        n = int((self.hi - first) / step + 1e-9)
        return [first + i * step for i in range(n + 1)]


def time_axis(ts: TimeScale, y: float) -> str:
    """Horizontal time axis at ``y``: baseline, ticks with UTC labels, axis title."""
    out = [
        f'<line class="axis" x1="{ts.x0:.1f}" y1="{y:.1f}" x2="{ts.x0 + ts.width:.1f}" '
        f'y2="{y:.1f}"/>'
    ]
    for t in ts.ticks():
        x = ts.x(t)
        out.append(f'<line class="tick" x1="{x:.1f}" y1="{y:.1f}" x2="{x:.1f}" y2="{y + 4:.1f}"/>')
        out.append(
            f'<text class="tl" x="{x:.1f}" y="{y + 15:.1f}" text-anchor="middle">'
            f"{ts.label(t)}</text>"
        )
    out.append(
        f'<text class="at" x="{ts.x0 + ts.width / 2:.1f}" y="{y + 30:.1f}" '
        f'text-anchor="middle">{escape(ts.title())}</text>'
    )
    return "".join(out)


def value_axis(sc: LinearScale, x: float, width: float, title: str) -> str:
    """Vertical axis at ``x`` with grid lines across ``width`` and a rotated title (units)."""
    out = [
        f'<line class="axis" x1="{x:.1f}" y1="{sc.y0:.1f}" x2="{x:.1f}" '
        f'y2="{sc.y0 + sc.height:.1f}"/>'
    ]
    for v in sc.ticks():
        y = sc.y(v)
        out.append(
            f'<line class="grid" x1="{x:.1f}" y1="{y:.1f}" x2="{x + width:.1f}" y2="{y:.1f}"/>'
        )
        out.append(
            f'<text class="tl" x="{x - 5:.1f}" y="{y + 4:.1f}" text-anchor="end">{short(v)}</text>'
        )
    cy = sc.y0 + sc.height / 2
    out.append(
        f'<text class="at" transform="translate({x - 44:.1f},{cy:.1f}) rotate(-90)" '
        f'text-anchor="middle">{escape(title)}</text>'
    )
    return "".join(out)


def legend(items: Sequence[tuple[str, str, str]], x: float, y: float, width: float) -> str:
    """A legend row (wrapping): ``(colour, label, kind)`` with kind ``line``, ``dot``,
    ``box`` or ``dash``. Returns SVG; takes 18 px per row."""
    out, cx, cy = ['<g class="legend">'], x, y
    for colour, label, kind in items:
        w = 26 + 6.2 * len(label)
        if cx + w > x + width and cx > x:
            cx, cy = x, cy + 18
        if kind == "dot":
            out.append(f'<circle cx="{cx + 6:.1f}" cy="{cy - 4:.1f}" r="4" fill="{colour}"/>')
        elif kind == "box":
            out.append(
                f'<rect x="{cx:.1f}" y="{cy - 10:.1f}" width="12" height="12" '
                f'fill="{colour}" stroke="#555" stroke-width="0.5"/>'
            )
        else:
            dash = ' stroke-dasharray="4 3"' if kind == "dash" else ""
            out.append(
                f'<line x1="{cx:.1f}" y1="{cy - 4:.1f}" x2="{cx + 14:.1f}" '
                f'y2="{cy - 4:.1f}" stroke="{colour}" stroke-width="2"{dash}/>'
            )
        out.append(f'<text class="lg" x="{cx + 18:.1f}" y="{cy:.1f}">{escape(label)}</text>')
        cx += w
    out.append("</g>")
    return "".join(out)


def ramp_legend(gid: str, x: float, y: float, width: float, lo: str, hi: str, title: str) -> str:
    """A horizontal colour-ramp legend, ``lo`` .. ``hi`` labels and a title with the unit;
    ``gid`` names its gradient (unique in the page)."""
    stops = "".join(f'<stop offset="{i / 4:.2f}" stop-color="{ramp(i / 4)}"/>' for i in range(5))
    return (
        f'<g class="legend"><defs><linearGradient id="{gid}">{stops}</linearGradient></defs>'
        f'<rect x="{x:.1f}" y="{y:.1f}" width="{width:.1f}" height="10" fill="url(#{gid})" '
        f'stroke="#888" stroke-width="0.5"/>'
        f'<text class="lg" x="{x:.1f}" y="{y + 22:.1f}">{escape(lo)}</text>'
        f'<text class="lg" x="{x + width:.1f}" y="{y + 22:.1f}" text-anchor="end">'
        f"{escape(hi)}</text>"
        f'<text class="lg" x="{x + width / 2:.1f}" y="{y - 3:.1f}" text-anchor="middle">'
        f"{escape(title)}</text></g>"
    )


def svg(width: float, height: float, body: str, **data: object) -> str:
    """An ``<svg>`` element of the given size holding ``body``."""
    extra = attrs(**data)
    return (
        f'<svg width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}" role="img" {extra}>{body}</svg>'
    )


def polyline(points: Sequence[tuple[float, float]], colour: str, dash: bool = False) -> str:
    """A line through ``points`` (pixels)."""
    if not points:
        return ""
    d = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
    extra = ' stroke-dasharray="5 3"' if dash else ""
    return f'<polyline fill="none" stroke="{colour}" stroke-width="1.6" points="{d}"{extra}/>'
