"""Transport and overlap deduplication."""

from __future__ import annotations

import random
import struct

import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelines.refine.dedupe import OverlapState, SeqOutcome, SeqWindow, drop_overlaps


def test_seq_outcomes() -> None:
    w = SeqWindow(window=8)
    assert w.observe(1, (0, 10)) is SeqOutcome.NEW
    assert w.observe(1, (0, 10)) is SeqOutcome.REPLAY  # same record reprocessed
    assert w.observe(1, (0, 11)) is SeqOutcome.DUPLICATE  # same seq, other position
    assert w.observe(1, (1, 10)) is SeqOutcome.DUPLICATE
    assert w.observe(3, (0, 12)) is SeqOutcome.NEW
    assert w.observe(2, (0, 13)) is SeqOutcome.NEW  # a gap filled late is new
    for s in range(4, 30):
        assert w.observe(s, (0, 100 + s)) is SeqOutcome.NEW
    assert w.observe(5, (0, 999)) is SeqOutcome.STALE
    assert SeqOutcome.STALE.is_duplicate and not SeqOutcome.REPLAY.is_duplicate
    assert len(w.positions) <= 8
    w2 = SeqWindow.from_dict(w.to_dict())
    assert w2.observe(29, (0, 129)) is SeqOutcome.REPLAY


def test_seq_window_memory_is_bounded_with_out_of_order_arrivals() -> None:
    w = SeqWindow(window=64)
    seqs = list(range(10_000))
    rng = random.Random(7)
    for i in range(0, len(seqs), 50):  # shuffle locally
        chunk = seqs[i : i + 50]
        rng.shuffle(chunk)
        seqs[i : i + 50] = chunk
    for s in seqs:
        w.observe(s, (0, s))
        assert len(w.positions) < 2 * 64


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 200), max_size=400), st.integers(1, 24))
def test_seq_window_never_holds_two_windows_in_any_arrival_order(
    seqs: list[int], window: int
) -> None:
    """Whatever the order, late seqs left behind newer ones included, the window keeps fewer
    than ``2 * window`` positions and every seq still in the window."""
    w = SeqWindow(window=window)
    for i, s in enumerate(seqs):
        w.observe(s, (0, i))
        assert len(w.positions) < 2 * window
        assert set(w.positions) >= {x for x in seqs[: i + 1] if x > w.hwm - window}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.booleans(), st.booleans()), max_size=60))
def test_property_declared_duplicates_dropped_distinct_kept(
    ops: list[tuple[int, bool, bool]],
) -> None:
    """Each op delivers seq s from the producer; ``retry`` re-sends it at a new offset
    (a declared duplicate), ``crash`` replays the same offset (not a duplicate)."""
    w = SeqWindow(window=1024)
    first: dict[int, tuple[int, int]] = {}
    offset = 0
    for s, retry, crash in ops:
        offset += 1
        out = w.observe(s, (0, offset))
        if s in first:
            assert out is SeqOutcome.DUPLICATE
        else:
            assert out is SeqOutcome.NEW
            first[s] = (0, offset)
        if retry:
            offset += 1
            assert w.observe(s, (0, offset)) is SeqOutcome.DUPLICATE
        if crash:
            assert w.observe(s, first[s]) is SeqOutcome.REPLAY


def arrays(rows: list[tuple[str, str, int]]) -> tuple[pa.Array, pa.Array, pa.Array]:
    return (
        pa.array([r[0] for r in rows], pa.string()),
        pa.array([r[1] for r in rows], pa.string()),
        pa.array([r[2] for r in rows], pa.int64()),
    )


