"""Builders of refined sample tables for the derived-stream unit tests."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from schemas.records import REFINED_SCHEMA

S = 1_000_000_000
T0 = 1_700_000_000 * S

_DEFAULTS: dict[str, Any] = {
    "unit": "1",
    "ts_source": 0,
    "clock_offset_ns": 0,
    "clock_error_ns": 0,
    "reset": False,
    "late": False,
    "exporter": "node",
    "instance": "0",
    "boot_id": "b0",
    "seq": 0,
    "raw_partition": 0,
    "raw_offset": 0,
}


def refined(rows: list[dict[str, Any]]) -> pa.Table:
    """A REFINED_SCHEMA table; unspecified columns take defaults or NULL."""
    full = []
    for r in rows:
        x = {**_DEFAULTS, **r}
        x.setdefault("ts_source", x["ts"])
        full.append({f.name: x.get(f.name) for f in REFINED_SCHEMA})
    return pa.Table.from_pylist(full, REFINED_SCHEMA)


def series(
    node: str,
    device: str,
    metric: str,
    values: list[float | None],
    t0: int = T0,
    step_s: int = 1,
    field: str = "value",
    offset0: int = 0,
    **extra: Any,
) -> list[dict[str, Any]]:
    """One sample per step: ``values[i]`` at ``t0 + i * step`` (in ``field``)."""
    out = []
    for i, v in enumerate(values):
        row = {"node": node, "device": device, "metric": metric, "ts": t0 + i * step_s * S}
        row |= {field: v, "raw_offset": offset0 + i, "seq": i, **extra}
        out.append(row)
    return out


def batches(rows: list[dict[str, Any]], step_s: int = 1) -> list[tuple[int, pa.Table]]:
    """Split rows into per-second batches: ``[(now_ns, table), ...]`` in time order."""
    by: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(int(r["ts"]) // (step_s * S), []).append(r)
    return [(k * step_s * S + S // 2, refined(by[k])) for k in sorted(by)]
