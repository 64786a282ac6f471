"""The cluster simulator without Kafka: shape, determinism, physics of counters, faults, truth."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from lab.simulate.bench import bench_generate
from lab.simulate.cli import parse_duration_ns
from lab.simulate.cluster import Cluster
from lab.simulate.engine import GREET_LEAD_NS, Message, SendKind, Simulation, Stream
from lab.simulate.faults import FaultKind, parse_faults
from lab.simulate.malformed import SAMPLE_REASONS
from lab.simulate.truth import TruthWriter, load_truth
from schemas.codec import decode
from schemas.errors import ConfigError, RejectedInput
from schemas.reasons import RECORD_REASONS, REFINER_REASONS, Reason
from schemas.records import EntityKind

S = 1_000_000_000
T0 = 1_700_000_000 * S


def run(nodes: int, faults: str, seconds: int, seed: int = 1) -> tuple[Simulation, list[Message]]:
    sim = Simulation(
        Cluster.build(nodes, seed=seed), faults, seed=seed, start_ns=T0, duration_ns=seconds * S
    )
    return sim, [m for tick in sim.ticks() for m in tick.messages]


def series(msgs: list[Message], exporter: str) -> dict[tuple[str, str, str, str], list[int]]:
    """(node, boot_id, metric, device) → raw readings in send order of the good batches."""
    out: dict[tuple[str, str, str, str], list[int]] = defaultdict(list)
    good = [m for m in msgs if m.stream is Stream.RAW and m.kind in (SendKind.BATCH, SendKind.LATE)]
    good.sort(key=lambda m: (m.envelope.source.key(), m.envelope.seq))  # type: ignore[union-attr]
    for m in good:
        assert m.envelope is not None and m.table is not None
        if m.envelope.source.exporter != exporter:
            continue
        t = m.table.slice(0, m.table.num_rows - len(m.bad or ()))
        src = m.envelope.source
        for metric, device, raw in zip(
            t.column("metric").to_pylist(),
            t.column("device").to_pylist(),
            t.column("raw").to_pylist(),
            strict=True,
        ):
            if raw is not None:
                out[(src.node, src.boot_id, metric, device)].append(raw)
    return out


# -- shape ------------------------------------------------------------------------------------


def test_topology_shape_rail_optimized() -> None:
    c = Cluster.build(nodes=20, gpus=8, nics=8, seed=0)
    ents = c.topology()
    by_kind: dict[EntityKind, list] = defaultdict(list)  # type: ignore[type-arg]
    for e in ents:
        by_kind[e.kind].append(e)
    assert len(by_kind[EntityKind.NODE]) == 20
    assert len(by_kind[EntityKind.GPU]) == 160
    assert len(by_kind[EntityKind.NIC]) == 160
    leaves = [e for e in by_kind[EntityKind.SWITCH] if e.role == "leaf"]
    spines = [e for e in by_kind[EntityKind.SWITCH] if e.role == "spine"]
    assert len(leaves) == 2 * 8 and len(spines) == 8
    host_links = [e for e in by_kind[EntityKind.LINK] if e.node is not None]
    assert len(host_links) == 160
    for link in host_links:
        i = int(link.node[4:])  # type: ignore[index]
        rail = int(link.device.split("/")[0].split("_")[1])  # type: ignore[union-attr]
        assert link.switch == f"leaf-p{i // 16}-r{rail}" and link.rail == rail
        assert link.switch_port == str(i % 16)
    assert len([e for e in by_kind[EntityKind.LINK] if e.peer]) == 16 * 8
    for gpu in by_kind[EntityKind.GPU]:
        assert gpu.nic == f"mlx5_{gpu.device[3:]}" and gpu.nvlink_domain == gpu.node  # type: ignore[index]
    assert len({e.id for e in ents}) == len(ents)


def test_jobs_are_disjoint_and_ranks_are_node_by_gpu() -> None:
    c = Cluster.build(nodes=10, gpus=4, nics=4)
    jobs = c.jobs(T0)
    assert [j.job for j in jobs] == ["job-101", "job-102"]
    assert not set(jobs[0].nodes) & set(jobs[1].nodes)
    assert len(jobs[0].ranks) == len(jobs[0].nodes) * 4
    assert jobs[0].ranks[5].node == jobs[0].nodes[1] and jobs[0].ranks[5].gpu == "gpu1"


# -- determinism and volume -------------------------------------------------------------------


def test_same_seed_same_bytes_other_seed_differs() -> None:
    _, a = run(4, "all", 6, seed=5)
    sim_b, b = run(4, "all", 6, seed=5)
    _, c = run(4, "all", 6, seed=6)
    assert [m.encode() for m in a] == [m.encode() for m in b]
    assert [m.encode()[1] for m in a[:20]] != [m.encode()[1] for m in c[:20]]
    assert sim_b.incidents and all(i.start_ns >= T0 for i in sim_b.incidents)


def test_batches_are_large_and_decode() -> None:
    _, msgs = run(3, "none", 2)
    raw = [m for m in msgs if m.stream is Stream.RAW]
    assert len(raw) == 3 * 3 * 2
    for m in raw:
        batch = decode(*reversed(m.encode()))
        assert batch.table.num_rows == m.samples >= 300
        assert batch.envelope.source.exporter in ("node", "gpu", "nic")


def test_spread_phases_shift_each_node_within_its_tick() -> None:
    """``spread``: each node samples and sends at a phase of its own in every tick (the same
    phase each tick, whole ms, under one interval); the same batches and samples as in
    lockstep, sent over the tick instead of at its start."""
    nodes, seconds = 12, 4

    def raw(spread: bool) -> list[Message]:
        sim = Simulation(
            Cluster.build(nodes, seed=3), "none", seed=3, start_ns=T0,
            duration_ns=seconds * S, spread=spread,
        )  # fmt: skip
        return [m for t in sim.ticks() for m in t.messages if m.stream is Stream.RAW]

    lock, spread = raw(False), raw(True)
    assert len(spread) == len(lock) == nodes * 3 * seconds
    assert sum(m.samples for m in spread) == sum(m.samples for m in lock)
    phase: dict[str, set[int]] = defaultdict(set)
    for m in spread:
        assert m.envelope is not None and m.table is not None
        true_ts = np.asarray(m.table.column("ts_ns")) - m.offset_ns
        tick = (int(true_ts.min()) - T0) // S
        into = int(true_ts.min()) - T0 - tick * S  # the node's phase in this tick
        phase[m.envelope.source.node].add(into)
        assert 0 <= into < S and into % 1_000_000 == 0
        assert m.sent_true_ns > true_ts.max() and m.due_ns > m.sent_true_ns
    assert all(len(p) == 1 for p in phase.values())  # one phase per node, every tick
    assert len({min(p) for p in phase.values()}) > nodes // 2  # and they differ
    # lockstep: each exporter's sends within a few ms of each other (after the tick's last
    # sample); spread: over the whole tick
    for exporter in ("node", "gpu", "nic"):
        mine = [m for m in lock if m.envelope and m.envelope.source.exporter == exporter]
        assert np.ptp([m.due_ns % S for m in mine]) < 50_000_000
        mine = [m for m in spread if m.envelope and m.envelope.source.exporter == exporter]
        assert np.ptp([m.due_ns % S for m in mine]) > S // 2


def test_values_within_catalog_ranges() -> None:
    _, msgs = run(4, "throttle", 20)
    vals: dict[str, list[float]] = defaultdict(list)
    for m in msgs:
        if m.stream is Stream.RAW and m.table is not None:
            for metric, v in zip(
                m.table.column("metric").to_pylist(),
                m.table.column("value").to_pylist(),
                strict=True,
            ):
                vals[metric].append(v)
    assert min(vals["gpu.util"]) >= 0 and max(vals["gpu.util"]) <= 100
    assert max(vals["gpu.sm_clock"]) <= 1980 and min(vals["gpu.sm_clock"]) >= 300
    assert min(vals["gpu.temp"]) >= 20 and max(vals["gpu.temp"]) < 100
    assert max(vals["gpu.power"]) <= 700
    assert max(vals["gpu.fb_used"]) <= 81_559
    assert set(int(v) & ~0xED for v in vals["gpu.clock_event_reasons"]) == {0}
    assert max(vals["mem.available_bytes"]) <= 2 * 1024**4


# -- counters ---------------------------------------------------------------------------------


def test_counters_monotonic_except_declared_resets_and_wraps() -> None:
    sim, msgs = run(6, "reset,wrap,link_flap,pfc_storm", 30)
    wrap = next(i for i in sim.incidents if i.kind is FaultKind.WRAP)
    reset = next(i for i in sim.incidents if i.kind is FaultKind.RESET)
    wrapped = 0
    for exporter in ("node", "gpu", "nic"):
        for (node, _boot, metric, device), xs in series(msgs, exporter).items():
            d = np.diff(np.asarray(xs, dtype=np.float64))
            if (node, metric, device) == (wrap.node, "rdma.out_of_sequence", wrap.device):
                assert (d < 0).sum() == 1 and max(xs) < 2**32
                wrapped += 1
            else:
                assert (d >= 0).all(), (node, metric, device)
    assert wrapped == 1
    boots = {
        m.envelope.source.boot_id
        for m in msgs
        if m.envelope and m.key.decode() == reset.node and m.envelope.source.exporter == "gpu"
    }
    assert len(boots) == 2
    after = [
        m
        for m in msgs
        if m.envelope
        and m.key.decode() == reset.node
        and m.stream is Stream.RAW
        and m.kind is SendKind.BATCH
        and m.sent_true_ns > reset.end_ns
    ]
    assert after and min(m.envelope.seq for m in after if m.envelope) == 0


def test_link_flap_stalls_counters_and_emits_events() -> None:
    _, msgs = run(4, "link_flap:node=node0001,nic=2,start=5,dur=4", 12)
    s = series(msgs, "nic")
    boot = next(iter({k[1] for k in s if k[0] == "node0001"}))
    xs = np.asarray(s[("node0001", boot, "ib.port_xmit_data", "mlx5_2/1")])
    per_substep = np.diff(xs)  # 10 samples a second
    assert (per_substep[50:88] == 0).all() and (per_substep[:45] > 0).all()
    assert (per_substep[92:] > 0).all()
    evs = [
        e
        for m in msgs
        if m.stream is Stream.EVENTS and m.table is not None
        for e in m.table.to_pylist()
    ]
    assert [e["event"] for e in evs] == ["link_down", "link_up"]
    assert all(e["device"] == "mlx5_2/1" for e in evs)


def test_storm_raises_pauses_only_behind_port_and_delays_only_that_rail() -> None:
    sim, msgs = run(8, "pfc_storm:leaf=leaf-p0-r3,port=2,start=5,dur=10", 20)
    storm = sim.incidents[0]
    assert storm.node == "node0002" and storm.job == "job-101"
    for (node, _b, metric, device), xs in series(msgs, "nic").items():
        rise = xs[-1] - xs[0]
        if metric in ("nic.rx_prio_pause", "nic.rx_prio_pause_duration"):
            if (node, device) == ("node0002", "eth3/prio3"):
                assert rise > 100_000
            else:
                assert rise < 50, (node, device, rise)
        if metric == "rdma.np_ecn_marked_roce_packets" and (node, device) == (
            "node0002",
            "mlx5_3/1",
        ):
            assert rise > 100_000
    colls = [m for m in msgs if m.stream is Stream.COLLECTIVES and m.envelope is not None]
    assert {m.key for m in colls} == {b"job-101", b"job-102"}
    late_ranks = set()
    for m in colls:
        ct = m.extra
        for node, dev, st, job in zip(
            ct.node,
            m.table.column("device").to_pylist(),  # type: ignore[union-attr]
            ct.straggle_ns,
            m.table.column("job").to_pylist(),
            strict=True,
        ):
            if st > 0:
                late_ranks.add((job, node, dev))
                assert 5_000_000 <= st <= 25_000_000
    assert late_ranks == {("job-101", "node0002", "gpu3")}
    # arrival skew shows in the records themselves: that rank starts ≥ 5 ms after the median
    m = next(m for m in colls if m.key == b"job-101" and m.extra.straggle_ns.max() > 0)
    t = m.table.filter(pc.equal(m.table.column("op_seq"), m.table.column("op_seq")[0]))  # type: ignore[union-attr]
    ts = np.asarray(t.column("ts_ns"))
    late = ts[2 * 8 + 3]
    assert late - np.median(ts) >= 5_000_000


def test_throttle_sets_bits_drops_clock_and_emits_onset() -> None:
    sim, msgs = run(4, "throttle:node=node0000,gpu=1,cause=thermal,start=4,dur=10", 16)
    vals = defaultdict(list)
    for m in msgs:
        if (
            m.stream is Stream.RAW
            and m.envelope
            and m.envelope.source.exporter == "gpu"
            and m.envelope.source.node == "node0000"
        ):
            t = m.table.filter(pc.equal(m.table.column("device"), "gpu1"))  # type: ignore[union-attr]
            for metric, ts, v in zip(
                t.column("metric").to_pylist(),
                t.column("ts_ns").to_pylist(),
                t.column("value").to_pylist(),
                strict=True,
            ):
                vals[metric].append((ts, v))
    inc = sim.incidents[0]
    off = int(sim.clocks.offsets(inc.start_ns)[0])
    during = [
        v for ts, v in vals["gpu.clock_event_reasons"] if inc.start_ns <= ts - off < inc.end_ns
    ]
    assert during and all(int(v) & 0x60 == 0x60 for v in during)
    clocks = [v for ts, v in vals["gpu.sm_clock"] if inc.start_ns <= ts - off < inc.end_ns]
    assert max(clocks) < 1600
    assert max(v for _, v in vals["gpu.temp"]) >= 80
    codes = [
        e["code"]
        for m in msgs
        if m.stream is Stream.EVENTS and m.table is not None
        for e in m.table.to_pylist()
        if e["event"] == "throttle"
    ]
    assert codes == [0x60, 0]


# -- malformed, duplicates, late --------------------------------------------------------------


def test_malformed_records_decode_to_exactly_their_reason() -> None:
    _, msgs = run(3, "malformed", 5)
    bad = [m for m in msgs if m.kind is SendKind.MALFORMED]
    assert {m.expected_reason for m in bad} == set(RECORD_REASONS)
    for m in bad:
        ct, body = m.encode()
        with pytest.raises(RejectedInput) as e:
            decode(body, ct)
        assert e.value.reason == m.expected_reason
        assert len(body) < 1_000_000
    rows = [m for m in msgs if m.bad]
    assert len(rows) == 1 and rows[0].bad == list(SAMPLE_REASONS)
    t = decode(*reversed(rows[0].encode())).table  # whole batch decodes; bad rows are samples
    tail = t.slice(t.num_rows - len(SAMPLE_REASONS)).to_pylist()
    by = dict(zip(SAMPLE_REASONS, tail, strict=True))
    assert by[Reason.BAD_DEVICE]["device"] == ""
    assert np.isnan(by[Reason.NON_FINITE]["value"])
    assert by[Reason.WRONG_KIND]["raw"] is None and by[Reason.WRONG_KIND]["value"] < 0
    assert set(RECORD_REASONS) | set(SAMPLE_REASONS) | REFINER_REASONS == set(Reason)


def test_duplicates_resend_identical_bytes_and_late_batches_come_later() -> None:
    _, msgs = run(4, "dup:rate=0.05,late:rate=0.02,delay=3", 10)
    dups = [m for m in msgs if m.kind is SendKind.DUPLICATE]
    assert dups
    firsts = {m.tag: m for m in msgs if m.kind is SendKind.BATCH}
    for d in dups:
        assert firsts[d.tag].encode() == d.encode() and d.due_ns > firsts[d.tag].due_ns
    late = [m for m in msgs if m.kind is SendKind.LATE]
    assert late
    for m in late:
        assert m.envelope is not None and m.table is not None
        assert m.envelope.sent_ns - int(m.table.column("ts_ns")[-1].as_py()) > 2 * S
    # the publisher sees arrivals in order, so a late batch is out of sequence for its source
    assert [m.due_ns for m in msgs] == sorted(m.due_ns for m in msgs)
    pos = {id(m): i for i, m in enumerate(msgs)}
    later_seq = [
        m
        for m in msgs
        if m.kind is SendKind.BATCH
        and m.tag.rsplit("|", 1)[0] == late[0].tag.rsplit("|", 1)[0]
        and m.envelope
        and late[0].envelope
        and m.envelope.seq > late[0].envelope.seq
    ]
    assert any(pos[id(m)] < pos[id(late[0])] for m in later_seq)


def test_clock_fault_skews_some_nodes_only() -> None:
    sim, msgs = run(16, "clock:max_offset=3600,max_drift=200", 4)
    off = sim.clocks.offsets(T0)
    assert (np.abs(off) > 5_000_000).any() and (np.abs(off) < 100_000).any()
    assert (np.abs(off) <= 3600 * S + 31 * S).all()
    assert (np.abs(sim.clocks.drift_ppm) <= 200).all()
    m = next(m for m in msgs if m.stream is Stream.RAW)
    assert m.envelope is not None and m.table is not None
    i = int(m.envelope.source.node[4:])
    assert int(m.table.column("ts_ns")[0].as_py()) == T0 + int(sim.clocks.offsets(T0)[i])


# -- truth ------------------------------------------------------------------------------------


def test_truth_counts_each_identity_once_and_maps_true_time(tmp_path: Path) -> None:
    sim, msgs = run(4, "all", 20)
    w = TruthWriter(tmp_path / "t.parquet", flush_rows=5_000)
    for n, m in enumerate(msgs):
        w.acked(m, n, f"topic.{m.stream}", 0, n)
    w.close([i.row() for i in sim.incidents], sim.clocks.table(sim.cluster.node_names))
    tr = load_truth(tmp_path / "t.parquet")
    uniq = {
        m.tag: m.samples
        for m in msgs
        if m.stream is Stream.RAW and m.kind is not SendKind.MALFORMED
    }
    assert tr.samples.num_rows == sum(uniq.values())
    assert tr.sends.num_rows == len(msgs)
    kinds = tr.summary()["by_kind"]
    assert kinds["duplicate"] >= 1 and kinds["late"] >= 1
    assert kinds["malformed"] == len(RECORD_REASONS)
    reasons = tr.samples.filter(pc.is_valid(tr.samples.column("expected_reason")))
    assert sorted(reasons.column("expected_reason").to_pylist()) == sorted(
        r.value for r in SAMPLE_REASONS
    )
    good = tr.samples.filter(pc.is_null(tr.samples.column("expected_reason")))
    ts_true = np.asarray(good.column("ts_true_ns"))
    assert ts_true.min() >= T0 and ts_true.max() < T0 + 20 * S
    assert {r["kind"] for r in tr.incidents.to_pylist()} >= {
        "pfc_storm",
        "link_flap",
        "throttle",
        "xid",
        "reset",
        "wrap",
    }
    assert tr.clocks.num_rows == 4 and tr.events.num_rows >= 4
    assert tr.collectives.num_rows == sum(m.samples for m in msgs if m.stream is Stream.COLLECTIVES)
    assert isinstance(tr.samples, pa.Table)


# -- spec, cli, bench -------------------------------------------------------------------------


def test_fault_spec_grammar() -> None:
    assert parse_faults("none").enabled == {}
    assert set(parse_faults("all").enabled) == set(FaultKind)
    assert set(parse_faults("all,-dup,-xid").enabled) == set(FaultKind) - {
        FaultKind.DUP,
        FaultKind.XID,
    }
    s = parse_faults("dup,pfc_storm:leaf=leaf-p0-r3,port=2,start=20,dur=15,xid:count=3")
    assert s.enabled[FaultKind.PFC_STORM] == {
        "leaf": "leaf-p0-r3",
        "port": "2",
        "start": "20",
        "dur": "15",
    }
    assert s.enabled[FaultKind.XID] == {"count": "3"} and s.enabled[FaultKind.DUP] == {}
    for bad in ("bogus", "port=2", "xid:count"):
        with pytest.raises(ConfigError):
            parse_faults(bad)
    with pytest.raises(ConfigError):
        parse_faults("dup:rate=lots").fparam(FaultKind.DUP, "rate", 0.1)


def test_parse_duration() -> None:
    assert parse_duration_ns("1s") == S and parse_duration_ns("500ms") == S // 2
    assert parse_duration_ns("2") == 2 * S
    with pytest.raises(ConfigError):
        parse_duration_ns("soon")


def test_bench_generate_reports_samples_per_second() -> None:
    rate = bench_generate(16, 3)
    print(f"\nbench_generate(16 nodes, 3 ticks): {rate:,.0f} samples/s (generate + encode)")
    assert rate > 50_000


def test_cli_parser_accepts_the_documented_flags() -> None:
    import argparse

    from lab.simulate.cli import add_parser, cmd_simulate

    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers())
    a = p.parse_args(
        [
            "simulate",
            "--nodes",
            "4",
            "--gpus-per-node",
            "8",
            "--nics-per-node",
            "8",
            "--interval",
            "1s",
            "--duration",
            "5",
            "--speed",
            "10",
            "--seed",
            "3",
            "--faults",
            "all",
            "--truth",
            "t.parquet",
            "--stdout-summary",
            "--json",
            "--spread",
        ]
    )
    assert a.handler is cmd_simulate and a.nodes == 4 and a.speed == 10.0 and a.json
    assert a.spread and not p.parse_args(["simulate", "--nodes", "1", "--seed", "1"]).spread


def test_published_exporters_greet_first_with_batches_without_rows() -> None:
    """``ticks(greet=True)`` (what ``publish`` runs): before any batch with rows, each node's
    ``node`` and ``events`` exporters and each job's ``nccl`` one send one without rows,
    ``GREET_LEAD_NS`` before the start, their first seq; the batches with rows are those of
    ``ticks()`` after it."""
    nodes = 3
    sim = Simulation(Cluster.build(nodes, seed=2), "all", seed=2, start_ns=T0, duration_ns=3 * S)
    greeted = [m for t in sim.ticks(greet=True) for m in t.messages]
    plain = Simulation(Cluster.build(nodes, seed=2), "all", seed=2, start_ns=T0, duration_ns=3 * S)
    ungreeted = [m for t in plain.ticks() for m in t.messages]
    hellos = [m for m in greeted if m.table is not None and m.table.num_rows == 0]
    jobs = len(sim.cluster.job_list)
    assert len(hellos) == 2 * nodes + jobs
    assert greeted[: len(hellos)] == hellos  # sent first, at the start
    for m in hellos:
        assert m.envelope is not None and m.envelope.seq == 0
        assert m.due_ns == m.sent_true_ns == T0 - GREET_LEAD_NS and m.kind is SendKind.BATCH
        assert m.envelope.sent_ns == m.sent_true_ns + m.offset_ns  # the node's clock then
        batch = decode(*reversed(m.encode()))
        assert batch.table.num_rows == 0 and batch.envelope.kind == m.envelope.kind
    assert {(m.stream, m.envelope.source.exporter) for m in hellos if m.envelope} == {
        (Stream.RAW, "node"), (Stream.EVENTS, "events"), (Stream.COLLECTIVES, "nccl")
    }  # fmt: skip
    rest = greeted[len(hellos) :]
    assert [m.samples for m in rest] == [m.samples for m in ungreeted]
    hello_sources = {m.envelope.source for m in hellos if m.envelope}
    for a, b in zip(rest, ungreeted, strict=True):
        assert a.envelope is not None and b.envelope is not None
        assert a.envelope.source == b.envelope.source
        # a greeted source's batches come one seq later, after its greeting's
        shift = 1 if a.envelope.source in hello_sources else 0
        assert a.envelope.seq == b.envelope.seq + shift


def test_a_duplicate_sends_the_bytes_its_original_was_sent_with() -> None:
    """A transport duplicate is the same record again: when the publisher has put the
    producer's exchanges into the original's clock block, the copy (due later, from a second
    producer session) carries them too, so whichever copy the refiner keeps is bounded
    alike."""
    _, msgs = run(4, "dup", 4, seed=9)
    dups = [m for m in msgs if m.kind is SendKind.DUPLICATE]
    assert dups
    for d in dups:
        orig = d.original
        assert orig is not None and orig.due_ns < d.due_ns
        assert orig.envelope is not None
        clock = orig.envelope.clock
        assert clock is not None
        ex = (T0, T0 // 1_000_000, T0 + 1_000_000, 0)
        block = clock.model_copy(update={"exchanges": [ex]})
        orig.envelope = orig.envelope.model_copy(update={"clock": block})
        orig.body = None  # what the publisher does when it adds the exchanges
        assert d.encode() == orig.encode()
        sent = decode(*reversed(d.encode()))
        assert sent.envelope.clock is not None and sent.envelope.clock.exchanges == [ex]


def test_an_xid_planned_while_its_node_reboots_happens_once_it_is_back() -> None:
    """A node that is down reports nothing: an XID planned inside its reset is moved into the
    tick after the reset ends, so the truth holds only events the node could report, and
    its events exporter does report it."""
    spec = "xid:node=node0001,start=5,count=1,reset:node=node0001,start=4,dur=5"
    sim, msgs = run(4, spec, 14, seed=3)
    (xid,) = [i for i in sim.incidents if i.kind is FaultKind.XID]
    (reset,) = [i for i in sim.incidents if i.kind is FaultKind.RESET]
    assert reset.start_ns == T0 + 4 * S and reset.end_ns == T0 + 9 * S
    assert reset.end_ns <= xid.start_ns < reset.end_ns + S
    events = [m for m in msgs if m.stream is Stream.EVENTS and m.table is not None]
    codes = [
        (m.envelope.source.node, c)
        for m in events
        if m.envelope is not None
        for c in m.table.column("code").to_pylist()
    ]
    assert ("node0001", xid.detail["code"]) in codes


# -- clock models -----------------------------------------------------------------------------

MS = 1_000_000
NEW_CLOCK_KINDS = {
    FaultKind.CHRONY_SLEW, FaultKind.NTPD_SLEW, FaultKind.STEPS, FaultKind.VM_PAUSE,
    FaultKind.PTP, FaultKind.LEAP_SMEAR, FaultKind.FAST_CLOCK,
}  # fmt: skip


def setting(sim: Simulation, i: int, t: np.ndarray) -> np.ndarray:
    """Node ``i``'s wall - raw at true times ``t``: every step and slew so far."""
    wall, raw = sim.clocks.node_offsets(i, t)
    return wall - raw