def test_overlap_first_seen_wins_and_flat_series_kept() -> None:
    a = [("gpu.temp", "gpu0", 1), ("gpu.temp", "gpu0", 2), ("gpu.temp", "gpu1", 2)]
    r1, s1 = drop_overlaps(*arrays(a), "n|A|0", OverlapState())
    assert r1.duplicates == 0
    # B re-publishes the same points plus a new one: the copies go
    b = [*a, ("gpu.temp", "gpu0", 3)]
    r2, s2 = drop_overlaps(*arrays(b), "n|B|0", s1)
    assert r2.keep.to_pylist() == [False, False, False, True]
    assert r2.duplicates == 3
    # A repeating its own timestamps is not an overlap (counters flag it late instead)
    r3, _ = drop_overlaps(*arrays([("gpu.temp", "gpu1", 2)]), "n|A|0", s2)
    assert r3.duplicates == 0
    # flat series: same value at new timestamps is never a duplicate
    r4, _ = drop_overlaps(*arrays([("gpu.temp", "gpu0", 4), ("gpu.temp", "gpu0", 5)]), "n|B|0", s2)
    assert r4.duplicates == 0
    assert len(OverlapState.from_dict(s2.to_dict())) == len(s2)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(st.tuples(st.sampled_from(["m.a", "m.b"]), st.sampled_from(["d0", "d1"])),
                     min_size=1, max_size=4, unique=True),
            st.lists(st.integers(0, 1000), min_size=1, max_size=3, unique=True),
            st.booleans(),
        ),
        max_size=25,
    )
)  # fmt: skip
def test_property_overlap_never_drops_distinct_and_drops_copies(
    steps: list[tuple[list[tuple[str, str]], list[int], bool]],
) -> None:
    """Source A publishes batches of distinct readings; when ``copy`` is set, source B
    re-publishes the same readings right after (a declared duplicate)."""
    state = OverlapState()
    delivered: set[tuple[str, str, int]] = set()
    base = 0
    for series, offsets, copy in steps:
        base += 2000  # timestamps move forward: every A batch holds new readings
        rows = [(m, d, base + o) for m, d in series for o in offsets]
        r, state = drop_overlaps(*arrays(rows), "n|A|0", state)
        assert r.duplicates == 0  # distinct readings are never dropped
        delivered |= set(rows)
        if copy:
            r, state = drop_overlaps(*arrays(rows), "n|B|0", state)
            assert r.duplicates == len(rows)  # every declared copy is dropped
    assert len(state) <= 4 * 3  # per series: one batch's points, never history


