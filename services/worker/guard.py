"""A record can fail only itself: what the refiner does when refining raises.

The causes known are checked where they arise (an envelope integer past int64 is rejected by
the decoder, a refined message over the output limit is split or its record dead-lettered),
but refining is a lot of code and any bug in it must not stop a partition: a record whose
refining raises would replay after the crash, raise again, and its raw partition would stop
for every node on it until retention deletes the data.

So :class:`services.worker.refiner.Refiner` refines a group of records at once, and if that
raises for anything but an infrastructure failure (:func:`recoverable`), puts back the state
the group changed (:class:`Undo`) and refines its records one at a time: each one that raises
again is dead-lettered whole (``refine_failed``, or ``output_too_large``, with the exception's
class in the detail) and its state changes put back, the others are refined as they would
have been. The worker exits only for infrastructure failures (the broker, authorization),
never for a record's content.

Each source's clock estimator is the one object refining changes in place: the attempt
works on a copy of it (:func:`clone`, containers copied, their immutable items shared: ~6 µs
for a full window, where ``copy.deepcopy`` took ~370 µs), and a failed attempt's points never
reach the estimator the next records see. A point the failed record would have added (one
that breaks the clock's arithmetic) would otherwise fail every later record of its source
too.
"""

from __future__ import annotations

import base64
import copy
import logging
from collections import deque
from typing import TYPE_CHECKING, Any

from pipelines.refine._packed import PackedRows
from pipelines.refine.batch import RefineState
from schemas.codec import content_type_of
from schemas.reasons import Reason
from schemas.records import DeadLetter
from schemas.wire import Batch

if TYPE_CHECKING:
    from services.worker.refiner import Outcome, RawRecord, Refiner

log = logging.getLogger(__name__)


class OutputTooLarge(ValueError):
    """One record's output is over the output topic's message limit and cannot be split
    (a record's refined rows go out in one message: consumers dedupe by its raw position)."""


def recoverable(e: BaseException) -> bool:
    """Whether refining failed because of what it was given (a bug or an unforeseen input),
    not because the process cannot go on (out of memory, interrupted)."""
    return isinstance(e, Exception) and not isinstance(e, MemoryError)


def reason_of(e: BaseException) -> Reason:
    return Reason.OUTPUT_TOO_LARGE if isinstance(e, OutputTooLarge) else Reason.REFINE_FAILED


def detail_of(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:1024]


def failed(r: Refiner, rec: RawRecord, batch: Batch, e: Exception, now_ns: int) -> Outcome:
    """The outcome of a record whose refining raised: dead-lettered whole (its samples
    quarantined), its state as before it."""
    from services.kafka.outputs import OutMessage
    from services.worker.refiner import Outcome  # (it imports this module)

    reason = reason_of(e)
    if reason is Reason.REFINE_FAILED:  # a bug: its traceback is worth a log line
        log.warning("%s[%d]@%d: refining raised; dead-lettered", rec.topic, rec.partition,
                    rec.offset, exc_info=e)  # fmt: skip
    src = batch.envelope.source
    n = batch.table.num_rows
    dl = DeadLetter(
        reason=reason, detail=detail_of(e), topic=rec.topic, partition=rec.partition,
        offset=rec.offset, node=src.node, content_type=content_type_of(rec.headers),
        scope="record", samples=n, original_b64=base64.b64encode(rec.value or b"").decode(),
        ts_ns=now_ns,
    )  # fmt: skip
    msgs = [
        OutMessage(r.topics.deadletter, src.node.encode(), dl.model_dump_json().encode()),
        r._accounting(rec, "deadletter", n, 0, 0, n, src.node, reason=reason.value),
    ]
    return Outcome(msgs, "deadletter", n, 0, 0, n, {reason.value: 1}, src.stream_key(), None, None)


_MISSING: Any = object()


class Undo:
    """The parts of a refiner's state that refining ``batches`` may change, as they are now:
    per stream its clock estimator (replaced by a copy for the attempt), counters, watermark
    and clock-alert flags, per node its overlap state, per
    source key the seq window's mark (the seqs it makes new are discarded again by
    :meth:`restore`). References only: refining replaces those objects, it does not change
    them, so taking one costs a few dict lookups per batch."""

    def __init__(self, refiner: Refiner, batches: list[Batch]) -> None:
        st: RefineState = refiner.state
        self.refiner = refiner
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
                    refiner._flagged.get(stream, _MISSING),
                    refiner._onsets.get(stream, _MISSING),
                )
            self.nodes.setdefault(src.node, st.overlaps.get(src.node, _MISSING))
            window = st.seqs.get(src.key())
            if window is None:
                self.seqs.append((src.key(), batch.envelope.seq, -1))
            elif not window.seen(batch.envelope.seq):
                self.seqs.append((src.key(), batch.envelope.seq, window.hwm))

    def restore(self) -> None:
        r = self.refiner
        st = r.state
        for stream, (clock, counters, mark, flagged, onset) in self.streams.items():
            for d, v in (
                (st.clocks, clock),
                (st.counters, counters),
                (st.watermarks, mark),
                (r._flagged, flagged),
                (r._onsets, onset),
            ):
                _put_back(d, stream, v)
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
