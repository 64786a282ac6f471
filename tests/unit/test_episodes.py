"""Congestion and throttling episodes: grouping by leaf port and priority, open/close, peaks,
members, stable ids."""

from __future__ import annotations

import json
import math
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from pipelines.detect.episodes import THROTTLE_BITS, EpisodeSettings, EpisodeTracker, _port_keys
from schemas.records import AlertState, Episode
from tests.unit.derived_helpers import T0, S, batches, refined, series


def storm_rows(
    storm_s: int = 20, calm_s: int = 45, leaf: str | None = "leaf-p0-r3"
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    n = 5 + storm_s + calm_s
    pause = [10.0] * 5 + [1.2e5] * storm_s + [5.0] * calm_s
    cnp = [2.0] * 5 + [4e3] * storm_s + [1.0] * calm_s
    for node, job in (("n1", "j1"), ("n2", "j2")):
        enr = {"leaf": leaf, "leaf_port": "2" if leaf else None, "nic": "mlx5_3", "job": job}
        rows += series(node, "mlx5_3/1/prio3", "nic.rx_prio_pause", pause, field="rate", **enr)
        rows += series(node, "mlx5_3/1", "rdma.np_cnp_sent", cnp, field="rate", **enr)
    # another rail, quiet: no episode
    rows += series(
        "n1",
        "mlx5_0/1/prio3",
        "nic.rx_prio_pause",
        [3.0] * n,
        field="rate",
        leaf="leaf-p0-r0",
        leaf_port="2",
        nic="mlx5_0",
    )
    assert len(pause) == n
    return rows


def run(tr: EpisodeTracker, rows: list[dict[str, Any]]) -> list[Episode]:
    out: list[Episode] = []
    for now, t in batches(rows):
        out += tr.update(t, now)
    return out


def test_one_episode_per_leaf_port_and_priority_with_members_and_peaks() -> None:
    out = run(EpisodeTracker(), storm_rows())
    assert [e.state for e in out] == [AlertState.FIRING, AlertState.RESOLVED]
    fire, res = out
    assert fire.id == res.id and fire.kind == "congestion"
    assert fire.entity == "leaf-p0-r3/2/prio3"
    assert fire.start_ns == T0 + 5 * S
    assert res.end_ns == T0 + 24 * S
    assert res.nodes == ["n1", "n2"] and res.jobs == ["j1", "j2"]
    assert res.nics == ["n1/mlx5_3", "n2/mlx5_3"] and res.ports == ["leaf-p0-r3/2"]
    assert res.peak["nic.rx_prio_pause"] == 1.2e5
    assert res.peak["rdma.np_cnp_sent"] == 4e3
    assert res.cause_hint is not None
    assert res.cause_hint.startswith("PFC storm on leaf-p0-r3 port 2 (prio 3): rx pause 1.2e+05/s")


def test_unknown_leaf_keys_by_node_nic() -> None:
    out = run(EpisodeTracker(), storm_rows(leaf=None))
    ents = sorted({e.entity for e in out})
    assert ents == ["n1/mlx5_3/prio3", "n2/mlx5_3/prio3"]


def test_quiet_time_bridges_short_gaps() -> None:
    pause = [1e5] * 10 + [0.0] * 10 + [1e5] * 10 + [0.0] * 40
    rows = series(
        "n1",
        "mlx5_1/1/prio3",
        "nic.rx_prio_pause",
        pause,
        field="rate",
        leaf="L",
        leaf_port="7",
        nic="mlx5_1",
    )
    out = run(EpisodeTracker(EpisodeSettings(quiet_ns=15 * S)), rows)
    assert [e.state.value for e in out] == ["firing", "resolved"]
    out = run(EpisodeTracker(EpisodeSettings(quiet_ns=5 * S)), rows)
    assert [e.state.value for e in out] == ["firing", "resolved", "firing", "resolved"]


def test_tick_closes_an_episode_whose_port_went_silent() -> None:
    tr = EpisodeTracker()
    rows = series("n1", "mlx5_1/1/prio3", "nic.rx_prio_pause", [1e5] * 5, field="rate")
    assert [e.state.value for e in run(tr, rows)] == ["firing"]
    assert tr.tick(T0 + 20 * S) == []
    assert [e.state.value for e in tr.tick(T0 + 40 * S)] == ["resolved"]


def test_throttling_episode() -> None:
    bits = [0.0] * 5 + [float(0x60)] * 20 + [0.0] * 40
    rows = series("n3", "gpu5", "gpu.clock_event_reasons", bits, job="j7")
    rows += series("n3", "gpu5", "gpu.sm_clock", [1980.0] * 5 + [900.0] * 20 + [1980.0] * 40)
    out = run(EpisodeTracker(), rows)
    assert [e.state.value for e in out] == ["firing", "resolved"]
    res = out[1]
    assert res.kind == "throttling" and res.entity == "n3/gpu5" and res.jobs == ["j7"]
    assert res.peak["gpu.clock_event_reasons"] == 0x60
    assert res.peak["gpu.sm_clock_min"] == 900.0
    assert res.cause_hint is not None and res.cause_hint.startswith("thermal throttling")


def test_ids_are_stable_across_replay_and_restart() -> None:
    rows = storm_rows()
    a = run(EpisodeTracker(), rows)
    b = run(EpisodeTracker(), rows)
    assert [(e.id, e.state) for e in a] == [(e.id, e.state) for e in b]
    tr = EpisodeTracker()
    bs = batches(rows)
    out: list[Episode] = []
    for now, t in bs[:12]:
        out += tr.update(t, now)
    tr2 = EpisodeTracker.from_dict(json.loads(json.dumps(tr.to_dict())))
    for now, t in bs[12:]:
        out += tr2.update(t, now)
    assert [(e.id, e.state) for e in out] == [(e.id, e.state) for e in a]


def test_clean_stream_has_no_episodes() -> None:
    rows = series("n1", "mlx5_0/1/prio3", "nic.rx_prio_pause", [3.0] * 60, field="rate")
    rows += series("n1", "gpu0", "gpu.clock_event_reasons", [0.0] * 60)
    assert run(EpisodeTracker(), rows) == []


def _plain_rows(tr: EpisodeTracker, t: pa.Table) -> list[dict[str, Any]]:
    """The congestion rows an update reads, every row's port key built: over a threshold,
    or a rate of a congestion metric on a port with an episode open."""
    th = tr.settings.thresholds
    key, _ = _port_keys(t)
    open_ports = set(tr._open_ports().to_pylist())
    out = []
    for r, port in zip(t.to_pylist(), key.to_pylist(), strict=True):
        rate, limit = r["rate"], th.get(r["metric"])
        hot = rate is not None and limit is not None and rate > limit
        if hot or (limit is not None and rate is not None and port in open_ports):
            out.append({"port": port, "metric": r["metric"], "rate": rate, "hot": hot})
    return out


def test_rows_on_open_ports_are_read_whatever_slashes_the_names_hold() -> None:
    ports = [  # leaf, leaf port, node, nic: a "/" in one of the names a key is made of
        ("leaf/a", "2", "n1", "mlx5_0"),
        ("leaf-b", "p/3", "n2", "mlx5_0"),
        (None, None, "rack/n3", "mlx5_1"),
        (None, None, "n4", "mlx5/2"),
    ]
    tr = EpisodeTracker()
    rows: list[dict[str, Any]] = []
    for rate, step in ((1e5, 0), (10.0, 1), (10.0, 2)):  # hot once, then quiet
        for leaf, port, node, nic in [*ports, ("leaf", "a/2", "n5", "mlx5_0")]:
            enr = {"leaf": leaf, "leaf_port": port, "nic": nic}
            ts = T0 + step * S
            for m in ("nic.rx_prio_pause", "rdma.np_cnp_sent"):
                rows.append({"node": node, "device": f"{nic}/1/prio3", "metric": m} | enr)
                rows[-1] |= {"ts": ts, "rate": rate if node != "n5" or step else 1.0}
    for step in range(3):
        t = refined([r for r in rows if r["ts"] == T0 + step * S])
        sel = ["leaf", "leaf_port", "device", "node", "nic", "metric", "rate", "ts", "job"]
        got = tr._congestion_rows(t)
        want = _plain_rows(tr, t.select(sel))
        cols = ["port", "metric", "rate", "hot"]
        assert (got.select(cols).to_pylist() if got is not None else []) == want
        tr.update(t, T0 + step * S)
    assert len(tr.open) == len(ports)


def test_throttle_reasons_that_are_no_integer_read_as_arrow_casts_them() -> None:
    odd = [math.nan, math.inf, 1e30, 0.9]  # no reason bits, but as Arrow's unsafe cast reads them
    rows = series("n3", "gpu5", "gpu.clock_event_reasons", odd)
    rows += series("n3", "gpu6", "gpu.clock_event_reasons", [0.0, 32.5], t0=T0 + 10 * S)
    cast = pc.cast(pa.array(odd), pa.int64(), safe=False)
    odd_bits = {int(b) & THROTTLE_BITS for b in cast.to_pylist()} - {0}
    tr = EpisodeTracker()
    out = run(tr, rows)
    want = [("n3/gpu5", "firing")] if odd_bits else []
    assert [(e.entity, e.state.value) for e in out] == [*want, ("n3/gpu6", "firing")]
    assert tr.open["n3/gpu6"].peak["gpu.clock_event_reasons"] == 0x20
