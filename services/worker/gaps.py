"""The gap guard: no input record is skipped because the stream never handed it over.

Input offsets are contiguous, so a jump in a partition's offsets between two events is a
record the stream never handed over (seen with Faust's ``take_events`` under backlog after a
restart, and at the first event after a partition moved between two workers): it is fetched
directly and refined, not skipped. A partition whose records wait while its commits stand
still (events Faust dropped when partitions were reassigned, which no later event shows) is
read again from its committed offset."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

import faust
from faust.types import TP

from services.kafka.internals import declare_gap
from services.kafka.watch import CommitWatch, fetch_range
from services.telemetry import ServiceTelemetry
from services.worker.records import confluent_record, raw_record
from services.worker.refiner_outputs import RawRecord

log = logging.getLogger(__name__)

Partition = tuple[str, int]


class GapGuard:
    """The last offset handed over per input partition of this assignment, and what follows
    from it (see the module)."""

    def __init__(
        self,
        app: faust.App,
        conf: dict[str, Any],
        commits: CommitWatch,
        telemetry: ServiceTelemetry,
        reread_every_s: float,
    ) -> None:
        self._app = app
        self._conf = conf
        self._commits = commits
        self._telemetry = telemetry
        self._reread_every_s = reread_every_s
        self._last: dict[Partition, int] = {}
        self._reread_at: dict[Partition, float] = {}

    def forget(self) -> None:
        """The next assignment starts from the committed offsets."""
        self._last.clear()

    async def with_skipped(self, chunk: list[Any]) -> tuple[list[Any], list[RawRecord]]:
        """The chunk's records, preceded where a partition's offsets jump by the records in
        between, fetched directly. A newly assigned partition's first event is compared with
        the group's committed offset. Each is paired with the event after it (same
        partition: its state goes to the same changelog partition)."""
        evs: list[Any] = []
        recs: list[RawRecord] = []
        await self._starts(chunk)
        for ev in chunk:
            m = ev.message
            tp = (m.topic, m.partition)
            last = self._last.get(tp)
            if last is not None and m.offset > last + 1:
                for g in await self._refetch(m.topic, m.partition, last + 1, m.offset):
                    evs.append(ev)
                    recs.append(confluent_record(g))
            self._last[tp] = m.offset if last is None else max(last, m.offset)
            evs.append(ev)
            recs.append(raw_record(m))
        return evs, recs

    async def _starts(self, chunk: list[Any]) -> None:
        """First events of this assignment: compare them with where reading starts."""
        new = sorted({(e.message.topic, e.message.partition) for e in chunk} - set(self._last))
        if not new:
            return
        try:
            starts = await asyncio.get_running_loop().run_in_executor(
                None, self._commits.start_offsets, new
            )
        except Exception as e:  # no answer: the in-assignment check still runs
            log.warning("start offsets of %s: %s", new, e)
            starts = {}
        for tp, start in starts.items():
            self._last[tp] = start - 1

    async def _refetch(self, topic: str, partition: int, start: int, end: int) -> list[Any]:
        got: list[Any] = await asyncio.get_running_loop().run_in_executor(
            None, fetch_range, self._conf, topic, partition, start, end
        )
        log.warning(
            "%s[%d]: offsets %d..%d never reached the agent; refining the %d fetched",
            topic, partition, start, end - 1, len(got),
        )  # fmt: skip
        self._telemetry.count("worker.skipped_refetched", len(got), {"topic": topic})
        # Faust's consumer counts these offsets as read but never sees them acked, and it
        # commits nothing past a hole in its acked offsets: the partition would stall at its
        # committed offset for good (seen after a rebalance). Declared as a gap, they count
        # as acked once an offset after them is, and those are acked only when this group
        # has ended.
        await declare_gap(self._app.consumer, topic, partition, start, end - 1)
        return got

    async def reread(self, tp: Partition) -> None:
        """Seek a partition whose records wait while its commits stand still back to its
        committed offset. Faust drops the events it buffered when partitions are reassigned
        but counts them read; when they were a partition's last records no later event shows
        the jump and nothing would refine them: read again, they are. Once per stall: if that
        does not help, the watch's crash follows."""
        if time.monotonic() - self._reread_at.get(tp, -math.inf) <= self._reread_every_s:
            return
        self._reread_at[tp] = time.monotonic()
        try:
            starts = await asyncio.get_running_loop().run_in_executor(
                None, self._commits.start_offsets, [tp]
            )
        except Exception as e:  # no answer: this stall is not read again (the crash follows)
            log.warning("committed offset of %s: %s", tp, e)
            return
        log.warning("%s[%d]: records wait and no commit moves; reading again from %d",
                    tp[0], tp[1], starts[tp])  # fmt: skip
        self._telemetry.count("worker.reread", 1, {"topic": tp[0]})
        self._last[tp] = starts[tp] - 1
        await self._app.consumer.seek(TP(*tp), starts[tp])
