"""The lake on object storage against the local lake, side by side in one run.

Lands the same synthetic samples (:mod:`lab.lake.synth`) into a local directory and into a
loopback s3proxy (:mod:`lab.s3`), the two kinds alternating: landing throughput in flushes of
``--land-flush-rows``; then a lake of many small flushes (``--flush-rows``, four source
partitions, plus the side datasets) on which every named query runs on both, before and after
compaction (refresh included, as ``refinery query`` runs them; answers compared); bytes per
sample of the compacted lakes. Prints the ratios s3 / local it exists to measure.

Reproduce: ``python -m lab.lake.s3bench [--rows N] [--flush-rows N] [--land-flush-rows N]``
(needs Java and Maven for s3proxy; the jar is cached under ~/.cache/refinery).
"""

from __future__ import annotations

import argparse
import contextlib
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
from services.lake.backend import LakeSink, open_compactor, open_writer
from services.lake.s3store import S3Settings
from services.lake.writer import LakeWriter


def _lake_pair(tmp: Path, st: Any) -> tuple[tuple[str, S3Settings], tuple[str, S3Settings]]:
    s3 = S3Settings(endpoint=st.endpoint, region=st.region, access_key_id=st.access_key,
                    secret_access_key=SecretStr(st.secret_key))  # fmt: skip
    return (str(tmp / "lake"), s3), (f"s3://{st.bucket}/bench", s3)


def bench_landing(
    lakes: dict[str, tuple[str, S3Settings]], rows: pa.Table, flush_rows: int, repeat: int = 3
) -> dict[str, Any]:
    """Land ``rows`` in flushes of ``flush_rows`` into a fresh lake of each kind, the kinds
    alternating ``repeat`` times after one untimed round (s3proxy's JIT warms up in its first
    seconds, as a long-running store has long done); median rows/s of each and the ratio
    s3 / local, wall clock and process CPU."""
    chunks = [rows.slice(i, flush_rows) for i in range(0, rows.num_rows, flush_rows)]
    secs: dict[str, list[float]] = {k: [] for k in lakes}
    cpu: dict[str, list[float]] = {k: [] for k in lakes}
    for r in range(repeat + 1):
        for kind, (lake, s3) in lakes.items():
            w: LakeSink = open_writer(f"{lake}-land{flush_rows}-{r}", s3=s3)
            w.ensure_seeds()
            t0, c0 = time.perf_counter(), time.process_time()
            for i, c in enumerate(chunks):
                w.land("samples", c, partition=0, first=i, last=i)
            if r:
                secs[kind].append(time.perf_counter() - t0)
                cpu[kind].append(time.process_time() - c0)
    med = statistics.median
    per_s = {k: round(rows.num_rows / med(v)) for k, v in secs.items()}
    return {"rows": rows.num_rows, "flush_rows": flush_rows, "flushes": len(chunks),
            "rows_per_s": per_s, "ratio": round(per_s["s3"] / per_s["local"], 3),
            "cpu_ratio": round(med(cpu["local"]) / med(cpu["s3"]), 3)}  # fmt: skip


def _time_queries(cons: dict[str, Any], repeat: int) -> dict[str, dict[str, Any]]:
    """Every named query on each connection, the kinds alternating; first run and median of
    ``repeat`` more (refresh included, as ``refinery query``), rows compared."""
    out: dict[str, dict[str, Any]] = {}
    for q in sqlload.list_queries():
        times: dict[str, list[float]] = {k: [] for k in cons}
        answers: dict[str, Any] = {}
        for _ in range(repeat + 1):
            for kind, con in cons.items():
                t0 = time.perf_counter()
                answers[kind] = sqlload.run_query(con, q).fetchall()
                times[kind].append(time.perf_counter() - t0)
        med = {k: statistics.median(v[1:]) for k, v in times.items()}
        out[q] = {
            "local_s": round(med["local"], 4),
            "s3_s": round(med["s3"], 4),
            "s3_first_s": round(times["s3"][0], 4),
            "ratio": round(med["s3"] / med["local"], 2),
            "rows": len(answers["s3"]),
            "same_answer": sorted(map(repr, answers["s3"])) == sorted(map(repr, answers["local"])),
        }
    return out


