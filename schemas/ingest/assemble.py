"""Decoded foreign points into the native :class:`~schemas.wire.Batch`, identity included.

A decoder hands over :class:`Points`: its distinct series (:data:`SeriesKey`) and, per
sample, the series index, source timestamp and value. :func:`assemble` resolves each
distinct series through the family's :class:`~schemas.ingest.mapping.Mapping` and builds the
samples table with Arrow/numpy kernels (no Python per sample), then synthesizes the
envelope the format lacks:

- ``node``: the series' node label (one node per message), else the Kafka key; a message
  with neither (an OTel Collector without the ``resourcedetection`` processor keys its
  records by a hash of the resource attributes: no host name) is rejected whole
  (``bad_envelope``) by :class:`RejectedSamples`, whose detail says what the producer must
  set (the family's ``node_hint``) and whose samples the refiner still accounts for;
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
from typing import Any

import numpy as np
import pyarrow as pa

from schemas.codec import MAX_ROWS
from schemas.errors import RejectedInput
from schemas.ingest.mapping import Family, Mapping, SeriesKey
from schemas.reasons import Reason
from schemas.wire import NAME_PATTERN, SAMPLES_SCHEMA, Batch, Envelope, SourceId

TWO_53 = float(2**53)
_NAME = re.compile(NAME_PATTERN)


class SeriesRegistry:
    """Process-wide ids of the distinct series a decoder has seen, so that a message's
    samples carry an int each and everything per series is done once per distinct set.
    Bounded: :meth:`begin` (called before each message) starts over past ``limit``; ids
    are stable within a message."""

    def __init__(self, limit: int = 500_000) -> None:
        self.ids: dict[SeriesKey, int] = {}
        self.keys: list[SeriesKey] = []
        self.limit = limit
        self.generation = 0

    def begin(self) -> int:
        if len(self.keys) >= self.limit:
            self.ids.clear()
            self.keys.clear()
            self.generation += 1
        return self.generation

    def id_of(self, key: SeriesKey) -> int:
        i = self.ids.get(key)
        if i is None:
            i = self.ids[key] = len(self.keys)
            self.keys.append(key)
        return i


@dataclass
class Points:
    """What a decoder read: per sample the id of its series in ``series``, the source
    timestamp (-1 where the format gave none: the arrival time is used) and the value."""

    series: SeriesRegistry
    gid: np.ndarray  # int64
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


class RejectedSamples(RejectedInput):
    """A message that decoded into ``samples`` samples and is rejected whole all the same (no
    host identity, several hosts in one message): its dead letter and accounting record
    count those samples as quarantined, so input = refined + duplicate + quarantined holds."""

    def __init__(self, reason: Reason, detail: str, samples: int) -> None:
        super().__init__(reason, detail)
        self.samples = samples


def no_node(family: Family | None, key: bytes | None) -> RejectedInput:
    """Why a message whose samples carry none of the family's node labels has no node: its
    Kafka key is absent, or no host name (a hash of resource attributes, a random key), and
    what the producer must set."""
    labels = " or ".join(family.node_labels) if family and family.node_labels else "host label"
    keyed = "no Kafka key" if not key else f"its Kafka key {key[:24]!r} is no host name"
    hint = f"; {family.node_hint}" if family and family.node_hint else ""
    return RejectedInput(Reason.BAD_ENVELOPE, f"no host identity: no {labels} and {keyed}{hint}")


def _valid(node: str) -> str | None:
    """``node`` as a node name (``host:9100`` -> ``host``), None if it is none."""
    node = node.split(":", 1)[0] if node.count(":") == 1 else node  # instance="host:9100"
    return node if _NAME.match(node) else None


def _node(nodes: set[str], pos: Position, family: Family | None = None) -> str:
    if len(nodes) > 1:
        shown = ", ".join(sorted(nodes)[:4])
        raise RejectedInput(
            Reason.BAD_ENVELOPE, f"one message carries samples of {len(nodes)} nodes ({shown})"
        )
    if not nodes:  # no node label: the Kafka key, when it is a host name
        keyed = _valid(pos.key.decode("utf-8", "replace")) if pos.key else None
        if keyed is None:
            raise no_node(family, pos.key)
        return keyed
    node = next(iter(nodes))
    valid = _valid(node)
    if valid is None:
        raise RejectedInput(Reason.BAD_ENVELOPE, f"node {node[:64]!r} is not a valid name")
    return valid


@dataclass(frozen=True)
class _Shape:
    """A message's distinct series, resolved: the columns per distinct series."""

    metric: pa.Array
    device: pa.Array
    factor: np.ndarray
    counter: np.ndarray
    nodes: frozenset[str]
    names: list[str]
    devices: list[str]
    mapping: Mapping  # the shape's key holds its id: an id is reused once its object is gone

    def columns(self, inv: np.ndarray) -> tuple[pa.Array, pa.Array]:
        """Metric and device per sample: by Arrow's take for many samples, by a Python
        list for a few (a take costs ~25 µs whatever its size)."""
        if len(inv) > 256:
            idx = pa.array(inv, pa.int32())
            return self.metric.take(idx), self.device.take(idx)
        rows = inv.tolist()
        names, devices = self.names, self.devices
        return (pa.array([names[i] for i in rows], pa.string()),
                pa.array([devices[i] for i in rows], pa.string()))  # fmt: skip


