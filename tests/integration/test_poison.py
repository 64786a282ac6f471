"""A record can fail only itself: the real worker against the real broker, fed good records
interleaved with hostile ones on one raw partition (envelope integers past int64, NaN
readings, too many rows, over-long strings, wrong types in every envelope field, garbage,
nested IPC compression, a clock block whose arithmetic overflows, a valid 150,000-row record).

Every record's fate is predicted without the worker: what ``schemas.codec.decode`` makes of
it (a whole-record reason, or a batch whose rows the worker must refine or quarantine row by
row). The worker must give each exactly that: one accounting record per raw offset, every
good row on ``telemetry.refined`` under its raw position, every bad record dead-lettered with
its reason; it must never exit, and the partition's committed offset must reach its end.

Run: ``REFINERY_TEST_BOOTSTRAP=127.0.0.1:PORT pytest -q tests/integration/test_poison.py -s``
(``-s`` prints the worker's peak RSS and the counts).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from confluent_kafka import Producer

from lab.demo.procs import group_lag
from schemas.codec import ARROW, ENVELOPE_KEY, JSON, MAX_ROWS, MAX_STRING_BYTES, decode
from schemas.errors import RejectedInput
from schemas.records import refined_lineage
from schemas.wire import SAMPLES_SCHEMA, ClockBlock, Envelope, SourceId
from tests.integration.worker_helpers import (
    accounting,
    committed,
    fresh_topics,
    read_all,
    running_worker,
)

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

S = 1_000_000_000
M = 2**63 - 1


def _table(t0: int, n: int, devices: int = 50, nan: int = 0) -> pa.Table:
    """``n`` gpu.temp readings, ``devices`` series at one-second steps; the first ``nan``
    values NaN."""
    values = [float(40 + i % 30) for i in range(n)]
    for i in range(nan):
        values[i] = math.nan
    return pa.table(
        {
            "ts_ns": pa.array([t0 + (i // devices) * S for i in range(n)], pa.int64()),
            "metric": pa.array(["gpu.temp"] * n).dictionary_encode().cast(pa.string()),
            "device": [f"gpu{i % devices}" for i in range(n)],
            "value": pa.array(values, pa.float64()),
            "raw": pa.nulls(n, pa.uint64()),
            "text": pa.nulls(n, pa.string()),
        },
        schema=SAMPLES_SCHEMA,
    )


def _ipc(table: pa.Table, env: dict[str, Any], compression: str | None = None) -> bytes:
    sink = pa.BufferOutputStream()
    meta = {ENVELOPE_KEY: json.dumps(env).encode()}
    opts = pa.ipc.IpcWriteOptions(compression=compression)
    with pa.ipc.new_stream(sink, table.schema.with_metadata(meta), options=opts) as w:
        w.write_table(table)
    return bytes(sink.getvalue().to_pybytes())


class Feed:
    """The records to send, in order, each with what the worker must make of it."""

    def __init__(self, now: int) -> None:
        self.now = now
        self.items: list[tuple[bytes, bytes, str]] = []
        self.expect: list[dict[str, Any]] = []  # outcome, reason, rows refined
        self.seqs: dict[str, int] = {}

    def env(self, node: str, exporter: str = "gpu") -> dict[str, Any]:
        key = f"{node}|{exporter}"
        seq = self.seqs[key] = self.seqs.get(key, -1) + 1
        src = SourceId(node=node, exporter=exporter, instance="0", boot_id="b1")
        e = Envelope(source=src, seq=seq, sent_ns=self.now + seq * S)
        doc: dict[str, Any] = json.loads(e.model_dump_json(exclude_none=True))
        return doc

    def add(self, node: str, ct: str, body: bytes, override: str | None = None) -> None:
        """Send ``body``; its fate is what the decoder makes of it, unless ``override`` (a
        reason the worker finds only in refining)."""
        self.items.append((node.encode(), body, ct))
        try:
            batch = decode(body, ct)
        except RejectedInput as e:
            self.expect.append({"outcome": "deadletter", "reason": e.reason.value, "rows": 0})
            return
        if override is not None:
            self.expect.append({"outcome": "deadletter", "reason": override, "rows": 0})
            return
        values = batch.table.column("value").to_pylist()
        bad = sum(1 for v in values if v is not None and not math.isfinite(v))
        self.expect.append({"outcome": "refined", "reason": None, "rows": len(values) - bad})

    def good(self, node: str, n: int = 50, nan: int = 0) -> None:
        env = self.env(node)
        self.add(node, ARROW, _ipc(_table(env["sent_ns"] - S, n, nan=nan), env))

    def json_mutant(self, node: str, field: str, value: Any) -> None:
        env = self.env(node, "custom")
        t = _table(env["sent_ns"] - S, 5)
        doc = {**env, field: value, "columns": t.to_pydict()}
        self.add(node, JSON, json.dumps(doc).encode())


def _feed(now: int) -> Feed:
    f = Feed(now)
    good = [f"g{i}" for i in range(4)]
    hostile: list[Any] = [
        # envelope integers past int64, in both encodings
        lambda: f.add("h1", ARROW, _ipc(_table(now, 5), {**f.env("h1"), "seq": 2**63})),
        lambda: f.add("h1", ARROW, _ipc(_table(now, 5), {**f.env("h1"), "sent_ns": 2**64 + 1})),
        lambda: f.json_mutant("h2", "interval_ns", 2**70),
        # NaN readings in an otherwise good batch: those rows quarantined, the rest refined
        lambda: f.good("h3", nan=7),
        # one row over the row limit, IPC-compressed so that it is small on the wire
        lambda: f.add("h4", ARROW, _ipc(_table(now, MAX_ROWS + 1), f.env("h4"), "zstd")),
        # an over-long device string
        lambda: f.add(
            "h5",
            ARROW,
            _ipc(
                _table(now, 3).set_column(
                    2, "device", pa.array(["x" * (MAX_STRING_BYTES + 1)] * 3)
                ),
                f.env("h5"),
            ),
        ),
        # wrong types in every envelope field
        *[
            _mutant(f, k, v)
            for k in ("seq", "sent_ns", "interval_ns", "kind", "source", "schema_version")
            for v in _WRONG
        ],
        # a column of the wrong type, a ts past int64, a raw past uint64
        lambda: f.add(
            "h7",
            JSON,
            json.dumps(
                {
                    **f.env("h7"),
                    "columns": {
                        "ts_ns": ["yesterday"],
                        "metric": ["gpu.temp"],
                        "device": ["gpu0"],
                        "value": [1.0],
                    },
                }
            ).encode(),
        ),
        lambda: f.add(
            "h7",
            JSON,
            json.dumps(
                {
                    **f.env("h7"),
                    "columns": {
                        "ts_ns": [2**63],
                        "metric": ["gpu.temp"],
                        "device": ["gpu0"],
                        "value": [1.0],
                    },
                }
            ).encode(),
        ),
        lambda: f.add(
            "h7",
            JSON,
            json.dumps(
                {
                    **f.env("h7"),
                    "columns": {
                        "ts_ns": [now],
                        "metric": ["gpu.energy"],
                        "device": ["gpu0"],
                        "raw": [2**64],
                    },
                }
            ).encode(),
        ),
        # garbage, an empty value, an unknown content type
        lambda: f.add("h8", ARROW, b"\x00garbage" * 100),
        lambda: f.add("h8", ARROW, b""),
        lambda: f.add("h8", "application/x-protobuf", b"\x08\x01"),
        # nested compression: a valid batch whose IPC buffers are zstd-compressed
        lambda: f.add("h9", ARROW, _ipc(_table(f.now, 50), f.env("h9"), "zstd")),
        # a clock block no clock reports (offset and error bound 2^63-1 with a send time of
        # 1 ns: its arithmetic would leave int64): value_out_of_range in the decoder
        lambda: f.add(
            "h10",
            ARROW,
            _ipc(
                _table(now, 5),
                {
                    **f.env("h10"),
                    "sent_ns": 1,
                    "clock": ClockBlock(source="chrony", offset_ns=M, error_bound_ns=M).model_dump(
                        exclude_none=True
                    ),
                },
            ),
        ),
        # a valid 150,000-row record: ~35 MB of refined rows, sent compressed
        lambda: f.good("h11", n=150_000),
    ]
    for k, make in enumerate(hostile):
        f.good(good[k % len(good)])
        make()
    for node in good:  # and the partition goes on
        f.good(node)
    return f


_WRONG: tuple[object, ...] = ("x", -1, 1.5, [], {}, None, 2**64)  # values of every wrong type


def _mutant(f: Feed, field: str, value: object) -> Any:
    return lambda: f.json_mutant("h6", field, value)


def _rss_peak_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return math.nan


def test_hostile_records_fail_alone_and_the_worker_goes_on(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    prefix = fresh_topics(kafka_bootstrap)
    raw = prefix + "telemetry.raw"
    feed = _feed(time.time_ns() - 60 * S)
    with running_worker(kafka_bootstrap, prefix, tmp_path) as w:
        p = Producer({"bootstrap.servers": kafka_bootstrap, "enable.idempotence": True,
                      "message.max.bytes": 16_000_000})  # fmt: skip
        for key, body, ct in feed.items:  # all on one partition: one stuck record stops all
            p.produce(raw, body, key=key, partition=0, headers=[("content-type", ct.encode())])
        assert p.flush(60) == 0
        acc = accounting(kafka_bootstrap, prefix, expect=len(feed.items), timeout=240)
        assert w.proc.poll() is None, w.tail()
        by_offset = {int(str(a["raw_offset"])): a for a in acc}
        assert len(acc) == len(by_offset) == len(feed.items), w.tail()

        # each record's fate, as predicted
        for off, want in enumerate(feed.expect):
            got = by_offset[off]
            assert (got["outcome"], got["reason"]) == (want["outcome"], want["reason"]), off
            assert got["refined_samples"] == want["rows"], off

        # every refined row is on telemetry.refined under its raw position, once
        want_rows = {off: e["rows"] for off, e in enumerate(feed.expect) if e["rows"]}
        refined = read_all(kafka_bootstrap, prefix + "telemetry.refined", idle=8)
        rows: dict[int, int] = {}
        for _, value, headers in refined:
            table = pa.ipc.open_stream(value).read_all()
            assert len(value or b"") <= 31 * 1024 * 1024
            for off, n in zip(*_positions(table), strict=True):
                rows[off] = rows.get(off, 0) + n
            assert {x["raw_offset"] for x in refined_lineage(headers)} >= set(_positions(table)[0])
        assert rows == want_rows

        # every bad record dead-lettered whole, with its reason
        dl_topic = prefix + "telemetry.deadletter"
        dls = [json.loads(v or b"") for _, v, _ in read_all(kafka_bootstrap, dl_topic, idle=5)]
        whole = {d["offset"]: d["reason"] for d in dls if d["scope"] == "record"}
        assert whole == {off: e["reason"] for off, e in enumerate(feed.expect) if e["reason"]}
        nan_dl = [d for d in dls if d["scope"] == "samples"]
        assert [(d["reason"], d["samples"]) for d in nan_dl] == [("non_finite", 7)]

        # no partition stalls: the group commits to the end
        deadline = time.monotonic() + 60
        while group_lag({"bootstrap.servers": kafka_bootstrap}, f"{prefix}worker", [raw]):
            assert time.monotonic() < deadline, "the raw partition stalled\n" + w.tail()
            time.sleep(0.5)
        assert w.proc.poll() is None, w.tail()
        peak = _rss_peak_mib(w.proc.pid)
        reasons: dict[str, int] = {}
        for e in feed.expect:
            if e["reason"]:
                reasons[e["reason"]] = reasons.get(e["reason"], 0) + 1
        print(f"\npoison: {len(feed.items)} records, {sum(want_rows.values())} rows refined, "
              f"dead-lettered {reasons}; worker peak RSS {peak:.0f} MiB")  # fmt: skip
        assert peak < 3072
        assert w.stop() == 0, w.tail()


def test_a_worker_that_would_dead_letter_everything_stops_past_its_limit(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """A bad deploy, played by input that turns to garbage after a good start: once more than
    ``--max-deadletter-share`` of the last ``--deadletter-window`` records were dead-lettered
    the worker stops, non-zero, with a line saying so, instead of dead-lettering on. The good
    records were refined and committed; no offset is committed past a record whose outputs
    were not all published (its group is never acked: a restart replays it)."""
    prefix = fresh_topics(kafka_bootstrap)
    raw = prefix + "telemetry.raw"
    feed = Feed(time.time_ns() - 60 * S)
    for i in range(30):
        feed.good(f"g{i % 4}")
    garbage = [(b"h8", b"\x00garbage" * 100, ARROW)] * 60
    p = Producer({"bootstrap.servers": kafka_bootstrap, "enable.idempotence": True})

    def send(items: list[tuple[bytes, bytes, str]]) -> None:
        for key, body, ct in items:
            p.produce(raw, body, key=key, partition=0, headers=[("content-type", ct.encode())])
        assert p.flush(60) == 0

    extra = ["--max-deadletter-share", "0.5", "--deadletter-window", "20"]
    with running_worker(kafka_bootstrap, prefix, tmp_path, extra=extra) as w:
        send(feed.items)
        deadline = time.monotonic() + 120
        while group_lag({"bootstrap.servers": kafka_bootstrap}, f"{prefix}worker", [raw]):
            assert time.monotonic() < deadline, "the good records never committed\n" + w.tail()
            assert w.proc.poll() is None, w.tail()
            time.sleep(0.5)
        send(garbage)
        rc = w.proc.wait(120)
        log = w.log.read_text(errors="replace")
    assert rc != 0, log[-3000:]
    # the 11th garbage record (offset 40) is the one past half of the last 20
    line = "11 of the last 20 records were dead-lettered (55%, more than the limit of 50%"
    assert line in log and "undecodable 11" in log, log[-3000:]
    done = {int(str(a["raw_offset"])) for a in accounting(kafka_bootstrap, prefix, 90, 15)}
    upto = committed(kafka_bootstrap, raw, f"{prefix}worker").get(0, 0)
    assert 30 <= upto <= 40, (upto, log[-3000:])
    assert set(range(upto)) <= done


def _positions(table: pa.Table) -> tuple[list[int], list[int]]:
    """The raw offsets in a refined table and the rows of each."""
    counts = table.group_by("raw_offset").aggregate([("raw_offset", "count")])
    return counts.column("raw_offset").to_pylist(), counts.column("raw_offset_count").to_pylist()
