"""The lake on object storage against the local lake, side by side in one run.

Lands the same synthetic samples (:mod:`lab.lake.synth`, as many small flushes over four
source partitions, plus the side datasets) into a local directory and into a loopback
s3proxy (:mod:`lab.s3`), compacts both, and times a named query on each. Prints each figure
and the ratio s3 / local it exists to measure (landing throughput, compaction, query time).

Reproduce: ``python -m lab.lake.s3bench [--rows N] [--flush-rows N] [--query NAME]``
(needs Java and Maven for s3proxy; the jar is cached under ~/.cache/refinery).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
from pydantic import SecretStr

from lab.lake import synth
from lab.lake.bench import _data
from lab.s3 import LocalS3
from services.lake import sqlload
from services.lake.backend import LakeCompaction, LakeSink, open_compactor, open_writer
from services.lake.s3store import S3Settings


def _one(
    lake: str, s3: S3Settings | None, rows: pa.Table, flush_rows: int, query: str
) -> dict[str, Any]:
    """Land, compact and query one lake; seconds of each step."""
    writer: LakeSink = open_writer(lake, s3=s3)
    writer.ensure_seeds()
    t0 = time.perf_counter()
    files = synth.land_lake(writer, rows, chunk_rows=flush_rows)
    land_s = time.perf_counter() - t0
    con = sqlload.connect(lake, s3=s3)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        n = len(sqlload.run_query(con, query).fetchall())
        times.append(time.perf_counter() - t0)
    refresh = []
    for _ in range(3):  # the file listing every query starts with (one glob per dataset)
        t0 = time.perf_counter()
        sqlload.refresh(con)
        refresh.append(time.perf_counter() - t0)
    compactor: LakeCompaction = open_compactor(lake, s3=s3, grace_s=0.0)
    t0 = time.perf_counter()
    rep = compactor.compact_closed(None, close_after_s=0.0, wait=True)
    compact_s = time.perf_counter() - t0
    after = []
    for _ in range(3):
        t0 = time.perf_counter()
        sqlload.run_query(con, query).fetchall()
        after.append(time.perf_counter() - t0)
    return {
        "files": files,
        "land_s": round(land_s, 3),
        "land_rows_per_s": round(rows.num_rows / land_s),
        "query_rows": n,
        "query_s": round(statistics.median(times), 3),
        "refresh_s": round(statistics.median(refresh), 3),
        "compact_s": round(compact_s, 3),
        "compacted_files": rep.merged,
        "query_compacted_s": round(statistics.median(after), 3),
    }


def bench_s3(
    rows: int = 500_000, flush_rows: int = 5_000, query: str = "top_congested_links"
) -> dict[str, Any]:
    """Both lakes' figures and the ratios s3 / local (above 1: s3 is slower)."""
    samples = _data(rows)
    with tempfile.TemporaryDirectory() as tmp:
        proxy = LocalS3(Path(tmp) / "s3proxy")
        st = proxy.start()
        try:
            s3 = S3Settings(endpoint=st.endpoint, region=st.region, access_key_id=st.access_key,
                            secret_access_key=SecretStr(st.secret_key))  # fmt: skip
            local = _one(str(Path(tmp) / "lake"), None, samples, flush_rows, query)
            remote = _one(f"s3://{st.bucket}/bench", s3, samples, flush_rows, query)
        finally:
            proxy.stop()
    ratios = {
        "land_s": round(remote["land_s"] / local["land_s"], 2),
        "query_s": round(remote["query_s"] / local["query_s"], 2),
        "refresh_s": round(remote["refresh_s"] / local["refresh_s"], 2),
        "compact_s": round(remote["compact_s"] / local["compact_s"], 2),
        "query_compacted_s": round(remote["query_compacted_s"] / local["query_compacted_s"], 2),
    }
    return {"rows": samples.num_rows, "flush_rows": flush_rows, "query": query,
            "local": local, "s3": remote, "s3_over_local": ratios}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m lab.lake.s3bench", description=__doc__)
    p.add_argument("--rows", type=int, default=500_000)
    p.add_argument("--flush-rows", type=int, default=5_000)
    p.add_argument("--query", default="top_congested_links")
    args = p.parse_args()
    out = bench_s3(args.rows, args.flush_rows, args.query)
    print(json.dumps(out, indent=2))
    r = out["s3_over_local"]
    print(
        f"s3/local: landing {r['land_s']}x the time, {args.query} {r['query_s']}x "
        f"({r['query_compacted_s']}x compacted), compaction {r['compact_s']}x"
    )


if __name__ == "__main__":
    main()
