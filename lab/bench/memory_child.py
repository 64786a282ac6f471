"""refine_memory's subprocess: ``python -m lab.bench.memory_child SOURCES SERIES``.

Feeds ``SOURCES`` sources x ``SERIES`` counter series, two batches each (all first batches,
then all second batches, so every series is live at once), through
:meth:`services.worker.refiner.Refiner.process`, and prints one JSON line: peak RSS, RSS before
any state, and the live series. A separate process so the peak belongs to the refiner alone.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from services.heap import keep_arrow_pages, keep_heap

keep_arrow_pages()  # the worker's allocator settings (before pyarrow loads), so that the
keep_heap()  # peak measured is the one a worker would have

import pyarrow as pa  # noqa: E402

from lab.bench.synthetic_source import bench_catalog  # noqa: E402
from pipelines.refine.enrich import TopologyIndex  # noqa: E402
from schemas.codec import encode  # noqa: E402
from schemas.topics import TOPICS  # noqa: E402
from schemas.wire import SAMPLES_SCHEMA, Envelope, SourceId  # noqa: E402
from services.worker.refiner import RawRecord, Refiner  # noqa: E402

T0 = 1_700_000_000_000_000_000
SEC = 1_000_000_000
COUNTERS = ("ib.port_rcv_data", "ib.port_xmit_wait", "rdma.np_cnp_sent")


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _record(source: int, batch: int, series: int, metric: pa.Array, device: pa.Array) -> RawRecord:
    node = f"n{source:04d}"
    ts = T0 + batch * SEC
    table = pa.table(
        {
            "ts_ns": pa.array([ts] * series, pa.int64()),
            "metric": metric,
            "device": device,
            "value": pa.nulls(series, pa.float64()),
            "raw": pa.array(range(batch * 1000, batch * 1000 + series), pa.uint64()),
            "text": pa.nulls(series, pa.string()),
        },
        schema=SAMPLES_SCHEMA,
    )
    env = Envelope(
        source=SourceId(node=node, exporter="node", instance="0", boot_id="b0"),
        seq=batch,
        sent_ns=ts + 50_000_000,
    )
    ct, body = encode(env, table)
    return RawRecord(
        "raw", source % 8, source * 2 + batch, node.encode(), body, [("content-type", ct.encode())],
        (ts + 51_000_000) // 1_000_000,
    )  # fmt: skip


def main(sources: int, series: int) -> dict[str, float]:
    metric = pa.array([COUNTERS[i % 3] for i in range(series)], pa.string())
    device = pa.array([f"mlx5_{i % 8}/1/prio{i // 8}" for i in range(series)], pa.string())
    topo = TopologyIndex([], [])
    refiner = Refiner(bench_catalog(), TOPICS, lambda: topo, _none, _none)
    # warm up code paths and caches on a throwaway source, then take the baseline
    for b in range(2):
        refiner.process(_record(sources, b, 8, metric[:8], device[:8]), T0)
    refiner.forget()
    base = _status_kib("VmRSS")
    t0 = time.perf_counter()
    refined = 0
    for b in range(2):
        for s in range(sources):
            out = refiner.process(_record(s, b, series, metric, device), T0 + (b + 1) * SEC)
            refined += out.refined
    secs = time.perf_counter() - t0
    rss = _status_kib("VmRSS")
    return {
        "sources": sources,
        "series": sources * series,
        "refined_samples": refined,
        "seconds": secs,
        "baseline_rss_bytes": base * 1024,
        "rss_bytes": rss * 1024,
        "peak_rss_bytes": _status_kib("VmHWM") * 1024,
    }


def _none(_: str) -> bytes | None:
    return None


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), int(sys.argv[2]))))
