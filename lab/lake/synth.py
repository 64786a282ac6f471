"""Realistic refined data for lake tests and benchmarks (no Kafka, no refiner needed).

:func:`refined_samples` builds what the refiner would publish for a small GPU cluster: per node
8 GPUs (temperature, power, SM clock, utilisation, clock event reasons), 8 RDMA ports (data,
ECN, CNP and XmitWait counters), 8 Ethernet priority queues (PFC pause counters) and a few CPU
gauges, scraped every ``interval_s`` with millisecond jitter, each source with its own clock
offset, enriched with rack/leaf/rail/job and carrying lineage. Counters are mostly idle, data
counters busy, congestion counters bursty, as on real fabrics. Deterministic for a seed.

:func:`collectives` and :func:`topology` give matching NCCL records and topology facts;
:func:`land_lake` lands all of it through a writer (local or object store) as many small files.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from schemas.records import REFINED_SCHEMA
from services.lake.backend import LakeSink
from services.lake.datasets import (
    ACCOUNTING_SCHEMA,
    COLLECTIVES_LAKE_SCHEMA,
    DATASETS,
    TOPOLOGY_SCHEMA,
    conform,
)

T0_NS = 1_767_225_600_000_000_000  # 2026-01-01T00:00:00Z

_GPU = [
    ("gpu.temp", "degC"),
    ("gpu.power", "W"),
    ("gpu.sm_clock", "MHz"),
    ("gpu.util", "%"),
    ("gpu.clock_event_reasons", "1"),
]
_RDMA = [
    ("ib.port_rcv_data", "B"),
    ("ib.port_xmit_data", "B"),
    ("ib.port_xmit_wait", "1"),
    ("rdma.np_ecn_marked_roce_packets", "1"),
    ("rdma.np_cnp_sent", "1"),
    ("rdma.rp_cnp_handled", "1"),
]
_PFC = [("nic.rx_prio_pause", "1"), ("nic.rx_prio_pause_duration", "us")]
_CPU = [("cpu.busy", "%"), ("mem.available", "B")]


def _series(nodes: int) -> list[tuple[int, str, str, str, str, bool, int]]:
    """(node index, device, metric, unit, exporter, is_counter, gpu/port index)."""
    out = []
    for n in range(nodes):
        for g in range(8):
            out += [(n, f"gpu{g}", m, u, "dcgm", False, g) for m, u in _GPU]
            out += [(n, f"mlx5_{g}/1", m, u, "node", True, g) for m, u in _RDMA]
            out += [(n, f"eth{g}/prio3", m, u, "node", True, g) for m, u in _PFC]
        out += [(n, "cpu", m, u, "node", False, -1) for m, u in _CPU]
    return out


def refined_samples(
    nodes: int = 4,
    seconds: int = 60,
    *,
    interval_s: float = 1.0,
    start_ns: int = T0_NS,
    seed: int = 0,
    partitions: int = 4,
) -> pa.Table:
    """A REFINED_SCHEMA table of ``nodes x 106 series x seconds/interval_s`` samples, in
    arrival order (by scrape, then series), as the landing service receives them."""
    rng = np.random.default_rng(seed)
    series = _series(nodes)
    s_n, steps = len(series), max(1, int(seconds / interval_s))
    node_i = np.array([s[0] for s in series])
    is_ctr = np.array([s[5] for s in series])
    metric = np.array([s[2] for s in series])
    step = np.repeat(np.arange(steps), s_n)
    sidx = np.tile(np.arange(s_n), steps)
    base = start_ns + (step * interval_s * 1e9).astype(np.int64)
    jitter = rng.integers(0, 2_000_000, steps * nodes).reshape(steps, nodes)
    ts_source = base + jitter[step, node_i[sidx]] + (sidx % 64) * 3_000
    offset = (rng.integers(-40_000_000, 40_000_000, nodes))[node_i[sidx]] + step * 20
    ts = ts_source - offset
    value = np.zeros(steps * s_n)
    raw = np.zeros(steps * s_n, dtype=np.uint64)
    delta = np.full(steps * s_n, np.nan)
    m = metric[sidx]
    for name, gen in (
        (
            "gpu.temp",
            lambda k: np.round(np.clip(np.cumsum(rng.normal(0, 0.3, k)), -10.0, 15.0) + 62),
        ),
        ("gpu.power", lambda k: np.round(rng.normal(620, 25, k), 3)),
        ("gpu.sm_clock", lambda k: np.where(rng.random(k) < 0.03, 1410.0, 1980.0)),
        ("gpu.util", lambda k: np.round(np.clip(rng.normal(92, 4, k), 0.0, 100.0))),
        ("gpu.clock_event_reasons", lambda k: np.where(rng.random(k) < 0.03, 4.0, 0.0)),
        ("cpu.busy", lambda k: np.round(rng.normal(35, 5, k), 1)),
        ("mem.available", lambda k: np.round(rng.normal(8e11, 1e8, k), -6)),
    ):
        sel = m == name
        value[sel] = gen(int(sel.sum()))
    # counters: per-series increments, then cumulative
    inc = np.zeros((steps, s_n))
    for s, (_, _, name, _, _, counter, _) in enumerate(series):
        if not counter:
            continue
        if name.endswith("_data"):
            inc[:, s] = rng.integers(4_000_000_000, 5_000_000_000, steps)  # ~18 GB/s
        else:
            burst = rng.random(steps) < 0.02
            inc[:, s] = np.where(burst, rng.integers(1, 50_000, steps), 0)
    cum = np.cumsum(inc, axis=0).reshape(-1)
    ctr = is_ctr[sidx]
    raw[ctr] = cum[ctr].astype(np.uint64)
    value[ctr] = cum[ctr]
    delta[ctr] = inc.reshape(-1)[ctr]
    delta[ctr & (step == 0)] = np.nan
    rate = delta / interval_s
    rail = np.array([max(s[6], 0) for s in series])[sidx]
    leaf_i = node_i[sidx] // 4
    seq = step * 2 + (np.array([s[4] for s in series])[sidx] == "node")
    part = node_i[sidx] % partitions
    cols = {
        "node": [f"node{n:03d}" for n in node_i[sidx]],
        "device": [series[i][1] for i in sidx],
        "metric": m.tolist(),
        "unit": [series[i][3] for i in sidx],
        "ts": ts,
        "ts_source": ts_source,
        "clock_offset_ns": offset,
        "clock_error_ns": np.full(steps * s_n, 250_000),
        "value": value,
        "raw": pa.array(raw, mask=~ctr),
        "delta": pa.array(delta, mask=np.isnan(delta)),
        "rate": pa.array(rate, mask=np.isnan(rate)),
        "null_reason": pa.array(
            np.full(steps * s_n, "first_sample"), pa.string(), mask=~(ctr & (step == 0))
        ),
        "reset": np.zeros(steps * s_n, dtype=bool),
        "late": np.zeros(steps * s_n, dtype=bool),
        "rack": [f"rack{i // 2:02d}" for i in leaf_i],
        "pod": ["pod0"] * (steps * s_n),
        "leaf": [f"leaf{i:02d}-r{r}" for i, r in zip(leaf_i, rail, strict=True)],
        "leaf_port": (node_i[sidx] % 4 + 1).astype(str),
        "rail": rail.astype(np.int32),
        "nic": [f"mlx5_{r}" for r in rail],
        "gpu": [f"gpu{r}" for r in rail],
        "numa": (rail // 4).astype(np.int32),
        "job": ["job-1001"] * (steps * s_n),
        "rank": (node_i[sidx] * 8 + rail).astype(np.int32),
        "exporter": [series[i][4] for i in sidx],
        "instance": ["0"] * (steps * s_n),
        "boot_id": [f"boot-{n}" for n in node_i[sidx]],
        "seq": seq,
        "raw_partition": part.astype(np.int32),
        "raw_offset": (step * (nodes // partitions + 1) * 2 + seq % 2).astype(np.int64),
    }
    return conform(pa.table(cols), REFINED_SCHEMA)


def collectives(
    nodes: int = 4, ops: int = 20, *, start_ns: int = T0_NS, seed: int = 0, slow_rank: int = 5
) -> pa.Table:
    """AllReduce records of one job over ``nodes x 8`` ranks; ``slow_rank`` arrives late."""
    rng = np.random.default_rng(seed)
    nranks = nodes * 8
    rows: dict[str, list[object]] = {}  # columns not set here (nullable) conform as NULL
    for op in range(ops):
        t = start_ns + op * 1_000_000_000
        for r in range(nranks):
            arrive = t + int(rng.integers(0, 200_000)) + (20_000_000 if r == slow_rank else 0)
            for k, v in (
                ("ts", arrive),
                ("ts_ns", arrive),
                ("end_ns", t + 40_000_000),
                ("job", "job-1001"),
                ("comm", "c0"),
                ("op", "AllReduce"),
                ("op_seq", op),
                ("rank", r),
                ("nranks", nranks),
                ("device", f"gpu{r % 8}"),
                ("bytes", 1 << 28),
                ("dtype", "bf16"),
                ("algbw_gbps", 180.0),
                ("busbw_gbps", 340.0 - (r == slow_rank)),
                ("node", f"node{r // 8:03d}"),
                ("exporter", "nccl"),
                ("boot_id", "b"),
                ("seq", op),
                ("ts_source", arrive),
                ("clock_offset_ns", 0),
                ("clock_error_ns", 1_000_000),
                ("end_ts", t + 40_000_000),
                ("raw_partition", 0),
                ("raw_offset", op),
            ):
                rows.setdefault(k, []).append(v)
    return conform(pa.table(rows), COLLECTIVES_LAKE_SCHEMA)


def topology(nodes: int = 4, *, valid_from: int = 0) -> pa.Table:
    """NIC, GPU and host-link facts matching :func:`refined_samples` (one version)."""
    rows: dict[str, list[object]] = {k: [] for k in TOPOLOGY_SCHEMA.names}

    def add(**kv: object) -> None:
        for k in TOPOLOGY_SCHEMA.names:
            rows[k].append(kv.get(k))

    off = 0
    for n in range(nodes):
        node = f"node{n:03d}"
        for g in range(8):
            leaf, port = f"leaf{n // 4:02d}-r{g}", str(n % 4 + 1)
            common = {"ts": valid_from, "valid_from": valid_from, "node": node, "source": "sim"}
            add(
                id=f"nic:{node}:mlx5_{g}",
                kind="nic",
                device=f"mlx5_{g}",
                rail=g,
                numa=g // 4,
                gpu=f"gpu{g}",
                switch=leaf,
                switch_port=port,
                kafka_partition=0,
                kafka_offset=off,
                **common,
            )
            add(
                id=f"gpu:{node}:gpu{g}",
                kind="gpu",
                device=f"gpu{g}",
                nic=f"mlx5_{g}",
                numa=g // 4,
                kafka_partition=0,
                kafka_offset=off + 1,
                **common,
            )
            add(
                id=f"link:{node}:mlx5_{g}/1",
                kind="link",
                device=f"mlx5_{g}/1",
                switch=leaf,
                switch_port=port,
                kafka_partition=0,
                kafka_offset=off + 2,
                **common,
            )
            off += 3
    return conform(pa.table(rows), TOPOLOGY_SCHEMA)


def _chunk(t: pa.Table, n: int) -> list[pa.Table]:
    return [t.slice(i, n) for i in range(0, t.num_rows, n)]


def land_lake(
    writer: LakeSink,
    samples: pa.Table,
    *,
    chunk_rows: int = 5_000,
    partitions: int = 4,
    with_side_datasets: bool = True,
) -> int:
    """Land ``samples`` as a stream of small flushes (``chunk_rows`` each) spread over
    ``partitions`` source partitions by node (as the node-keyed topic would), plus matching
    collectives, topology, jobs, accounting, dead letters, alerts and episodes. Returns the
    number of sample files written."""
    files = 0
    node_no = pc.cast(pc.utf8_slice_codeunits(samples.column("node"), 4), pa.int64()).to_numpy()
    for p in range(partitions):  # the refined topic is keyed by node
        rows = samples.filter(pa.array(node_no % partitions == p))
        for i, chunk in enumerate(_chunk(rows, chunk_rows)):
            first = 3 * i
            files += len(writer.land("samples", chunk, partition=p, first=first, last=first + 2))
    if not with_side_datasets:
        return files
    start = int(pc.min(samples.column("ts")).as_py())
    nodes = len(pc.unique(samples.column("node")))
    writer.land("collectives", collectives(nodes, start_ns=start), partition=0, first=0, last=0)
    writer.land("topology", topology(nodes), partition=0, first=0, last=0)
    land_small_datasets(writer, start, samples.num_rows)
    return files


def land_small_datasets(writer: LakeSink, start: int, n: int, *, jobs: bool = True) -> None:
    """One row each of accounting (``n`` refined samples), dead letters, alerts, episodes and
    (unless ``jobs`` is false) a job placement, at ``start``."""
    acc = {
        "ts": [start],
        "raw_topic": ["telemetry.raw"],
        "raw_partition": [0],
        "raw_offset": [0],
        "input_samples": [n + 2],
        "refined_samples": [n],
        "duplicate_samples": [1],
        "quarantined_samples": [1],
        "outcome": ["refined"],
    }
    writer.land(
        "accounting", conform(pa.table(acc), ACCOUNTING_SCHEMA), partition=0, first=0, last=0
    )
    side: list[tuple[str, dict[str, object]]] = [
        (
            "deadletter",
            {
                "ts": start,
                "reason": "non_finite",
                "detail": "NaN",
                "topic": "telemetry.raw",
                "partition": 0,
                "offset": 0,
                "scope": "samples",
                "samples": 1,
                "rows": [3],
                "ts_ns": start,
            },
        ),
        (
            "jobs",
            {
                "ts": start,
                "job": "job-1001",
                "start_ns": start,
                "nodes": ["node000"],
                "ranks": [{"rank": 0, "node": "node000", "gpu": "gpu0"}],
            },
        ),
        (
            "alerts",
            {
                "ts": start,
                "id": "a1",
                "rule": "pfc",
                "state": "firing",
                "severity": "warning",
                "entity": "node000/eth0/prio3",
                "starts_ns": start,
                "summary": "PFC storm",
                "emitted_ns": start,
            },
        ),
        (
            "episodes",
            {
                "ts": start,
                "id": "e1",
                "kind": "congestion",
                "state": "firing",
                "entity": "leaf00-r0:1",
                "start_ns": start,
                "ports": ["leaf00-r0:1"],
                "emitted_ns": start,
            },
        ),
    ]
    for ds, row in side:
        if ds == "jobs" and not jobs:
            continue
        row = {"kafka_partition": 0, "kafka_offset": 0, **row}
        schema = DATASETS[ds].schema
        t = pa.Table.from_pylist([{k: row.get(k) for k in schema.names}], schema=schema)
        writer.land(ds, t, partition=0, first=0, last=0)
