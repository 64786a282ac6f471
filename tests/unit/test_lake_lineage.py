"""The lander's index of landed identities (services/lake/lineage.py): copies are dropped,
records that share only part of an identity are not, memory stays within the window, and the
index rebuilt from landed files agrees with the one built while landing."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from lab.lake import synth
from services.lake.datasets import DATASETS, conform
from services.lake.lineage import IDENTITIES, Identity, Landed, LineageIndex
from services.lake.writer import LakeWriter

T0 = 1_704_067_200_000_000_000


def _deadletters(rows: list[tuple[int, int, str, str]]) -> pa.Table:
    n = len(rows)
    return conform(
        pa.table(
            {
                "ts": [T0] * n,
                "reason": [r[3] for r in rows],
                "detail": ["d"] * n,
                "topic": ["telemetry.raw"] * n,
                "partition": [r[0] for r in rows],
                "offset": [r[1] for r in rows],
                "scope": [r[2] for r in rows],
                "samples": [1] * n,
                "ts_ns": [T0] * n,
                "kafka_partition": [0] * n,
                "kafka_offset": list(range(n)),
            }
        ),
        DATASETS["deadletter"].schema,
    )


def _accounting(offsets: list[int], topic: str | None = None) -> pa.Table:
    n = len(offsets)
    return conform(
        pa.table(
            {
                "ts": [T0] * n,
                "raw_topic": pa.array([topic] * n, pa.string()),
                "raw_partition": [1] * n,
                "raw_offset": offsets,
                "input_samples": [5] * n,
                "refined_samples": [5] * n,
                "duplicate_samples": [0] * n,
                "quarantined_samples": [0] * n,
                "outcome": ["refined"] * n,
            }
        ),
        DATASETS["accounting"].schema,
    )


def _rollups(node: str, starts: list[int], series: int = 3, count: int = 10) -> pa.Table:
    rows = [(s, k) for s in starts for k in range(series)]
    n = len(rows)
    return conform(
        pa.table(
            {
                "ts": [T0 + s for s, _ in rows],
                "window_s": pa.array([10] * n, pa.int32()),
                "window_start": [T0 + s for s, _ in rows],
                "node": [node] * n,
                "device": [f"gpu{k}" for _, k in rows],
                "metric": ["gpu.power"] * n,
                "count": [count] * n,
            }
        ),
        DATASETS["rollups"].schema,
    )


def _alerts(ids: list[tuple[str, str]], first_offset: int) -> pa.Table:
    n = len(ids)
    cols: dict[str, list[object]] = {c: [c] * n for c in ("rule", "severity", "entity", "summary")}
    return conform(
        pa.table(
            {
                **cols,
                "ts": [T0] * n,
                "id": [i for i, _ in ids],
                "state": [s for _, s in ids],
                "starts_ns": [T0] * n,
                "emitted_ns": [T0] * n,
                "kafka_partition": [0] * n,
                "kafka_offset": list(range(first_offset, first_offset + n)),
            }
        ),
        DATASETS["alerts"].schema,
    )


def test_an_alert_lands_once_per_state() -> None:
    index = LineageIndex(IDENTITIES["alerts"])
    assert index.drop_landed(_alerts([("a", "firing"), ("b", "firing")], 0)).num_rows == 2
    kept = index.drop_landed(_alerts([("a", "firing"), ("a", "resolved")], 2))
    assert kept.column("state").to_pylist() == ["resolved"]


def test_positions_below_the_window_count_as_landed_and_memory_stays_bounded() -> None:
    landed = Landed(window=100)
    for off in range(0, 10_000, 2):
        landed.add((off,), off)
    assert landed.has((9_998,), 9_998) and not landed.has((9_999,), 9_999)
    assert landed.has((5,), 5)  # far below the window: a position that old is not resent
    assert len(landed._recent) <= 2 * 1024


def test_ids_below_the_window_are_forgotten_not_assumed() -> None:
    landed = Landed(window=10, older_landed=False)
    for off in range(5000):
        landed.add((f"a{off}", "firing"), off)
    assert landed.has(("a4999", "firing"), 5000)
    assert not landed.has(("a1", "firing"), 5001)  # forgotten: it would land again
    assert len(landed._recent) <= 2 * 1024


def test_a_dead_letter_copy_is_dropped_another_reason_at_the_same_position_lands() -> None:
    index = LineageIndex(IDENTITIES["deadletter"])
    first = _deadletters([(0, 5, "samples", "unknown_metric"), (0, 6, "record", "undecodable")])
    assert index.drop_landed(first).num_rows == 2
    again = _deadletters(
        [
            (0, 5, "samples", "unknown_metric"),  # copy
            (0, 5, "samples", "non_finite"),  # same record, another reason
            (1, 5, "samples", "unknown_metric"),  # same offset, another partition
            (0, 6, "record", "undecodable"),  # copy
        ]
    )
    kept = index.drop_landed(again)
    assert kept.select(["partition", "offset", "reason"]).to_pylist() == [
        {"partition": 0, "offset": 5, "reason": "non_finite"},
        {"partition": 1, "offset": 5, "reason": "unknown_metric"},
    ]


def test_accounting_with_no_raw_topic_is_one_stream() -> None:
    index = LineageIndex(IDENTITIES["accounting"])
    assert index.drop_landed(_accounting([1, 2, 3])).num_rows == 3
    assert index.drop_landed(_accounting([2, 3, 4])).column("raw_offset").to_pylist() == [4]
    # the same offsets of another raw topic are other records
    assert index.drop_landed(_accounting([2, 3], "telemetry.ingest")).num_rows == 2


def test_rollup_windows_of_a_node_land_once_whichever_message_carries_them() -> None:
    index = LineageIndex(IDENTITIES["rollups"])
    assert index.drop_landed(_rollups("n0", [0, 10 * 10**9])).num_rows == 6
    kept = index.drop_landed(_rollups("n0", [10 * 10**9, 20 * 10**9]))
    assert set(kept.column("window_start").to_pylist()) == {T0 + 20 * 10**9}
    assert index.drop_landed(_rollups("n1", [0])).num_rows == 3  # another node's window


def test_a_rollup_window_published_again_with_more_samples_lands_again() -> None:
    """detect flushes its open windows when stopped; the next process publishes them whole."""
    index = LineageIndex(IDENTITIES["rollups"])
    assert index.drop_landed(_rollups("n0", [0], count=4)).num_rows == 3
    assert index.drop_landed(_rollups("n0", [0], count=10)).num_rows == 3
    assert index.drop_landed(_rollups("n0", [0], count=10)).num_rows == 0
    assert index.drop_landed(_rollups("n0", [0], count=4)).num_rows == 0


def _samples(offsets: list[int], topic: str | None = None) -> pa.Table:
    t = synth.refined_samples(nodes=1, seconds=2).slice(0, len(offsets))
    t = t.set_column(t.schema.get_field_index("raw_offset"), "raw_offset", pa.array(offsets))
    at = t.schema.get_field_index("raw_topic")
    return t.set_column(at, "raw_topic", pa.array([topic] * len(offsets), pa.string()))


def test_refined_rows_of_another_raw_topic_are_other_records_once_rows_name_it() -> None:
    index = LineageIndex(IDENTITIES["samples"])
    assert index.drop_landed(_samples([7, 7, 8])).num_rows == 3
    assert index.drop_landed(_samples([8, 8, 9])).column("raw_offset").to_pylist() == [9]
    assert index.drop_landed(_samples([7, 8], "telemetry.ingest.influx")).num_rows == 2
    assert index.drop_landed(_samples([7], "telemetry.ingest.influx")).num_rows == 0
    # rows that name telemetry.raw are those that did not name it (older rows): copies
    assert index.drop_landed(_samples([7, 9], "telemetry.raw")).num_rows == 0
    assert index.drop_landed(_samples([10], "telemetry.raw")).num_rows == 1
    assert index.drop_landed(_samples([10])).num_rows == 0


def test_an_ingest_stream_far_behind_telemetry_raw_in_its_partition_lands() -> None:
    """Each raw topic's offsets are a stream of their own: telemetry.raw a window ahead does
    not make an ingest topic's positions count as landed."""
    index = LineageIndex(IDENTITIES["samples"])
    far = IDENTITIES["samples"].window * 3
    assert index.drop_landed(_samples([far], "telemetry.raw")).num_rows == 1
    assert index.drop_landed(_samples([5, 6], "telemetry.ingest.otlp")).num_rows == 2
    assert index.drop_landed(_samples([5], "telemetry.ingest.otlp")).num_rows == 0
    assert index.drop_landed(_samples([5])).num_rows == 0  # NULL: telemetry.raw, far behind


