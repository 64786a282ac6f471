"""Everything a :class:`~services.worker.refiner.Refiner` remembers, as one object.

:class:`RefinerState` holds the refining state :func:`pipelines.refine.refine_group` works on
(:class:`~pipelines.refine.types.RefineState`: per stream its seq window, clock estimator,
counters and watermark, per node its overlap state), the clock alerts
(:class:`~services.worker.clock_alerts.ClockAlerts`), which streams and nodes were loaded from
the changelog-backed tables, and which changed since the last checkpoint. It is the only
writer of those: the refiner asks it to :meth:`~RefinerState.load` a batch's source, to
:meth:`~RefinerState.mark` what a record changed, for the :meth:`~RefinerState.dirty_blobs`
of a checkpoint, to :meth:`~RefinerState.forget` it all on a revocation, and, around an
attempt at refining that may raise, for a :meth:`~RefinerState.snapshot` to
:meth:`~RefinerState.restore` (see :mod:`services.worker.guard` for why).

A snapshot holds references, not copies: refining replaces the objects it changes, except
each source's clock estimator, which it changes in place; the snapshot keeps the estimator and
puts a copy in its place for the attempt (:func:`clone`, containers copied, their immutable
items shared: ~6 µs for a full window, where ``copy.deepcopy`` took ~370 µs). A failed
attempt's clock points then never reach the estimator the next records see: a point that
breaks the clock's arithmetic would otherwise fail every later record of its source too.

>>> from pipelines.refine.clock import ClockSettings
>>> state = RefinerState("telemetry.alerts", ClockSettings(), lambda _: None, lambda _: None)
>>> snap = state.snapshot([])
>>> state.refine.watermarks["n1|node|0"] = 5
>>> state.restore(snap)  # a snapshot of no batches puts nothing back
>>> state.refine.watermarks
{'n1|node|0': 5}
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pipelines.refine._packed import PackedRows
from pipelines.refine.clock import ClockSettings
from pipelines.refine.counters import CounterState
from pipelines.refine.types import RefineState
from schemas.wire import Batch
from services.worker.clock_alerts import ClockAlerts
from services.worker.state import StreamState, decode_overlap, encode_overlap

Loader = Callable[[str], bytes | None]

_MISSING: Any = object()


@dataclass
class Snapshot:
    """The parts of a :class:`RefinerState` that refining some batches may change, as they
    were (see :meth:`RefinerState.snapshot`)."""

    # per stream: clock estimator, counters, watermark, clock alert (or _MISSING each)
    streams: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    nodes: dict[str, Any] = field(default_factory=dict)  # per node: overlap state
    seqs: list[tuple[str, int, int]] = field(default_factory=list)  # key, unseen seq, mark


class RefinerState:
    """A refiner's state (see the module). ``load_stream`` and ``load_node`` read a stream's
    or a node's checkpointed blob (the Faust tables; None when it has none). Not thread-safe."""

    def __init__(
        self,
        alerts_topic: str,
        clock: ClockSettings,
        load_stream: Loader,
        load_node: Loader,
    ) -> None:
        self.refine = RefineState()
        self.alerts = ClockAlerts(alerts_topic)  # per stream: clock flagged, since when
        self._clock = clock
        self._load_stream = load_stream
        self._load_node = load_node
        self._streams: dict[str, str] = {}  # stream key -> its current source key (boot)
        self._nodes: set[str] = set()
        self._dirty_streams: set[str] = set()
        self._dirty_nodes: set[str] = set()

    def forget(self) -> None:
        """Drop every source's state (partitions were revoked); it reloads from the tables.
        The layouts shared between sources are kept: they depend on no source's state."""
        self.refine = RefineState(shared_layouts=self.refine.shared_layouts)
        self._streams.clear()
        self._nodes.clear()
        self.alerts.clear()
        self._dirty_streams.clear()
        self._dirty_nodes.clear()

    def load(self, batch: Batch) -> None:
        """Load the state of ``batch``'s stream and node from the tables, once."""
        src = batch.envelope.source
        stream, key = src.stream_key(), src.key()
        if stream not in self._streams:
            blob = self._load_stream(stream)
            if blob is not None:
                ss = StreamState.decode(blob, self._clock)
                st = self.refine
                if ss.seqs is not None and ss.boot_id is not None:
                    st.seqs[f"{stream}|{ss.boot_id}"] = ss.seqs
                if ss.clock is not None:
                    st.clocks[stream] = ss.clock
                st.counters[stream] = ss.counters
                if ss.watermark is not None:
                    st.watermarks[stream] = ss.watermark
                self.alerts.load(stream, ss.clock_flagged, ss.clock_onset)
        self._streams[stream] = key  # (a new key: a new boot of the source)
        if src.node not in self._nodes:
            blob = self._load_node(src.node)
            if blob is not None:
                self.refine.overlaps[src.node] = decode_overlap(blob)
            self._nodes.add(src.node)

    def mark(self, stream: str, node: str | None = None) -> None:
        """``stream`` (and ``node``) changed: in the next :meth:`dirty_blobs`."""
        self._dirty_streams.add(stream)
        if node is not None:
            self._dirty_nodes.add(node)

    def dirty_blobs(self) -> tuple[dict[str, bytes], dict[str, bytes]]:
        """(stream key → blob, node → blob) changed since the last call."""
        st = self.refine
        streams = {}
        for stream in self._dirty_streams:
            key = self._streams[stream]
            streams[stream] = StreamState(
                boot_id=key.rsplit("|", 1)[1],
                seqs=st.seqs.get(key),
                clock=st.clocks.get(stream),
                counters=st.counters.get(stream) or CounterState(),
                watermark=st.watermarks.get(stream),
                clock_flagged=self.alerts.flagged(stream),
                clock_onset=self.alerts.onset(stream),
            ).encode()
        nodes = {n: encode_overlap(st.overlaps[n]) for n in self._dirty_nodes if n in st.overlaps}
        self._dirty_streams.clear()
        self._dirty_nodes.clear()
        return streams, nodes

    def snapshot(self, batches: list[Batch]) -> Snapshot:
        """What refining ``batches`` may change, as it is now: per stream its clock
        estimator (replaced by a copy for the attempt), counters, watermark and clock alert,
        per node its overlap state, per source key the seq window's mark (the seqs it makes
        new are discarded again by :meth:`restore`). A few dict lookups per batch."""
        st, snap = self.refine, Snapshot()
        for batch in batches:
            src = batch.envelope.source
            stream = src.stream_key()
            if stream not in snap.streams:
                clock = st.clocks.get(stream)
                if clock is not None:  # the attempt works on a copy, the original kept
                    st.clocks[stream] = clone(clock)
                snap.streams[stream] = (
                    clock if clock is not None else _MISSING,
                    st.counters.get(stream, _MISSING),
                    st.watermarks.get(stream, _MISSING),
                    self.alerts.snapshot(stream),
                )
            snap.nodes.setdefault(src.node, st.overlaps.get(src.node, _MISSING))
            window = st.seqs.get(src.key())
            if window is None:
                snap.seqs.append((src.key(), batch.envelope.seq, -1))
            elif not window.seen(batch.envelope.seq):
                snap.seqs.append((src.key(), batch.envelope.seq, window.hwm))
        return snap

    def restore(self, snap: Snapshot) -> None:
        """Put back what :meth:`snapshot` took (after an attempt that raised)."""
        st = self.refine
        for stream, (clock, counters, mark, alert) in snap.streams.items():
            for d, v in ((st.clocks, clock), (st.counters, counters), (st.watermarks, mark)):
                _put_back(d, stream, v)
            self.alerts.restore(stream, alert)
            # caches derived from the state while it was being changed: built anew
            st.layouts.pop(stream, None)
            st.counter_layouts.pop(stream, None)
        for node, ov in snap.nodes.items():
            _put_back(st.overlaps, node, ov)
        for key, seq, hwm in reversed(snap.seqs):
            window = st.seqs.get(key)
            if window is not None and window.seen(seq):
                window.discard(seq, hwm)


def _put_back(d: dict[str, Any], key: str, value: Any) -> None:
    if value is _MISSING:
        d.pop(key, None)
    else:
        d[key] = value


CLONED = (list, dict, set, deque, PackedRows)  # the mutable attribute types :func:`clone` copies


def clone(obj: Any) -> Any:
    """A copy of ``obj`` (a clock estimator) that shares nothing mutable with it: its
    attributes' containers are copied, their items (ints, tuples, frozen estimates) shared.
    ``tests/unit/test_guard.py`` fails if the estimator gains an attribute of another
    mutable type."""
    new = copy.copy(obj)
    d = new.__dict__
    for k, v in d.items():
        t = type(v)
        if t is list or t is dict or t is set:
            d[k] = t(v)
        elif t is deque:
            d[k] = deque(v, v.maxlen)
        elif t is PackedRows:
            p = d[k] = copy.copy(v)
            p._added = list(v._added)
    return new
