"""NCCL stragglers: arrival skew, one alert per (job, straggler episode), cause through
placement + topology + episodes, stable ids."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from pipelines.detect.episodes import EpisodeTracker, OpenEpisode
from pipelines.detect.stragglers import NONE_FOUND, StragglerDetector, arrival_skew
from schemas.records import Alert, JobPlacement, RankPlacement
from schemas.wire import COLLECTIVES_SCHEMA
from tests.unit.derived_helpers import T0, S, batches, series

NODES, GPUS = 4, 4
MS = 1_000_000


class Topo:
    """node n<i>, gpu<k> → NIC mlx5_<k> on rail k, behind leaf-p0-r<k> port <i>."""

    def resolve(self, node: str, device: str, t: int) -> Mapping[str, Any]:
        k, i = int(device[3:]), int(node[1:])
        return {"nic": f"mlx5_{k}", "leaf": f"leaf-p0-r{k}", "leaf_port": str(i), "rail": k}


PLACEMENT = JobPlacement(
    job="j1",
    start_ns=T0 - 100 * S,
    nodes=[f"n{i}" for i in range(NODES)],
    ranks=[
        RankPlacement(rank=i * GPUS + k, node=f"n{i}", gpu=f"gpu{k}")
        for i in range(NODES)
        for k in range(GPUS)
    ],
)


def collectives(ops: range, late_rail: int | None = 3, late_ns: int = 20 * MS) -> list[pa.Table]:
    """Per op, one batch per node (ranks of that node)."""
    out = []
    for s in ops:
        for i in range(NODES):
            rows = []
            for k in range(GPUS):
                r = i * GPUS + k
                ts = T0 + s * S + r * 13_000 + (late_ns if k == late_rail else 0)
                rows.append(
                    {
                        "ts_ns": ts,
                        "end_ns": ts + 30 * MS,
                        "job": "j1",
                        "comm": "c0",
                        "op": "AllReduce",
                        "op_seq": s,
                        "rank": r,
                        "nranks": NODES * GPUS,
                        "device": f"gpu{k}",
                        "bytes": 1 << 28,
                        "busbw_gbps": 180.0,
                    }
                )
            out.append(pa.Table.from_pylist(rows, COLLECTIVES_SCHEMA))
    return out


def storm(port: str = "2", rail: int = 3, node: str = "n2") -> list[OpenEpisode]:
    enr = {"leaf": f"leaf-p0-r{rail}", "leaf_port": port, "nic": f"mlx5_{rail}", "job": "j1"}
    dev = f"mlx5_{rail}/1"
    rows = series(node, f"{dev}/prio3", "nic.rx_prio_pause", [1.2e5] * 30, field="rate", **enr)
    rows += series(node, dev, "rdma.np_cnp_sent", [4e3] * 30, field="rate", **enr)
    tr = EpisodeTracker()
    for now, t in batches(rows):
        tr.update(t, now)
    return tr.all_episodes()


def run(det: StragglerDetector, tables: list[pa.Table], eps: list[OpenEpisode]) -> list[Alert]:
    out: list[Alert] = []
    for t in tables:
        out += det.update(t, eps, int(pc.max(t["ts_ns"]).as_py()))
    return out


def test_arrival_skew_and_straggler_flags() -> None:
    t = pa.concat_tables(collectives(range(1)))
    sk = arrival_skew(t)
    rows = sk.to_pylist()
    assert [r["skew_ns"] for r in rows][:4] == [0, 13_000, 26_000, 39_000 + 20 * MS]
    assert {r["rank"] for r in rows if r["straggler"]} == {3, 7, 11, 15}


def test_straggler_alert_names_the_congested_port() -> None:
    det = StragglerDetector([PLACEMENT], Topo())
    eps = storm() + storm(port="1", rail=0, node="n1")  # a distractor off the straggler path
    out = run(det, collectives(range(10)), eps)
    assert len(out) == 1
    a = out[0]
    assert a.state.value == "firing" and a.rule == "nccl_straggler" and a.job == "j1"
    assert a.cause is not None
    assert a.cause.startswith("PFC storm on leaf-p0-r3 port 2 (prio 3): rx pause 1.2e+05/s")
    assert "CNP 4e+03/s" in a.cause
    assert a.evidence["port"] == "leaf-p0-r3/2"
    assert a.evidence["peak"]["nic.rx_prio_pause"] == 1.2e5
    assert a.evidence["matched_ranks"] == ["11"]
    assert set(a.evidence["ranks"]) == {"3", "7", "11", "15"}
    assert a.starts_ns == T0 + 3 * 13_000 + 20 * MS  # first straggler arrival (rank 3)
    # healthy collectives for longer than quiet: resolved, same id
    later = run(det, collectives(range(10, 80), late_rail=None), eps)
    assert [x.state.value for x in later] == ["resolved"]
    assert later[0].id == a.id and later[0].cause == a.cause


def test_without_an_episode_the_cause_is_none_found() -> None:
    det = StragglerDetector([PLACEMENT], Topo())
    (a,) = run(det, collectives(range(10)), [])
    assert a.cause == NONE_FOUND
    (b,) = run(StragglerDetector([PLACEMENT], Topo()), collectives(range(10)), storm(rail=1))
    assert b.cause == NONE_FOUND


def test_throttling_on_the_rank_gpu_is_a_cause() -> None:
    rows = series("n1", "gpu3", "gpu.clock_event_reasons", [float(0x40)] * 30)
    tr = EpisodeTracker()
    for now, t in batches(rows):
        tr.update(t, now)
    (a,) = run(StragglerDetector([PLACEMENT], Topo()), collectives(range(10)), tr.all_episodes())
    assert a.cause is not None and a.cause.startswith("thermal throttling on n1/gpu3")


def test_no_stragglers_no_alert_and_ids_stable_across_replay_and_duplicates() -> None:
    assert run(StragglerDetector([PLACEMENT], Topo()), collectives(range(10), None), []) == []
    tabs = collectives(range(10))
    a = run(StragglerDetector([PLACEMENT], Topo()), tabs, storm())
    dup = [t for t in tabs for _ in range(2)]  # every batch delivered twice
    b = run(StragglerDetector([PLACEMENT], Topo()), dup, storm())
    assert [(x.id, x.state) for x in a] == [(x.id, x.state) for x in b]
    assert len(b) == 1
    # restart mid-way: restored state does not fire the same episode twice
    d1 = StragglerDetector([PLACEMENT], Topo())
    first = run(d1, tabs[:24], storm())
    d2 = StragglerDetector([PLACEMENT], Topo())
    d2.restore(d1.to_dict())
    rest = run(d2, tabs[24:], storm())
    assert [(x.id, x.state) for x in first + rest] == [(x.id, x.state) for x in a]


def test_a_backlog_released_at_once_is_judged_as_two_straggle_episodes() -> None:
    """Collectives a backlog releases in one batch: a straggle at 0-9 s and another at
    200-209 s, calm in between. Judged in time order, the first episode resolves at the quiet
    gap and the second fires under an id of its own, as when they arrive live."""
    calm = collectives(range(10, 200, 10), None)
    tabs = collectives(range(10)) + calm + collectives(range(200, 210))
    bulk = StragglerDetector([PLACEMENT], Topo())
    got = bulk.update(pa.concat_tables(tabs), storm(), T0 + 210 * S)
    live = run(StragglerDetector([PLACEMENT], Topo()), tabs, storm())
    assert [a.state.value for a in got] == ["firing", "resolved", "firing"], got
    assert got[0].id == got[1].id != got[2].id
    assert got[1].ends_ns is not None and got[1].ends_ns < T0 + 10 * S
    assert [(a.id, a.state) for a in got] == [(a.id, a.state) for a in live]


def test_a_straggle_on_other_ranks_after_a_calm_spell_is_another_incident() -> None:
    """Rail 3 straggles at 0-9 s, calm, then rail 1 at 40-49 s (less than the 60 s quiet
    after the first): another rank's path, another incident, another alert with its own
    cause; live and released at once alike. The same rail after the same calm continues
    the episode."""
    calm = collectives(range(10, 40, 5), None)
    tabs = collectives(range(10)) + calm + collectives(range(40, 50), late_rail=1)
    eps = storm() + storm(port="2", rail=1)
    live = run(StragglerDetector([PLACEMENT], Topo()), tabs, eps)
    assert [a.state.value for a in live] == ["firing", "resolved", "firing"], live
    assert live[0].id == live[1].id != live[2].id
    assert live[1].ends_ns is not None and live[1].ends_ns < T0 + 10 * S
    assert live[0].cause is not None and live[0].cause.startswith("PFC storm on leaf-p0-r3 port 2")
    assert live[2].cause is not None and live[2].cause.startswith("PFC storm on leaf-p0-r1 port 2")
    assert set(live[2].evidence["ranks"]) == {"1", "5", "9", "13"}
    bulk = StragglerDetector([PLACEMENT], Topo()).update(pa.concat_tables(tabs), eps, T0 + 50 * S)
    assert [(a.id, a.state) for a in bulk] == [(a.id, a.state) for a in live]
    same = collectives(range(10)) + calm + collectives(range(40, 50))
    again = run(StragglerDetector([PLACEMENT], Topo()), same, eps)
    assert [a.state.value for a in again] == ["firing"]
