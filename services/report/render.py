"""The report page: five panels built from :mod:`services.report.data`, one HTML file.

:func:`render_report` runs every query for a :class:`~services.report.data.Scope` and returns
the page text: inline CSS, inline SVG and a few lines of inline JavaScript for the hover
tooltip. It references nothing outside the file (no URL at all), so it opens offline.
Each panel is a ``<section class="panel" id="panel-...">`` with ``data-state`` ``data`` or
``empty``; an empty one says "no data in this range" instead of drawing.
"""

from __future__ import annotations

from collections import defaultdict
from html import escape
from typing import Any

import duckdb

from services.report import data as D
from services.report.figures import (
    WIDTH,
    HeatCell,
    Series,
    bar_chart,
    heat_map,
    line_chart,
    time_scale,
)
from services.report.svg import (
    NS,
    LinearScale,
    TimeScale,
    attrs,
    iso,
    legend,
    short,
    svg,
    time_axis,
    value_axis,
)

CHECKS = ("gap", "reset", "duplicate_deduplicated", "duplicate_in_lake", "deadletter")
EMPTY = '<div class="empty">no data in this range</div>'
CAUSE_COLOUR = dict(
    zip(
        (c for _, c in D.CAUSES),
        ("#7f0000", "#d7301f", "#fc8d59", "#e69f00", "#0072b2", "#56b4e9", "#999999"),
        strict=True,
    )
)


def _panel(pid: str, title: str, caption: str, body: str, empty: bool, **data: object) -> str:
    return (
        f'<section class="panel" id="panel-{pid}" '
        f"{attrs(data_state='empty' if empty else 'data', **data)}>"
        f'<h2>{escape(title)}</h2><p class="caption">{escape(caption)}</p>'
        f"{EMPTY if empty else body}</section>"
    )


# --- (1) congestion -------------------------------------------------------------------------


def congestion_panel(d: dict[str, list[D.Row]], scope: D.Scope) -> str:
    keys = sorted({(r[0], r[1], r[2]) for r in d["cells"]}, key=lambda k: (k[0] is None, k))
    names = [f"rail {k[0]} {k[1]}:{k[2]}" for k in keys]
    index = {k: i for i, k in enumerate(keys)}
    label_w = 150.0
    w = (WIDTH - label_w - 100) / 3  # three maps and their margins in one row
    paused = any(r[4] for r in d["cells"])
    figs: list[str] = []
    for series, title, unit, col, scale in (
        ("paused_pct", "PFC paused time (busiest priority)", "% of time paused", 4, 100.0)
        if paused  # a fabric that counts pause frames but not paused time: show the frames
        else ("pause_fps", "PFC pause frames received", "frames/s", 5, 1.0),
        ("ecn_ps", "ECN-marked RoCE packets", "packets/s", 6, 1.0),
        ("cnp_ps", "CNPs sent", "CNPs/s", 7, 1.0),
    ):
        ts = TimeScale(scope.start_ns, scope.end_ns, label_w if not figs else 24.0, w)
        cells = [
            HeatCell(index[(r[0], r[1], r[2])], r[3], float(r[col]) * scale) for r in d["cells"]
        ]
        overlay = _storm_outlines(d["storms"], ts, index) if series == "paused_pct" else ""
        figs.append(
            heat_map(
                ts,
                names,
                cells,
                bucket_ns=scope.bucket_ns,
                series=series,
                title=title,
                unit=unit,
                gid=f"ramp-{series}",
                overlays=overlay,
                labels=not figs,
            )
        )
    links = "".join(_link_row(r) for r in d["links"])
    named = "; ".join(
        f"{r[0]} {r[1]} {r[6]:%H:%M:%S} for {r[8]:.0f} s, peak {r[10] * 100:.0f} %"
        for r in d["storms"][:5]
    )
    storms = (
        f'<p class="note">{len(d["storms"])} PFC storm(s) (pfc_storms: ≥ 20 % paused for '
        f"≥ 2 s) outlined in black{': ' + escape(named) if named else ''}.</p>"
    )
    table = (
        '<table class="links"><tr><th>rail</th><th>switch port</th><th>host port</th>'
        "<th>pause frames</th><th>ECN marks</th><th>CNPs sent</th><th>score (0-6)</th></tr>"
        f"{links}</table>"
        if links
        else ""
    )
    body = f'<div class="row">{"".join(figs)}</div>{storms}{table}'
    return _panel(
        "congestion",
        "Fabric congestion by rail and switch port",
        "Look for rows that stay dark across all three maps at the same time: a port paused by "
        "PFC while ECN marks and CNPs rise is congested, not just bursty.",
        body,
        not d["cells"],
        data_bucket_ns=scope.bucket_ns,
        data_storms=len(d["storms"]),
    )


