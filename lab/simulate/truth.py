"""Ground truth of a simulator run, written as Parquet next to each other.

``FILE`` (the main table) has one row per sample of every ACKNOWLEDGED raw batch identity —
a batch counts once however many of its copies (duplicates) were acknowledged:

  node, exporter, instance, boot_id, seq, metric, device, ts_source_ns, ts_true_ns, value,
  raw, expected_reason (NULL for a good sample, else the Reason the refiner must give it)

Siblings:

- ``FILE.sends.parquet`` — one row per acknowledged Kafka record of the telemetry topics:
  msg, tag, stream, topic, partition, offset, kind (batch|duplicate|malformed|late),
  expected_reason, samples, bad_samples, node, exporter, instance, boot_id, seq, content_type,
  sent_true_ns, sent_source_ns, due_true_ns
- ``FILE.incidents.parquet`` — id, kind, node, device, switch, port, job, start_ns, end_ns,
  detail (JSON)
- ``FILE.clocks.parquet`` — node, offset_ns (at the start), drift_ppm, synced,
  steps (list of {at_ns, step_ns}), models (list of {kind, start_ns, end_ns, params: map of
  name to float}, the node's clock models); :func:`.clock_models.truth_offsets` rebuilds a
  node's wall and raw clock offsets at any true time from its row
- ``FILE.events.parquet`` — node, boot_id, seq, event, device, code, ts_source_ns, ts_true_ns,
  incident (acknowledged events only)
- ``FILE.collectives.parquet`` — job, op_seq, rank, node, device, ts_source_ns, ts_true_ns,
  straggle_ns, incident (acknowledged records only)
- ``FILE.run.json`` — how the run was published: ``speed`` (true time / wall time; null when
  flat out), ``start_ns``, ``end_ns`` (true time the publishing ended), ``interval_ns``,
  ``nodes``, ``seed``, ``spread``, ``faults``. Optional: a truth without it is read with
  ``run = None``.

All times are ns since the epoch; ``*_true_ns`` on the simulator's true clock, which is the
wall clock at the start of publishing plus simulated time (see :mod:`.publish`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from lab.simulate.engine import Message, SendKind, Stream

SAMPLES_TRUTH = pa.schema(
    [
        ("node", pa.string()),
        ("exporter", pa.string()),
        ("instance", pa.string()),
        ("boot_id", pa.string()),
        ("seq", pa.int64()),
        ("metric", pa.string()),
        ("device", pa.string()),
        ("ts_source_ns", pa.int64()),
        ("ts_true_ns", pa.int64()),
        ("value", pa.float64()),
        ("raw", pa.uint64()),
        ("expected_reason", pa.string()),
    ]
)
SENDS_TRUTH = pa.schema(
    [
        ("msg", pa.int64()),
        ("tag", pa.string()),
        ("stream", pa.string()),
        ("topic", pa.string()),
        ("partition", pa.int32()),
        ("offset", pa.int64()),
        ("kind", pa.string()),
        ("expected_reason", pa.string()),
        ("samples", pa.int64()),
        ("bad_samples", pa.int64()),
        ("node", pa.string()),
        ("exporter", pa.string()),
        ("instance", pa.string()),
        ("boot_id", pa.string()),
        ("seq", pa.int64()),
        ("content_type", pa.string()),
        ("sent_true_ns", pa.int64()),
        ("sent_source_ns", pa.int64()),
        ("due_true_ns", pa.int64()),
    ]
)
EVENTS_TRUTH = pa.schema(
    [
        ("node", pa.string()),
        ("boot_id", pa.string()),
        ("seq", pa.int64()),
        ("event", pa.string()),
        ("device", pa.string()),
        ("code", pa.int64()),
        ("ts_source_ns", pa.int64()),
        ("ts_true_ns", pa.int64()),
        ("incident", pa.string()),
    ]
)
COLLECTIVES_TRUTH = pa.schema(
    [
        ("job", pa.string()),
        ("op_seq", pa.int64()),
        ("rank", pa.int32()),
        ("node", pa.string()),
        ("device", pa.string()),
        ("ts_source_ns", pa.int64()),
        ("ts_true_ns", pa.int64()),
        ("straggle_ns", pa.int64()),
        ("incident", pa.string()),
    ]
)
SIBLINGS = ("sends", "incidents", "clocks", "events", "collectives")


def sibling(path: Path, name: str) -> Path:
    return path.with_name(f"{path.name}.{name}.parquet")


@dataclass(frozen=True)
class Truth:
    """A loaded truth: one pyarrow table per file."""

    samples: pa.Table
    sends: pa.Table
    incidents: pa.Table
    clocks: pa.Table
    events: pa.Table
    collectives: pa.Table
    run: dict[str, Any] | None = field(default=None)

    def summary(self) -> dict[str, Any]:
        """Counts a report or test starts from."""
        kinds = self.sends.column("kind").value_counts().to_pylist()
        bad = pc.is_valid(self.samples.column("expected_reason"))
        return {
            "samples": self.samples.num_rows,
            "bad_samples": int(pc.sum(bad).as_py() or 0),
            "messages": self.sends.num_rows,
            "by_kind": {d["values"]: d["counts"] for d in kinds},
            "incidents": self.incidents.num_rows,
            "events": self.events.num_rows,
            "collectives": self.collectives.num_rows,
        }


def load_truth(path: str | Path) -> Truth:
    """Read a truth written by :class:`TruthWriter`; raises FileNotFoundError if incomplete."""
    p = Path(path)
    s, i, c, e, k = (pq.read_table(sibling(p, n)) for n in SIBLINGS)
    run_file = run_path(p)
    run = json.loads(run_file.read_text()) if run_file.exists() else None
    return Truth(pq.read_table(p), s, i, c, e, k, run)


def run_path(path: Path) -> Path:
    return path.with_name(f"{path.name}.run.json")


class TruthWriter:
    """Records acknowledged messages as they are acknowledged; :meth:`close` writes the rest.
    Sample rows stream to ``path`` in row groups, so memory stays bounded."""

    def __init__(self, path: str | Path, flush_rows: int = 1_000_000) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._writer = pq.ParquetWriter(str(self.path), SAMPLES_TRUTH, compression="zstd")
        self._pending: list[pa.Table] = []
        self._pending_rows, self._flush_rows = 0, flush_rows
        self._sends: list[dict[str, Any]] = []
        self._events: list[pa.Table] = []
        self._colls: list[pa.Table] = []
        self._seen: set[str] = set()

    def acked(self, msg: Message, msg_no: int, topic: str, partition: int, offset: int) -> None:
        """Record one acknowledged message (call once per message; duplicates welcome)."""
        env = msg.envelope
        src = env.source if env is not None else None
        bad = len(msg.bad or ())
        self._sends.append(
            {
                "msg": msg_no,
                "tag": msg.tag,
                "stream": msg.stream.value,
                "topic": topic,
                "partition": partition,
                "offset": offset,
                "kind": msg.kind.value,
                "expected_reason": msg.expected_reason.value if msg.expected_reason else None,
                "samples": msg.samples,
                "bad_samples": bad,
                "node": src.node if src else msg.key.decode(),
                "exporter": src.exporter if src else None,
                "instance": src.instance if src else None,
                "boot_id": src.boot_id if src else None,
                "seq": env.seq if env else None,
                "content_type": msg.content_type,
                "sent_true_ns": msg.sent_true_ns,
                "sent_source_ns": env.sent_ns if env else None,
                "due_true_ns": msg.due_ns,
            }
        )
        if (
            msg.kind is SendKind.MALFORMED
            or msg.table is None
            or msg.table.num_rows == 0  # an exporter's first batch: no rows
            or env is None
            or msg.tag in self._seen
        ):
            return
        self._seen.add(msg.tag)
        if msg.stream is Stream.RAW:
            self._add_samples(msg)
        elif msg.stream is Stream.EVENTS:
            self._add_events(msg)
        else:
            self._add_collectives(msg)

    def _add_samples(self, msg: Message) -> None:
        t, env = msg.table, msg.envelope
        assert t is not None and env is not None
        n, src = t.num_rows, env.source
        reasons = [None] * (n - len(msg.bad or ())) + [r.value for r in (msg.bad or ())]
        ts = t.column("ts_ns")
        self._pending.append(
            pa.Table.from_arrays(
                [
                    pa.repeat(src.node, n),
                    pa.repeat(src.exporter, n),
                    pa.repeat(src.instance, n),
                    pa.repeat(src.boot_id, n),
                    pa.repeat(pa.scalar(env.seq, pa.int64()), n),
                    t.column("metric"),
                    t.column("device"),
                    ts,
                    pc.subtract(ts, msg.offset_ns),
                    t.column("value"),
                    t.column("raw"),
                    pa.array(reasons, pa.string()),
                ],
                schema=SAMPLES_TRUTH,
            )
        )
        self._pending_rows += n
        if self._pending_rows >= self._flush_rows:
            self._flush()

    def _add_events(self, msg: Message) -> None:
        t, env = msg.table, msg.envelope
        assert t is not None and env is not None
        n = t.num_rows
        ts = t.column("ts_ns")
        self._events.append(
            pa.Table.from_arrays(
                [
                    pa.repeat(env.source.node, n),
                    pa.repeat(env.source.boot_id, n),
                    pa.repeat(pa.scalar(env.seq, pa.int64()), n),
                    t.column("event"),
                    t.column("device"),
                    t.column("code"),
                    ts,
                    pc.subtract(ts, msg.offset_ns),
                    pa.array([e.incident for e in msg.extra], pa.string()),
                ],
                schema=EVENTS_TRUTH,
            )
        )

    def _add_collectives(self, msg: Message) -> None:
        t, ct = msg.table, msg.extra
        assert t is not None
        self._colls.append(
            pa.Table.from_arrays(
                [
                    t.column("job"),
                    t.column("op_seq"),
                    t.column("rank"),
                    pa.array(ct.node, pa.string()),
                    t.column("device"),
                    t.column("ts_ns"),
                    pa.array(np.asarray(ct.true_start, np.int64)),
                    pa.array(np.asarray(ct.straggle_ns, np.int64)),
                    pa.array(ct.cause, pa.string()),
                ],
                schema=COLLECTIVES_TRUTH,
            )
        )

    def _flush(self) -> None:
        if self._pending:
            self._writer.write_table(pa.concat_tables(self._pending))
        self._pending, self._pending_rows = [], 0

    def close(
        self,
        incidents: list[dict[str, Any]],
        clocks: pa.Table,
        run: dict[str, Any] | None = None,
    ) -> None:
        """Write everything still held and the sibling files (``run``: ``FILE.run.json``)."""
        self._flush()
        if run is not None:
            run_path(self.path).write_text(json.dumps(run, sort_keys=True) + "\n")
        self._writer.close()
        inc_schema = pa.schema(
            [
                ("id", pa.string()),
                ("kind", pa.string()),
                ("node", pa.string()),
                ("device", pa.string()),
                ("switch", pa.string()),
                ("port", pa.string()),
                ("job", pa.string()),
                ("start_ns", pa.int64()),
                ("end_ns", pa.int64()),
                ("detail", pa.string()),
            ]
        )
        tables = {
            "sends": pa.Table.from_pylist(self._sends, SENDS_TRUTH),
            "incidents": pa.Table.from_pylist(incidents, inc_schema),
            "clocks": clocks,
            "events": pa.concat_tables(self._events)
            if self._events
            else EVENTS_TRUTH.empty_table(),
            "collectives": (
                pa.concat_tables(self._colls) if self._colls else COLLECTIVES_TRUTH.empty_table()
            ),
        }
        for name, table in tables.items():
            pq.write_table(table, str(sibling(self.path, name)), compression="zstd")