def rows_of(msgs: list[Message], node: str, exporter: str) -> list[Message]:
    return [
        m for m in msgs
        if m.stream is Stream.RAW and m.kind is SendKind.BATCH and m.envelope is not None
        and m.envelope.source.node == node and m.envelope.source.exporter == exporter
    ]  # fmt: skip


def test_chrony_slews_an_offset_away_at_most_at_its_maxslewrate() -> None:
    """chrony slews 0.1 s away at min(maxslewrate, x / 1 s, x² / C): at most 83.3 µs per ms,
    so not done 1.2 s in; done (within 1 µs) by its end. The raw clock never moves; the rows
    of a batch stamped during the slew sit on the setting each was stamped on."""
    sim, msgs = run(4, "chrony_slew:node=node0001,start=2,offset=0.1", 4)
    (m,) = sim.clocks.models
    assert (m.kind, m.node, m.start_ns) == (FaultKind.CHRONY_SLEW, 1, T0 + 2 * S)
    t = T0 + 2 * S + np.arange(-100, 3_000) * MS  # every ms
    k = setting(sim, 1, t)
    assert (k[:100] == 0).all() and k[100 + 1] < 0
    assert np.abs(np.diff(k)).max() <= 83_334  # 83,333 ppm of a ms
    assert k[100 + 1_200] > -100 * MS + 1_000  # not done after 1.2 s
    assert abs(setting(sim, 1, np.asarray([m.end_ns + S]))[0] + 100 * MS) <= 1_000
    ref, _ = run(4, "none", 1)
    assert sim.clocks.raw_offsets(t) == ref[0].clocks.raw_offsets(t) if False else True
    base = Simulation(Cluster.build(4, seed=1), "none", seed=1, start_ns=T0, duration_ns=S)
    list(base.ticks())
    assert (sim.clocks.raw_offsets(t) == base.clocks.raw_offsets(t)).all()
    (b,) = [x for x in rows_of(msgs, "node0001", "gpu") if x.sent_true_ns // S == T0 // S + 2]
    assert b.table is not None
    ts = np.asarray(b.table.column("ts_ns"))
    off = np.asarray(b.offset_ns)
    assert np.ptp(off) > 10 * MS  # the rows of one batch: slewed apart
    true = ts - off
    assert ((true - T0) % (100 * MS) == 0).all()  # each row's true instant, exactly
    assert (off == sim.clocks.node_offsets(1, true)[0]).all()


def test_a_configured_maxslewrate_and_ntpd_slew_at_their_rate() -> None:
    """chrony with maxslewrate 500 ppm and ntpd (the kernel's 500 ppm) move the wall clock
    linearly at 500 ppm: 2 ms in 4 s; ntpd is done with 10 ms after 20 s."""
    spec = (
        "chrony_slew:node=node0001,start=1,offset=0.1,maxslewrate=500,"
        "ntpd_slew:node=node0002,start=1,offset=-0.01"
    )
    sim, _ = run(4, spec, 2)
    t = T0 + S + np.asarray([0, 4 * S, 20 * S, 40 * S])
    assert np.abs(setting(sim, 1, t)[:2] - [0, -2 * MS]).max() <= 1
    assert np.abs(setting(sim, 2, t) - [0, 2 * MS, 10 * MS, 10 * MS]).max() <= 1
    assert np.abs(np.diff(setting(sim, 1, T0 + S + np.arange(1_000) * MS))).max() <= 500


def test_steps_below_and_above_tolerance_and_two_between_sends() -> None:
    """Steps of 30 µs, -120 µs and 5 ms, then +1.588 ms and -1.548 ms 0.3 s apart: no send of
    the node falls between the two, its sends' settings differ by 40 µs, and the rows stamped
    between them sit on the middle setting (1.588 ms ahead)."""
    sim, msgs = run(4, "steps:node=node0001,start=2", 12)
    ms = sorted(sim.clocks.models, key=lambda m: m.start_ns)
    at = np.asarray([m.start_ns for m in ms])
    sizes = [int(m.params["size_ns"]) for m in ms]
    assert sizes == [30_000, -120_000, 5_000_000, 1_588_000, -1_548_000]
    jumps = setting(sim, 1, at) - setting(sim, 1, at - 1)
    assert list(jumps) == sizes
    first, second = at[3], at[4]
    assert second - first == 300 * MS
    mine = [m for m in msgs if m.key == b"node0001" and m.table is not None]
    assert not any(first <= m.sent_true_ns < second for m in mine)
    gpu = [m for m in rows_of(msgs, "node0001", "gpu") if first - S < m.sent_true_ns < second + S]
    before, during = (m for m in gpu)
    assert before.sent_true_ns < first < second < during.sent_true_ns
    sends = [m.envelope.sent_ns - m.sent_true_ns for m in (before, during) if m.envelope]
    assert abs(sends[1] - sends[0] - 40_000) < 1_000  # nets 40 µs: under the 50 µs tolerance
    off = np.asarray(during.offset_ns)
    assert abs(np.ptp(off) - 1_588_000) < 1_000  # the middle setting, in the batch
    assert during.table is not None
    true = np.asarray(during.table.column("ts_ns")) - off
    middle = (true >= first) & (true < second)
    assert middle.any() and (off[middle] - off[~middle].min() > 1_500_000).all()
    # what the publisher hands ExchangeLog.for_batch as ``stamps``: the settings of the
    # instants the rows were stamped, the middle one among them
    from lab.simulate.publish import _stamped_at

    stamps = setting(sim, 1, _stamped_at(during))
    assert abs(np.ptp(stamps) - 1_588_000) < 1_000


def test_a_vm_pause_stops_both_clocks_then_the_wall_catches_up() -> None:
    """A pause of P (from between a tick's last samples and their send): wall and raw stand
    still for P, nothing is stamped or sent meanwhile, the batch due then is sent when the
    node resumes (same boot id); afterwards raw stays P
    behind while the wall clock is caught up: slewed (P <= 1 s, at most 83.3 µs per ms) or
    stepped (P > 1 s)."""
    base = Simulation(Cluster.build(4, seed=1), "none", seed=1, start_ns=T0, duration_ns=S)
    list(base.ticks())
    for pause in (0.5, 1.5):
        sim, msgs = run(4, f"vm_pause:node=node0000,start=3.9002,pause={pause}", 8)
        (m,) = sim.clocks.models
        a, p, d = m.start_ns, int(pause * S), int(m.params["delay_ns"])
        assert a == T0 + 3_900_200_000 and m.params["step"] == (pause > 1)
        inside = a + np.linspace(0, p, 200).astype(np.int64)
        wall, raw = sim.clocks.node_offsets(0, inside)
        assert np.ptp(inside + wall) <= 2 and np.ptp(inside + raw) <= 2  # standing still
        later = a + p + np.asarray([d // 2, d + 1, 30 * S, 20_000 * S])
        wall, raw = sim.clocks.node_offsets(0, later)
        wall0, raw0 = base.clocks.node_offsets(0, later)
        assert np.abs(raw - raw0 + p).max() <= 1_000  # raw: P behind for good
        assert abs(wall[0] - wall0[0] + p) <= 1_000  # the wall too, until the catch-up
        if pause > 1:
            assert np.abs(wall[1:] - wall0[1:]).max() <= 1_000  # stepped back
        else:
            assert abs(wall[1] - wall0[1] + p) <= 100_000 and abs(wall[3] - wall0[3]) <= 1_000
            k = setting(sim, 0, a + p + d + np.arange(1_000) * MS)
            assert np.abs(np.diff(k)).max() <= 83_334 and k[-1] - k[0] > 80 * MS  # slewed
        mine = [x for x in msgs if x.key == b"node0000"]
        assert not any(a <= x.sent_true_ns < a + p for x in mine)
        assert any(a + p <= x.sent_true_ns < a + p + 5 * MS for x in mine)  # the held batch
        for x in mine:
            if x.table is not None and x.stream is not Stream.COLLECTIVES and x.table.num_rows:
                true = np.asarray(x.table.column("ts_ns")) - np.asarray(x.offset_ns)
                assert not ((true >= a) & (true <= a + p)).any()
        assert len({x.envelope.source.boot_id for x in mine if x.envelope}) == 1


def test_ptp_leap_smear_and_a_fast_clock() -> None:
    """PTP: the wall clock within 1 µs of true time (the servo cancels the oscillator's
    offset and drift); a leap smear: the wall runs 11.574 ppm slow; a fast clock: 1,000 ppm
    for its minute, then back (the 60 ms it gained stay)."""
    spec = "ptp:node=node0001,leap_smear:node=node0002,fast_clock:node=node0003,start=1,ppm=1000"
    sim, _ = run(4, spec, 2)
    t = T0 + np.arange(-5 * S, 120 * S, 37 * MS)
    wall = sim.clocks.offsets(t)
    assert np.abs(wall[1]).max() < 1_000 and np.ptp(wall[1]) > 100  # sub-µs, and wandering
    assert np.ptp(setting(sim, 1, t)) > 0
    smear = setting(sim, 2, t)
    assert np.abs(np.diff(smear) + 37 * MS * 1e6 / 86_400 / 1e6).max() <= 1
    fast = setting(sim, 3, T0 + S + np.asarray([0, 30 * S, 60 * S, 90 * S]))
    assert list(fast) == [0, 30 * MS, 60 * MS, 60 * MS]
    # a VM pause of a PTP node: the servo does not undo the pause, its catch-up does
    sim, _ = run(4, "ptp:node=node0001,vm_pause:node=node0001,start=3,pause=1.5", 1)
    wall = sim.clocks.offsets(T0 + np.asarray([3, 4, 5, 6]) * S)[1]
    assert np.abs(wall - [0, -S, -1_500 * MS, 0]).max() < 1_000


def test_all_includes_every_clock_model_each_on_a_node_of_its_own() -> None:
    assert set(parse_faults("all").enabled) >= NEW_CLOCK_KINDS
    sim, _ = run(8, "all", 2)
    nodes: dict[FaultKind, set[int]] = defaultdict(set)
    for m in sim.clocks.models:
        nodes[m.kind].add(m.node)
    assert set(nodes) == NEW_CLOCK_KINDS
    assert all(len(v) == 1 for v in nodes.values())
    assert len(set().union(*nodes.values())) == len(NEW_CLOCK_KINDS)  # each its own node


def test_the_clocks_truth_rebuilds_every_clock(tmp_path: Path) -> None:
    """The truth's ``models`` (and steps, offset, drift) give back the offsets the simulator
    stamped with, wall and raw, after a trip through Parquet; and the clock incident rule
    reads them: a pause past 1 s is an incident, a slew within the threshold is not."""
    from lab.bench.accuracy_match import clock_signals
    from lab.simulate.clock_models import truth_offsets

    sim, _ = run(8, "all", 20)
    w = TruthWriter(tmp_path / "t.parquet")
    w.close([i.row() for i in sim.incidents], sim.clocks.table(sim.cluster.node_names))
    rows = load_truth(tmp_path / "t.parquet").clocks.to_pylist()
    assert {r["kind"] for row in rows for r in row["models"]} == set(NEW_CLOCK_KINDS)
    t = T0 + np.arange(-3 * S, 40 * S, 3_917_000)
    wall, raw = sim.clocks.offsets(t), sim.clocks.raw_offsets(t)
    for i, row in enumerate(rows):
        assert (truth_offsets(row, t, T0) == wall[i]).all(), row["node"]
        assert (truth_offsets(row, t, T0, raw=True) == raw[i]).all(), row["node"]
    spec = "vm_pause:node=node0002,start=3,pause=1.5,chrony_slew:node=node0001,start=2,offset=0.5"
    sim, _ = run(4, spec, 10)
    rows = sim.clocks.table(sim.cluster.node_names).to_pylist()
    sigs = clock_signals(rows, (T0, T0 + 10 * S), 5 * S, 50_000_000)
    # stepped back a second after it resumed: over 1 s for too short to be proven, optional
    assert [(s.incident, s.required) for s in sigs] == [("clock-node0002", False)]
    # a pause under 1 s (slewed away) is no incident; a clock stepped 2 s and left is
    spec = "vm_pause:node=node0002,start=3,pause=0.9,chrony_slew:node=node0001,start=2,offset=0.5"
    spec += ",clock:node=node0003,fraction=0,step=2,max_offset=0"
    sim, _ = run(4, spec, 10)
    rows = sim.clocks.table(sim.cluster.node_names).to_pylist()
    sigs = clock_signals(rows, (T0, T0 + 10 * S), 5 * S, 50_000_000)
    assert ("clock-node0003", True) in [(s.incident, s.required) for s in sigs]
    assert "clock-node0002" not in [s.incident for s in sigs]
