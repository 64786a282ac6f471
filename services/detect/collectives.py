"""The cross-layer stage of detect: a job's collectives, held until refined data covers
them, then judged for stragglers against the episodes on the ranks' paths.

A replica judges the jobs of the collectives partitions it owns (collectives are keyed by
job). What refined data covers, and the episodes, come from every replica through the
:class:`~services.detect.progress.ProgressView` (its :class:`Coverage`), so a replica owning
no refined partition of a job's nodes judges it as one process owning everything would.

Time: collectives wait for the view's watermark (the data time every refined partition has
reached) to pass their newest ts plus the grace, and for every node of their jobs to reach it
(one refined partition interleaves nodes read at paces of their own), but for nodes found
silent or not monitored. The grace is for a cause whose episode has not opened yet; so once
refined data covers the collectives' own time (watermark and nodes past their newest ts) they
are judged on a copy of the straggler state, and that judgement stands at once when every
straggler alert it fires names its cause (or none fires); otherwise they wait out the grace.
A node behind holds them ``NODE_WAIT_NS`` of wall time at most. When refined data has stopped
(the watermark stands and no partition has records left to read for ``STALL_NS`` of wall time)
they are judged anyway.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import pyarrow as pa
import pyarrow.compute as pc

from pipelines.detect.episodes import OpenEpisode
from pipelines.detect.stragglers import NONE_FOUND, StragglerDetector
from schemas.records import Alert, AlertState

# how far past their newest ts refined data must reach before collectives are judged: the
# congestion and throttling episodes on the ranks' paths open on the first sample past the
# episode's onset, which a node exporter scraping every second reads up to 1 s after it;
# plus the clock bound's and arrival order's slack. A straggle judged before its cause's
# episode opened would name no cause (it is never judged again), and every second of it is
# a second of the straggler alert's latency
GRACE_NS = 1_500_000_000
FIRST_DATA_NS = 120_000_000_000  # how long held collectives wait for the first refined data
# how long held collectives wait while refined data has stopped with none left to read: a
# worker killed and started again (Faust's start, its state's recovery) takes tens of seconds
STALL_NS = 60_000_000_000
# how long (wall time) collectives the watermark has passed wait for a node of their job not
# read that far: a worker catching up on a backlog reads nodes tens of seconds apart; a node
# whose data ended (a job's nodes gone, no silence judged) must not hold them for good
NODE_WAIT_NS = 60_000_000_000


class Coverage(Protocol):
    """What refined data covers: a :class:`~services.detect.progress.ProgressView` (every
    replica's progress), or one detector's own state when it owns every partition."""

    def watermark(self) -> int | None: ...

    def pending(self) -> bool: ...

    def seen(self) -> bool: ...

    def moved(self) -> int: ...

    def reach(self, placements: Mapping[str, Any]) -> dict[str, float]: ...

    def episodes(self, watermark: int | None) -> list[OpenEpisode]: ...


@dataclass
class _Held:
    """Collectives waiting for refined data to cover ``due`` (their newest ts plus the
    grace), of ``jobs``; ``passed_ns``: when (wall) the watermark passed ``due``."""

    due: int
    jobs: tuple[str, ...]
    table: pa.Table
    passed_ns: int = 0


def _reached(reach: Mapping[str, float], jobs: tuple[str, ...], ts: int) -> bool:
    """Whether every node of each of ``jobs`` was read up to ``ts``."""
    return all(reach.get(j, math.inf) >= ts for j in jobs)


class CollectiveJudge:
    """Held collectives and the straggler detector they feed."""

    def __init__(
        self, stragglers: StragglerDetector, view: Coverage, grace_ns: int = GRACE_NS
    ) -> None:
        self.stragglers = stragglers
        self.view = view
        self.grace_ns = grace_ns
        self.watermark = 0  # the view's watermark as last read (never moves back)
        self._held: list[_Held] = []
        self._stalled_since: int | None = None  # wall ns since when held data waits in vain
        self._moved = 0  # the coverage's moved() as last read
        self.early = 0  # releases judged before their grace was out

    @property
    def holding(self) -> int:
        return sum(h.table.num_rows for h in self._held)

    def hold(self, table: pa.Table) -> None:
        """Aligned collectives (``ts_ns`` aligned): held until covered (see the module)."""
        if table.num_rows:
            due = int(pc.max(table.column("ts_ns")).as_py()) + self.grace_ns
            self._held.append(_Held(due, tuple(pc.unique(table.column("job")).to_pylist()), table))

    def release(self, now_ns: int, force: bool = False) -> list[Alert]:
        """Judge the held collectives refined data covers (all with ``force``); sooner, those
        it covers up to their own time, when no straggler alert they fire lacks its cause."""
        wm = self.view.watermark()
        if wm is not None and wm > self.watermark:
            self.watermark = wm
            self._stalled_since = None
        if force:
            return self._judge(list(self._held), now_ns)
        covered = [h for h in self._held if h.due - self.grace_ns <= self.watermark]
        if not covered:
            return []
        jobs = {j for h in covered for j in h.jobs}
        placements = self.stragglers.placements
        reach = self.view.reach({j: placements[j] for j in jobs if j in placements})
        for h in covered:
            if h.due <= self.watermark:
                h.passed_ns = h.passed_ns or now_ns
        passed = [
            h
            for h in covered
            if h.passed_ns
            and (now_ns - h.passed_ns >= NODE_WAIT_NS or _reached(reach, h.jobs, h.due))
        ]
        judged = {id(h) for h in passed}
        early = [h for h in covered
                 if id(h) in judged or _reached(reach, h.jobs, h.due - self.grace_ns)]  # fmt: skip
        if len(early) > len(passed):
            out = self._early(early, now_ns)
            if out is not None:
                return out
        return self._judge(passed, now_ns) if passed else []

    def _early(self, held: list[_Held], now_ns: int) -> list[Alert] | None:
        """Judge ``held`` before their grace is out, if every straggler alert that fires
        names a cause: the episodes on its path are known already, and waiting would only
        delay it (the grace is for a cause whose episode has not opened yet). None (nothing
        judged) otherwise: they wait for the grace."""
        twin = self.stragglers.fork()
        coll = pa.concat_tables([h.table for h in held])
        out = twin.update(coll, self.view.episodes(self.watermark or None), now_ns)
        if any(a.state is AlertState.FIRING and a.cause == NONE_FOUND for a in out):
            return None
        self.stragglers.adopt(twin)
        gone = {id(h) for h in held}
        self._held = [h for h in self._held if id(h) not in gone]
        self.early += 1
        return out

    def _judge(self, held: list[_Held], now_ns: int) -> list[Alert]:
        if not held:
            return []
        gone = {id(h) for h in held}
        self._held = [h for h in self._held if id(h) not in gone]
        coll = pa.concat_tables([h.table for h in held])
        return self.stragglers.update(coll, self.view.episodes(self.watermark or None), now_ns)

    def tick(self, now_ns: int) -> list[Alert]:
        """Release what is covered; judge everything held once refined data has stopped
        (see the module: refined records came since the last tick, or are left to read,
        and it has not); resolve straggler episodes quiet at the watermark."""
        out = self.release(now_ns)
        moved, self._moved = self._moved, self.view.moved()
        if self._held and (self.view.pending() or moved != self._moved):
            self._stalled_since = None
        elif self._held:
            self._stalled_since = self._stalled_since or now_ns
            # before any refined data was read (a worker starting on a backlog takes a
            # while for its first refined group), the refined stream has not begun
            patience = STALL_NS if self.view.seen() else max(STALL_NS, FIRST_DATA_NS)
            if now_ns - self._stalled_since > patience:
                out += self.release(now_ns, force=True)
        if self.watermark:
            out += self.stragglers.tick(self.watermark)
        return out

    def flush(self) -> list[Alert]:
        """At shutdown: judge everything held."""
        return self.release(0, force=True) if self._held else []
