"""Host and data panels: (3) GPU SM clocks and throttle reasons, (4) clock offsets per
source, (5) data quality (accounting, dead letters, gaps, resets, duplicates).

Each ``*_panel`` takes the rows of its :mod:`services.report.data` function and returns one
``<section>`` (see :func:`services.report.figures.panel`).
"""

from __future__ import annotations

from collections import defaultdict
from html import escape
from typing import Any

from services.report import data as D
from services.report.figures import (
    WIDTH,
    Series,
    bar_chart,
    line_chart,
    panel,
    time_scale,
)
from services.report.svg import (
    TimeScale,
    attrs,
    legend,
    svg,
)

CHECKS = ("gap", "reset", "duplicate_deduplicated", "duplicate_in_lake", "deadletter")
CAUSE_COLOUR = dict(
    zip(
        (c for _, c in D.CAUSES),
        ("#7f0000", "#d7301f", "#fc8d59", "#e69f00", "#0072b2", "#56b4e9", "#999999"),
        strict=True,
    )
)


# --- (3) GPU clocks --------------------------------------------------------------------------


def gpu_panel(d: dict[str, Any], scope: D.Scope) -> str:
    ts = time_scale(scope.start_ns, scope.end_ns)
    by_gpu: dict[tuple[str, str], list[D.Row]] = defaultdict(list)
    for r in d["clock"]:
        by_gpu[(r[0], r[1])].append(r)
    series = [
        Series(
            f"{n} {g}",
            [(int(r[2]), float(r[3])) for r in rows if r[3] is not None],
            extra={"node": n, "gpu": g},
        )
        for (n, g), rows in sorted(by_gpu.items())
    ]
    series.append(
        Series(
            "fleet median",
            [(int(t), float(v)) for t, v in d["fleet"]],
            colour="#777",
            dash=True,
            marks=True,
        )
    )
    empty = not d["fleet"] and not d["clock"]
    cause_s: dict[str, float] = defaultdict(float)
    for r in d["by_cause"]:
        cause_s[r[2]] += float(r[4] or 0.0)
    body = ""
    if not empty:
        chart = line_chart(
            ts,
            series,
            y_title="SM clock (MHz)",
            height=200,
            bucket_ns=scope.bucket_ns,
            fig="gpu_sm_clock",
            unit="MHz",
        )
        body = chart + _reasons_strip(by_gpu, ts, scope, cause_s)
    return panel(
        "gpu",
        "GPU SM clocks and throttle reasons",
        "Look for SM clock dips under the fleet median that line up with coloured reason cells: "
        "HW_* causes (red) are slowdowns imposed by the board, SW_POWER_CAP (blue) is the "
        "power limit at work.",
        body,
        empty,
        data_bucket_ns=scope.bucket_ns,
    )


def _reasons_strip(
    by_gpu: dict[tuple[str, str], list[D.Row]],
    ts: TimeScale,
    scope: D.Scope,
    cause_s: dict[str, float],
) -> str:
    row_h, top = 13.0, 22.0
    body = [
        f'<text class="ft" x="{ts.x0:.1f}" y="14">clock event reasons per GPU '
        "(most severe bit shown)</text>"
    ]
    cw = max(ts.x(ts.t0 + scope.bucket_ns) - ts.x0, 1.0)
    for i, ((node, gpu), rows) in enumerate(sorted(by_gpu.items())):
        y = top + i * row_h
        body.append(
            f'<text class="tl" x="{ts.x0 - 4:.1f}" y="{y + 10:.1f}" text-anchor="end">'
            f"{escape(node)} {escape(gpu)}</text>"
        )
        for r in rows:
            bits = int(r[4] or 0)
            causes = [c for b, c in D.CAUSES if bits >> b & 1]
            if not causes:
                continue
            data = attrs(
                data_node=node,
                data_gpu=gpu,
                data_t=r[2],
                data_bits=bits,
                data_causes=" ".join(causes),
            )
            tip = attrs(data_tip=f"{node} {gpu} @ {ts.label(r[2])}: " + ", ".join(causes))
            body.append(
                f'<rect class="reason" x="{ts.x(r[2]):.1f}" y="{y:.1f}" width="{cw:.2f}" '
                f'height="{row_h - 2}" fill="{CAUSE_COLOUR[causes[0]]}" {data} {tip}/>'
            )
    base = top + row_h * max(len(by_gpu), 1)
    items = [(CAUSE_COLOUR[c], f"{c} {cause_s.get(c, 0.0):.1f} s", "box") for _, c in D.CAUSES]
    leg = legend(items, ts.x0, base + 18, ts.width)
    totals = "".join(
        f'<g class="cause-total" {attrs(data_cause=c, data_seconds=s)}></g>'
        for c, s in sorted(cause_s.items())
    )
    return svg(WIDTH, base + 30, "".join(body) + leg + totals, data_figure="gpu_reasons")


