"""A source is silent only when the pipeline has moved past the time it should have been heard
from: judged on each raw partition's progress in broker time, never on the wall clock or on
one source's clock. The stream below is what detect reads of a real run, record by record:
sources sending every second at phases of their own over two partitions, a refiner killed for
25 s and restarted (it replays a few records, then catches one partition up before the other),
the refined and accounting topics read with lags of their own, a node whose clock estimate
runs 20 s ahead for 10 s and then jumps back, and one source that really stops."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from schemas.catalog import default_catalog
from schemas.codec import ipc_stream
from schemas.topics import TOPICS
from services.detect.core import DetectCore
from services.detect.detector import Detector, Emitted
from services.telemetry import ServiceTelemetry
from tests.unit.derived_helpers import T0, S, refined

SEED = 8191  # this test's own
SECONDS = 90
NODES = [f"n{i:02d}" for i in range(6)]
EXPORTERS = {"gpu": ("gpu0", "gpu.temp", 60.0), "node": ("node", "mem.available_bytes", 5e11)}
STOPS = ("n03|gpu|0", 50)  # this source really stops after 50 s
SKEWED = ("n04", 30, 40, 20 * S)  # its aligned ts run 20 s ahead from 30 s to 40 s
KILLED, RESTARTED = 20, 45  # the refiner is down in between (true seconds)


@dataclass
class Raw:
    partition: int
    offset: int
    append: int
    node: str
    exporter: str
    seq: int
    ts: int  # aligned ts the refiner gives its rows


def raw_records(rng: np.random.Generator) -> list[Raw]:
    """Every exporter batch of the run, in append order, with its partition and offset."""
    out: list[tuple[int, str, str, int, int]] = []
    for node in NODES:
        for exp in EXPORTERS:
            phase = int(rng.integers(0, S))
            last = STOPS[1] if f"{node}|{exp}|0" == STOPS[0] else SECONDS
            for sec in range(last):
                true = T0 + sec * S + phase
                out.append((true + int(rng.integers(200_000, 5_000_000)), node, exp, sec, true))
    out.sort()
    offsets = [0, 0]
    recs = []
    for append, node, exp, sec, true in out:
        p = NODES.index(node) % 2
        skew = SKEWED[3] if node == SKEWED[0] and SKEWED[1] <= sec < SKEWED[2] else 0
        recs.append(Raw(p, offsets[p], append, node, exp, sec, true + skew))
        offsets[p] += 1
    return recs


def lane(node: str) -> int:
    """The refined partition of a node's rows (3 of them; raw records use 2): n00 and n02
    share both their raw and their refined partition, so do n03 and n05."""
    return (0, 1, 0, 2, 1, 2)[NODES.index(node)]


def processed_at(r: Raw) -> list[tuple[int, bool]]:
    """When the refiner handles ``r`` (true ns) and whether it publishes its rows then (a
    replay after the restart publishes nothing). Down from KILLED to RESTARTED; back, it
    replays the 3 s before the kill, then catches partition 0 up, then partition 1."""
    t = _round(r.append + 200 * 1_000_000, S)
    kill, back = T0 + KILLED * S, T0 + RESTARTED * S
    if t < kill:
        replay = t >= kill - 3 * S
        return [(t, True)] + ([(back + S // 2, False)] if replay else [])
    if r.append >= back + 15 * S:
        return [(t, True)]
    if r.partition == 0:  # caught up within 10 s, in order, 4 s of records a round
        share = (r.append - (kill - 3 * S)) / (back + 15 * S - kill)
        return [(_round(back + S + int(share * 9 * S), 4 * S), True)]
    share = (r.append - kill) / (back + 15 * S - kill)  # then partition 1, 10 s later
    return [(_round(back + 11 * S + int(share * 4 * S), 4 * S), True)]


def _round(t: int, every: int) -> int:
    """The end of the refiner's round (every ``every`` ns) that handles time ``t``: a round's
    records are published together, a node's rows in one message."""
    return -(-t // every) * every


def detect_inputs(rng: np.random.Generator) -> list[tuple[int, str, int, int, bytes]]:
    """(read time, topic, partition, offset, value) of every refined and accounting record, as
    detect reads them: each topic partition in order, each with a lag of its own."""
    streams: dict[tuple[str, int], list[tuple[int, bytes, str, int]]] = {}
    for r in raw_records(rng):
        for t, publish in processed_at(r):
            doc = {
                "raw_topic": "telemetry.raw",
                "raw_partition": r.partition,
                "raw_offset": r.offset,
                "node": r.node,
                "outcome": "refined",
                "append_ms": r.append // 1_000_000,
                "input_samples": 1,
                "refined_samples": 1,
                "quarantined_samples": 0,
            }
            if publish:
                doc["ts_max"] = r.ts  # the newest aligned ts of its rows
            else:
                doc["outcome"] = "replay"
            streams.setdefault((TOPICS.accounting, r.partition), []).append(
                (t, json.dumps(doc).encode(), "", r.offset)
            )
            if publish:
                dev, metric, base = EXPORTERS[r.exporter]
                row = {
                    "node": r.node,
                    "device": dev,
                    "metric": metric,
                    "ts": r.ts,
                    "value": base + float(rng.normal(0, 1)),
                    "exporter": r.exporter,
                    "seq": r.seq,
                    "raw_partition": r.partition,
                    "raw_offset": r.offset,
                }
                # the refined topic's partitioner is not the exporters': a raw partition's
                # rows reach detect through several refined partitions, read at paces of
                # their own
                streams.setdefault((TOPICS.refined, lane(r.node)), []).append(
                    (t, bytes(ipc_stream(refined([row]))), r.node, r.offset)
                )
    out = []
    for (topic, part), recs in streams.items():
        lag, last = 0, 0
        # a round's messages node by node (a refined message holds one node's rows)
        for off, (t, value, _, _) in enumerate(sorted(recs, key=lambda x: x[:1] + x[2:])):
            lag = max(0, min(8 * S, lag + int(rng.normal(0, 0.5 * S))))
            last = max(last + S // 20, t + lag)  # read one after the other
            out.append((last, topic, part, off, value))
    return sorted(out, key=lambda x: x[0])


def run_detect(inputs: list[tuple[int, str, int, int, bytes]]) -> Emitted:
    """Feed detect in groups of what arrived each 200 ms, ticking every second."""
    det = Detector(default_catalog())
    core = DetectCore(TOPICS, det, ServiceTelemetry("test"))
    core.begin([])
    out, i, now, next_tick = Emitted(), 0, T0, T0
    published: dict[int, int] = {}
    while now < T0 + (SECONDS + 20) * S:
        group = []
        while i < len(inputs) and inputs[i][0] <= now:
            _, topic, part, off, value = inputs[i]
            group.append((topic, part, off, value))
            if topic == TOPICS.refined:
                published[part] = off + 1
                core._next.setdefault(part, 0)
            i += 1
        out.extend(core.route_group(group, now))
        wm = core.watermark(lambda p: published.get(p, -1))
        if wm is not None:
            out.extend(det.advance(wm, now))
        if now >= next_tick:
            out.extend(det.tick(now))
            next_tick += S
        now += S // 5
    return out


def firing(out: Emitted) -> list[Any]:
    return [a for a in out.alerts if a.state.value == "firing"]


def test_only_the_source_that_stopped_is_silent() -> None:
    out = run_detect(detect_inputs(np.random.default_rng(SEED)))
    fired = firing(out)
    assert [(a.rule, a.entity) for a in fired] == [("exporter_silent", STOPS[0])], [
        (a.rule, a.entity, a.starts_ns - T0) for a in fired
    ]
    (a,) = fired
    # onset: the broker's append time of its last record, in its 50th second
    assert T0 + (STOPS[1] - 1) * S <= a.starts_ns < T0 + STOPS[1] * S
    assert a.evidence["raw_partition"] == NODES.index("n03") % 2


def test_the_same_under_other_seeds_of_the_stream() -> None:
    for seed in (SEED + 1, SEED + 2):
        fired = firing(run_detect(detect_inputs(np.random.default_rng(seed))))
        assert [(a.rule, a.entity) for a in fired] == [("exporter_silent", STOPS[0])]


def test_rows_of_one_raw_partition_all_count_however_its_nodes_interleave() -> None:
    """A refined partition read ahead of another, or one node's message of a refiner group
    read before another's whose records interleave with it, does not make the other's rows
    replays; a replay of a node's own message still is one."""
    core = DetectCore(TOPICS, Detector(default_catalog()), ServiceTelemetry("test"))

    def rec(node: str, *offsets: int) -> bytes:
        rows = [
            {
                "node": node,
                "device": "gpu0",
                "metric": "gpu.temp",
                "ts": T0 + o * S,
                "value": 60.0,
                "raw_partition": 0,
                "raw_offset": o,
            }
            for o in offsets
        ]
        return bytes(ipc_stream(refined(rows)))

    def kept(part: int, off: int, value: bytes) -> int:
        t = core._refined(part, off, value)
        return 0 if t is None else t.num_rows

    assert kept(1, 0, rec("n01", 20, 24)) == 2  # refined partition 1 read ahead
    assert kept(0, 0, rec("n00", 10, 14, 18)) == 3  # partition 0: older, not a replay
    assert kept(0, 1, rec("n02", 11, 15, 19)) == 3  # interleaves with n00's: all new
    assert kept(0, 2, rec("n00", 10, 14, 18)) == 0  # the refiner's replay of n00's
    assert kept(0, 3, rec("n00", 14, 18, 22)) == 1  # a replay that goes on


def test_an_ingest_topics_offsets_are_its_own() -> None:
    """A node's exporter on telemetry.raw and its Influx source on an ingest topic, both
    sending every second: partition 0 of each has offsets of its own (the raw one far ahead)."""
    from pipelines.detect.rule_config import load_rules
    from pipelines.detect.rules import RuleEngine
    from services.detect.detector import DEFAULT_RULES

    cat = default_catalog()
    e = RuleEngine(load_rules(DEFAULT_RULES, cat), cat, raw_topic="telemetry.raw")
    out: list[Any] = []
    for sec in range(40):
        for topic, exp, off in (
            ("telemetry.raw", "node", 1000 + 3 * sec),
            ("ingest.influx", "influx", sec),
        ):
            at = T0 + sec * S + (S // 3 if exp == "influx" else 0)
            e.on_progress(0, off, at, "n1", True, topic)
            row = {
                "node": "n1",
                "device": "node",
                "metric": "mem.available_bytes",
                "ts": at,
                "value": 5e11 + sec,
                "exporter": exp,
                "seq": sec,
                "raw_partition": 0,
                "raw_offset": off,
                "raw_topic": topic,
            }
            out += e.evaluate(refined([row]), at)
        e.on_progress(0, 1000 + 3 * sec + 2, T0 + sec * S + S // 2, "n2", False)  # another node
        out += e.tick(T0 + sec * S + S // 2)
    assert out == []
    for sec in range(40, 50):  # the Influx source stops; the raw one goes on
        e.on_progress(0, 1000 + 3 * sec, T0 + sec * S, "n1", True, "telemetry.raw")
        row = {
            "node": "n1",
            "device": "node",
            "metric": "mem.available_bytes",
            "ts": T0 + sec * S,
            "value": 5e11 + sec,
            "exporter": "node",
            "seq": sec,
            "raw_partition": 0,
            "raw_offset": 1000 + 3 * sec,
            "raw_topic": "telemetry.raw",
        }
        out += e.evaluate(refined([row]), T0 + sec * S)
        e.on_progress(0, 40 + sec, T0 + sec * S, "n9", False, "ingest.influx")  # others there
        out += e.tick(T0 + sec * S + S // 2)
    assert [(a.rule, a.entity, a.state.value) for a in out] == [
        ("exporter_silent", "n1|influx|0", "firing")
    ]


def test_a_leader_failover_silences_nobody_and_a_real_stop_after_it_fires() -> None:
    """Nodes n1 and n2 share raw partition 0, one batch a second each. The partition's
    leader fails for 10 s: nothing is appended, then every queued batch at once, n2's first;
    read up to n2's burst, n1 is not silent (the partition took nobody's records meanwhile).
    Later n1 stops while n2 goes on: n1 is silent after three intervals."""
    from pipelines.detect.rule_config import load_rules
    from pipelines.detect.rules import RuleEngine
    from services.detect.detector import DEFAULT_RULES

    cat = default_catalog()
    e = RuleEngine(load_rules(DEFAULT_RULES, cat), cat, raw_topic="telemetry.raw")
    off = 0
    out: list[Any] = []

    def batch(node: str, sec: int, append_ns: int) -> None:
        nonlocal off, out
        off += 1
        e.on_progress(0, off, append_ns, node, True, "telemetry.raw")
        row = {
            "node": node,
            "device": "node",
            "metric": "mem.available_bytes",
            "ts": T0 + sec * S,
            "value": 5e11 + sec,
            "exporter": "node",
            "seq": sec,
            "raw_partition": 0,
            "raw_offset": off,
            "raw_topic": "telemetry.raw",
        }
        out += e.evaluate(refined([row]), append_ns)

    for sec in range(20):
        batch("n1", sec, T0 + sec * S)
        batch("n2", sec, T0 + sec * S + S // 2)
        out += e.tick(T0 + sec * S + S // 2)
    resume = T0 + 30 * S
    for sec in range(20, 30):  # n2's queued batches, appended at once
        batch("n2", sec, resume)
    out += e.tick(resume)
    assert out == []  # read up to n2's burst: n1's own come next
    for sec in range(20, 30):
        batch("n1", sec, resume + 1_000_000)
    out += e.tick(resume + 1_000_000)
    for sec in range(30, 45):  # n1 stops after 34
        if sec < 35:
            batch("n1", sec, T0 + sec * S)
        batch("n2", sec, T0 + sec * S + S // 2)
        out += e.tick(T0 + sec * S + S // 2)
    assert [(a.rule, a.entity, a.state.value) for a in out] == [
        ("exporter_silent", "n1|node|0", "firing")
    ]
    assert out[0].starts_ns == T0 + 34 * S


def test_a_source_whose_records_the_broker_takes_slower_than_its_clock_is_not_silent() -> None:
    """n1's clock spaces its batches 0.25 s apart, but its producer gets one to the broker
    every 0.8 s, two at once at times (1.6 s gaps): silence is judged in broker time, on the
    interval its records keep there, so n1 is not silent; when it stops while n2 goes on,
    it is after three of those intervals."""
    from pipelines.detect.rule_config import load_rules
    from pipelines.detect.rules import RuleEngine
    from services.detect.detector import DEFAULT_RULES

    cat = default_catalog()
    e = RuleEngine(load_rules(DEFAULT_RULES, cat), cat, raw_topic="telemetry.raw")
    out: list[Any] = []
    off, append = 0, T0

    def n2_until(end: int) -> None:  # n2's records every 0.2 s, detect ticking after each
        nonlocal off, append, out
        while append + S // 5 < end:
            append += S // 5
            off += 1
            e.on_progress(0, off, append, "n2", False)
            out += e.tick(append)

    for k in range(60):
        n2_until(append + (8 * S // 10 if k % 7 else 16 * S // 10))
        append += S // 5
        off += 1
        e.on_progress(0, off, append, "n1", True)
        row = {"node": "n1", "device": "node", "metric": "mem.available_bytes",
               "ts": T0 + k * S // 4, "value": 5e11 + k, "exporter": "node", "seq": k,
               "raw_partition": 0, "raw_offset": off}  # fmt: skip
        out += e.evaluate(refined([row]), append)
        out += e.tick(append)
    assert out == []
    n2_until(append + 3 * S)  # n1 stops; n2's records go on
    assert [(a.rule, a.entity, a.state.value) for a in out] == [
        ("exporter_silent", "n1|node|0", "firing")
    ]


def test_a_producer_stall_shorter_than_a_second_silences_nobody() -> None:
    """n1 and n2 share raw partition 0, a batch every 0.25 s each; their producer stalls: for
    0.9 s (more than three of their intervals) the partition takes nothing. Read up to
    n2's first batch after it, n1 is not silent."""
    from pipelines.detect.rule_config import load_rules
    from pipelines.detect.rules import RuleEngine
    from services.detect.detector import DEFAULT_RULES

    cat = default_catalog()
    e = RuleEngine(load_rules(DEFAULT_RULES, cat), cat, raw_topic="telemetry.raw")
    out: list[Any] = []
    off = 0
    for k in range(40):
        at = T0 + k * S // 4 + (65 * S // 100 if k >= 30 else 0)
        for node in ("n2", "n1") if k == 30 else ("n1", "n2"):
            off += 1
            e.on_progress(0, off, at + (node == "n1"), node, True)
            row = {"node": node, "device": "node", "metric": "mem.available_bytes",
                   "ts": at, "value": 5e11 + k, "exporter": "node", "seq": k,
                   "raw_partition": 0, "raw_offset": off}  # fmt: skip
            out += e.evaluate(refined([row]), at)
            out += e.tick(at)
    assert out == []


def test_a_producer_falling_behind_silences_nobody_and_a_real_stop_still_fires() -> None:
    """Four nodes share raw partition 0, a batch a second each (data time). Their producer
    falls behind (a loaded host): at 10 s it gets a second of their records to the broker
    in 4.4 s, the partition never pausing for long. In broker time n1's records are more
    than three intervals apart; in the time they tell, nobody's data stopped: nobody is
    silent. Back on time, n1 stops while
    the others go on: it is silent after three intervals."""
    from pipelines.detect.rule_config import load_rules
    from pipelines.detect.rules import RuleEngine
    from services.detect.detector import DEFAULT_RULES

    cat = default_catalog()
    e = RuleEngine(load_rules(DEFAULT_RULES, cat), cat, raw_topic="telemetry.raw")
    out: list[Any] = []
    off, append = 0, T0
    nodes = ("n1", "n2", "n3", "n4")
    for sec in range(60):
        # broker time one second of data takes: 1 s, 4.4 s at 10 s (the host crawled), then
        # 0.4 s while the backlog drains, 1 s again once it has
        took = S if sec < 10 or sec >= 17 else (44 * S // 10 if sec == 10 else 4 * S // 10)
        for k, node in enumerate(nodes):
            if node == "n1" and sec >= 45:
                continue  # n1 stops
            append += took // len(nodes)
            off += 1
            ts = T0 + sec * S + k * S // 8
            e.on_progress(0, off, append, node, True, "telemetry.raw", ts)
            row = {"node": node, "device": "node", "metric": "mem.available_bytes",
                   "ts": ts, "value": 5e11 + sec, "exporter": "node", "seq": sec,
                   "raw_partition": 0, "raw_offset": off, "raw_topic": "telemetry.raw"}  # fmt: skip
            out += e.evaluate(refined([row]), append)
            out += e.tick(append)
        if sec == 44:
            assert out == []  # the slow spell silenced nobody
    assert [(a.rule, a.entity, a.state.value) for a in out] == [
        ("exporter_silent", "n1|node|0", "firing")
    ]
