"""The worker reports a group's telemetry summed once per group: the same totals, histogram
counts and last clock offsets and error bounds as one report per record would give, and the
records whose clock bound was widened, by why."""

from __future__ import annotations

from pipelines.refine.clock import ClockEstimate
from services.telemetry import ServiceTelemetry
from services.worker.refiner import Outcome, RawRecord
from services.worker.tally import GroupTally


def _rec(offset: int, topic: str = "telemetry.raw") -> RawRecord:
    return RawRecord(topic, 0, offset, b"k", b"", [], 0)


def _out(
    outcome: str,
    n: int,
    refined: int,
    dup: int,
    quarantined: int,
    reasons: dict[str, int] | None = None,
    stream: str | None = None,
    offset: int | None = None,
    fresh: int | None = None,
    error: int | None = None,
    widened: str | None = None,
) -> Outcome:
    clock = None
    if offset is not None and error is not None:
        clock = ClockEstimate(offset, 0, 0.0, error, 16, True, widened=widened)
    return Outcome(
        [], outcome, n, refined, dup, quarantined, reasons or {}, stream, offset, fresh, clock
    )


def test_a_group_is_reported_as_its_records_sum() -> None:
    group = [
        (_out("refined", 600, 590, 4, 6, stream="n1|gpu|0", offset=5, fresh=800_000_000,
              error=40_000_000, widened="delay_trend"), _rec(0)),
        (_out("refined", 400, 400, 0, 0, stream="n1|gpu|0", offset=7, fresh=200_000_000,
              error=45_000_000, widened="delay_trend"), _rec(1)),
        (_out("refined", 10, 10, 0, 0, stream="n3|host|0", offset=1, error=31_000_000,
              widened="step_down"), _rec(5)),
        (_out("duplicate", 50, 0, 50, 0, stream="n2|nic|0", offset=-3), _rec(2)),
        (_out("deadletter", 0, 0, 0, 0, reasons={"undecodable": 1}), _rec(3)),
        (_out("deadletter", 0, 0, 0, 0, reasons={"bad_envelope": 1}), _rec(4, "telemetry.events")),
    ]  # fmt: skip
    t = ServiceTelemetry("test")
    tally = GroupTally()
    for out, rec in group:
        tally.add(out, rec)
    assert t.snapshot() == {}  # nothing is reported before the group ends
    tally.report(t)
    assert t.total("refinery.records") == 6
    assert t.total("refinery.records", outcome="refined", topic="telemetry.raw") == 3
    assert t.total("refinery.records", outcome="deadletter", topic="telemetry.events") == 1
    assert t.total("refinery.samples.in") == 1060
    assert t.total("refinery.samples.refined") == 1000
    assert t.total("refinery.samples.duplicate") == 54
    assert t.total("refinery.samples.quarantined") == 6
    assert t.total("refinery.deadletter", reason="undecodable") == 1
    assert t.total("refinery.deadletter", reason="bad_envelope") == 1
    snap = t.snapshot()
    (batch,) = snap["refinery.batch.samples"]
    assert batch["value"]["count"] == 6 and batch["value"]["sum"] == 1060
    (fresh,) = snap["refinery.freshness"]
    assert fresh["value"]["count"] == 2 and abs(fresh["value"]["sum"] - 1.0) < 1e-9
    offsets = {r["attributes"]["source"]: r["value"] for r in snap["refinery.clock.offset_ns"]}
    assert offsets == {"n1|gpu|0": 7, "n3|host|0": 1, "n2|nic|0": -3}  # each stream's last
    errors = {r["attributes"]["source"]: r["value"] for r in snap["refinery.clock.error_ns"]}
    assert errors == {"n1|gpu|0": 45_000_000, "n3|host|0": 31_000_000}
    assert t.total("refinery.clock.widened", why="delay_trend") == 2
    assert t.total("refinery.clock.widened", why="step_down") == 1
    assert t.total("refinery.clock.widened") == 3
