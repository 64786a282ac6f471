"""Rule engine: every rule kind fires once per incident and resolves after it; hysteresis;
a clean stream is silent; stable ids across replays; rule-file mistakes are one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from pipelines.detect.rules import ClockStatus, RuleEngine, load_rules, parse_rules
from schemas.catalog import default_catalog
from schemas.errors import ConfigError
from schemas.records import Alert, AlertState
from schemas.wire import EVENTS_SCHEMA
from tests.unit.derived_helpers import T0, S, batches, series

REPO = Path(__file__).resolve().parents[2]
CAT = default_catalog()


def engine(*rules: dict[str, Any]) -> RuleEngine:
    return RuleEngine(parse_rules({"rules": list(rules)}, catalog=CAT), CAT)


def run(e: RuleEngine, rows: list[dict[str, Any]]) -> list[Alert]:
    out: list[Alert] = []
    for now, t in batches(rows):
        out += e.evaluate(t, now)
    return out


def states(alerts: list[Alert]) -> list[tuple[str, str]]:
    return [(a.rule, a.state.value) for a in alerts]


HOT = {
    "name": "hot",
    "kind": "threshold",
    "metric": "gpu.temp",
    "above": 85,
    "resolve": 80,
    "for": "30s",
    "summary": "{node} {device} at {value:.0f} degC",
}


def test_threshold_fires_once_and_resolves_with_the_same_id() -> None:
    vals = [70.0] * 10 + [90.0] * 40 + [70.0] * 10
    rows = series("n1", "gpu3", "gpu.temp", vals, raw_partition=2, offset0=100)
    out = run(engine(HOT), rows)
    assert states(out) == [("hot", "firing"), ("hot", "resolved")]
    fire, res = out
    assert fire.id == res.id
    assert fire.starts_ns == T0 + 10 * S  # onset, not the moment `for` was satisfied
    assert res.ends_ns == T0 + 50 * S
    assert fire.entity == "n1/gpu3" and fire.summary == "n1 gpu3 at 90 degC"
    assert fire.lineage[0].partition == 2
    assert fire.lineage[0].offset_first == 110 and fire.lineage[0].offset_last >= 140


def test_a_refire_in_the_same_minute_gets_its_own_id_and_replays_keep_it() -> None:
    # fires (onset T0+2 s), resolves at 6 s, fires again (onset 7 s): one onset minute
    quick = {**HOT, "for": "2s"}
    vals = [70.0] * 2 + [90.0] * 4 + [70.0] + [90.0] * 4 + [70.0]
    rows = series("n1", "gpu3", "gpu.temp", vals)
    out = run(engine(quick), rows)
    assert states(out) == [("hot", "firing"), ("hot", "resolved")] * 2
    assert out[0].id == out[1].id and out[2].id == out[3].id
    assert out[0].id != out[2].id  # else a consumer keyed on (id, state) drops the re-fire
    assert [a.id for a in run(engine(quick), rows)] == [a.id for a in out]  # a replay: same ids
    # a restart from saved state in between the two: the re-fire keeps its id too
    e = engine(quick)
    first = run(e, rows[: len(rows) // 2])
    e2 = RuleEngine.from_dict(parse_rules({"rules": [quick]}, catalog=CAT), CAT, e.to_dict())
    rest = run(e2, rows[len(rows) // 2 :])
    assert [a.id for a in first + rest] == [a.id for a in out]


def test_threshold_shorter_than_for_does_not_fire() -> None:
    vals = [70.0] * 5 + [90.0] * 20 + [70.0] * 5
    assert run(engine(HOT), series("n1", "gpu0", "gpu.temp", vals)) == []


def test_hysteresis_no_flapping_around_the_threshold() -> None:
    # pending resets below the threshold: 84/86 alternating never fires
    wobble = [84.0, 86.0] * 40
    assert run(engine(HOT), series("n1", "gpu0", "gpu.temp", wobble)) == []
    # once firing, wandering inside the band (81..89) keeps it firing: one record, not many
    vals = [90.0] * 35 + [81.0, 89.0, 82.0, 86.0] * 20 + [75.0] * 3
    out = run(engine(HOT), series("n1", "gpu0", "gpu.temp", vals))
    assert states(out) == [("hot", "firing"), ("hot", "resolved")]


def test_rate_rule_with_where_and_below_rule() -> None:
    pause = {
        "name": "pfc",
        "kind": "threshold",
        "metric": "nic.rx_prio_pause",
        "above": 1000,
        "resolve": 100,
        "for": "3s",
        "where": {"rail": 3},
    }
    rows = series(
        "n1", "mlx5_3/1/prio3", "nic.rx_prio_pause", [5e4] * 10 + [0.0] * 3, field="rate", rail=3
    )
    rows += series("n2", "mlx5_2/1/prio3", "nic.rx_prio_pause", [5e4] * 10, field="rate", rail=2)
    out = run(engine(pause), rows)
    assert states(out) == [("pfc", "firing"), ("pfc", "resolved")]
    assert {a.node for a in out} == {"n1"}
    low = {
        "name": "mem",
        "kind": "threshold",
        "metric": "mem.available_bytes",
        "below": 2e9,
        "resolve": 4e9,
        "for": "2s",
    }
    vals = [8e9] * 3 + [1e9] * 5 + [3e9] * 3 + [5e9] * 2
    out = run(engine(low), series("n1", "node", "mem.available_bytes", vals))
    assert states(out) == [("mem", "firing"), ("mem", "resolved")]


def events(rows: list[dict[str, Any]]) -> pa.Table:
    full = [{f.name: r.get(f.name) for f in EVENTS_SCHEMA} | {"node": r["node"]} for r in rows]
    return pa.Table.from_pylist(full)


XID = {"name": "xid", "kind": "event", "event": "xid", "summary": "Xid {code}: {meaning}"}
LINK = {"name": "link", "kind": "event", "event": "link_down", "resolve_on": "link_up"}


def test_every_xid_is_one_alert_with_its_meaning() -> None:
    e = engine(XID)
    ev = events(
        [
            {"node": "n1", "ts_ns": T0, "event": "xid", "device": "gpu3", "code": 79},
            {"node": "n1", "ts_ns": T0 + 5 * S, "event": "xid", "device": "gpu3", "code": 79},
            {"node": "n2", "ts_ns": T0 + 6 * S, "event": "xid", "device": "gpu0", "code": 48},
            {"node": "n2", "ts_ns": T0 + 6 * S, "event": "link_up", "device": "mlx5_0/1"},
        ]
    )
    out = e.on_events(ev, T0 + 7 * S)
    assert states(out) == [("xid", "firing")] * 3
    assert len({a.id for a in out}) == 3
    assert out[0].summary == "Xid 79: GPU has fallen off the bus"
    assert out[0].severity.value == "critical" and out[0].evidence["code"] == 79
    assert e.on_events(ev, T0 + 8 * S) == []  # the same events again: no new alerts
    res = e.tick(T0 + 400 * S)
    assert states(res) == [("xid", "resolved")] * 3
    assert {a.id for a in res} == {a.id for a in out}


def test_an_event_alert_states_the_bound_on_its_onset() -> None:
    """Aligned events carry ``clock_error_ns``: the alert keeps it as ``ts_error_ns`` (wide
    right after the node's clock stepped), and says nothing where the events do not."""
    ev = events([{"node": "n1", "ts_ns": T0, "event": "xid", "device": "gpu3", "code": 63}])
    wide = ev.append_column("clock_error_ns", pa.array([7_600_000_000], pa.int64()))
    (a,) = engine(XID).on_events(wide, T0)
    assert a.evidence["ts_error_ns"] == 7_600_000_000 and a.starts_ns == T0
    (b,) = engine(XID).on_events(ev, T0)
    assert "ts_error_ns" not in b.evidence


def test_link_down_fires_and_link_up_resolves() -> None:
    e = engine(LINK)
    down = events([{"node": "n1", "ts_ns": T0, "event": "link_down", "device": "mlx5_1/1"}])
    up = events([{"node": "n1", "ts_ns": T0 + 3 * S, "event": "link_up", "device": "mlx5_1/1"}])
    a = e.on_events(down, T0)
    b = e.on_events(up, T0 + 3 * S)
    assert states(a + b) == [("link", "firing"), ("link", "resolved")]
    assert a[0].id == b[0].id and b[0].ends_ns == T0 + 3 * S


def test_events_without_node_column_take_the_envelope_node() -> None:
    e = engine(XID)
    t = pa.Table.from_pylist(
        [{"ts_ns": T0, "event": "xid", "device": "gpu1", "code": 13}], EVENTS_SCHEMA
    )
    (a,) = e.on_events(t, T0, node="n9")
    assert a.node == "n9" and a.entity == "n9/gpu1"


def test_xid_from_samples_is_an_onset_not_a_gauge() -> None:
    e = engine({"name": "xid_s", "kind": "event", "metric": "gpu.xid"})
    vals = [0.0] * 3 + [79.0] * 10 + [0.0] * 2 + [48.0] * 3
    out = run(e, series("n1", "gpu2", "gpu.xid", vals))
    assert states(out) == [("xid_s", "firing")] * 2
    assert [a.evidence["code"] for a in out] == [79, 48]


def test_throttle_reason_transitions_fire_once_with_decoded_names() -> None:
    th = {
        "name": "thermal",
        "kind": "bitmask",
        "bits": ["SW_THERMAL", "HW_THERMAL"],
        "summary": "{device}: {reasons}",
    }
    pw = {"name": "power", "kind": "bitmask", "bits": ["SW_POWER_CAP", "HW_POWER_BRAKE"]}
    vals = [0.0] * 5 + [float(0x60)] * 20 + [float(0x20)] * 5 + [0.0] * 5
    out = run(engine(th, pw), series("n1", "gpu5", "gpu.clock_event_reasons", vals))
    assert states(out) == [("thermal", "firing"), ("thermal", "resolved")]
    assert out[0].summary == "gpu5: SW_THERMAL,HW_THERMAL"


CLOCK = {"name": "clock", "kind": "clock", "above": "1s", "resolve": "500ms"}


def test_clock_alert_with_hysteresis() -> None:
    e = engine(CLOCK)

    def st(off_ms: float, i: int) -> list[ClockStatus]:
        return [ClockStatus(source="n1|node|0", offset_ns=int(off_ms * 1e6), ts_ns=T0 + i * S)]

    out: list[Alert] = []
    for i, off in enumerate([5, 2000, 900, 1200, 800, 100, 50]):
        out += e.on_clock(st(off, i), T0 + i * S)
    assert states(out) == [("clock", "firing"), ("clock", "resolved")]
    assert out[0].entity == "n1|node|0" and out[0].node == "n1"


def test_silent_source_fires_on_tick_and_resolves_when_it_speaks() -> None:
    e = engine({"name": "silent", "kind": "silent", "intervals": 3})
    rows = series("n1", "cpu0", "cpu.user_seconds", [float(i) for i in range(10)])
    out = run(e, rows)
    assert e.tick(T0 + 11 * S) == []  # 1.5 intervals quiet
    fired = e.tick(T0 + 14 * S)
    assert states(fired) == [("silent", "firing")]
    assert e.tick(T0 + 20 * S) == []  # still silent: no new record
    back = run(e, series("n1", "cpu0", "cpu.user_seconds", [1.0], t0=T0 + 30 * S))
    assert states(out + back) == [("silent", "resolved")]
    assert back[0].id == fired[0].id


def test_frozen_source() -> None:
    e = engine({"name": "frozen", "kind": "frozen", "intervals": 3})
    rows: list[dict[str, Any]] = []
    for i, v in enumerate([1.0, 2.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 4.0]):
        for dev in ("gpu0", "gpu1"):
            rows += series("n1", dev, "gpu.temp", [v], t0=T0 + i * S, seq=i)
    out = run(e, rows)
    assert states(out) == [("frozen", "firing"), ("frozen", "resolved")]


def test_deadletter_rate_and_freshness() -> None:
    e = engine(
        {"name": "dl", "kind": "deadletter_rate", "above": 5, "resolve": 1, "window": "10s"},
        {"name": "fresh", "kind": "freshness", "above": "30s", "resolve": "10s"},
    )
    e.on_deadletters(100, T0)
    fired = e.tick(T0 + S)
    assert states(fired) == [("dl", "firing")]
    assert e.tick(T0 + 5 * S) == []
    assert states(e.tick(T0 + 20 * S)) == [("dl", "resolved")]
    old = series("n1", "gpu0", "gpu.temp", [60.0], t0=T0)[0:1]
    ((_, t),) = batches(old)
    assert states(e.evaluate(t, T0 + 60 * S)) == [("fresh", "firing")]
    assert e.evaluate(t, T0 + 20 * S) == []  # inside the band
    assert states(e.evaluate(t, T0 + 2 * S)) == [("fresh", "resolved")]


def _clean_stream() -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for n in ("n1", "n2"):
        temps = [60.0 + (i % 7) for i in range(120)]
        rows += series(n, "gpu0", "gpu.temp", temps, instance="dcgm")
        rows += series(n, "gpu0", "gpu.clock_event_reasons", [0.0] * 120, instance="dcgm")
        rows += series(
            n,
            "mlx5_0/1/prio3",
            "nic.rx_prio_pause",
            [float(i % 3) for i in range(120)],
            field="rate",
            instance="nic",
        )
        rows += series(
            n,
            "mlx5_0/1",
            "rdma.np_cnp_sent",
            [1.0 + i % 5 for i in range(120)],
            field="rate",
            instance="nic",
        )
        rows += series(
            n, "node", "mem.available_bytes", [5e11 + i for i in range(120)], instance="host"
        )
    return rows


def test_clean_stream_gives_zero_alerts_with_the_default_rules() -> None:
    rules = load_rules(REPO / "deploy" / "rules" / "default.yaml", CAT)
    e = RuleEngine(rules, CAT)
    out = run(e, _clean_stream())
    for k in range(120):
        out += e.tick(T0 + k * S + S // 2)
    out += e.on_clock([ClockStatus(source="n1|node|0", offset_ns=2_000_000, ts_ns=T0)], T0)
    assert out == []


def test_replay_and_restart_give_identical_ids() -> None:
    rules = [HOT, {"name": "thermal", "kind": "bitmask", "bits": ["HW_THERMAL"]}]
    vals = [70.0] * 5 + [95.0] * 40 + [60.0] * 5
    rows = series("n1", "gpu0", "gpu.temp", vals)
    rows += series("n1", "gpu0", "gpu.clock_event_reasons", [0.0] * 10 + [64.0] * 30 + [0.0] * 10)
    first = run(engine(*rules), rows)
    again = run(engine(*rules), rows)
    assert [(a.id, a.state) for a in first] == [(a.id, a.state) for a in again]
    assert len(first) == 4
    # restart in the middle: state through JSON, the rest of the input, the same records
    e = engine(*rules)
    bs = batches(rows)
    out: list[Alert] = []
    for now, t in bs[:20]:
        out += e.evaluate(t, now)
    saved = json.loads(json.dumps(e.to_dict()))
    e2 = RuleEngine.from_dict(e.rules, CAT, saved)
    for now, t in bs[20:]:
        out += e2.evaluate(t, now)
    assert [(a.id, a.state) for a in out] == [(a.id, a.state) for a in first]
    assert all(a.state in (AlertState.FIRING, AlertState.RESOLVED) for a in out)


@pytest.mark.parametrize(
    ("rule", "field"),
    [
        ({"name": "r1", "kind": "threshold", "metric": "gpu.temp", "above": "hot"}, "above"),
        ({"name": "r2", "kind": "threshold", "metric": "gpu.tmp", "above": 1}, "metric"),
        ({"name": "r3", "kind": "threshold", "metric": "gpu.temp"}, "above"),
        (
            {
                "name": "r4",
                "kind": "threshold",
                "metric": "gpu.temp",
                "above": 1,
                "where": {"colour": "red"},
            },
            "where.colour",
        ),
        (
            {"name": "r5", "kind": "threshold", "metric": "gpu.temp", "above": 90, "resolve": 95},
            "resolve",
        ),
        (
            {"name": "r6", "kind": "threshold", "metric": "gpu.temp", "above": 1, "for": "soon"},
            "for",
        ),
        ({"name": "r7", "kind": "bitmask", "bits": ["TOO_HOT"]}, "bits"),
        ({"name": "r8", "kind": "event", "event": "xid", "summary": "{colour}"}, "summary"),
        ({"name": "r9", "kind": "magic"}, "kind"),
        ({"name": "r10", "kind": "event", "event": "xid", "sevrity": "critical"}, "sevrity"),
        ({"name": "r11", "kind": "event", "event": "xid", "severity": "dire"}, "severity"),
    ],
)
def test_a_rule_file_mistake_is_one_line_naming_rule_and_field(
    rule: dict[str, Any], field: str, tmp_path: Path
) -> None:
    p = tmp_path / "bad.yaml"
    import yaml

    p.write_text(yaml.safe_dump({"rules": [XID | {"name": "ok"}, rule]}))
    with pytest.raises(ConfigError) as ei:
        load_rules(p, CAT)
    msg = str(ei.value)
    assert "\n" not in msg
    assert f"rule {rule['name']}: {field}" in msg
    assert msg.startswith("rules bad.yaml:")


def test_duplicate_names_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="rule xid: name: defined twice"):
        parse_rules({"rules": [XID, XID]})
    p = tmp_path / "r.yaml"
    p.write_text("rules: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_rules(p)


def test_default_rules_cover_every_domain() -> None:
    rules = load_rules(REPO / "deploy" / "rules" / "default.yaml", CAT)
    kinds = {r.kind for r in rules}
    assert kinds == {
        "threshold",
        "event",
        "bitmask",
        "clock",
        "silent",
        "frozen",
        "deadletter_rate",
        "freshness",
    }
    metrics = {getattr(r, "metric", None) for r in rules}
    # RoCE congestion is reported once, as episodes, not also as per-NIC threshold alerts
    from pipelines.detect.episodes import CONGESTION_THRESHOLDS

    for m in ("nic.rx_prio_pause", "rdma.np_cnp_sent", "rdma.np_ecn_marked_roce_packets"):
        assert m in CONGESTION_THRESHOLDS and m not in metrics
    for m in (
        "gpu.temp",
        "gpu.pcie_replay",
        "pcie.aer_fatal",
        "mem.available_bytes",
        "psi.memory_some_avg10",
        "nic.rx_symbol_err_phy",
    ):
        assert m in metrics
