"""Scoring alerts and episodes against simulator truth (lab.bench.accuracy_match)."""

from __future__ import annotations

import json
from typing import Any

from lab.bench.accuracy_match import detections, score

S = 1_000_000_000
RUN = (0, 120 * S)


def incident(kind: str, start_s: float, end_s: float, **kw: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "id": f"{kind}-000-00",
        "kind": kind,
        "node": None,
        "device": None,
        "switch": None,
        "port": None,
        "job": None,
        "start_ns": int(start_s * S),
        "end_ns": int(end_s * S),
        "detail": json.dumps(kw.pop("detail", {})),
    }
    return row | kw


def alert(
    rule: str, entity: str, start_s: float, state: str = "firing", **kw: Any
) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "id": kw.pop("id", f"{rule}|{entity}|{start_s}"),
        "rule": rule,
        "state": state,
        "entity": entity,
        "starts_ns": int(start_s * S),
        "ends_ns": None,
        "evidence": {},
    }
    return doc | kw


def episode(kind: str, entity: str, start_s: float, end_s: float | None = None) -> dict[str, Any]:
    return {
        "id": f"ep|{kind}|{entity}|{start_s}",
        "kind": kind,
        "state": "firing",
        "entity": entity,
        "start_ns": int(start_s * S),
        "end_ns": None if end_s is None else int(end_s * S),
    }


def test_nothing_expected_and_nothing_fired_is_perfect() -> None:
    r = score([], [], [], [], RUN)
    assert (r.precision, r.recall, r.incident_recall) == (1.0, 1.0, 1.0)


def test_xid_matches_on_entity_code_and_onset() -> None:
    inc = [incident("xid", 30, 30, node="n1", device="gpu2", detail={"code": 79})]
    good = alert("gpu_xid", "n1/gpu2", 30.2, evidence={"code": 79})
    r = score(inc, [], [good], [], RUN)
    assert (r.precision, r.recall, r.true_positive) == (1.0, 1.0, 1)

    wrong_code = alert("gpu_xid", "n1/gpu2", 30.2, evidence={"code": 48})
    wrong_gpu = alert("gpu_xid", "n1/gpu3", 30.2, evidence={"code": 79})
    too_late = alert("gpu_xid", "n1/gpu2", 50, evidence={"code": 79})
    r = score(inc, [], [wrong_code, wrong_gpu, too_late], [], RUN)
    assert (r.precision, r.recall) == (0.0, 0.0)
    assert r.unmatched_by_rule() == {"gpu_xid": 3}
    assert r.missed == [
        {"incident": "xid-000-00", "kind": "xid", "signal": "gpu_xid", "entity": "n1/gpu2"}
    ]


