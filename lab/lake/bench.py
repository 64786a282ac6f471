"""Lake benchmarks; each returns a dict of figures and prints the ratio it exists to measure.

- :func:`bench_landing`: LakeWriter throughput (sort, LZ4, encodings, fsync, rename) against
  one plain ``pyarrow.parquet.write_table`` of the same tables. Goal: ratio >= 0.8. fsync
  time is reported apart.
- :func:`bench_bytes_per_sample`: bytes per refined sample after compaction, on realistic data
  (:mod:`lab.lake.synth`), with the biggest columns. Goal: <= 6 B/sample.
- the named queries, compacted lake against one sorted file at 10^8 samples, and the
  small-file penalty: :mod:`lab.lake.scalebench`.

``rows`` sets the size (approximate; default small for a quick run). ``refinery bench`` wires
these in; ``python -m lab.lake.bench ROWS`` runs them all.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from lab.lake import synth
from services.lake.compact import Compactor
from services.lake.writer import LakeWriter

SERIES_PER_NODE = 106


def _data(rows: int, seed: int = 0) -> pa.Table:
    nodes = max(1, min(64, rows // (SERIES_PER_NODE * 600)))
    seconds = max(10, rows // (SERIES_PER_NODE * nodes))
    return synth.refined_samples(nodes=nodes, seconds=seconds, seed=seed, start_ns=synth.T0_NS)


def _chunks(t: pa.Table, n: int) -> list[pa.Table]:
    return [t.slice(i, n) for i in range(0, t.num_rows, n)]


def bench_landing(rows: int = 200_000, flush_rows: int = 50_000, repeat: int = 3) -> dict[str, Any]:
    """Land ``rows`` in flushes of ``flush_rows``; compare with one write_table of them all.

    Runs alternate (landing, write_table) ``repeat`` times; figures are medians. ``ratio`` is
    wall-clock throughput, fsync included; ``cpu_ratio`` compares process CPU (steadier while
    other work shares the machine); ``ratio_without_fsync`` leaves out the seconds landing
    blocked in fsync (two per flush: the file, then its directory after the rename), which
    write_table never pays.
    """
    t = _data(rows)
    chunks = _chunks(t, flush_rows)
    whole = pa.concat_tables(chunks)
    land_s, land_cpu, sync_s, plain_s, plain_cpu, syncs = [], [], [], [], [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeat):
            w = LakeWriter(Path(tmp) / f"lake{r}")
            w.ensure_seeds()
            before = w.fsync_s, w.fsyncs
            t0, c0 = time.perf_counter(), time.process_time()
            for i, c in enumerate(chunks):
                w.land("samples", c, partition=0, first=i, last=i)
            land_s.append(time.perf_counter() - t0)
            land_cpu.append(time.process_time() - c0)
            sync_s.append(w.fsync_s - before[0])
            syncs = w.fsyncs - before[1]
            t0, c0 = time.perf_counter(), time.process_time()
            pq.write_table(whole, Path(tmp) / f"plain{r}.parquet")
            plain_s.append(time.perf_counter() - t0)
            plain_cpu.append(time.process_time() - c0)
    med = statistics.median
    out = {
        "rows": t.num_rows,
        "flushes": len(chunks),
        "landing_rows_per_s": round(t.num_rows / med(land_s)),
        "write_table_rows_per_s": round(t.num_rows / med(plain_s)),
        "ratio": round(med(plain_s) / med(land_s), 3),
        "cpu_ratio": round(med(plain_cpu) / med(land_cpu), 3),
        "fsyncs": syncs,
        "fsync_s": round(med(sync_s), 3),
        "fsync_share": round(med(sync_s) / med(land_s), 3),
        "ratio_without_fsync": round(med(plain_s) / (med(land_s) - med(sync_s)), 3),
    }
    print(
        f"lake landing: {out['ratio']:.2f}x of write_table throughput (goal >= 0.8); "
        f"CPU {out['cpu_ratio']:.2f}x; without fsync {out['ratio_without_fsync']:.2f}x {out}"
    )
    return out


def _column_bytes(files: list[Path]) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for f in files:
        md = pq.ParquetFile(f).metadata
        for rg in range(md.num_row_groups):
            for ci in range(md.num_columns):
                col = md.row_group(rg).column(ci)
                sizes[col.path_in_schema] = sizes.get(col.path_in_schema, 0) + (
                    col.total_compressed_size
                )
    return sizes


def _small_file_lake(root: Path, t: pa.Table, chunk_rows: int) -> LakeWriter:
    w = LakeWriter(root)
    w.ensure_seeds()
    synth.land_lake(w, t, chunk_rows=chunk_rows, partitions=4)
    return w


def bench_bytes_per_sample(rows: int = 500_000, chunk_rows: int = 20_000) -> dict[str, Any]:
    """Bytes per sample of the compacted lake (Parquet data files only)."""
    t = _data(rows)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "lake"
        w = _small_file_lake(root, t, chunk_rows)
        small = sum(p.stat().st_size for p in w.live_paths("samples"))
        Compactor(root, grace_s=0).compact_closed(["samples"], close_after_s=-1e12, wait=True)
        files = w.live_paths("samples")
        size = sum(p.stat().st_size for p in files)
        cols = _column_bytes(files)
        plain = Path(tmp) / "plain.parquet"
        pq.write_table(t, plain)
        plain_b = plain.stat().st_size
    top = sorted(cols.items(), key=lambda kv: -kv[1])[:8]
    out = {
        "rows": t.num_rows,
        "bytes_per_sample": round(size / t.num_rows, 3),
        "small_files_bytes_per_sample": round(small / t.num_rows, 3),
        "plain_write_table_bytes_per_sample": round(plain_b / t.num_rows, 3),
        "top_columns_bytes_per_sample": {k: round(v / t.num_rows, 3) for k, v in top},
    }
    print(f"lake bytes/sample after compaction: {out['bytes_per_sample']} (goal <= 6) {out}")
    return out


def run_all(rows: int = 200_000, query_rows: int | None = None) -> dict[str, Any]:
    """Every lake benchmark: landing and bytes/sample at about ``rows`` rows, the named
    queries at ``query_rows`` (default 10 x ``rows``) and the small-file penalty."""
    from lab.lake import scalebench

    return {
        "landing": bench_landing(rows),
        "bytes_per_sample": bench_bytes_per_sample(rows),
        "queries": scalebench.bench_queries_at_scale(query_rows or 10 * rows),
        "small_file_penalty": scalebench.bench_small_file_penalty(),
    }


if __name__ == "__main__":
    run_all(int(sys.argv[1]) if len(sys.argv) > 1 else 200_000)
