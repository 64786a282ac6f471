"""The worker's dead-letter step: a record can fail only itself, and dead letters have a limit.

A record can fail only itself. The causes known are checked where they arise (an envelope
integer past int64 is rejected by the decoder, a refined message over the output limit is
split or its record dead-lettered), but refining is a lot of code and any bug in it must not
stop a partition: a record whose refining raises would replay after the crash, raise again,
and its raw partition would stop for every node on it until retention deletes the data.

So the refine step (:class:`services.worker.refining.RefineStep`) refines a group of records
at once, and if that
raises for anything but an infrastructure failure (:func:`recoverable`), puts back the state
the group changed (:meth:`RefinerState.snapshot
<services.worker.refiner_state.RefinerState.snapshot>` and ``restore``) and refines its
records one at a time: each one that raises again is dead-lettered whole (``refine_failed``,
or ``output_too_large``, with the exception's class in the detail,
:meth:`services.worker.outcomes.OutputsStep.failed`) and its state changes put back, the others
are refined as they would have been. A single record's content never stops the worker. This
module holds no state of the refiner's.

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

from collections import Counter, deque
from dataclasses import dataclass

from schemas.errors import RefineryError
from services.worker.refiner_outputs import Outcome, RawRecord


def recoverable(e: BaseException) -> bool:
    """Whether refining failed because of what it was given (a bug or an unforeseen input),
    not because the process cannot go on (out of memory, interrupted)."""
    return isinstance(e, Exception) and not isinstance(e, MemoryError)


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