def test_overlap_state_round_trips_as_one_table() -> None:
    a = [("gpu.temp", "gpu0", 1), ("gpu.temp", "gpu1", 1)]
    _, s1 = drop_overlaps(*arrays(a), "n|A|0", OverlapState())
    _, s2 = drop_overlaps(*arrays([("gpu.temp", "gpu0", 9)]), "n|B|0", s1)
    whole = s2.table
    assert whole.num_rows == 3 and set(whole.column("src").to_pylist()) == {"n|A|0", "n|B|0"}
    back = OverlapState(whole)  # type: ignore[arg-type]
    r, _ = drop_overlaps(*arrays([("gpu.temp", "gpu1", 1)]), "n|B|0", back)
    assert r.duplicates == 1


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 90), st.integers(0, 3), st.booleans()), min_size=1, max_size=200
    ),
    st.integers(1, 16),
)
def test_the_packed_window_is_always_its_positions_in_order(
    steps: list[tuple[int, int, bool]], window: int
) -> None:
    """Packed between observations (only what changed packed anew) or not at all, the bytes
    are those of the positions in dict order, through prunes, replays and stale seqs."""
    w = SeqWindow(window=window)
    for i, (seq, partition, pack_now) in enumerate(steps):
        w.observe(seq, (partition, 1000 + i))
        if pack_now:
            want = b"".join(struct.pack("<3q", s, p, o) for s, (p, o) in w.positions.items())
            assert w.packed() == want
    assert w.packed() == b"".join(struct.pack("<3q", s, *po) for s, po in w.positions.items())


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["n|A|0", "n|B|0"]),
            st.lists(st.tuples(st.sampled_from(["m.a", "m.b"]), st.sampled_from(["d0", "d1"])),
                     min_size=1, max_size=4, unique=True),
            st.lists(st.integers(0, 3), min_size=1, max_size=2, unique=True),
            st.booleans(),
        ),
        max_size=25,
    )
)  # fmt: skip
def test_property_a_known_layout_generation_changes_no_result(
    steps: list[tuple[str, list[tuple[str, str]], list[int], bool]],
) -> None:
    """Batches of two sources whose series come and go and whose timestamps collide: passing
    each batch's layout generation (the same for the same metric and device columns, as
    validation gives it; or none, as for a batch some of whose rows were rejected) gives
    the same keep masks, counts and states as comparing the columns every time."""
    gens: dict[tuple[tuple[str, ...], tuple[str, ...]], int] = {}
    plain, fast = OverlapState(), OverlapState()
    for k, (source, series, offsets, known) in enumerate(steps):
        rows = [(m, d, 1000 * (k // 2) + o) for m, d in series for o in offsets]
        cols = (tuple(r[0] for r in rows), tuple(r[1] for r in rows))
        gen = gens.setdefault(cols, len(gens) + 1) if known else None
        ra, plain = drop_overlaps(*arrays(rows), source, plain)
        rb, fast = drop_overlaps(*arrays(rows), source, fast, gen)
        assert ra.keep.equals(rb.keep) and ra.duplicates == rb.duplicates
        assert plain.sources.keys() == fast.sources.keys()
        for s in plain.sources:
            assert plain.sources[s].equals(fast.sources[s]), s


# -- identity, not window position -------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 3000), min_size=1, max_size=300, unique=True),
    st.lists(st.integers(0, 299), max_size=200),
    st.randoms(use_true_random=False),
    st.integers(1, 32),
)
def test_property_any_delivery_order_makes_each_seq_new_exactly_once(
    seqs: list[int], resend: list[int], rng: random.Random, window: int
) -> None:
    """Deliveries of distinct seqs plus re-sends of some of them, in any order and however
    far behind the high-water mark: each seq is NEW exactly once, every other delivery of
    it a duplicate (a re-send) or a replay (the same position again)."""
    deliveries = [(s, i) for i, s in enumerate(seqs)]
    deliveries += [(seqs[r % len(seqs)], 10_000 + k) for k, r in enumerate(resend)]
    rng.shuffle(deliveries)
    w = SeqWindow(window=window)
    new: dict[int, int] = {}
    for s, offset in deliveries:
        out = w.observe(s, (0, offset))
        if out is SeqOutcome.NEW:
            new[s] = new.get(s, 0) + 1
        else:
            assert out.is_duplicate, (s, out)
        assert len(w.positions) < 2 * window
    assert new == dict.fromkeys(seqs, 1)
    assert len(w.lo) == len(w.hi) <= len(seqs) and w.forgotten == 0
    assert all(a <= b < c - 1 for a, b, c in zip(w.lo, w.hi, w.lo[1:], strict=False))


def test_a_first_delivery_far_behind_the_mark_is_new() -> None:
    """An exporter re-queues a timed-out batch behind thousands of newer ones: still new."""
    w = SeqWindow(window=512)
    for s in range(10_000):
        if s != 17:
            assert w.observe(s, (0, s)) is SeqOutcome.NEW
    assert w.runs == [(0, 16), (18, 9_999)]
    assert w.observe(17, (1, 5)) is SeqOutcome.NEW
    assert w.runs == [(0, 9_999)]
    assert w.observe(17, (1, 6)) is SeqOutcome.STALE  # its re-send: a duplicate
    assert len(w.positions) <= 512


def test_gaps_past_max_runs_are_given_up_counted() -> None:
    w = SeqWindow(window=8, max_runs=4)
    for s in range(0, 20, 2):  # every other seq lost: a gap after each
        w.observe(s, (0, s))
    assert len(w.lo) == 4
    assert w.forgotten == 6  # seqs 1, 3, ..., 11 given up as seen
    assert SeqWindow.forgotten_total >= 6
    assert w.observe(1, (0, 99)).is_duplicate
    assert w.observe(17, (0, 99)) is SeqOutcome.NEW  # a gap still kept


def test_discard_undoes_a_new_seq() -> None:
    w = SeqWindow(window=8)
    for s in (1, 2, 3):
        w.observe(s, (0, s))
    before = w.hwm
    assert w.observe(4, (0, 4)) is SeqOutcome.NEW
    w.discard(4, before)
    assert w.observe(4, (0, 4)) is SeqOutcome.NEW  # not a replay: it was never refined
    w.discard(2, w.hwm)
    assert w.runs == [(1, 1), (3, 4)] and 2 not in w.positions
    assert w.observe(2, (0, 2)) is SeqOutcome.NEW
    assert w.packed() == b"".join(struct.pack("<3q", s, *p) for s, p in w.positions.items())


def test_runs_round_trip_and_older_state_counts_below_the_window_as_seen() -> None:
    w = SeqWindow(window=4)
    for s in (0, 1, 2, 5, 9):
        w.observe(s, (0, s))
    back = SeqWindow.from_dict(w.to_dict())
    assert (back.runs, back.positions, back.hwm) == (w.runs, w.positions, w.hwm)
    # written before runs were kept: the window's positions and hwm only
    old = SeqWindow.restore({"window": 4, "hwm": 9}, {6: (0, 6), 9: (0, 9)})
    assert old.runs == [(0, 6), (9, 9)]
    assert old.observe(3, (0, 3)) is SeqOutcome.STALE  # as the older worker judged it
    assert old.observe(7, (0, 7)) is SeqOutcome.NEW
