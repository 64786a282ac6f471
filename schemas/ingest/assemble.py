"""Decoded foreign points into the native :class:`~schemas.wire.Batch`, identity included.

A decoder hands over :class:`Points`: its distinct series (:data:`SeriesKey`) and, per
sample, the series index, source timestamp and value. :func:`assemble` resolves each
distinct series through the family's :class:`~schemas.ingest.mapping.Mapping` and builds the
samples table with Arrow/numpy kernels (no Python per sample), then synthesizes the
envelope the format lacks:

- ``node``: the series' node label (one node per message), else the Kafka key;
- ``exporter``: the format's producer (``telegraf``, ``collectd``, ``otlp``, ``prometheus``);
- ``instance``: ``p<partition>``: each stream stays within one partition, so its state and
  its seqs (below) live there;
- ``boot_id``: given by the decoder where the format says when counting began (OTLP start
  time), else ``ingest``;
- ``seq``: the Kafka offset: monotonic within the stream, so a replay of the same position
  is recognised, but a message published twice has two offsets: no transport dedupe;
- ``sent_ns``: the newest sample's time: the format has no send time, so the clock estimate
  rests on ``sample time <= arrival`` only (one-sided).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from schemas.codec import MAX_ROWS
from schemas.errors import RejectedInput
from schemas.ingest.mapping import Mapping, SeriesKey
from schemas.reasons import Reason
from schemas.wire import NAME_PATTERN, SAMPLES_SCHEMA, Batch, Envelope, SourceId

TWO_53 = float(2**53)
_NAME = re.compile(NAME_PATTERN)


@dataclass
class Points:
    """What a decoder read: distinct series and per-sample (series index, ts, value).
    ``ts`` may hold -1 where the format gave no time (the arrival time is used)."""

    keys: list[SeriesKey]
    sid: np.ndarray  # int64, index into keys
    ts: np.ndarray  # int64 ns, -1 = none
    value: np.ndarray  # float64
    boot_id: str = "ingest"
    exact: np.ndarray | None = None  # uint64: an integer reading as sent, where exact_ok
    exact_ok: np.ndarray | None = None  # bool
    text: list[str | None] | None = None  # a string reading (value NaN)


@dataclass(frozen=True)
class Position:
    """Where the record sits in Kafka, and what the broker said about it."""

    partition: int
    offset: int
    append_ns: int
    key: bytes | None


@dataclass
class Exactness:
    """Float counters above 2**53 cannot be exact: counted per process, per metric."""

    inexact: dict[str, int]


INEXACT = Exactness({})


def _node(nodes: set[str], pos: Position) -> str:
    if len(nodes) > 1:
        shown = ", ".join(sorted(nodes)[:4])
        raise RejectedInput(
            Reason.BAD_ENVELOPE, f"one message carries samples of {len(nodes)} nodes ({shown})"
        )
    node = next(iter(nodes)) if nodes else None
    if node is None and pos.key:
        node = pos.key.decode("utf-8", "replace")
    if node is None:
        raise RejectedInput(Reason.BAD_ENVELOPE, "no node: no host label and no Kafka key")
    node = node.split(":", 1)[0] if node.count(":") == 1 else node  # instance="host:9100"
    if not _NAME.match(node):
        raise RejectedInput(Reason.BAD_ENVELOPE, f"node {node[:64]!r} is not a valid name")
    return node


def assemble(points: Points, mapping: Mapping, exporter: str, pos: Position) -> Batch:
    """The native batch of ``points``; raises :class:`RejectedInput` (``oversized``,
    ``bad_envelope``) and nothing else for any content."""
    n = len(points.sid)
    if n > MAX_ROWS:
        raise RejectedInput(Reason.OVERSIZED, f"{n} samples > {MAX_ROWS}")
    targets = [mapping.resolve(k) for k in points.keys]
    node = _node({t.node for t in targets if t.node}, pos)
    sid = points.sid
    factor = np.array([t.factor for t in targets] or [1.0], dtype=np.float64)[sid]
    counter = np.array([t.counter for t in targets] or [False], dtype=bool)[sid]
    value = points.value * factor
    ts = np.where(points.ts < 0, pos.append_ns, points.ts)
    ok = counter & np.isfinite(value) & (value >= 0) & (value < 1.8446744073709552e19)
    raw_np = np.rint(np.where(ok, value, 0.0)).astype(np.uint64)
    if points.exact is not None and points.exact_ok is not None:
        use = points.exact_ok & counter & (factor == 1.0)
        raw_np[use] = points.exact[use]  # an integer counter stays exact past 2**53
        ok = ok | use
    raw = pa.array(raw_np, mask=~ok)
    value = np.where(ok, raw_np.astype(np.float64), value)  # a counter's value is its raw
    big = ok & (value > TWO_53)
    if points.exact_ok is not None:
        big &= ~(points.exact_ok & (factor == 1.0))
    if big.any():
        for i in np.unique(sid[big]).tolist():
            m = targets[i].metric
            INEXACT.inexact[m] = INEXACT.inexact.get(m, 0) + int((sid[big] == i).sum())
    idx = pa.array(sid, pa.int32())
    metric = pc.take(pa.array([t.metric for t in targets], pa.string()), idx)
    device = pc.take(pa.array([t.device for t in targets], pa.string()), idx)
    table = pa.Table.from_arrays(
        [
            pa.array(ts, pa.int64()),
            metric,
            device,
            pa.array(value, pa.float64()),
            raw,
            pa.array(points.text, pa.string()) if points.text else pa.nulls(n, pa.string()),
        ],
        schema=SAMPLES_SCHEMA,
    )
    source = SourceId(node=node, exporter=exporter, instance=f"p{pos.partition}",
                      boot_id=points.boot_id)  # fmt: skip
    sent = int(ts.max()) if n else pos.append_ns
    env = Envelope(source=source, seq=pos.offset, sent_ns=max(sent, 0))
    return Batch(envelope=env, table=table)
