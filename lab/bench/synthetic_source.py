"""Synthetic input for :func:`lab.bench.refine.bench_refine` (pure: builds values only)."""

from __future__ import annotations

import pyarrow as pa

from pipelines.refine.enrich import TopologyIndex
from schemas.catalog import Catalog, Kind, Metric, Origin, Overflow
from schemas.records import EntityKind, JobPlacement, RankPlacement, TopologyEntity
from schemas.wire import SAMPLES_SCHEMA, Batch, Envelope, SourceId

T0 = 1_700_000_000_000_000_000
SEC = 1_000_000_000


def bench_catalog() -> Catalog:
    o = Origin(simulator=True)
    return Catalog(
        [
            Metric(name="ib.port_rcv_data", unit="B", kind=Kind.COUNTER, width=64,
                   overflow=Overflow.WRAP, scale=4.0, description="received words", origin=o,
                   sentinel_texts=("N/A (no PMA)",)),
            Metric(name="ib.port_xmit_wait", unit="ticks", kind=Kind.COUNTER, width=32,
                   overflow=Overflow.SATURATE, description="transmit wait ticks", origin=o),
            Metric(name="rdma.np_cnp_sent", unit="packets", kind=Kind.COUNTER, width=32,
                   overflow=Overflow.WRAP, description="CNPs sent", origin=o),
            Metric(name="gpu.sm_clock", unit="MHz", kind=Kind.GAUGE, valid_min=0,
                   valid_max=5000, description="SM clock", origin=o),
            Metric(name="gpu.clock_event_reasons", unit="1", kind=Kind.BITMASK,
                   bits={0: "gpu_idle", 3: "hw_slowdown", 5: "sw_thermal"},
                   description="clock event reasons", origin=o),
            Metric(name="cpu.busy", unit="1", kind=Kind.GAUGE, valid_min=0, valid_max=1,
                   description="CPU busy fraction", origin=o),
        ]
    )  # fmt: skip


def bench_topology(node: str = "n1") -> tuple[list[TopologyEntity], list[JobPlacement]]:
    ents = [TopologyEntity(id=f"node:{node}", kind=EntityKind.NODE, node=node, rack="r1",
                           pod="p1")]  # fmt: skip
    for k in range(8):
        ents += [
            TopologyEntity(id=f"{node}:mlx5_{k}", kind=EntityKind.NIC, node=node,
                           device=f"mlx5_{k}", rail=k, numa=k // 4, gpu=f"gpu{k}"),
            TopologyEntity(id=f"{node}:gpu{k}", kind=EntityKind.GPU, node=node,
                           device=f"gpu{k}", nic=f"mlx5_{k}", numa=k // 4,
                           nvlink_domain="nvl0"),
            TopologyEntity(id=f"{node}:mlx5_{k}/1", kind=EntityKind.LINK, node=node,
                           device=f"mlx5_{k}/1", switch=f"leaf{k}", switch_port=f"{k + 1}"),
        ]  # fmt: skip
    ents.append(TopologyEntity(id="leaf0", kind=EntityKind.SWITCH, device="leaf0", peer="spine0"))
    ranks = [RankPlacement(rank=k, node=node, gpu=f"gpu{k}") for k in range(8)]
    job = JobPlacement(job="j1", start_ns=0, nodes=[node], ranks=ranks)
    return ents, [job]


def synthetic_source(
    n_batches: int, rows: int, node: str = "n1"
) -> tuple[Catalog, TopologyIndex, list[tuple[Batch, int]]]:
    """Catalog, topology index and ``n_batches`` consecutive batches of ``rows`` distinct
    series each (1 s apart), with the broker append time of each."""
    catalog = bench_catalog()
    ents, jobs = bench_topology(node)
    counters = ["ib.port_rcv_data", "ib.port_xmit_wait", "rdma.np_cnp_sent"]
    metric, device, is_counter = [], [], []
    for i in range(rows):
        r = i % 10
        if r < 6:
            metric.append(counters[r % 3])
            device.append(f"mlx5_{i % 8}/1/prio{i // 8}")
            is_counter.append(True)
        elif r < 8:
            metric.append("gpu.sm_clock" if r == 6 else "gpu.clock_event_reasons")
            device.append(f"gpu{i % 8}/{i}")
            is_counter.append(False)
        else:
            metric.append("cpu.busy")
            device.append(f"cpu{i}")
            is_counter.append(False)
    src = SourceId(node=node, exporter="node", instance="0", boot_id="b0")
    out = []
    base_raw = [(1 << 32) - 5000 + i for i in range(rows)]
    for b in range(n_batches):
        ts = T0 + b * SEC
        raw = [((x + b * 1000) & 0xFFFFFFFF) if c else None
               for x, c in zip(base_raw, is_counter, strict=True)]  # fmt: skip
        value = [None if c else float(b % 2 if m == "cpu.busy" else 1000 + b)
                 for c, m in zip(is_counter, metric, strict=True)]  # fmt: skip
        table = pa.table(
            {
                "ts_ns": pa.array([ts] * rows, pa.int64()),
                "metric": metric,
                "device": device,
                "value": pa.array(value, pa.float64()),
                "raw": pa.array(raw, pa.uint64()),
                "text": pa.nulls(rows, pa.string()),
            },
            schema=SAMPLES_SCHEMA,
        )
        env = Envelope(source=src, seq=b, sent_ns=ts + 50_000_000)
        out.append((Batch(envelope=env, table=table), ts + 51_000_000))
    return catalog, TopologyIndex(ents, jobs), out
