"""The report page: five panels built from :mod:`services.report.data`, one HTML file.

:func:`render_report` runs every query for a :class:`~services.report.data.Scope` and returns
the page text: inline CSS, inline SVG and a few lines of inline JavaScript for the hover
tooltip. It references nothing outside the file (no URL at all), so it opens offline.
Each panel is a ``<section class="panel" id="panel-...">`` with ``data-state`` ``data`` or
``empty``; an empty one says "no data in this range" instead of drawing.
"""

from __future__ import annotations

from html import escape

import duckdb

from services.report import data as D
from services.report.fabric import congestion_panel, straggler_panel
from services.report.hosts import clock_panel, gpu_panel, quality_panel
from services.report.svg import NS, attrs, iso

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
