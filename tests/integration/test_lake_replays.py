"""Every dataset the lander writes lands a republished record once: the same derived records
published twice, as a refining worker or a detect process replaying after kill -9 publishes
them (same lineage or id, new Kafka offsets), through the real lander (a subprocess) against
the real broker. Copies arrive both within one landing run and after a lander restart (the
index rebuilt from the lake); records that share only part of an identity (another reason at
the same raw position, the resolved state of an alert, a record resent late) still land; and
``lake_accounting`` stays ok."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import duckdb
import pyarrow as pa
import pytest
from confluent_kafka import Producer

from lab.lake import synth
from pipelines.refine.aligned import ALIGNED_COLLECTIVES_SCHEMA, ALIGNED_EVENTS_SCHEMA
from schemas.codec import ARROW
from schemas.records import REFINED_SCHEMA, ROLLUP_SCHEMA
from services.lake import sqlload
from services.lake.writer import LakeWriter

pytestmark = pytest.mark.kafka

REPO = Path(__file__).resolve().parents[2]
T0 = 1_704_067_200_000_000_000 + 60 * 10**9
RAW = "telemetry.raw"
Msg = tuple[int, bytes, str | None]  # partition, value, content-type


def _ipc(t: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, t.schema) as w:
        w.write_table(t)
    return bytes(sink.getvalue().to_pybytes())


def _lineage_cols(n: int, part: int, off: int) -> dict[str, pa.Array]:
    return {
        "node": pa.array(["n0"] * n),
        "ts": pa.array([T0 + off * 10**9 + i for i in range(n)], pa.int64()),
        "ts_source": pa.array([T0 + off * 10**9 + i for i in range(n)], pa.int64()),
        "clock_offset_ns": pa.array([0] * n, pa.int64()),
        "clock_error_ns": pa.array([1000] * n, pa.int64()),
        "exporter": pa.array(["node"] * n),
        "boot_id": pa.array(["b0"] * n),
        "seq": pa.array([off] * n, pa.int64()),
        "raw_partition": pa.array([part] * n, pa.int32()),
        "raw_offset": pa.array([off] * n, pa.int64()),
    }


def _table(schema: pa.Schema, cols: dict[str, pa.Array], n: int) -> pa.Table:
    arrays = []
    for f in schema:
        if f.name in cols:
            arrays.append(cols[f.name].cast(f.type))
        elif pa.types.is_string(f.type):
            arrays.append(pa.array([f"{f.name}{i}" for i in range(n)], f.type))
        elif pa.types.is_integer(f.type):
            arrays.append(pa.array(list(range(n)), f.type))
        elif pa.types.is_floating(f.type):
            arrays.append(pa.array([1.5] * n, f.type))
        else:
            arrays.append(pa.array([False] * n, f.type))
    return pa.Table.from_arrays(arrays, schema=schema)


class Derived:
    """Builders of one record of each dataset, as the worker and detect publish them."""

    samples_src = synth.refined_samples(nodes=1, seconds=30, start_ns=T0)

    @classmethod
    def samples(cls, part: int, off: int, n: int = 20) -> Msg:
        t = cls.samples_src.slice(off * n % 2000, n)
        for name, typ, v in (("raw_partition", pa.int32(), part), ("raw_offset", pa.int64(), off)):
            t = t.set_column(t.schema.get_field_index(name), name, pa.array([v] * n, typ))
        return part, _ipc(t.cast(REFINED_SCHEMA)), ARROW

    @staticmethod
    def events(part: int, off: int, n: int = 3) -> Msg:
        return part, _ipc(_table(ALIGNED_EVENTS_SCHEMA, _lineage_cols(n, part, off), n)), ARROW

    @staticmethod
    def collectives(part: int, off: int, n: int = 4) -> Msg:
        cols = {**_lineage_cols(n, part, off), "rank": pa.array(range(n), pa.int32())}
        return part, _ipc(_table(ALIGNED_COLLECTIVES_SCHEMA, cols, n)), ARROW

    @staticmethod
    def deadletter(part: int, off: int, reason: str, scope: str, samples: int) -> Msg:
        doc = {"reason": reason, "detail": "x", "topic": RAW, "partition": part, "offset": off,
               "node": "n0", "scope": scope, "samples": samples, "ts_ns": T0 + off}  # fmt: skip
        return part, json.dumps(doc).encode(), None

    @staticmethod
    def accounting(part: int, off: int, refined: int, quarantined: int) -> Msg:
        doc = {"raw_topic": RAW, "raw_partition": part, "raw_offset": off, "node": "n0",
               "outcome": "refined", "input_samples": refined + quarantined,
               "refined_samples": refined, "duplicate_samples": 0,
               "quarantined_samples": quarantined, "ts": T0 + off}  # fmt: skip
        return part, json.dumps(doc).encode(), None

    @staticmethod
    def alert(part: int, aid: str, state: str) -> Msg:
        doc = {"id": aid, "rule": "r", "state": state, "severity": "warning", "entity": "n0",
               "starts_ns": T0, "summary": "s", "emitted_ns": T0 + 5}  # fmt: skip
        return part, json.dumps(doc).encode(), None

    @staticmethod
    def episode(part: int, eid: str, state: str) -> Msg:
        doc = {"id": eid, "kind": "congestion", "state": state, "entity": "sw0/1",
               "start_ns": T0, "emitted_ns": T0 + 5}  # fmt: skip
        return part, json.dumps(doc).encode(), None

    @staticmethod
    def rollups(part: int, node: str, window: int, n: int = 5) -> Msg:
        cols = {
            "window_s": pa.array([10] * n, pa.int32()),
            "window_start": pa.array([T0 + window * 10**10] * n, pa.int64()),
            "node": pa.array([node] * n),
        }
        return part, _ipc(_table(ROLLUP_SCHEMA, cols, n)), ARROW


def _publish(bootstrap: str, topic: str, msgs: list[Msg]) -> None:
    p = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    for part, value, ct in msgs:
        headers: list[tuple[str, str | bytes | None]] = [("content-type", ct)] if ct else []
        p.produce(topic, value, key=b"k", partition=part, headers=headers)
    assert p.flush(30) == 0


def _land(lake: Path, bootstrap: str, topics: dict[str, str], group: str) -> None:
    args = [sys.executable, "-m", "services.cli", "land", "--group", group, "--once-idle", "2",
            "--max-age", "0.2", "--max-rows", "60", "--no-compact", "--topics",
            *(f"{t}={ds}" for ds, t in topics.items())]  # fmt: skip
    env = {**os.environ, "REFINERY_BOOTSTRAP_SERVERS": bootstrap, "REFINERY_LAKE": str(lake)}
    r = subprocess.run(args, cwd=REPO, env=env, timeout=180, capture_output=True)
    assert r.returncode == 0, r.stderr.decode()[-2000:]


def _first_wave() -> dict[str, list[Msg]]:
    """Per dataset, the originals (two partitions) and, at the end, copies of some of them
    published in the same run (the lander sees both before it flushes or after)."""
    d = Derived
    waves: dict[str, list[Msg]] = {
        "samples": [d.samples(p, o) for p in (0, 1) for o in range(6)],
        "events": [d.events(p, o) for p in (0, 1) for o in range(6)],
        "collectives": [d.collectives(p, o) for p in (0, 1) for o in range(6)],
        "deadletter": [d.deadletter(p, o, "unknown_metric", "samples", 2) for p in (0, 1)
                       for o in range(6)]
        + [d.deadletter(0, 2, "non_finite", "samples", 1)],  # same position, another reason
        "accounting": [d.accounting(p, o, 20, 3) for p in (0, 1)
                       for o in range(6)],
        "alerts": [d.alert(p, f"a{p}{i}", "firing") for p in (0, 1) for i in range(4)],
        "episodes": [d.episode(p, f"e{p}{i}", "firing") for p in (0, 1) for i in range(4)],
        "rollups": [d.rollups(p, f"n{p}", w) for p in (0, 1) for w in range(4)],
    }  # fmt: skip
    for msgs in waves.values():
        msgs += msgs[:3] + msgs[6:8]  # replayed at once
    return waves


def _second_wave() -> dict[str, list[Msg]]:
    """After a lander restart: copies of first-wave records, and new records (one of them a
    resend that arrives after later offsets of its raw partition)."""
    d = Derived
    return {
        "samples": [d.samples(0, 1), d.samples(1, 4), d.samples(0, 8), d.samples(0, 7)],
        "events": [d.events(0, 1), d.events(1, 5), d.events(0, 8), d.events(0, 7)],
        "collectives": [d.collectives(0, 0), d.collectives(1, 5), d.collectives(0, 8)],
        "deadletter": [d.deadletter(0, 2, "non_finite", "samples", 1),
                       d.deadletter(1, 3, "unknown_metric", "samples", 2),
                       d.deadletter(0, 8, "unknown_metric", "samples", 2),
                       d.deadletter(0, 7, "undecodable", "record", 0)],
        "accounting": [d.accounting(0, 2, 20, 3), d.accounting(0, 8, 20, 2),
                       d.accounting(0, 7, 0, 0)],
        "alerts": [d.alert(0, "a00", "firing"), d.alert(0, "a00", "resolved"),
                   d.alert(1, "a13", "firing"), d.alert(1, "a19", "firing")],
        "episodes": [d.episode(0, "e01", "firing"), d.episode(0, "e01", "resolved")],
        "rollups": [d.rollups(0, "n0", 1), d.rollups(0, "n0", 9), d.rollups(1, "n1", 0)],
    }  # fmt: skip


# Per dataset: the columns whose distinct values name one landed row, and how many distinct
# records (identities) the two waves hold.
ROW_KEY = {
    "samples": "raw_partition, raw_offset, metric, device, ts",
    "events": "raw_partition, raw_offset, event, device",
    "collectives": "raw_partition, raw_offset, rank",
    "deadletter": 'topic, partition, "offset", scope, reason',
    "accounting": "raw_partition, raw_offset",
    "alerts": "id, state",
    "episodes": "id, state",
    "rollups": "node, window_s, window_start, device, metric",
}


def _count(lake: Path, ds: str) -> tuple[int, int]:
    files = [str(p) for p in LakeWriter(lake).live_paths(ds)]
    row = duckdb.execute(
        f"SELECT count(*), count(DISTINCT ({ROW_KEY[ds]})) FROM read_parquet(?)", [files]
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def test_every_dataset_lands_a_republished_record_once(
    kafka_bootstrap: str, unique_topic: Callable[..., str], unique_group: str, tmp_path: Path
) -> None:
    lake = tmp_path / "lake"
    topics = {ds: unique_topic(ds, partitions=2) for ds in ROW_KEY}
    first, second = _first_wave(), _second_wave()
    for ds, msgs in first.items():
        _publish(kafka_bootstrap, topics[ds], msgs)
    _land(lake, kafka_bootstrap, topics, unique_group)
    after_first = {ds: _count(lake, ds) for ds in ROW_KEY}
    for ds, msgs in second.items():
        _publish(kafka_bootstrap, topics[ds], msgs)
    _land(lake, kafka_bootstrap, topics, unique_group)  # a new process: index from the lake

    # rows per distinct record, first wave (originals only) plus the second wave's new ones
    expect_rows = {
        "samples": 20 * (12 + 2),
        "events": 3 * (12 + 2),
        "collectives": 4 * (12 + 1),
        "deadletter": 13 + 2,
        "accounting": 12 + 2,
        "alerts": 8 + 2,
        "episodes": 8 + 1,
        "rollups": 5 * (8 + 1),
    }
    for ds in ROW_KEY:
        rows, distinct = _count(lake, ds)
        assert after_first[ds][0] == after_first[ds][1], (ds, after_first[ds])
        assert (ds, rows, distinct) == (ds, expect_rows[ds], expect_rows[ds])


def test_lake_accounting_stays_ok_after_replays(
    kafka_bootstrap: str, unique_topic: Callable[..., str], unique_group: str, tmp_path: Path
) -> None:
    """Every raw record refined into 20 samples, 3 more quarantined into a dead letter; the
    worker replays a third of them (samples, dead letter and accounting again)."""
    lake = tmp_path / "lake"
    topics = {ds: unique_topic(ds, partitions=2) for ds in ("samples", "deadletter", "accounting")}
    d = Derived
    records = [(p, o) for p in (0, 1) for o in range(9)]
    waves = {
        "samples": [d.samples(p, o) for p, o in records],
        "deadletter": [d.deadletter(p, o, "unknown_metric", "samples", 3) for p, o in records],
        "accounting": [d.accounting(p, o, 20, 3) for p, o in records],
    }
    for ds, msgs in waves.items():
        _publish(kafka_bootstrap, topics[ds], msgs + msgs[::3])
    _land(lake, kafka_bootstrap, topics, unique_group)
    for ds, msgs in waves.items():
        _publish(kafka_bootstrap, topics[ds], msgs[1::3])
    _land(lake, kafka_bootstrap, topics, unique_group)
    LakeWriter(lake).ensure_seeds()  # every view binds
    con = sqlload.connect(lake)
    rows = con.execute(
        "SELECT raw_partition, raw_records, landed_samples, deadletter_samples, ok "
        "FROM lake_accounting ORDER BY raw_partition"
    ).fetchall()
    assert rows == [(0, 9, 180, 27, True), (1, 9, 180, 27, True)]