def test_rows_of_two_raw_topics_in_one_table_are_told_apart() -> None:
    index = LineageIndex(IDENTITIES["samples"])
    assert index.drop_landed(_samples([3], "telemetry.ingest.collectd")).num_rows == 1
    both = pa.concat_tables(
        [_samples([3, 4], "telemetry.raw"), _samples([3, 4], "telemetry.ingest.collectd")]
    )
    kept = index.drop_landed(both)
    topics, offsets = kept.column("raw_topic").to_pylist(), kept.column("raw_offset").to_pylist()
    got = list(zip(topics, offsets, strict=True))
    assert got == [("telemetry.raw", 3), ("telemetry.raw", 4), ("telemetry.ingest.collectd", 4)]


def test_a_table_without_the_identity_columns_lands_whole() -> None:
    index = LineageIndex(Identity(("nope",), ("raw_offset",), "raw_offset", 10))
    t = _accounting([1, 1])
    assert index.drop_landed(t).num_rows == 2


def test_the_index_rebuilt_from_landed_files_drops_what_landing_dropped(tmp_path: Path) -> None:
    w = LakeWriter(tmp_path)
    cases = {
        "samples": _samples([3, 3, 4]),
        "deadletter": _deadletters([(0, 5, "samples", "unknown_metric"), (0, 7, "record", "x")]),
        "accounting": _accounting([1, 2, 3]),
        "rollups": _rollups("n0", [0, 10 * 10**9]),
        "alerts": _alerts([("a", "firing"), ("a", "resolved")], 40),
    }
    for i, (ds, t) in enumerate(cases.items()):
        w.land(ds, t, partition=0, first=10 * i, last=10 * i + 5)
        files = [str(p) for p in w.live_paths(ds, 0)]
        index = LineageIndex.from_files(IDENTITIES[ds], files)
        assert index.drop_landed(t).num_rows == 0, ds
    assert LineageIndex.from_files(IDENTITIES["alerts"], []).streams == {}


def test_the_index_rebuilt_from_files_keeps_raw_topics_apart(tmp_path: Path) -> None:
    """Older landed rows (raw_topic NULL) are telemetry.raw's; an ingest topic's positions
    rebuild as a stream of their own."""
    w = LakeWriter(tmp_path)
    w.land("samples", _samples([3, 4]), partition=0, first=0, last=1)
    w.land("samples", _samples([4, 5], "telemetry.ingest.influx"), partition=0, first=2, last=3)
    files = [str(p) for p in w.live_paths("samples", 0)]
    index = LineageIndex.from_files(IDENTITIES["samples"], files)
    assert index.drop_landed(_samples([3, 4], "telemetry.raw")).num_rows == 0
    assert index.drop_landed(_samples([5], "telemetry.raw")).num_rows == 1
    assert index.drop_landed(_samples([4, 5], "telemetry.ingest.influx")).num_rows == 0
    assert index.drop_landed(_samples([3], "telemetry.ingest.influx")).num_rows == 1