def _link_row(r: D.Row) -> str:
    data = attrs(
        data_rail=r[0],
        data_switch=r[1],
        data_switch_port=r[2],
        data_node=r[3],
        data_port=r[4],
        data_score=r[-1],
    )
    cells = [str(r[0]), f"{r[1]}:{r[2]}", f"{r[3]} {r[4]}", short(r[5]), short(r[7]), short(r[8])]
    bar = f'<span class="bar" style="width:{r[-1] / 6 * 100:.0f}px"></span> {r[-1]:.2f}'
    return f"<tr {data}>" + "".join(f"<td>{escape(c)}</td>" for c in cells) + f"<td>{bar}</td></tr>"


def _storm_outlines(
    storms: list[D.Row], ts: TimeScale, index: dict[tuple[Any, Any, Any], int]
) -> str:
    out = []
    for r in storms:
        i = index.get((r[3], r[4], r[5]))
        if i is None:
            continue
        t0 = int(r[6].timestamp() * 1e9) if hasattr(r[6], "timestamp") else int(r[6])
        t1 = int(r[7].timestamp() * 1e9) if hasattr(r[7], "timestamp") else int(r[7])
        x0, x1 = max(ts.x(t0), ts.x0), min(ts.x(t1), ts.x0 + ts.width)
        data = attrs(data_node=r[0], data_device=r[1], data_seconds=r[8], data_peak=r[10])
        tip = attrs(data_tip=f"PFC storm {r[0]} {r[1]}: {r[8]:.0f} s, peak {r[10]:.0%}")
        out.append(
            f'<rect class="storm" x="{x0:.1f}" y="{22 + i * 14 - 1:.1f}" '
            f'width="{max(x1 - x0, 2):.1f}" height="15" fill="none" stroke="#000" '
            f'stroke-width="1.5" {data} {tip}/>'
        )
    return "".join(out)


# --- (2) stragglers ---------------------------------------------------------------------------


def straggler_panel(d: dict[str, Any], scope: D.Scope, skew_ms: float) -> str:
    ts = time_scale(scope.start_ns, scope.end_ns)
    empty = not d["ops"]
    body = ""
    if not empty:
        skew = _skew_chart(d, ts, scope, skew_ms)
        path = [
            Series("PFC pause frames/s", [(int(r[0]), float(r[1])) for r in d["path"]]),
            Series("CNPs/s (sent + handled)", [(int(r[0]), float(r[2])) for r in d["path"]]),
        ]
        path_svg = (
            line_chart(
                ts,
                path,
                y_title="events/s",
                height=120,
                bucket_ns=scope.bucket_ns,
                fig="straggler_path",
                unit="/s",
            )
            if d["path"]
            else '<div class="empty small">no congestion counters on the stragglers\' path</div>'
        )
        ranks: dict[int, int] = defaultdict(int)
        for r in d["slow"]:
            ranks[r[0]] += 1
        top = sorted(ranks.items(), key=lambda x: (-x[1], x[0]))[:4]
        worst = ", ".join(f"rank {k} x{v}" for k, v in top)
        cause = ""
        if d["causes"]:
            found = [r[-1] for r in d["causes"] if r[-1] != "none found"]
            cause = (
                f"; likely cause: {found[0]}" if found else "; no congestion found on their path"
            )
        worst = ": " + escape(worst) if worst else ""
        body = (
            f'<p class="note">job <b>{escape(str(d["job"]))}</b>: {len(d["ops"])} op instances, '
            f"{len(d['slow'])} straggler arrivals (&gt; {skew_ms:g} ms){worst}"
            f"{escape(cause)}.</p>{skew}<h3>PFC pauses and CNPs on the stragglers' NICs and "
            f"leaf ports (same time axis)</h3>{path_svg}"
        )
    return _panel(
        "stragglers",
        "NCCL stragglers and the congestion on their path",
        "Look for red dots (late ranks) lining up with a rise in pause frames or CNPs below: "
        "the fabric held that rank back; red dots over a quiet fabric point at the host or GPU.",
        body,
        empty,
        data_job=d["job"],
        data_skew_ms=skew_ms,
        data_bucket_ns=scope.bucket_ns,
    )


