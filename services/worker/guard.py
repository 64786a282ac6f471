"""The worker's dead-letter step: a record can fail only itself, and dead letters have a limit.

A record can fail only itself. The causes known are checked where they arise (an envelope
integer past int64 is rejected by the decoder, a refined message over the output limit is
split or its record dead-lettered), but refining is a lot of code and any bug in it must not
stop a partition: a record whose refining raises would replay after the crash, raise again,
and its raw partition would stop for every node on it until retention deletes the data.

So :class:`services.worker.refiner.Refiner` refines a group of records at once, and if that
raises for anything but an infrastructure failure (:func:`recoverable`), puts back the state
the group changed (:class:`Undo`) and refines its records one at a time: each one that raises
again is dead-lettered whole (``refine_failed``, or ``output_too_large``, with the exception's
class in the detail, :func:`failed`) and its state changes put back, the others are refined as
they would have been. A single record's content never stops the worker.

Each source's clock estimator is the one object refining changes in place: the attempt
works on a copy of it (:func:`clone`, containers copied, their immutable items shared: ~6 µs
for a full window, where ``copy.deepcopy`` took ~370 µs), and a failed attempt's points never
reach the estimator the next records see. A point the failed record would have added (one
that breaks the clock's arithmetic) would otherwise fail every later record of its source
too.

Dead letters have a limit (:class:`DeadLetterLimit`, arroyo's ``DlqLimit``): a bad deploy (a
catalog, decoder or refining bug) would dead-letter every record, quietly, by the million.
:class:`DeadLetterStep` sees every record's outcome, in order, before the group runner hands
its outputs to the producer; when more than ``share`` of an agent's last ``records`` records
were dead-lettered it raises :class:`DeadLetterLimitExceeded`, and the worker stops, non-zero,
with that one line: the group being refined is never acked, so no offset is committed past
what was refined and published, and the supervisor's restart replays it. One broken source
does not trip it (its records are a small share of an agent's input, which the worker's
partitions spread over many nodes); a share of 1.0 turns the limit off.
"""

from __future__ import annotations

import copy
import logging
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

from pipelines.refine._packed import PackedRows
from pipelines.refine.types import RefineState
from schemas.codec import content_type_of
from schemas.errors import RefineryError
from schemas.reasons import Reason
from schemas.wire import Batch
from services.worker.clock_alerts import ClockAlerts
from services.worker.refiner_outputs import (
    Outcome,
    OutputTooLarge,
    OutputTopics,
    RawRecord,
    dead_lettered,
)

log = logging.getLogger(__name__)


def recoverable(e: BaseException) -> bool:
    """Whether refining failed because of what it was given (a bug or an unforeseen input),
    not because the process cannot go on (out of memory, interrupted)."""
    return isinstance(e, Exception) and not isinstance(e, MemoryError)


def reason_of(e: BaseException) -> Reason:
    return Reason.OUTPUT_TOO_LARGE if isinstance(e, OutputTooLarge) else Reason.REFINE_FAILED


def detail_of(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:1024]


def failed(
    topics: OutputTopics, rec: RawRecord, batch: Batch, e: Exception, now_ns: int
) -> Outcome:
    """The outcome of a record whose refining raised: dead-lettered whole (its samples
    quarantined), its state as before it."""
    reason = reason_of(e)
    if reason is Reason.REFINE_FAILED:  # a bug: its traceback is worth a log line
        log.warning("%s[%d]@%d: refining raised; dead-lettered", rec.topic, rec.partition,
                    rec.offset, exc_info=e)  # fmt: skip
    src = batch.envelope.source
    return dead_lettered(topics, rec, reason, detail_of(e), key=src.node.encode(), node=src.node,
                         ct=content_type_of(rec.headers), samples=batch.table.num_rows,
                         stream=src.stream_key(), now_ns=now_ns)  # fmt: skip


_MISSING: Any = object()