_SHAPES: dict[tuple[int, int, int, bytes], _Shape] = {}
_SOURCES: dict[tuple[str, str, int, str], SourceId] = {}


def _shape(points: Points, uniq: np.ndarray, mapping: Mapping) -> _Shape:
    key = (id(mapping), id(points.series), points.series.generation, uniq.tobytes())
    got = _SHAPES.get(key)
    if got is None or got.mapping is not mapping:
        targets = [mapping.resolve(points.series.keys[g]) for g in uniq.tolist()]
        names = [t.metric for t in targets]
        devices = [t.device for t in targets]
        got = _Shape(
            pa.array(names, pa.string()),
            pa.array(devices, pa.string()),
            np.array([t.factor for t in targets], dtype=np.float64),
            np.array([t.counter for t in targets], dtype=bool),
            frozenset(t.node for t in targets if t.node),
            names,
            devices,
            mapping,
        )
        if len(_SHAPES) >= 1024:  # bounded: the distinct shapes of recent messages
            _SHAPES.clear()
        _SHAPES[key] = got
    return got


def _source(node: str, exporter: str, partition: int, boot_id: str) -> SourceId:
    k = (node, exporter, partition, boot_id)
    src = _SOURCES.get(k)
    if src is None:
        if len(_SOURCES) >= 100_000:
            _SOURCES.clear()
        src = _SOURCES[k] = SourceId(
            node=node, exporter=exporter, instance=f"p{partition}", boot_id=boot_id
        )
    return src


def _raw(points: Points, value: np.ndarray, counter: np.ndarray, factor: np.ndarray) -> Any:
    """A counter's raw reading: the exact integer sent where there is one, else the value
    rounded; NULL (the refiner says wrong_kind) where negative or not finite."""
    ok = counter & np.isfinite(value) & (value >= 0) & (value < 1.8446744073709552e19)
    raw = np.rint(np.where(ok, value, 0.0)).astype(np.uint64)
    exact = np.zeros_like(ok)
    if points.exact is not None and points.exact_ok is not None:
        exact = points.exact_ok & counter & (factor == 1.0)
        raw[exact] = points.exact[exact]  # an integer counter stays exact past 2**53
        ok = ok | exact
    return ok, raw, ok & (value > TWO_53) & ~exact


def assemble(points: Points, mapping: Mapping, exporter: str, pos: Position) -> Batch:
    """The native batch of ``points``; raises :class:`RejectedInput` (``oversized``,
    ``bad_envelope``) and nothing else for any content."""
    n = len(points.gid)
    if n > MAX_ROWS:
        raise RejectedInput(Reason.OVERSIZED, f"{n} samples > {MAX_ROWS}")
    uniq, inv = np.unique(points.gid, return_inverse=True)
    shape = _shape(points, uniq, mapping)
    try:
        node = _node(set(shape.nodes), pos, mapping.family)
    except RejectedInput as e:  # decoded, then rejected: its samples are accounted for
        raise RejectedSamples(e.reason, e.detail, n) from None
    factor, counter = shape.factor[inv], shape.counter[inv]
    value = points.value * factor
    ts = np.where(points.ts < 0, pos.append_ns, points.ts)
    ok, raw, inexact = _raw(points, value, counter, factor)
    if inexact.any():
        for i in np.unique(inv[inexact]).tolist():
            m = shape.names[i]
            INEXACT.inexact[m] = INEXACT.inexact.get(m, 0) + int((inv[inexact] == i).sum())
    value = np.where(ok, raw.astype(np.float64), value)  # a counter's value is its raw
    metric, device = shape.columns(inv)
    text = pa.array(points.text, pa.string()) if points.text else pa.nulls(n, pa.string())
    table = pa.Table.from_arrays(
        [pa.array(ts), metric, device, pa.array(value),
         pa.array(raw, mask=~ok), text],
        schema=SAMPLES_SCHEMA,
    )  # fmt: skip
    source = _source(node, exporter, pos.partition, points.boot_id)
    sent = int(ts.max()) if n else pos.append_ns
    env = Envelope.model_construct(source=source, seq=pos.offset, sent_ns=max(sent, 0))
    return Batch.model_construct(envelope=env, table=table)