def _skew_chart(d: dict[str, Any], ts: TimeScale, scope: D.Scope, skew_ms: float) -> str:
    top, h = 10.0, 220.0
    ymax = max(
        [skew_ms * 1.5] + [float(r[6]) for r in d["slow"]] + [float(r[5] or 0) for r in d["ops"]]
    )
    sc = LinearScale(0.0, ymax * 1.08, top, h)
    body = [value_axis(sc, ts.x0, ts.width, "arrival skew (ms)")]
    yt = sc.y(skew_ms)
    body.append(
        f'<line x1="{ts.x0:.1f}" y1="{yt:.1f}" x2="{ts.x0 + ts.width:.1f}" y2="{yt:.1f}" '
        f'stroke="#d55e00" stroke-dasharray="6 4"/>'
    )
    for comm, op, seq, t0, ranks, mx, p50, n in d["ops"]:
        x = ts.x(t0)
        y1 = sc.y(float(mx or 0.0))
        data = attrs(
            data_comm=comm,
            data_op=op,
            data_op_seq=seq,
            data_t=t0,
            data_ranks=ranks,
            data_value=mx,
            data_p50=p50,
            data_stragglers=n,
        )
        tip = attrs(
            data_tip=f"{op} #{seq}: {ranks} ranks, on-time skew ≤ {short(mx)} ms, {n} straggler(s)"
        )
        body.append(
            f'<line class="op" x1="{x:.1f}" y1="{sc.y(0):.1f}" x2="{x:.1f}" y2="{y1:.1f}" '
            f'stroke="#8aa" stroke-width="3" {data} {tip}/>'
        )
    for rank, node, gpu, seq, t, t0, sk in d["slow"]:
        data = attrs(
            data_rank=rank,
            data_node=node,
            data_gpu=gpu,
            data_op_seq=seq,
            data_t=t,
            data_t0=t0,
            data_value=sk,
        )
        tip = attrs(data_tip=f"rank {rank} ({node} {gpu}) op #{seq}: {short(sk)} ms late")
        body.append(
            f'<circle class="straggler" cx="{ts.x(t0):.1f}" cy="{sc.y(float(sk)):.1f}" r="3.5" '
            f'fill="#d62728" {data} {tip}/>'
        )
    body.append(time_axis(ts, top + h))
    body.append(
        legend(
            [
                ("#8aa", "on-time ranks (0 … max skew)", "line"),
                ("#d62728", "straggler rank", "dot"),
                ("#d55e00", f"threshold {skew_ms:g} ms", "dash"),
            ],
            ts.x0,
            top + h + 52,
            ts.width,
        )
    )
    return svg(WIDTH, top + h + 62, "".join(body), data_figure="straggler_skew")


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
    return _panel(
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
    return _panel(
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
    return _panel(
        "quality",
        "Data quality: accounting, dead letters, gaps, resets, duplicates",
        "Look for a ✗ (input not fully accounted for), dead-letter reasons you do not expect, "
        "and gaps: a figure above is only as good as the data under it.",
        f'<div class="row">{"".join(figs)}</div>{gaps}',
        not figs,
    )


# --- page ------------------------------------------------------------------------------------

CSS = """
body{font:13px/1.4 system-ui,-apple-system,'Segoe UI',sans-serif;margin:20px auto;
max-width:1160px;color:#222;background:#fafafa}
h1{font-size:20px;margin:0 0 2px}h2{font-size:16px;margin:0 0 2px}
h3{font-size:13px;margin:10px 0 0;font-weight:600}
.meta{color:#555;margin-bottom:14px}
.panel{background:#fff;border:1px solid #ddd;border-radius:6px;padding:12px 14px;
margin:0 0 16px;min-height:60px}
.caption{color:#555;margin:0 0 8px;font-style:italic}.note{margin:4px 0;color:#333}
.empty{padding:28px;text-align:center;color:#777;background:#f4f4f4;border-radius:4px;
font-size:15px}.empty.small{padding:10px;font-size:13px}
.row{display:flex;flex-wrap:wrap;gap:12px;align-items:flex-start}
svg text{font-family:inherit}.tl{font-size:10.5px;fill:#444}.at{font-size:11px;fill:#222}
.lg{font-size:11px;fill:#222}.ft{font-size:12px;font-weight:600;fill:#222}
.axis{stroke:#444;stroke-width:1}.tick{stroke:#444}.grid{stroke:#e6e6e6}
.cell:hover,.pt:hover,.straggler:hover{stroke:#000;stroke-width:1}
table.links{border-collapse:collapse;margin-top:6px;font-size:12px}
table.links td,table.links th{padding:2px 8px;border-bottom:1px solid #eee;text-align:left}
.bar{display:inline-block;height:8px;background:#d94801;vertical-align:middle}
#tip{position:absolute;display:none;background:#222;color:#fff;padding:3px 7px;
border-radius:3px;font-size:12px;pointer-events:none;white-space:nowrap;z-index:9}
"""
JS = """
(function(){var tip=document.getElementById('tip');
document.addEventListener('mousemove',function(e){
var el=e.target&&e.target.closest?e.target.closest('[data-tip]'):null;
if(!el){tip.style.display='none';return;}
tip.textContent=el.getAttribute('data-tip');tip.style.display='block';
tip.style.left=(e.pageX+12)+'px';tip.style.top=(e.pageY+12)+'px';});})();
"""


def render_report(
    con: duckdb.DuckDBPyConnection, scope: D.Scope, *, lake: str, skew_ms: float = 5.0
) -> str:
    """Query the lake for ``scope`` and return the whole HTML page."""
    panels = [
        congestion_panel(D.congestion_data(con, scope), scope),
        straggler_panel(D.straggler_data(con, scope, skew_ms), scope, skew_ms),
        gpu_panel(D.gpu_data(con, scope), scope),
        clock_panel(D.clock_data(con, scope), scope),
        quality_panel(D.quality_data(con, scope)),
    ]
    job = f" · job {escape(scope.job)}" if scope.job else ""
    meta = (
        f"lake {escape(lake)} · {iso(scope.start_ns)[:19]} → {iso(scope.end_ns)[:19]} UTC"
        f"{job} · time bucket {scope.bucket_ns / NS:g} s"
    )
    data = attrs(
        data_start_ns=scope.start_ns,
        data_end_ns=scope.end_ns,
        data_bucket_ns=scope.bucket_ns,
        data_job=scope.job,
    )
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>Refinery report</title><style>{CSS}</style></head><body {data}>"
        f'<h1>Refinery report</h1><div class="meta">{meta}</div>'
        + "".join(panels)
        + f'<div id="tip"></div><script>{JS}</script></body></html>\n'
    )