# --- (4) clock offsets -------------------------------------------------------------------------


def clock_panel(d: dict[str, Any], scope: D.Scope) -> str:
    ts = time_scale(scope.start_ns, scope.end_ns)
    by_src: dict[str, list[D.Row]] = defaultdict(list)
    for r in d["series"]:
        by_src[r[0]].append(r)
    series = [
        Series(src, [(int(r[1]), float(r[2])) for r in rows], band=[float(r[3]) for r in rows])
        for src, rows in sorted(by_src.items())
    ]
    late = sum(int(r[4]) for r in d["series"])
    body = (
        f'<p class="note">{len(series)} of {d["total"]} sources shown (largest |offset|); '
        f"band = ± clock error bound; {late} late rows among them.</p>"
        + line_chart(
            ts,
            series,
            y_title="clock offset (ms)",
            height=220,
            bucket_ns=scope.bucket_ns,
            fig="clock_offset",
            unit="ms",
        )
        if series
        else ""
    )
    return panel(
        "clocks",
        "Clock offset per source (source clock - common clock)",
        "Look for steps and slopes: a step is a clock jump, a slope is drift; a wide band "
        "means the alignment is uncertain there. Offsets above 1 s raise a clock alert.",
        body,
        not series,
        data_bucket_ns=scope.bucket_ns,
        data_sources=d["total"],
    )


# --- (5) data quality --------------------------------------------------------------------------


def quality_panel(d: dict[str, Any]) -> str:
    acc = [
        (
            f"partition {r[0]}" + ("" if r[6] else " ✗"),
            [float(r[2]), float(r[3]), float(r[4])],
            {"partition": r[0], "input": r[1], "unaccounted": r[5], "ok": str(bool(r[6])).lower()},
        )
        for r in d["accounting"]
    ]
    figs = []
    if acc:
        figs.append(
            bar_chart(
                acc,
                stack=(
                    ("refined", "#009e73"),
                    ("deduplicated", "#e69f00"),
                    ("quarantined", "#d55e00"),
                ),
                title="accounting: input = refined + deduplicated + quarantined",
                unit="samples",
                fig="accounting",
                width=420,
                label_w=110,
            )
        )
    if d["dead"]:
        figs.append(
            bar_chart(
                [(str(r[0]), [float(r[1])], {"reason": r[0], "samples": r[2]}) for r in d["dead"]],
                stack=(("records", "#cc79a7"),),
                title="dead letters by reason",
                unit="records",
                fig="deadletter",
                width=330,
            )
        )
    counts: dict[str, float] = dict.fromkeys(CHECKS, 0.0)
    for f in d["findings"]:
        if f[0] != "clock_offset":
            counts[str(f[0])] += float(f[2] or 0)
    if any(counts.values()) or figs:
        figs.append(
            bar_chart(
                [(k, [v], {"check": k}) for k, v in counts.items()],
                stack=(("count", "#0072b2"),),
                title="gaps, resets, duplicates",
                unit="occurrences",
                fig="findings",
                width=330,
            )
        )
    worst = [f for f in d["findings"] if f[0] == "gap"][:5]
    gaps = (
        '<p class="note">longest gaps: '
        + "; ".join(f"{escape(str(f[1]))} {float(f[3]):.1f} s" for f in worst)
        + "</p>"
        if worst
        else ""
    )
    return panel(
        "quality",
        "Data quality: accounting, dead letters, gaps, resets, duplicates",
        "Look for a ✗ (input not fully accounted for), dead-letter reasons you do not expect, "
        "and gaps: a figure above is only as good as the data under it.",
        f'<div class="row">{"".join(figs)}</div>{gaps}',
        not figs,
    )
