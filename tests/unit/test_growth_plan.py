"""The pure parts of ``refinery worker grow`` (services.worker.growth_plan): where keys go,
what the re-keying writes, in which order the old partitions' records are refined, when the
producers have moved, and what the worker's preflight says."""

from __future__ import annotations

import zlib
from typing import Any

import pytest

from services.worker.growth_plan import (
    GrowthMarker,
    SettleWatch,
    Write,
    grown_from,
    home_of,
    judge,
    murmur2,
    partition_of,
    phase_of,
    rekey,
)


@pytest.mark.parametrize(
    ("text", "want"),
    [  # Kafka's own vectors (clients/src/test/.../UtilsTest.testMurmur2)
        ("21", -973932308),
        ("foobar", -790332482),
        ("a-little-bit-long-string", -985981536),
        ("a-little-bit-longer-string", -1486304829),
        ("lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8", -58897971),
        ("abc", 479470107),
    ],
)
def test_murmur2_is_kafkas(text: str, want: int) -> None:
    assert murmur2(text.encode()) == want


def test_a_key_goes_where_the_producers_partitioner_sends_it() -> None:
    key = b"node0002"
    assert partition_of(key, 16) == zlib.crc32(key) % 16  # librdkafka's consistent_random
    assert partition_of(key, 16, "murmur2_random") == (murmur2(key) & 0x7FFFFFFF) % 16
    # doubling: a key stays or moves to its partition + the old count
    for n in (8, 16):
        for i in range(200):
            k = f"node{i:04d}".encode()
            assert partition_of(k, 2 * n) in {partition_of(k, n), partition_of(k, n) + n}


def test_a_streams_state_lives_with_its_node() -> None:
    assert home_of(b"node0002|node|0", 16) == home_of(b"node0002", 16) == 15


def _copies(n: int, keys: list[bytes]) -> dict[bytes, dict[int, bytes]]:
    return {k: {home_of(k, n): b"v-" + k} for k in keys}


def _apply(copies: dict[bytes, dict[int, bytes]], plan: Any) -> dict[bytes, dict[int, bytes]]:
    """The live copies once ``plan`` is written and its partitions truncated."""
    after = {k: {p: v for p, v in c.items() if p not in plan.truncate} for k, c in copies.items()}
    for w in plan.writes:
        after.setdefault(w.key, {})[w.partition] = w.value
    return {k: c for k, c in after.items() if c}


def test_rekeying_leaves_one_copy_of_each_key_at_its_home_and_is_idempotent() -> None:
    keys = [f"node{i:04d}|node|0".encode() for i in range(40)] + [b"node0003"]
    copies = _copies(8, keys)
    plan = rekey(copies, 8, 16, "consistent_random")
    moving = [k for k in keys if home_of(k, 8) != home_of(k, 16)]
    assert moving and plan.moved == len(moving) and plan.unplaced == 0
    # the partitions keys left are rewritten whole: no tombstone (module docstring)
    assert plan.truncate == {home_of(k, 8) for k in moving}
    rewritten = {k for k in keys if home_of(k, 16) in plan.truncate}
    assert {w.key for w in plan.writes} == set(moving) | rewritten
    after = _apply(copies, plan)
    assert after == {k: {home_of(k, 16): b"v-" + k} for k in keys}
    again = rekey(after, 8, 16, "consistent_random")
    assert again.writes == [] and again.truncate == set()


def test_refined_state_wins_and_a_half_done_run_keeps_the_copy_at_the_new_home() -> None:
    k = b"node0002|node|0"  # home 7 with 8 partitions, 15 with 16
    plan = rekey({k: {7: b"old"}}, 8, 16, "consistent_random", {k: b"refined"})
    assert plan.writes == [Write(15, k, b"refined")] and plan.truncate == {7}
    # cut short after writing the new home: that copy is the state, the old one goes
    plan = rekey({k: {7: b"old", 15: b"new"}}, 8, 16, "consistent_random")
    assert plan.writes == [] and plan.truncate == {7} and plan.moved == 0
    # a keyless source's state was nowhere near its node's home
    plan = rekey({k: {2: b"x"}}, 8, 16, "consistent_random")
    assert plan.unplaced == 1 and plan.writes == [Write(15, k, b"x")] and plan.truncate == {2}


def test_records_that_moved_onto_an_old_partition_wait_for_their_sources_old_home() -> None:
    k = b"node0002"  # 7 of 8, 2 of 12
    assert phase_of(7, k, 8, "consistent_random") == 0  # before the raise, on its old home
    assert phase_of(2, k, 8, "consistent_random") == 1  # after it, on an old partition
    assert phase_of(2, None, 8, "consistent_random") == 0


def test_settled_once_every_moving_node_arrived_and_nothing_went_astray_for_a_while() -> None:
    a, b = b"node0002", b"node0003"  # 7 -> 15, 1 -> 9
    w = SettleWatch({a, b}, 16, "consistent_random", quiet_s=5.0, t0=0.0)
    w.see(7, a, 1.0)  # still sent to its old partition
    w.see(15, a, 2.0)
    assert not w.settled(10.0)  # b not seen on its new partition
    w.see(9, b, 11.0)
    assert w.quiet(11.0) and w.settled(11.0)
    w.see(1, b, 12.0)  # a record queued before the metadata refresh lands late
    assert not w.settled(16.0) and w.settled(17.0) and w.misplaced == 2
    w.see(3, None, 18.0)  # keyless: says nothing
    assert w.settled(18.0)


def test_the_preflight_refuses_a_growth_made_by_hand_or_unfinished_naming_the_procedure() -> None:
    raw, cl = "telemetry.raw", "w-refine-streams-changelog"
    assert judge(raw, 8, cl, 8, None) is None
    by_hand = judge(raw, 16, cl, 8, None)
    assert by_hand is not None and "refinery worker grow --partitions 16" in by_hand
    assert "\n" not in by_hand and "new --app-id" in by_hand
    started = GrowthMarker(8, 16, "consistent_random", "started")
    unfinished = judge(raw, 16, cl, 16, started)
    assert unfinished is not None and "not finished" in unfinished
    done = GrowthMarker(8, 16, "consistent_random", "done")
    assert judge(raw, 16, cl, 16, done) is None
    later = judge(raw, 32, cl, 32, done)  # both raised by hand after a growth
    assert later is not None and "keyed for 16" in later
    assert GrowthMarker.decode(done.encode()) == done


def test_a_resumed_growth_starts_from_the_count_its_marker_kept() -> None:
    # the first run raised the state topics to 16 before it was cut short: the state is
    # still keyed for 8, and the records left on partitions 0-7 are refined as such
    started = GrowthMarker(8, 16, "consistent_random", "started")
    assert grown_from(started, 16, 16, "consistent_random") == 8
    assert grown_from(None, 8, 16, "consistent_random") == 8
    assert grown_from(GrowthMarker(8, 16, "consistent_random", "done"), 16, 32,
                      "consistent_random") == 16  # fmt: skip
    for want, how in ((32, "consistent_random"), (16, "murmur2_random")):
        with pytest.raises(ValueError, match="--partitions 16 --partitioner consistent_random"):
            grown_from(started, 16, want, how)  # type: ignore[arg-type]
