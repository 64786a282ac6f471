"""`refinery verify`'s comparison on a synthetic truth and a lake of real Parquet files landed by
the lake writer, read through DuckDB: every injected defect is counted and named, and only the
defects make the verdict fail."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lab.simulate.truth import (
    COLLECTIVES_TRUTH,
    EVENTS_TRUTH,
    SAMPLES_TRUTH,
    SENDS_TRUTH,
    run_path,
    sibling,
)
from lab.verify.verdict import render, verify
from services.lake.writer import LakeWriter

S = 1_000_000_000
SEED = 20431  # this test's own
T0 = 1_800_000_000 * S  # true start of the run
NODES = ["n01", "n02", "n03"]
EXPORTERS = ["gpu", "nic"]
SECONDS = 40


def _truth(rng: np.random.Generator) -> tuple[pa.Table, list[dict[str, Any]]]:
    """Samples: per node, exporter and second one batch of 4 samples; the last of each batch
    of n03/nic has an expected reason (bad sample: must not land). Sends: one per batch."""
    rows, sends = [], []
    offset = 0
    for sec in range(SECONDS):
        for node in NODES:
            for exp in EXPORTERS:
                due = T0 + sec * S + int(rng.integers(0, 50_000_000))
                part = NODES.index(node)
                sends.append(
                    {
                        "msg": offset,
                        "tag": f"{node}{exp}{sec}",
                        "stream": "raw",
                        "topic": "telemetry.raw",
                        "partition": part,
                        "offset": offset,
                        "kind": "batch",
                        "expected_reason": None,
                        "samples": 4,
                        "bad_samples": 0,
                        "node": node,
                        "exporter": exp,
                        "instance": "0",
                        "boot_id": f"b-{node}",
                        "seq": sec,
                        "content_type": "arrow",
                        "sent_true_ns": due,
                        "sent_source_ns": due,
                        "due_true_ns": due,
                    }
                )
                offset += 1
                for d in range(4):
                    bad = node == "n03" and exp == "nic" and d == 3
                    ts = due - 10_000_000 - d * 1_000_000
                    rows.append(
                        {
                            "node": node,
                            "exporter": exp,
                            "instance": "0",
                            "boot_id": f"b-{node}",
                            "seq": sec,
                            "metric": "gpu.temp" if exp == "gpu" else "nic.rx_bytes",
                            "device": f"dev{d}",
                            "ts_source_ns": ts,
                            "ts_true_ns": ts,
                            "value": float(rng.normal(50, 5)),
                            "raw": None,
                            "expected_reason": "out_of_range" if bad else None,
                        }
                    )
    return pa.Table.from_pylist(rows, SAMPLES_TRUTH), sends


def _write_truth(
    path: Path, speed: float | None, more: tuple[dict[str, Any], ...] = ()
) -> tuple[pa.Table, list[dict[str, Any]]]:
    rng = np.random.default_rng(SEED)
    samples, sends = _truth(rng)
    pq.write_table(samples, path)
    pq.write_table(pa.Table.from_pylist(sends, SENDS_TRUTH), sibling(path, "sends"))
    xid_at = T0 + 12 * S
    incidents = [
        {
            "id": "xid-000-00",
            "kind": "xid",
            "node": "n02",
            "device": "gpu2",
            "switch": None,
            "port": None,
            "job": None,
            "start_ns": xid_at,
            "end_ns": xid_at,
            "detail": json.dumps({"code": 79}),
        }
    ]
    pq.write_table(pa.Table.from_pylist([*incidents, *more]), sibling(path, "incidents"))
    clocks = [
        {"node": n, "offset_ns": 0, "drift_ppm": 0.0, "synced": True, "steps": []} for n in NODES
    ]
    clock_schema = pa.schema(
        [
            ("node", pa.string()),
            ("offset_ns", pa.int64()),
            ("drift_ppm", pa.float64()),
            ("synced", pa.bool_()),
            ("steps", pa.list_(pa.struct([("at_ns", pa.int64()), ("step_ns", pa.int64())]))),
        ]
    )
    pq.write_table(pa.Table.from_pylist(clocks, clock_schema), sibling(path, "clocks"))
    events = [
        {
            "node": "n02",
            "boot_id": "b-n02",
            "seq": 0,
            "event": "xid",
            "device": "gpu2",
            "code": 79,
            "ts_source_ns": xid_at,
            "ts_true_ns": xid_at,
            "incident": "xid-000-00",
        }
    ]
    pq.write_table(pa.Table.from_pylist(events, EVENTS_TRUTH), sibling(path, "events"))
    colls = [
        {
            "job": "j1",
            "op_seq": i,
            "rank": r,
            "node": NODES[r],
            "device": "gpu0",
            "ts_source_ns": T0 + i * S,
            "ts_true_ns": T0 + i * S,
            "straggle_ns": 0,
            "incident": None,
        }
        for i in range(5)
        for r in range(3)
    ]
    pq.write_table(pa.Table.from_pylist(colls, COLLECTIVES_TRUTH), sibling(path, "collectives"))
    run = {"speed": speed, "start_ns": T0, "end_ns": T0 + SECONDS * S, "interval_ns": S}
    run_path(path).write_text(json.dumps(run))
    return samples, sends


def _broker(true_ns: int, speed: float) -> int:
    """A true time as the broker's (aligned) time of a run at ``speed``: the lake's times."""
    return T0 + round((true_ns - T0) / speed)


def _alert(rule: str, entity: str, at: int, node: str | None, **kw: Any) -> dict[str, Any]:
    return {
        "ts": at,
        "id": f"{rule}-{entity}-{at}",
        "rule": rule,
        "state": "firing",
        "severity": "warning",
        "entity": entity,
        "node": node,
        "starts_ns": at,
        "summary": rule,
        "emitted_ns": at,
        "kafka_partition": 0,
        "kafka_offset": at % 997,
        **kw,
    }


def _land_events_and_collectives(
    w: LakeWriter,
    event: dict[str, Any] | None = None,
    collective: Callable[[int, int], dict[str, Any]] = lambda op, rank: {},
) -> None:
    """The XID event and every collective record, once each, on their true time with a 1 ns
    bound; ``event`` and ``collective(op_seq, rank)``: columns to set instead."""
    ev = {
        "node": "n02",
        "ts": T0 + 12 * S,
        "ts_source": T0 + 12 * S,
        "clock_offset_ns": 0,
        "clock_error_ns": 1,
        "exporter": "kmsg",
        "boot_id": "b-n02",
        "seq": 0,
        "raw_partition": 1,
        "raw_offset": 0,
        "event": "xid",
        "device": "gpu2",
        "code": 79,
        **(event or {}),
    }
    w.land("events", pa.Table.from_pylist([ev]), partition=0, first=0, last=0)
    colls = [
        {
            "node": NODES[r],
            "ts": T0 + i * S,
            "ts_source": T0 + i * S,
            "clock_offset_ns": 0,
            "clock_error_ns": 1,
            "exporter": "nccl",
            "boot_id": "b",
            "seq": i,
            "raw_partition": 0,
            "raw_offset": i,
            "job": "j1",
            "comm": "c",
            "op": "AllReduce",
            "op_seq": i,
            "rank": r,
            "nranks": 3,
            "device": "gpu0",
            **collective(i, r),
        }
        for i in range(5)
        for r in range(3)
    ]
    w.land("collectives", pa.Table.from_pylist(colls), partition=0, first=0, last=0)


def _land(lake: Path, samples: pa.Table, sends: list[dict[str, Any]], speed: float) -> None:
    """The lake of a run with defects: one good sample lost, one landed twice, one made up,
    one bad sample landed (made up too), 3 samples of n01|gpu 50 ms off with a 1 ms bound;
    one event and every collective landed; the refiner 45 s behind for seconds 20-29; times on
    the broker's clock, which a run faster than real time runs behind the true one."""
    w = LakeWriter(lake)
    w.ensure_seeds()
    good = samples.to_pylist()
    lake_rows = []
    for i, r in enumerate(good):
        if i == 7:
            continue  # lost (a good sample: the first batch has no bad ones)
        if r["expected_reason"] is not None and i != 23:
            continue  # bad samples do not land; row 23 (n03|nic, bad) lands: made up
        off = 50_000_000 if r["node"] == "n01" and r["exporter"] == "gpu" and r["seq"] < 1 else 0
        lake_rows.append(
            {
                "node": r["node"],
                "device": r["device"],
                "metric": r["metric"],
                "unit": "x",
                "ts": _broker(r["ts_true_ns"], speed) + off + 200_000,
                "ts_source": r["ts_source_ns"],
                "clock_offset_ns": 0,
                "clock_error_ns": 1_000_000,
                "value": r["value"],
                "reset": False,
                "late": False,
                "exporter": r["exporter"],
                "instance": r["instance"],
                "boot_id": r["boot_id"],
                "seq": r["seq"],
                "raw_partition": 0,
                "raw_offset": i,
            }
        )
    lake_rows.append(dict(lake_rows[20]))  # duplicated
    lake_rows.append(dict(lake_rows[21], ts_source=lake_rows[21]["ts_source"] + 1))  # made up
    w.land("samples", pa.Table.from_pylist(lake_rows), partition=0, first=0, last=10)
    _land_events_and_collectives(w)
    acc = [
        {
            "ts": _broker(s["due_true_ns"], speed) + (45 * S if 20 <= s["seq"] < 30 else S // 2),
            "raw_topic": "telemetry.raw",
            "raw_partition": s["partition"],
            "raw_offset": s["offset"],
            "input_samples": 4,
            "refined_samples": 4,
            "duplicate_samples": 0,
            "quarantined_samples": 100 if s["seq"] in (5, 6) else 0,  # a burst of bad rows
            "outcome": "refined",
            "node": s["node"],
        }
        for s in sends
    ]
    w.land("accounting", pa.Table.from_pylist(acc), partition=0, first=0, last=0)
    alerts = [
        _alert(
            "gpu_xid",
            "n02/gpu2",
            _broker(T0 + 12 * S, speed),
            "n02",
            device="gpu2",
            evidence=json.dumps({"code": 79}),
        ),
        _alert("exporter_silent", "n03|nic|0", _broker(T0 + 25 * S, speed), "n03"),  # false
        _alert("refined_freshness", "pipeline", _broker(T0 + 60 * S, speed), None),  # 45 s behind
        _alert("clock_offset", "n01|gpu|0", _broker(T0 + 5 * S, speed), "n01"),  # clocks synced
        _alert("deadletter_rate", "pipeline", _broker(T0 + 7 * S, speed), None),  # the burst
    ]
    w.land("alerts", pa.Table.from_pylist(alerts), partition=0, first=0, last=0)


@pytest.mark.parametrize("speed", [1.0, 4.0])
def test_verify_names_every_defect(tmp_path: Path, speed: float) -> None:
    truth = tmp_path / "truth.parquet"
    samples, sends = _write_truth(truth, speed)
    _land(tmp_path / "lake", samples, sends, speed)
    v = verify(tmp_path / "lake", truth)
    s = v.data["samples"]
    good = sum(1 for r in samples.column("expected_reason").to_pylist() if r is None)
    assert (s.truth, s.lost, s.duplicated, s.unexpected) == (good, 1, 1, 2)
    assert (v.data["events"].lost, v.data["events"].duplicated) == (0, 0)
    assert v.data["collectives"].ok and v.data["collectives"].truth == 15
    clock = v.clock
    assert clock.samples == good - 1  # each key once, however often it landed
    if speed == 1.0:  # faster, the aligned times run behind the true ones: not judged
        assert clock.samples - clock.within == 4  # seq 0 of n01|gpu: 4 samples 50 ms off
        assert clock.worst_sources[0]["source"] == "n01|gpu|0"
        assert clock.err_max_ns == pytest.approx(50_200_000)
    assert v.run.factor == pytest.approx(speed, rel=0.01)  # the pace the samples kept
    a = v.alerts
    false = sorted(d["rule"] for d in a.unmatched)
    not_scored = {e["rule"]: e["why"] for e in a.excluded}
    assert not_scored["refined_freshness"].startswith("refiner behind: up to 4")
    assert not_scored["deadletter_rate"].startswith("dead letters at up to 20.0/s")
    assert a.incident_recall == 1.0 and a.missed == []
    if speed == 1.0:
        assert false == ["clock_offset", "exporter_silent"]
        assert a.precision == pytest.approx(1 / 3)
        assert any(m.startswith("clock:") for m in v.misses)
    else:  # clocks not judged: neither the samples' bound nor the clock alert
        assert false == ["exporter_silent"]
        assert "not judged" in not_scored["clock_offset"]
        assert not any(m.startswith("clock:") for m in v.misses)
    assert v.rules["exporter_silent"]["false"] == 1 and v.rules["gpu_xid"]["true"] == 1
    assert v.rules["node_memory_low"] == {"true": 0, "false": 0, "not_scored": 0}
    assert any(m.startswith("samples: 1 lost, 1 duplicated, 2 not in the truth") for m in v.misses)
    assert any("precision" in m for m in v.misses) and not v.ok
    text = render(v)
    assert "false: exporter_silent n03|nic|0" in text and "MISSED" in text


@pytest.mark.parametrize("speed", [1.0, 4.0])
def test_a_rule_holds_its_for_in_broker_time(tmp_path: Path, speed: float) -> None:
    """A power throttle of 24 s of true time and no gpu_power_throttle alert (its rule holds
    for 10 s): missed in real time; at speed 4 the pipeline saw 6 s of it, too short for
    the rule, so nothing was required (the throttling episode is not scored here)."""
    truth = tmp_path / "truth.parquet"
    throttle = {
        "id": "throttle-000-00",
        "kind": "throttle",
        "node": "n01",
        "device": "gpu1",
        "switch": None,
        "port": None,
        "job": None,
        "start_ns": T0 + 20 * S,
        "end_ns": T0 + 44 * S,
        "detail": json.dumps({"bits": 132, "cause": "power"}),
    }
    samples, sends = _write_truth(truth, speed, (throttle,))
    _land(tmp_path / "lake", samples, sends, speed)
    missed = {(m["incident"], m["signal"]) for m in verify(tmp_path / "lake", truth).alerts.missed}
    assert (("throttle-000-00", "gpu_power_throttle") in missed) == (speed == 1.0), missed


def _land_clean(
    lake: Path,
    samples: pa.Table,
    bound: Callable[[int], tuple[int, str | None]] = lambda i: (1000, None),
    event: dict[str, Any] | None = None,
    collective: Callable[[int, int], dict[str, Any]] = lambda op, rank: {},
) -> None:
    """A lake that has the run all, once, 100 ns from the true time, and the XID alert;
    ``bound(i)``: the i-th good sample's ``clock_error_ns`` and ``clock_basis``."""
    w = LakeWriter(lake)
    w.ensure_seeds()
    good = [r for r in samples.to_pylist() if r["expected_reason"] is None]
    rows = [
        {
            "node": r["node"],
            "device": r["device"],
            "metric": r["metric"],
            "unit": "x",
            "ts": r["ts_true_ns"] + 100,
            "ts_source": r["ts_source_ns"],
            "clock_offset_ns": 0,
            "clock_error_ns": bound(i)[0],
            "clock_basis": bound(i)[1],
            "reset": False,
            "late": False,
            "exporter": r["exporter"],
            "instance": "0",
            "boot_id": r["boot_id"],
            "seq": r["seq"],
            "raw_partition": 0,
            "raw_offset": i,
        }
        for i, r in enumerate(good)
    ]
    w.land("samples", pa.Table.from_pylist(rows), partition=0, first=0, last=0)
    _land_events_and_collectives(w, event, collective)
    xid = _alert("gpu_xid", "n02/gpu2", T0 + 12 * S, "n02", evidence=json.dumps({"code": 79}))
    w.land("alerts", pa.Table.from_pylist([xid]), partition=0, first=0, last=0)


def test_verify_clean_run_meets_every_goal(tmp_path: Path) -> None:
    """The same truth with a lake that has it all, once, on time: exit-0 verdict."""
    truth = tmp_path / "truth.parquet"
    samples, _ = _write_truth(truth, 1.0)
    _land_clean(tmp_path / "lake", samples)
    v = verify(tmp_path / "lake", truth)
    assert v.ok, v.misses
    assert v.misses == []
    assert v.clock.within_share == 1.0 and v.alerts.precision == 1.0
    assert "every goal met" in render(v)


def test_an_event_and_a_collective_off_their_bound_are_counted(tmp_path: Path) -> None:
    """The XID event 5 ms from its true time with a 1 ms bound; of the 15 collective records
    one 3 ms off with a 2 ms bound (out) and one 1 ms off with the same bound (in): each
    dataset's within-bound share misses its goal and fails the verdict."""
    truth = tmp_path / "truth.parquet"
    samples, _ = _write_truth(truth, 1.0)
    off = {(2, 1): 3_000_000, (3, 0): 1_000_000}
    _land_clean(
        tmp_path / "lake",
        samples,
        event={"ts": T0 + 12 * S + 5_000_000, "clock_error_ns": 1_000_000},
        collective=lambda op, r: (
            {"ts": T0 + op * S + off[op, r], "clock_error_ns": 2_000_000} if (op, r) in off else {}
        ),
    )
    v = verify(tmp_path / "lake", truth)
    ev, co = v.clocks["events"], v.clocks["collectives"]
    assert (ev.rows, ev.within, ev.err_p99_ns) == (1, 0, 5_000_000)
    assert ev.worst_sources == [
        {"source": "n02|kmsg", "out_of_bound": 1, "rows": 1, "err_max_ns": 5_000_000}
    ]
    assert (co.rows, co.within) == (15, 14)
    assert co.err_p99_ns == pytest.approx(np.quantile([0] * 13 + [1e6, 3e6], 0.99))
    assert co.worst_sources[0]["source"] == "n02|nccl"  # rank 1's row, as the lake names it
    assert v.clock.within == v.clock.rows  # the samples are all inside
    assert not v.ok
    assert "clock: 0.00 % of events within their bound (goal ≥ 99.9 %)" in v.misses
    assert "clock: 93.33 % of collectives within their bound (goal ≥ 99.9 %)" in v.misses
    text = render(v)
    assert "clock events      0.000 % of 1 within their bound (≥ 99.9 % missed)" in text
    assert "out of bound: collectives n02|nccl  1 of 5" in text


def _tight(i: int) -> tuple[int, str | None]:
    """The i-th sample's bound: every 100th 'assumed' and 150 ms wide, the others on
    exchanges from 0.5 to 3 ms."""
    if i % 100 == 0:
        return 150_000_000, "assumed"
    return 500_000 + (i % 51) * 50_000, "exchange"


def test_bound_tightness_figures(tmp_path: Path) -> None:
    truth = tmp_path / "truth.parquet"
    samples, _ = _write_truth(truth, 1.0)
    _land_clean(
        tmp_path / "lake",
        samples,
        bound=_tight,
        event={"clock_error_ns": 120_000_000, "clock_basis": "assumed"},
        collective=lambda op, r: {
            "clock_error_ns": 1_000_000 * (op + 1),
            "clock_basis": "exchange",
        },
    )
    v = verify(tmp_path / "lake", truth)
    k = v.clock
    bounds = [_tight(i) for i in range(k.rows)]
    ex = [b for b, basis in bounds if basis == "exchange"]
    assert k.rows == 920 and k.wide == 10  # i = 0, 100, ..., 900
    assert k.wide_share == pytest.approx(10 / 920)
    assert k.bound_p50_ns == pytest.approx(np.quantile([b for b, _ in bounds], 0.5))
    assert k.bound_p99_ns == pytest.approx(np.quantile([b for b, _ in bounds], 0.99))
    assert k.by_basis["exchange"].rows == 910 and k.by_basis["assumed"].rows == 10
    assert k.by_basis["exchange"].p50_ns == pytest.approx(np.quantile(ex, 0.5))
    assert k.by_basis["exchange"].p99_ns == pytest.approx(np.quantile(ex, 0.99))
    assert k.by_basis["assumed"].p50_ns == 150_000_000
    assert v.clocks["events"].wide_share == 1.0  # its one event, 120 ms
    co = v.clocks["collectives"]
    assert (co.wide, co.bound_p50_ns, co.by_basis["exchange"].p99_ns) == (
        0,
        3_000_000,
        pytest.approx(np.quantile([1e6 * (op + 1) for op in range(5) for _ in range(3)], 0.99)),
    )
    assert v.ok  # every row inside its bound: tightness alone does not fail
    assert v.misses == [
        "bounds: 1.087 % of samples bounded wider than 100 ms (goal ≤ 0.1 %)",
        "bounds: 100.000 % of events bounded wider than 100 ms (goal ≤ 0.1 %)",
        "bounds: collectives exchange-based bound p50 3 ms (goal ≤ 2 ms)",
    ]
    d = v.as_dict()
    assert d["ok"] and d["tightness_misses"] == v.misses
    assert d["clocks"]["samples"]["by_basis"]["exchange"]["rows"] == 910
    assert d["clocks"]["events"]["wide_share"] == 1.0


def test_a_tightness_miss_fails_only_with_strict_bounds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every exchange-based bound 3 ms wide, every row inside it: listed as missed, exit 0;
    exit 1 with --strict-bounds."""
    from services.cli import main

    truth = tmp_path / "truth.parquet"
    samples, _ = _write_truth(truth, 1.0)
    _land_clean(tmp_path / "lake", samples, bound=lambda i: (3_000_000, "exchange"))
    args = ["verify", "--truth", str(truth), "--lake", str(tmp_path / "lake")]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "exchange 920 p50 3 ms (≤ 2 ms missed) p99 3 ms (≤ 20 ms met)" in out
    assert "missed (not failing without --strict-bounds): bounds: samples exchange-based" in out
    assert main([*args, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["ok"] and d["misses"] == [
        "bounds: samples exchange-based bound p50 3 ms (goal ≤ 2 ms)"
    ]
    p50 = [g for g in d["clock_goals"] if g["figure"] == "exchange_bound_p50_ns"]
    assert [(g["dataset"], g["value"], g["met"]) for g in p50] == [("samples", 3e6, False)]
    assert main([*args, "--strict-bounds"]) == 1
    assert "MISSED: bounds: samples exchange-based bound p50 3 ms" in capsys.readouterr().out
    v = verify(tmp_path / "lake", truth, strict_bounds=True)
    assert not v.ok and v.misses == d["misses"]


def test_verify_cli_says_what_is_wrong_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from services.cli import main

    truth = tmp_path / "truth.parquet"
    assert main(["verify", "--truth", str(truth), "--lake", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip().endswith("no such file")
    _write_truth(truth, 1.0)
    (tmp_path / "half" / "samples").mkdir(parents=True)  # no dataset's seed file
    assert main(["verify", "--truth", str(truth), "--lake", str(tmp_path / "half")]) == 2
    err = capsys.readouterr().err.strip()
    assert "not a lake of every dataset" in err and len(err.splitlines()) == 1
    w = LakeWriter(tmp_path / "lake")
    w.ensure_seeds()  # every dataset, none with a sample
    _land_events_and_collectives(w)
    assert main(["verify", "--truth", str(truth), "--lake", str(tmp_path / "lake")]) == 1
    assert "MISSED: samples: 920 lost" in capsys.readouterr().out
