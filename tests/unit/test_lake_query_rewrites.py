"""Named queries rewritten for speed return exactly what their plain versions return.

``lake_reference_sql/`` keeps the straightforward versions (window sort per series, ASOF joins
per sample, whole-lake scans). Both run on a small lake built to hit every branch: gaps,
duplicates (some tripled), a second instance and a second exporter for some series, counter
resets and late rows, SM clock readings tied in time with clock-reasons samples, and topology
with re-cabled, closed, future and doubled link versions.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from lab.lake import synth
from services.lake import sqlload
from services.lake.datasets import TOPOLOGY_SCHEMA
from services.lake.writer import LakeWriter

REFERENCE = Path(__file__).parent / "lake_reference_sql"
T0 = synth.T0_NS
MID = T0 + 60 * 10**9


def _with(t: pa.Table, name: str, value: object) -> pa.Table:
    i = t.schema.get_field_index(name)
    return t.set_column(
        i, t.schema.field(i), pa.array([value] * t.num_rows, t.schema.field(i).type)
    )


def _samples() -> pa.Table:
    t = synth.refined_samples(nodes=2, seconds=120, start_ns=T0)
    rng = np.random.default_rng(1)
    n = t.num_rows
    reasons = t.filter(pa.compute.equal(t["metric"], "gpu.clock_event_reasons"))
    parts = [
        t.filter(pa.array(rng.random(n) > 0.02)),  # gaps
        t.take(pa.array(rng.choice(n, 300))),  # duplicates ...
        t.take(pa.array(rng.choice(n, 50))),
        _with(t.slice(0, 2000), "instance", "1"),  # a second instance
        _with(t.slice(3000, 2000), "exporter", "other"),  # a second exporter
        _with(_with(t.slice(5000, 100), "reset", True), "late", True),
        # SM clock readings stamped exactly when a clock-reasons sample is
        _with(_with(reasons.slice(0, 400), "metric", "gpu.sm_clock"), "value", 1234.0),
    ]
    parts[2] = pa.concat_tables([parts[2], parts[2]])  # ... some of them three times
    return pa.concat_tables([p.cast(t.schema) for p in parts])


def _topology_versions() -> pa.Table:
    rows, off = [], 5000
    for r in synth.topology(2).to_pylist():
        if r["kind"] not in ("link", "nic"):
            continue
        if r["node"] == "node000":  # re-cabled halfway
            rows.append(
                dict(r, valid_from=MID, ts=MID, switch="leaf77", switch_port="9", kafka_offset=off)
            )
            if r["kind"] == "nic":
                rows[-1]["rail"] = r["rail"] + 10
        elif r["kind"] == "link" and r["device"] == "mlx5_1/1":  # closed halfway
            rows.append(dict(r, valid_to=MID, kafka_offset=off))
        elif r["kind"] == "link" and r["device"] == "mlx5_2/1":  # a version after the data
            rows.append(dict(r, valid_from=T0 + 10**12, ts=T0, switch="later", kafka_offset=off))
        elif r["kind"] == "link":  # a second fact for the same port
            rows.append(
                dict(r, id=r["id"] + "-b", valid_from=MID, ts=MID, switch="twin", kafka_offset=off)
            )
        off += 1
    return pa.Table.from_pylist(rows, schema=TOPOLOGY_SCHEMA)


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lake")
    w = LakeWriter(root)
    w.ensure_seeds()
    synth.land_lake(w, _samples(), chunk_rows=3000)
    w.land("topology", _topology_versions(), partition=0, first=7, last=7)
    return root


CASES = [
    ("data_quality", {}),
    ("data_quality", {"gap_factor": "1.5"}),
    ("data_quality", {"start": "2026-01-01 00:00:30", "end": "2026-01-01 00:01:30"}),
    ("top_congested_links", {"limit": "1000"}),
    ("top_congested_links", {"start": "2026-01-01 00:00:50", "end": "2026-01-01 00:01:20"}),
    ("gpu_throttling_by_cause", {}),
    (
        "gpu_throttling_by_cause",
        {"include_idle": "true", "start": "2026-01-01 00:00:30", "end": "2026-01-01 00:01:30"},
    ),
    ("stragglers", {"skew_ms": "0.1", "limit": "100000"}),
    (
        "stragglers",
        {"skew_ms": "0.1", "start": "2026-01-01 00:00:05", "end": "2026-01-01 00:00:12"},
    ),
    ("stragglers", {"skew_ms": "0.1", "window_s": "3", "start": "2026-01-01 00:00:07"}),
]


@pytest.mark.parametrize(("name", "params"), CASES)
def test_rewritten_query_returns_what_the_plain_one_does(
    lake: Path, name: str, params: dict[str, str]
) -> None:
    con = sqlload.connect(lake)
    fast = sqlload.run_query(con, name, params).fetchall()
    q = sqlload.list_queries()[name]
    plain = con.execute((REFERENCE / f"{name}.sql").read_text(), sqlload.bind(q, params))
    assert fast == plain.fetchall()
    assert fast, "the case must find something to compare"
