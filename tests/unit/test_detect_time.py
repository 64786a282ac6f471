"""Detect judges data time by the watermark every refined partition has reached: a partition
read ahead (a backlog, a restart's warm-up) neither closes another's episodes nor judges
stragglers before the congestion on their path is known. Episode records carry their peaks
from the first one; two episodes of one entity never share an id."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from pipelines.detect.episodes import EpisodeSettings, EpisodeTracker
from schemas.catalog import default_catalog
from schemas.records import Episode
from services.detect.core import low_watermark
from services.detect.detector import Detector, Emitted
from tests.unit.derived_helpers import T0, S, batches, refined, series
from tests.unit.test_stragglers import PLACEMENT, Topo, collectives

ENR = {"leaf": "leaf-p0-r3", "leaf_port": "2", "nic": "mlx5_3", "job": "j1"}


def storm_rows(seconds: int, calm: int = 0, node: str = "n2") -> list[dict[str, Any]]:
    pause = [1.2e5] * seconds + [5.0] * calm
    return series(node, "mlx5_3/1/prio3", "nic.rx_prio_pause", pause, field="rate", **ENR)


def other_node(t0_s: int, seconds: int, node: str = "n0") -> list[pa.Table]:
    """A clean node whose partition was read far ahead."""
    temps = [60.0 + i % 3 for i in range(seconds)]
    rows = series(node, "gpu0", "gpu.temp", temps, t0=T0 + t0_s * S)
    return [t for _, t in batches(rows)]


def test_a_partition_read_ahead_does_not_close_another_partitions_episode() -> None:
    d = Detector(default_catalog())
    out = Emitted()
    for now, t in batches(storm_rows(10)):
        out.extend(d.on_refined(t, now))
        out.extend(d.advance(int(t.column("ts")[0].as_py()), now))
    for t in other_node(100, 5):  # 90 s ahead of the storm's partition, which is behind
        out.extend(d.on_refined(t, T0))
        out.extend(d.tick(T0))
    assert [e.state.value for e in out.episodes] == ["firing"]
    rest = [t for _, t in batches(storm_rows(20, calm=45))][10:]
    for t in rest:  # the storm's partition catches up: one episode, closed once
        out.extend(d.on_refined(t, T0))
        out.extend(d.advance(int(t.column("ts")[0].as_py()), T0))
    out.extend(d.tick(T0))
    eps = out.episodes
    assert [e.state.value for e in eps] == ["firing", "resolved"]
    assert eps[0].id == eps[1].id and eps[1].end_ns == T0 + 19 * S


def test_stragglers_wait_for_the_congestion_on_their_path() -> None:
    d = Detector(default_catalog(), topology=Topo())
    d.set_jobs([PLACEMENT])
    out = Emitted()
    # collectives of 0-9 s arrive first; rank 11 (n2, gpu3 → leaf-p0-r3 port 2) is late
    for t in collectives(range(10)):
        out.extend(d.on_collectives(t, T0))
    for t in other_node(0, 30):  # another partition's refined data is far ahead already
        out.extend(d.on_refined(t, T0))
    assert out.alerts == []
    for now, t in batches(storm_rows(20)):  # the storm's partition, behind until now
        out.extend(d.on_refined(t, now))
        out.extend(d.advance(int(t.column("ts")[0].as_py()), now))
    (a,) = out.alerts
    assert a.rule == "nccl_straggler" and a.cause is not None
    assert a.cause.startswith("PFC storm on leaf-p0-r3 port 2"), a.cause


def test_a_straggler_whose_cause_is_open_is_judged_before_the_grace_is_out() -> None:
    """The grace waits for a cause whose episode has not opened yet. Once refined data covers
    the collectives' own time and the congestion on the late rank's path is open, the
    straggler fires then; with no episode on its path it waits the grace out and says so."""
    fired: dict[bool, tuple[int, str | None]] = {}
    for storm in (True, False):
        d = Detector(default_catalog(), topology=Topo(), grace_ns=3 * S)
        d.set_jobs([PLACEMENT])
        for t in collectives(range(3)):  # the newest at 2 s (+ skews)
            assert d.on_collectives(t, T0).alerts == []
        pause = [1.2e5 if storm else 5.0] * 10
        rows = series("n2", "mlx5_3/1/prio3", "nic.rx_prio_pause", pause, field="rate", **ENR)
        for now, t in batches(rows):
            d.on_refined(t, now)
            wm = int(t.column("ts")[0].as_py())
            alerts = d.advance(wm, now).alerts
            if alerts and storm not in fired:
                (a,) = alerts
                assert a.rule == "nccl_straggler"
                fired[storm] = (wm - T0, a.cause)
    assert fired[True][0] == 3 * S  # the first watermark past the newest collective
    assert (fired[True][1] or "").startswith("PFC storm on leaf-p0-r3 port 2"), fired[True]
    assert fired[False] == (6 * S, "none found")  # the newest + the 3 s grace


def test_held_collectives_are_forced_out_only_when_the_watermark_stalls() -> None:
    d = Detector(default_catalog(), topology=Topo(), grace_ns=3 * S)
    d.set_jobs([PLACEMENT])
    for t in collectives(range(3, 6)):
        d.on_collectives(t, T0)
    wall = T0
    for k in range(20):  # refined data keeps coming, 4 s behind the collectives
        wall += S
        d.advance(T0 + k * S // 10, wall)
        assert d.tick(wall).alerts == []
    assert d.tick(wall + 59 * S).alerts == []  # then refined data stops: 59 s is patience
    (a,) = d.tick(wall + 61 * S).alerts  # a minute: judged anyway, with what is known
    assert a.rule == "nccl_straggler" and a.cause == "none found"


def test_held_collectives_wait_while_refined_data_comes_without_moving_the_watermark() -> None:
    """A worker started on a backlog refines one partition after another: for longer than the
    stall patience the watermark stands (a partition is still behind) while refined data of
    the others keeps coming. The collectives wait, and their straggler names its cause."""
    d = Detector(default_catalog(), topology=Topo(), grace_ns=3 * S)
    d.set_jobs([PLACEMENT])
    out = Emitted()
    for t in collectives(range(10)):
        out.extend(d.on_collectives(t, T0))
    wall = T0
    for t in other_node(0, 30):  # 30 s of wall time: another partition's backlog is refined
        wall += S
        out.extend(d.on_refined(t, wall))
        out.extend(d.tick(wall))
    assert out.alerts == []
    for _, t in batches(storm_rows(20)):  # the storm's partition is refined at last
        wall += S
        out.extend(d.on_refined(t, wall))
        out.extend(d.advance(int(t.column("ts")[0].as_py()), wall))
        out.extend(d.tick(wall))
    (a,) = out.alerts
    assert a.rule == "nccl_straggler" and a.cause is not None
    assert a.cause.startswith("PFC storm on leaf-p0-r3 port 2"), a.cause


def test_held_collectives_wait_longer_for_the_first_refined_data() -> None:
    """A worker starting on a backlog publishes aligned collectives before its first refined
    group: detect has seen no refined data yet, so the stall patience is not its measure."""
    d = Detector(default_catalog(), topology=Topo(), grace_ns=3 * S)
    d.set_jobs([PLACEMENT])
    out = Emitted()
    for t in collectives(range(10)):
        out.extend(d.on_collectives(t, T0))
    out.extend(d.tick(T0))
    out.extend(d.tick(T0 + 60 * S))  # a minute without any refined data: still waiting
    assert out.alerts == []
    wall = T0 + 60 * S
    for _, t in batches(storm_rows(20)):
        wall += S
        out.extend(d.on_refined(t, wall))
        out.extend(d.advance(int(t.column("ts")[0].as_py()), wall))
        out.extend(d.tick(wall))
    (a,) = out.alerts
    assert a.cause is not None and a.cause.startswith("PFC storm on leaf-p0-r3 port 2"), a.cause
    d2 = Detector(default_catalog(), topology=Topo(), grace_ns=3 * S)
    d2.set_jobs([PLACEMENT])
    for t in collectives(range(10)):
        d2.on_collectives(t, T0)
    d2.tick(T0)
    (b,) = d2.tick(T0 + 121 * S).alerts  # no refined data for two minutes: judged anyway
    assert b.cause == "none found"


def test_low_watermark_is_the_slowest_partition_with_records_left() -> None:
    assert low_watermark({}, {}, {}) is None
    assert low_watermark({0: 0, 1: 0}, {0: 0, 1: -1}, {}) is None  # 1 not fetched yet
    assert low_watermark({0: 0, 1: 4}, {0: 0, 1: 4}, {1: 7}) == 7  # 0 is empty
    assert low_watermark({0: 2, 1: 4, 2: 3}, {0: 9, 1: 9, 2: 3}, {0: 5, 1: 3, 2: 99}) == 3


def test_firing_records_carry_the_first_batch_peaks() -> None:
    tr = EpisodeTracker()
    rows = storm_rows(3)
    rows += series("n3", "gpu5", "gpu.clock_event_reasons", [float(0x84)] * 3, job="j7")
    fired: list[Episode] = []
    for now, t in batches(rows):
        fired += tr.update(t, now)
    cong, thr = sorted(fired, key=lambda e: e.kind)
    assert cong.peak["nic.rx_prio_pause"] == 1.2e5 and cong.nodes == ["n2"]
    assert cong.cause_hint is not None and cong.cause_hint.startswith("PFC storm")
    assert thr.peak["gpu.clock_event_reasons"] == 0x84
    assert thr.cause_hint is not None and thr.cause_hint.startswith("power throttling")


def test_two_episodes_of_one_entity_in_one_id_bucket_have_two_ids() -> None:
    base = (T0 // (60 * S) + 1) * 60 * S  # the start of a minute
    pause = [1e5] * 5 + [0.0] * 10 + [1e5] * 5 + [0.0] * 20
    rows = series("n1", "mlx5_1/1/prio3", "nic.rx_prio_pause", pause, t0=base, field="rate")
    tr = EpisodeTracker(EpisodeSettings(quiet_ns=5 * S))
    out: list[Episode] = []
    for now, t in batches(rows):
        out += tr.update(t, now)
    assert [e.state.value for e in out] == ["firing", "resolved", "firing", "resolved"]
    assert out[0].id == out[1].id != out[2].id == out[3].id
    again = EpisodeTracker(EpisodeSettings(quiet_ns=5 * S))  # a replay: the same ids
    replay = [e for now, t in batches(rows) for e in again.update(t, now)]
    assert [e.id for e in replay] == [e.id for e in out]


def test_an_empty_batch_changes_nothing() -> None:
    d = Detector(default_catalog())
    assert d.on_refined(refined([]), T0) == Emitted()
    assert d.advance(0, T0) == Emitted() and d.tick(T0) == Emitted()


def test_held_collectives_wait_while_refined_records_are_left_to_read() -> None:
    """On a busy host detect may read no refined record for longer than the stall patience
    while the broker holds refined records it has not read: those are coming, so held
    collectives wait for them, and the straggler names its cause; once none is left and the
    watermark stands, they are judged with what is known."""
    d = Detector(default_catalog(), topology=Topo(), grace_ns=3 * S)
    d.set_jobs([PLACEMENT])
    out = Emitted()
    for t in collectives(range(10)):
        out.extend(d.on_collectives(t, T0))
    out.extend(d.on_refined(other_node(0, 1, node="n9")[0], T0))  # a node of no job
    for k in range(1, 40):  # 40 s of ticks with refined records queued, none read
        out.extend(d.tick(T0 + k * S, refined_pending=True))
    assert out.alerts == []
    wall = T0 + 40 * S
    for _, t in batches(storm_rows(20)):
        wall += S
        out.extend(d.on_refined(t, wall))
        out.extend(d.advance(int(t.column("ts")[0].as_py()), wall))
        out.extend(d.tick(wall, refined_pending=True))
    (a,) = out.alerts
    assert a.cause is not None and a.cause.startswith("PFC storm on leaf-p0-r3 port 2"), a.cause
    d2 = Detector(default_catalog(), topology=Topo(), grace_ns=3 * S)
    d2.set_jobs([PLACEMENT])
    for t in collectives(range(10)):
        d2.on_collectives(t, T0)
    d2.on_refined(other_node(0, 1, node="n9")[0], T0)
    assert d2.tick(T0 + 30 * S, refined_pending=True).alerts == []
    assert d2.tick(T0 + 31 * S).alerts == []  # none left to read: patience starts now
    assert d2.tick(T0 + 90 * S).alerts == []  # a worker restarting takes tens of seconds
    (b,) = d2.tick(T0 + 92 * S).alerts
    assert b.cause == "none found"


def test_held_collectives_wait_for_every_node_of_their_job_not_for_the_partition() -> None:
    """A refined partition interleaves nodes that a worker on a backlog reads at paces of
    their own: one node's rows ahead move the partition's newest ts (and the watermark) past
    another node's, still to come. A job's collectives wait for each of its nodes read past
    them, so the straggler names the storm the node behind shows; a node found silent, or
    one never read, holds nobody."""
    d = Detector(default_catalog(), topology=Topo(), grace_ns=3 * S)
    d.set_jobs([PLACEMENT])
    out = Emitted()
    for t in collectives(range(10)):
        out.extend(d.on_collectives(t, T0))
    pre = series("n2", "gpu0", "gpu.temp", [60.0], t0=T0 - S)
    out.extend(d.on_refined(batches(pre)[0][1], T0))  # n2 read up to T0 - 1 s
    for t in other_node(0, 40):  # n0 of the job, 40 s ahead of n2
        out.extend(d.on_refined(t, T0))
    out.extend(d.advance(T0 + 39 * S, T0))  # the partition's newest ts: past the collectives
    assert out.alerts == []  # n2 is behind: they wait
    for _, t in batches(storm_rows(20)):  # n2 is read at last
        out.extend(d.on_refined(t, T0))
        out.extend(d.advance(T0 + 39 * S, T0))
    (a,) = out.alerts
    assert a.cause is not None and a.cause.startswith("PFC storm on leaf-p0-r3 port 2"), a.cause
    # the same, with n2 behind and found silent: judged with what is known
    d2 = Detector(default_catalog(), topology=Topo(), grace_ns=3 * S)
    d2.set_jobs([PLACEMENT])
    for t in collectives(range(10)):
        d2.on_collectives(t, T0)
    for _, t in batches(series("n2", "gpu0", "gpu.temp", [60.0, 61.0], t0=T0 - 2 * S)):
        d2.on_refined(t, T0)
    for t in other_node(0, 40):
        d2.on_refined(t, T0)
    assert d2.advance(T0 + 39 * S, T0).alerts == []
    silent = d2.tick(T0).alerts  # n2 sent nothing for 40 s of data time
    assert {(a.rule, a.node) for a in silent} == {("exporter_silent", "n2")}
    (b,) = d2.advance(T0 + 40 * S, T0).alerts
    assert b.rule == "nccl_straggler" and b.cause == "none found"


def test_a_node_accounted_for_but_not_yet_read_holds_its_jobs_collectives() -> None:
    """The refiner accounted for raw records of n2 with refined rows, none of which detect
    has read yet: they are coming, so n2's job waits; a node neither read nor accounted for
    (not monitored) holds nobody."""
    d = Detector(default_catalog(), topology=Topo(), grace_ns=3 * S)
    d.set_jobs([PLACEMENT])
    for t in collectives(range(10)):
        d.on_collectives(t, T0)
    d.on_progress(0, 7, T0 + 2 * S, "n2", rows=True)
    for t in other_node(0, 40):
        d.on_refined(t, T0)
    assert d.advance(T0 + 39 * S, T0).alerts == []
    for _, t in batches(storm_rows(20)):
        d.on_refined(t, T0)
    (a,) = d.advance(T0 + 40 * S, T0).alerts
    assert a.cause is not None and a.cause.startswith("PFC storm on leaf-p0-r3 port 2"), a.cause
    d2 = Detector(default_catalog(), topology=Topo(), grace_ns=3 * S)
    d2.set_jobs([PLACEMENT])
    for t in collectives(range(10)):
        d2.on_collectives(t, T0)
    for t in other_node(0, 40):
        d2.on_refined(t, T0)
    (b,) = d2.advance(T0 + 39 * S, T0).alerts
    assert b.cause == "none found"