def test_an_xid_onset_counts_within_the_bound_its_alert_states() -> None:
    """Right after a node's clock stepped by 15 s, the batch carrying its XID is bounded over
    both settings: the alert's onset is 7.6 s off, and it says ±7.6 s. That alert is right;
    one as far off claiming a tight onset is not."""
    inc = [incident("xid", 30, 30, node="n1", device="gpu2", detail={"code": 63})]
    stated = alert("gpu_xid", "n1/gpu2", 37.6, evidence={"code": 63, "ts_error_ns": 76 * S // 10})
    assert (
        score(inc, [], [stated], [], RUN).precision,
        score(inc, [], [stated], [], RUN).recall,
    ) == (1.0, 1.0)
    tight = alert("gpu_xid", "n1/gpu2", 37.6, evidence={"code": 63, "ts_error_ns": S // 100})
    assert (
        score(inc, [], [tight], [], RUN).precision,
        score(inc, [], [tight], [], RUN).recall,
    ) == (0.0, 0.0)


def test_throttle_needs_its_rule_and_an_episode_and_temp_high_is_optional() -> None:
    inc = [incident("throttle", 20, 44, node="n1", device="gpu6", detail={"cause": "thermal"})]
    rule = alert("gpu_thermal_throttle", "n1/gpu6", 20)
    ep = episode("throttling", "n1/gpu6", 20, 44)
    hot = alert("gpu_temp_high", "n1/gpu6", 40)
    r = score(inc, [], [rule, hot], [ep], RUN)
    assert (r.precision, r.recall, r.incident_recall) == (1.0, 1.0, 1.0)
    assert r.by_kind["throttle"].detections == 3

    r = score(inc, [], [rule], [], RUN)  # no episode: half the signals, incident not detected
    assert (r.recall, r.incident_recall) == (0.5, 0.0)
    assert r.missed_by_kind() == {"throttle": 1}

    power = [incident("throttle", 20, 44, node="n1", device="gpu6", detail={"cause": "power"})]
    r = score(power, [], [rule], [ep], RUN)  # the thermal rule for a power cap is wrong
    assert r.unmatched_by_rule() == {"gpu_thermal_throttle": 1}
    assert r.recall == 0.5


def test_pfc_storm_needs_the_port_episode_and_a_straggler_naming_it() -> None:
    inc = [
        incident(
            "pfc_storm",
            30,
            54,
            node="n3",
            device="mlx5_1/1",
            switch="leaf-p0-r1",
            port="3",
            job="job-101",
            detail={"jobs": ["job-101"], "nodes": ["n3"], "priority": 3},
        )
    ]
    ep = episode("congestion", "leaf-p0-r1/3/prio3", 30, 54)
    cause = {"episode_kind": "congestion", "port": "leaf-p0-r1/3"}
    strag = alert("nccl_straggler", "job/job-101", 31, job="job-101", evidence=cause)
    r = score(inc, [], [strag], [ep], RUN)
    assert (r.precision, r.recall) == (1.0, 1.0)

    other_port = episode("congestion", "leaf-p0-r1/4/prio3", 30, 54)
    no_cause = alert("nccl_straggler", "job/job-101", 31, evidence={"cause": "none found"})
    r = score(inc, [], [no_cause], [other_port], RUN)
    assert (r.precision, r.recall) == (0.0, 0.0)
    assert {m["signal"] for m in r.missed} == {"episode:congestion", "nccl_straggler"}


def test_a_consumer_keyed_on_id_sees_one_detection_per_id() -> None:
    fire = alert("nic_link_down", "n5/mlx5_7/1", 13, id="a1")
    done = alert("nic_link_down", "n5/mlx5_7/1", 13, state="resolved", id="a1", ends_ns=16 * S)
    ds = detections([fire, fire, done, done], [])  # a replay re-emits the same records
    assert [(d.id, d.end_ns) for d in ds] == [("a1", 16 * S)]
    inc = [incident("link_flap", 13, 16, node="n5", device="mlx5_7/1")]
    r = score(inc, [], [fire, done, fire], [], RUN)
    assert (r.detections, r.precision, r.recall, r.redundant) == (1, 1.0, 1.0, [])

    refire = alert("nic_link_down", "n5/mlx5_7/1", 14, id="a2")  # the same outage twice
    r = score(inc, [], [fire, refire], [], RUN)
    assert r.redundant == [{"incident": "link_flap-000-00", "signal": "nic_link_down",
                            "ids": ["a1", "a2"]}]  # fmt: skip


def test_clock_offsets_from_the_clock_truth() -> None:
    clocks = [
        {"node": "bad", "offset_ns": 2 * S, "drift_ppm": 0.0, "synced": False, "steps": []},
        {"node": "edge", "offset_ns": -980_000_000, "drift_ppm": 0.0, "synced": False,
         "steps": []},
        {"node": "good", "offset_ns": 40_000, "drift_ppm": 0.1, "synced": True, "steps": []},
        {"node": "stepped", "offset_ns": 0, "drift_ppm": 0.0, "synced": False,
         "steps": [{"at_ns": 60 * S, "step_ns": 5 * S}]},
    ]  # fmt: skip
    fired = [
        alert("clock_offset", "bad|gpu|0", 1, node="bad"),
        alert("clock_offset", "bad|nic|0", 1, node="bad"),
        alert("clock_offset", "edge|nic|0", 1, node="edge"),
        alert("clock_offset", "good|nic|0", 1, node="good"),
        alert("clock_offset", "stepped|nic|0", 61, node="stepped"),
    ]
    r = score([], clocks, fired, [], RUN)
    # "edge" is within the band around 1 s: allowed, not required; "good" never was off
    assert r.unmatched == [next(d.short() for d in detections(fired, []) if d.node == "good")]
    assert (r.signals, r.signals_met) == (2, 2)
    r = score([], clocks, fired[:1], [], RUN)
    assert r.missed == [
        {"incident": "clock-stepped", "kind": "clock", "signal": "clock_offset",
         "entity": "stepped|*"}
    ]  # fmt: skip
    early = alert("clock_offset", "stepped|nic|0", 10, node="stepped", id="e")
    ended = alert("clock_offset", "stepped|nic|0", 10, "resolved", id="e", ends_ns=12 * S)
    r = score([], clocks, [early, ended], [], RUN)  # resolved before the step: not about it
    assert r.precision == 0.0


def test_reset_and_run_end_silences_and_wraps() -> None:
    inc = [
        incident("reset", 26, 29, node="n2"),
        incident("wrap", 33, 34, node="n0", device="mlx5_4/1"),
        incident("xid", 200, 200, node="n1", device="gpu0"),  # after the run: never happened
    ]
    silent_reset = alert("exporter_silent", "n2|gpu|0", 29)
    silent_end = alert("exporter_silent", "n4|gpu|0", 119.5)
    silent_other = alert("exporter_silent", "n4|gpu|0", 29)
    r = score(inc, [], [silent_reset, silent_end], [], RUN)
    assert (r.precision, r.recall, r.incidents, r.detections) == (1.0, 1.0, 0, 1)
    assert [e["entity"] for e in r.excluded] == ["n4|gpu|0"]
    assert set(r.by_kind) == {"reset", "wrap"}
    r = score(inc, [], [], [], RUN)  # a reset need not alert
    assert r.recall == 1.0
    wrapped = alert("nic_counter_jump", "n0/mlx5_4/1", 33)
    r = score(inc, [], [silent_other, wrapped], [], RUN)
    assert r.unmatched_by_rule() == {"exporter_silent": 1, "nic_counter_jump": 1}


def test_alerts_the_run_explains_are_excluded_not_scored() -> None:
    from lab.bench.accuracy import run_signals

    clocks = [{"node": "n1", "offset_ns": 0, "drift_ppm": 0.0, "synced": True, "steps": []}]
    late = [{"node": "n1", "exporter": "node", "t0_ns": 70 * S, "t1_ns": 80 * S, "late_s": 1.3}]
    lags = [{"t0_ns": 60 * S, "t1_ns": 90 * S, "lag_s": 45.0}]
    fired = [
        alert("clock_offset", "n1|node|0", 74, node="n1"),  # while its input was late
        alert("clock_offset", "n1|gpu|0", 74, node="n1"),  # another source: not explained
        alert("refined_freshness", "pipeline", 64),
    ]
    r = score([], clocks, fired, [], RUN, explained=run_signals(late, lags, 5 * S))
    assert sorted(e["why"].split(":")[0] for e in r.excluded) == ["input late", "refiner behind"]
    assert r.unmatched_by_rule() == {"clock_offset": 1} and r.detections == 1


def test_input_timing_finds_late_sources_and_refiner_lag() -> None:
    from lab.bench.accuracy import input_timing

    def send(i: int, node: str, due_s: float) -> dict[str, Any]:
        return {"partition": 0, "offset": i, "node": node, "exporter": "node",
                "due_true_ns": int(due_s * S)}  # fmt: skip

    def acc(i: int, appended_s: float, processed_s: float) -> tuple[dict[str, Any], int]:
        doc = {"raw_partition": 0, "raw_offset": i, "append_ms": int(appended_s * 1000)}
        return doc, int(processed_s * S)

    sends = [send(i, "n1", i) for i in range(6)] + [send(6, "n2", 3)]
    accounting = [acc(i, i + (1.5 if 2 <= i <= 3 else 0.001), i + 2) for i in range(6)]
    accounting.append(acc(6, 3.001, 50))  # on time, but processed 47 s later
    offsets = {"n1": 0, "n2": -int(0.3 * S)}
    late, lags, stats = input_timing(sends, accounting, lambda t: offsets)
    assert late == [{"node": "n1", "exporter": "node", "t0_ns": int(3.5 * S), "t1_ns": 5 * S,
                     "late_s": 1.5}]  # fmt: skip
    assert lags == [{"t0_ns": 50 * S, "t1_ns": 50 * S, "lag_s": 46.999}]
    assert stats["publish_late_max_s"] == 1.5


def test_a_throttle_shorter_than_its_rules_for_is_not_expected_to_fire_it() -> None:
    power = {"bits": 132, "cause": "power"}
    inc = [incident("throttle", 12, 17, node="n0", device="gpu7", detail=power)]
    ep = episode("throttling", "n0/gpu7", 12.5, 17)
    for_ns = {"gpu_power_throttle": 10 * S}
    r = score(inc, [], [], [ep], RUN, for_ns=for_ns)
    assert (r.incident_recall, r.missed) == (1.0, [])
    fired = alert("gpu_power_throttle", "n0/gpu7", 12)  # fires anyway: still true
    r = score(inc, [], [fired], [ep], RUN, for_ns=for_ns)
    assert (r.precision, r.true_positive) == (1.0, 2)
    longer = [incident("throttle", 12, 30, node="n0", device="gpu7", detail=power)]
    r = score(longer, [], [], [ep], RUN, for_ns=for_ns)
    assert [m["signal"] for m in r.missed] == ["gpu_power_throttle"]