class Undo:
    """The parts of a refiner's state that refining ``batches`` may change, as they are now:
    per stream its clock estimator (replaced by a copy for the attempt), counters, watermark
    and clock alert (:meth:`ClockAlerts.snapshot`), per node its overlap state, per
    source key the seq window's mark (the seqs it makes new are discarded again by
    :meth:`restore`). References only: refining replaces those objects, it does not change
    them, so taking one costs a few dict lookups per batch."""

    def __init__(self, state: RefineState, alerts: ClockAlerts, batches: list[Batch]) -> None:
        st = self.state = state
        self.alerts = alerts
        self.streams: dict[str, tuple[Any, ...]] = {}
        self.nodes: dict[str, Any] = {}
        self.seqs: list[tuple[str, int, int]] = []  # source key, unseen seq, mark before
        for batch in batches:
            src = batch.envelope.source
            stream = src.stream_key()
            if stream not in self.streams:
                clock = st.clocks.get(stream)
                if clock is not None:  # the attempt works on a copy, the original kept
                    st.clocks[stream] = clone(clock)
                self.streams[stream] = (
                    clock if clock is not None else _MISSING,
                    st.counters.get(stream, _MISSING),
                    st.watermarks.get(stream, _MISSING),
                    alerts.snapshot(stream),
                )
            self.nodes.setdefault(src.node, st.overlaps.get(src.node, _MISSING))
            window = st.seqs.get(src.key())
            if window is None:
                self.seqs.append((src.key(), batch.envelope.seq, -1))
            elif not window.seen(batch.envelope.seq):
                self.seqs.append((src.key(), batch.envelope.seq, window.hwm))

    def restore(self) -> None:
        st = self.state
        for stream, (clock, counters, mark, alert) in self.streams.items():
            for d, v in ((st.clocks, clock), (st.counters, counters), (st.watermarks, mark)):
                _put_back(d, stream, v)
            self.alerts.restore(stream, alert)
            # caches derived from the state while it was being changed: built anew
            st.layouts.pop(stream, None)
            st.counter_layouts.pop(stream, None)
        for node, ov in self.nodes.items():
            _put_back(st.overlaps, node, ov)
        for key, seq, hwm in reversed(self.seqs):
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


class DeadLetterLimitExceeded(RefineryError):
    """More of an agent's recent records were dead-lettered than :class:`DeadLetterLimit`
    allows: the worker stops (one line, exit non-zero) instead of dead-lettering on."""


@dataclass(frozen=True)
class DeadLetterLimit:
    """How many dead letters are too many (arroyo's ``DlqLimit``): more than ``share`` of the
    last ``records`` records of an agent (``refinery worker --max-deadletter-share``,
    ``--deadletter-window``). ``share`` 1.0: no limit."""

    share: float = 0.5
    records: int = 1000

    def __post_init__(self) -> None:
        if not (0.0 < self.share <= 1.0 and self.records >= 1):
            raise ValueError(f"{self}: share must be in (0, 1], records at least 1")


class DeadLetterStep:
    """An agent's dead-letter limit: :meth:`submit` each record's outcome, in order; raises
    :class:`DeadLetterLimitExceeded` once its window holds ``limit.records`` records and more
    than ``limit.share`` of them were dead-lettered. A record counts as dead-lettered when it
    was rejected whole (outcome ``deadletter``) or every one of its samples was quarantined;
    a replay (refined before a restart, judged then) does not count. O(1) per record; not
    thread-safe.

    >>> step = DeadLetterStep(DeadLetterLimit(share=0.5, records=4))
    >>> rec = RawRecord("telemetry.raw", 0, 7, None, b"", [], 0)
    >>> ok = Outcome([], "refined", 1, 1, 0, 0, {}, None, None, None)
    >>> bad = Outcome([], "deadletter", 0, 0, 0, 0, {"undecodable": 1}, None, None, None)
    >>> for out in (bad, ok, bad, bad):  # doctest: +IGNORE_EXCEPTION_DETAIL
    ...     step.submit(out, rec)
    Traceback (most recent call last):
    DeadLetterLimitExceeded: 3 of the last 4 records were dead-lettered (75%, more than ...
    """

    def __init__(self, limit: DeadLetterLimit) -> None:
        self.limit = limit
        self._window: deque[str | None] = deque()  # per record: its reason when dead-lettered
        self._reasons: Counter[str] = Counter()  # of the dead-lettered records in the window
        self._dead = 0

    def submit(self, out: Outcome, rec: RawRecord) -> None:
        """Count ``out``, the outcome of ``rec``; raise past the limit."""
        if out.outcome == "replay":
            return
        whole = out.outcome == "deadletter"
        dead = whole or (out.quarantined > 0 and out.quarantined == out.input_samples)
        reason = max(out.reasons, key=out.reasons.__getitem__, default="?") if dead else None
        window = self._window
        window.append(reason)
        if reason is not None:
            self._dead += 1
            self._reasons[reason] += 1
        if len(window) > self.limit.records:
            gone = window.popleft()
            if gone is not None:
                self._dead -= 1
                self._reasons[gone] -= 1
        n = len(window)
        if n == self.limit.records and self._dead > self.limit.share * n:
            raise DeadLetterLimitExceeded(self._says(rec))

    def _says(self, rec: RawRecord) -> str:
        n, dead, share = len(self._window), self._dead, self.limit.share
        reasons = ", ".join(f"{r} {c}" for r, c in self._reasons.most_common(3) if c)
        return (
            f"{dead} of the last {n} records were dead-lettered ({dead / n:.0%}, more than the "
            f"limit of {share:.0%}: --max-deadletter-share, --deadletter-window): {reasons}; "
            f"the last at {rec.topic}[{rec.partition}]@{rec.offset}; stopping without "
            "committing them"
        )