def _summary(per: dict[str, dict[str, Any]]) -> dict[str, Any]:
    local = sum(v["local_s"] for v in per.values())
    s3 = sum(v["s3_s"] for v in per.values())
    return {"total_ratio": round(s3 / local, 2),
            "worst_ratio": max(v["ratio"] for v in per.values()),
            "same_answers": all(v["same_answer"] for v in per.values()),
            "queries": per}  # fmt: skip


def _sample_bytes(lake: str, s3: S3Settings) -> int:
    from services.lake.backend import open_store
    from services.lake.s3read import lake_object_files

    if not lake.startswith("s3://"):
        return sum(p.stat().st_size for p in LakeWriter(Path(lake)).live_paths("samples"))
    objs = lake_object_files(open_store(lake, s3).list("samples"))
    return sum(o.size for o in objs)


def bench_queries(
    lakes: dict[str, tuple[str, S3Settings]], rows: pa.Table, flush_rows: int, repeat: int = 3
) -> dict[str, Any]:
    """Land ``rows`` (plus the side datasets) in flushes of ``flush_rows`` into each lake;
    the named queries on the small files, then compacted; bytes per sample compacted."""
    cons: dict[str, Any] = {}
    out: dict[str, Any] = {}
    for kind, (lake, s3) in lakes.items():
        w = open_writer(lake, s3=s3)
        w.ensure_seeds()
        out.setdefault("files", {})[kind] = synth.land_lake(w, rows, chunk_rows=flush_rows)
        cons[kind] = sqlload.connect(lake, s3=s3)
    out["small_files"] = _summary(_time_queries(cons, repeat))
    for kind, (lake, s3) in lakes.items():
        t0 = time.perf_counter()
        open_compactor(lake, s3=s3, grace_s=0.0).compact_closed(None, close_after_s=0.0, wait=True)
        out.setdefault("compact_s", {})[kind] = round(time.perf_counter() - t0, 2)
    out["compacted"] = _summary(_time_queries(cons, repeat))
    out["bytes_per_sample"] = {
        kind: round(_sample_bytes(lake, s3) / rows.num_rows, 3)
        for kind, (lake, s3) in lakes.items()
    }
    return out


def bench_s3(
    rows: int = 500_000,
    flush_rows: int = 5_000,
    land_flush_rows: int = 50_000,
    st: Any = None,
    tmp: Path | None = None,
) -> dict[str, Any]:
    """Landing, queries and bytes/sample, s3 against local (s3proxy started here unless
    ``st``, a running one's state, is given)."""
    samples = _data(rows)
    with contextlib.ExitStack() as stack:
        if tmp is None:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        if st is None:
            proxy = LocalS3(tmp / "s3proxy")
            st = proxy.start()
            stack.callback(proxy.stop)
        local, remote = _lake_pair(tmp, st)
        lakes = {"local": local, "s3": remote}
        return {
            "landing": bench_landing(lakes, samples, land_flush_rows, repeat=5),
            "queries": bench_queries(lakes, samples, flush_rows),
        }


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m lab.lake.s3bench", description=__doc__)
    p.add_argument("--rows", type=int, default=500_000)
    p.add_argument("--flush-rows", type=int, default=5_000)
    p.add_argument("--land-flush-rows", type=int, default=50_000)
    args = p.parse_args()
    out = bench_s3(args.rows, args.flush_rows, args.land_flush_rows)
    print(json.dumps(out, indent=2))
    q = out["queries"]
    print(
        f"s3/local: landing throughput {out['landing']['ratio']}x (goal >= 0.7); named queries "
        f"{q['small_files']['total_ratio']}x the time on small files, "
        f"{q['compacted']['total_ratio']}x compacted (goal <= 1.5); bytes/sample "
        f"{q['bytes_per_sample']['s3']} (goal <= 6)"
    )


if __name__ == "__main__":
    main()
