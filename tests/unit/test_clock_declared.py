"""Producers without exchanges whose topic declares how long their rows wait (Telegraf's
flush, the Collector's batch processor): every row inside its bound, and no clock_offset
claimed from their send delay (ClockEstimator._declared)."""

from __future__ import annotations

import random

import pytest

from pipelines.refine.clock import ClockEstimator, DeclaredTiming

T0 = 1_700_000_000_000_000_000
S = 1_000_000_000
MS = 1_000_000


def _run(
    offset: int, delays: list[int], declared: int | None, every: int = 10 * S
) -> list[tuple[int, int, bool | None]]:
    """(|aligned - true| of the batch's newest row, its bound, the alert claim) per batch
    of a source ``offset`` ahead whose batches wait ``delays`` from their newest stamp to
    their append."""
    est = ClockEstimator()
    out = []
    for i, d in enumerate(delays):
        stamp = T0 + i * every  # true time of the newest row
        sent = stamp + offset  # ingest formats: sent_ns is the newest row's stamp
        append = (stamp + d) // MS * MS
        e = est.observe(sent, append, None, 0, DeclaredTiming(declared) if declared else None)
        out.append((abs(sent - e.offset_at(sent) - stamp), e.error_at(sent), e.alert_claim()))
    return out


@pytest.mark.parametrize("offset", [0, 40 * MS, -3 * S])
def test_a_stock_telegraf_flushing_seven_seconds_late_is_inside_its_bound(offset: int) -> None:
    """Telegraf stamps at collection and sends at its flush, 6.99-7.03 s later: read as a
    clock offset with a few ms of bound before; declared (12 s), every row is inside."""
    rng = random.Random(7)
    delays = [7 * S + rng.randrange(-10 * MS, 30 * MS) for _ in range(60)]
    rows = _run(offset, delays, 12 * S)
    assert all(err <= bound for err, bound, _ in rows)
    assert not any(claim for _, _, claim in rows)  # no clock_offset from a send delay
    undeclared = _run(offset, delays, None)
    assert sum(err > bound for err, bound, _ in undeclared) > len(undeclared) // 2


def test_flush_jitter_and_a_flush_of_old_rows_stay_inside() -> None:
    """interval 1 s, flush 5 s with 2 s of jitter; then a buffer flushed after an outage
    (rows 40 s old, more than declared): the bound spans both, every row inside."""
    rng = random.Random(11)
    delays = [rng.randrange(0, 7 * S) for _ in range(40)] + [40 * S, 39 * S] + [2 * S] * 5
    rows = _run(0, delays, 9 * S, every=S)
    within = [err <= bound for err, bound, _ in rows]
    assert all(within[:40]) and all(within[42:])
    assert not any(claim for _, _, claim in rows)


def test_a_collector_batching_for_200_ms_is_placed_close_and_bounded() -> None:
    """The Collector's rows reach the broker 16-200 ms after their newest stamp: declared
    1 s, the point stays near the least delay seen and the bound holds the truth."""
    rng = random.Random(3)
    rows = _run(5 * MS, [rng.randrange(16 * MS, 200 * MS) for _ in range(30)], S, every=S)
    assert all(err <= bound for err, bound, _ in rows)
    assert max(err for err, _, _ in rows[5:]) < 60 * MS
    assert all(bound <= S + 2 * MS for _, bound, _ in rows)


def test_a_clock_proven_off_by_more_than_the_threshold_is_still_claimed() -> None:
    """A host 30 s ahead: even a 12 s declared delay proves it beyond 1 s."""
    rows = _run(30 * S, [7 * S] * 10, 12 * S)
    assert rows[-1][2] is True and all(err <= bound for err, bound, _ in rows)
