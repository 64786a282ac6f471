"""Dead letters have a limit: an agent whose recent records are mostly dead-lettered (a bad
deploy, not bad input) stops with one line instead of dead-lettering on; a record rejected
now and then, or one broken source among many, never trips it."""

from __future__ import annotations

import pytest

from services.worker.guard import DeadLetterLimit, DeadLetterLimitExceeded, DeadLetterStep
from services.worker.refiner import Outcome, RawRecord
from tests.unit.test_guard import _rec, _refiner
from tests.unit.test_refine import NOW, S

REC = RawRecord("telemetry.raw", 3, 41, b"n1", b"", [], 0)


def _out(
    outcome: str, n: int = 10, quarantined: int = 0, reason: str = "unknown_metric"
) -> Outcome:
    if outcome == "deadletter":
        return Outcome([], "deadletter", n, 0, 0, n, {reason: 1}, None, None, None)
    reasons = {reason: quarantined} if quarantined else {}
    return Outcome([], outcome, n, n - quarantined, 0, quarantined, reasons, None, None, None)


def _feed(step: DeadLetterStep, outcomes: list[Outcome]) -> int:
    """How many outcomes the step took before it raised (all: it never did)."""
    for i, out in enumerate(outcomes):
        try:
            step.submit(out, REC)
        except DeadLetterLimitExceeded:
            return i
    return len(outcomes)


def test_more_than_the_share_of_a_full_window_stops() -> None:
    step = DeadLetterStep(DeadLetterLimit(share=0.5, records=10))
    # half of a full window is not more than half; the next dead letter is
    assert _feed(step, [_out("refined"), _out("deadletter")] * 5) == 10
    with pytest.raises(DeadLetterLimitExceeded) as e:
        step.submit(_out("deadletter", reason="undecodable"), REC)
    line = str(e.value)
    assert "\n" not in line and line.startswith("6 of the last 10 records were dead-lettered (60%")
    assert "unknown_metric 5, undecodable 1" in line and "telemetry.raw[3]@41" in line
    assert "--max-deadletter-share" in line


def test_a_window_not_yet_full_never_stops() -> None:
    step = DeadLetterStep(DeadLetterLimit(share=0.5, records=1000))
    assert _feed(step, [_out("deadletter")] * 999) == 999
    assert _feed(step, [_out("deadletter")]) == 0  # the 1000th: 100 % of a full window


def test_old_dead_letters_leave_the_window() -> None:
    """A burst of bad records long ago (a broker-side hiccup, a source resent its backlog)
    counts no more once a window of good records has come after it."""
    step = DeadLetterStep(DeadLetterLimit(share=0.5, records=100))
    assert _feed(step, [_out("deadletter")] * 50 + [_out("refined")] * 50) == 100
    assert _feed(step, [_out("refined")] * 100 + [_out("deadletter")] * 50) == 150
    assert _feed(step, [_out("deadletter")]) == 0


def test_what_counts_as_dead_lettered() -> None:
    """Whole records rejected, and records whose every sample was quarantined; a record with
    some rows quarantined was refined. Duplicates count as good, replays not at all."""
    step = DeadLetterStep(DeadLetterLimit(share=0.5, records=4))
    every_sample = _out("refined", n=10, quarantined=10)
    some = _out("refined", n=10, quarantined=9)
    dup = Outcome([], "duplicate", 10, 0, 10, 0, {}, None, None, None)
    replay = Outcome([], "replay", 10, 0, 0, 0, {}, None, None, None)
    assert _feed(step, [some, dup, every_sample, replay, replay, every_sample]) == 6
    assert _feed(step, [every_sample]) == 0  # 3 of the last 4


def test_a_share_of_one_never_stops() -> None:
    step = DeadLetterStep(DeadLetterLimit(share=1.0, records=10))
    assert _feed(step, [_out("deadletter")] * 100) == 100


@pytest.mark.parametrize(("share", "records"), [(0.0, 10), (1.5, 10), (0.5, 0)])
def test_a_limit_that_means_nothing_is_refused(share: float, records: int) -> None:
    with pytest.raises(ValueError, match="share must be"):
        DeadLetterLimit(share, records)


def test_via_the_refiner_poison_past_the_limit_stops_and_sparse_poison_does_not() -> None:
    """The refiner's own outcomes (``test_guard``'s lenient decoder lets poison through to
    refining, which raises and dead-letters the record): one bad record in four flows; a
    source gone bad for most records stops at the record that takes the share past the limit."""
    limit = DeadLetterLimit(share=0.5, records=8)
    sparse = [_rec(i, 10 + i, exporter="bmc", poison=i % 4 == 0) for i in range(1, 25)]
    step = DeadLetterStep(limit)
    outs = _refiner().process_group(sparse, NOW + 60 * S)
    assert [o.outcome for o in outs].count("deadletter") == 6
    for rec, out in zip(sparse, outs, strict=True):
        step.submit(out, rec)  # never raises
    bad = [_rec(i, 10 + i, exporter="bmc", poison=i > 4) for i in range(1, 25)]
    step = DeadLetterStep(limit)
    stopped_at = None
    for rec, out in zip(bad, _refiner().process_group(bad, NOW + 60 * S), strict=True):
        try:
            step.submit(out, rec)
        except DeadLetterLimitExceeded as e:
            stopped_at = rec.offset
            assert "refine_failed 5" in str(e) and f"telemetry.raw[0]@{rec.offset}" in str(e)
            break
    # records 1-4 good, 5 on bad: the window of 8 first holds more than 4 bad at the 9th
    assert stopped_at == 10 + 9


def test_the_docstring_example_runs() -> None:
    import doctest

    import services.worker.guard

    assert doctest.testmod(services.worker.guard).failed == 0
