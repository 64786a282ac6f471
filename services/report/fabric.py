"""Fabric panels: (1) congestion by rail and switch port over time, (2) a job's NCCL
stragglers above the PFC pauses and CNPs on their path, on one time axis.

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
    HeatCell,
    Series,
    heat_map,
    line_chart,
    panel,
    time_scale,
)
from services.report.svg import (
    LinearScale,
    TimeScale,
    attrs,
    legend,
    short,
    svg,
    time_axis,
    value_axis,
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
    return panel(
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
    return panel(
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
