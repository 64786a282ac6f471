"""Named queries at 10^8 samples: the compacted lake against one sorted file, and the
small-file penalty.

:func:`bench_queries_at_scale` writes (or reuses, given ``cache``) the two lakes of
:func:`lab.lake.synth_lake.write_lakes` — 128 nodes x 106 series x ~2 h at 10^8 rows — and
times every named query on both with the parameters of :func:`query_params`: a 15-minute window
around the injected incident (one hour for ``job_busbw``), the defaults otherwise. Runs
alternate between the layouts so that load from other work falls on both alike; the figure is
the median. Goals: compacted / single file <= 1.3 and <= 2 s per query.

:func:`bench_small_file_penalty` lands a slice (by default 15 minutes of the same 128 nodes,
12 M samples) as the landing service would — one flush per source partition every 2 s, so
3,600 files — times the same queries on it, compacts it and times them again.

Reproduce: ``python -m lab.lake.scalebench --cache /tmp/lake-bench --json out.json``
(about 4 minutes to write the 10^8-sample lakes once on 2 cores, ~1 GB of disk; later runs
reuse them), or ``refinery bench --only lake`` (full mode; quick mode runs it at 10^6).
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa

from lab.lake.synth_lake import (
    Dictionaries,
    LakeSpec,
    node_samples,
    write_lakes,
    write_side_datasets,
)
from services.lake import sqlload
from services.lake.compact import Compactor
from services.lake.writer import LakeWriter

GENERATOR_VERSION = 2  # bump when synth_lake's output changes: cached lakes are rebuilt
WINDOW_S = {"job_busbw": 3600}
DEFAULT_WINDOW_S = 900


def _text(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, UTC).strftime("%Y-%m-%d %H:%M:%S")


def query_params(spec: LakeSpec) -> dict[str, dict[str, str]]:
    """Per named query, what the benchmark runs it with: ``start``/``end`` five minutes before
    the injected PFC storm (and straggler) to ``WINDOW_S`` later; other parameters default."""
    start = spec.start_ns + max(0, spec.storm[0] - 300) * 1_000_000_000
    out = {}
    for name, q in sqlload.list_queries().items():
        w = WINDOW_S.get(name, DEFAULT_WINDOW_S) * 1_000_000_000
        out[name] = {"start": _text(start), "end": _text(start + w)} if "start" in q.params else {}
    return out


def _rows_in(con: duckdb.DuckDBPyConnection, params: dict[str, str]) -> int:
    if not params:
        return 0
    row = con.execute(
        "SELECT count(*) FROM samples WHERE ts >= epoch_ns(CAST(? AS TIMESTAMP)) "
        "AND ts < epoch_ns(CAST(? AS TIMESTAMP))",
        [params["start"], params["end"]],
    ).fetchone()
    return int(row[0]) if row else 0


def time_queries(
    roots: dict[str, Path], params: dict[str, dict[str, str]], repeat: int
) -> dict[str, dict[str, Any]]:
    """Per query: median wall seconds on each lake of ``roots`` (runs alternate between lakes,
    after one untimed run each), the fastest run, median CPU seconds of all DuckDB threads
    (less sensitive to other work on the machine), the rows it returned, whether every lake
    returned the same rows, and how many samples its window holds."""
    cons = {k: sqlload.connect(r) for k, r in roots.items()}
    for c in cons.values():
        c.execute("SET enable_progress_bar = false")
    out: dict[str, dict[str, Any]] = {}
    for name, p in params.items():
        results = {
            k: sorted(map(repr, sqlload.run_query(c, name, p).fetchall())) for k, c in cons.items()
        }
        times: dict[str, list[float]] = {k: [] for k in roots}
        cpu: dict[str, list[float]] = {k: [] for k in roots}
        for _ in range(repeat):
            for k, con in cons.items():
                t0, c0 = time.perf_counter(), time.process_time()
                sqlload.run_query(con, name, p).fetchall()
                times[k].append(time.perf_counter() - t0)
                cpu[k].append(time.process_time() - c0)
        first = next(iter(results.values()))
        out[name] = {
            **{f"{k}_s": round(statistics.median(v), 3) for k, v in times.items()},
            **{f"{k}_min_s": round(min(v), 3) for k, v in times.items()},
            **{f"{k}_cpu_s": round(statistics.median(v), 3) for k, v in cpu.items()},
            "result_rows": len(first),
            "same_results": all(r == first for r in results.values()),
            "window_samples": _rows_in(next(iter(cons.values())), p),
            "params": p,
        }
    return out


@contextmanager
def _lakes(spec: LakeSpec, cache: Path | None) -> Iterator[tuple[Path, Path, dict[str, Any]]]:
    """The two lakes of ``spec``: reused from ``cache`` when built there for the same spec and
    generator, else written (into ``cache``, or a temporary directory removed afterwards)."""
    key = {"spec": asdict(spec), "generator": GENERATOR_VERSION}
    tmp = None
    if cache is None:
        tmp = Path(tempfile.mkdtemp(prefix="refinery-lake-bench-"))
        base = tmp
    else:
        base = cache / f"n{spec.nodes}-s{spec.seconds}-seed{spec.seed}"
    marker = base / "lakes.json"
    try:
        if marker.exists() and json.loads(marker.read_text()).get("key") == key:
            info = json.loads(marker.read_text())
        else:
            shutil.rmtree(base, ignore_errors=True)
            base.mkdir(parents=True)
            t0 = time.perf_counter()
            lakes = write_lakes(spec, base / "compacted", base / "single")
            info = {
                "key": key,
                "rows": lakes.rows,
                "files": lakes.files,
                "bytes_per_sample_compacted": round(lakes.bytes_compacted / lakes.rows, 3),
                "bytes_per_sample_single": round(lakes.bytes_single / lakes.rows, 3),
                "generate_s": round(time.perf_counter() - t0, 1),
            }
            marker.write_text(json.dumps(info))
        yield base / "compacted", base / "single", info
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def bench_queries_at_scale(
    rows: int = 100_000_000, *, repeat: int = 5, cache: Path | None = None
) -> dict[str, Any]:
    """Every named query on the compacted lake and on one sorted file of ``rows`` samples."""
    spec = LakeSpec.of_rows(rows, nodes=128 if rows >= 50_000_000 else 16)
    params = query_params(spec)
    with _lakes(spec, cache) as (compacted, single, info):
        per = time_queries({"compacted": compacted, "single_file": single}, params, repeat)
    for v in per.values():
        v["ratio_vs_single"] = round(v["compacted_s"] / v["single_file_s"], 3)
    out = {
        "rows": info["rows"],
        "nodes": spec.nodes,
        "span_s": spec.seconds,
        "lake": {k: v for k, v in info.items() if k != "key"},
        "ratio_vs_single_total": round(
            sum(v["compacted_s"] for v in per.values())
            / sum(v["single_file_s"] for v in per.values()),
            3,
        ),
        "worst_ratio_vs_single": max(v["ratio_vs_single"] for v in per.values()),
        "slowest_compacted_s": max(v["compacted_s"] for v in per.values()),
        "queries": per,
    }
    print(
        f"lake queries at {out['rows']:,} samples: compacted/single file "
        f"{out['ratio_vs_single_total']}x (worst {out['worst_ratio_vs_single']}x, goal <= 1.3), "
        f"slowest {out['slowest_compacted_s']} s (goal <= 2) "
        + json.dumps({k: [v["compacted_s"], v["single_file_s"]] for k, v in per.items()})
    )
    return out


def land_like_the_lander(writer: LakeWriter, spec: LakeSpec, flush_s: int = 2) -> int:
    """Land ``spec``'s samples as the landing service does: per source partition, one flush
    of every ``flush_s`` seconds of data (its ``max_age_s``). Returns the files written."""
    dicts = Dictionaries(spec.nodes)
    files = 0
    for part in range(spec.partitions):
        nodes = range(part, spec.nodes, spec.partitions)
        t = pa.concat_tables([node_samples(spec, n, dicts) for n in nodes])
        flush = (t.column("ts").to_numpy() - spec.start_ns) // (flush_s * 1_000_000_000)
        order = np.argsort(flush, kind="stable")
        t = t.take(pa.array(order))
        bounds = np.searchsorted(flush[order], np.arange(flush.min(), flush.max() + 2))
        for k, (a, e) in enumerate(itertools.pairwise(bounds)):
            if e > a:
                chunk = t.slice(int(a), int(e - a))
                files += len(writer.land("samples", chunk, partition=part, first=k, last=k))
    return files


def bench_small_file_penalty(
    spec: LakeSpec | None = None, *, repeat: int = 3, flush_s: int = 2
) -> dict[str, Any]:
    """Named query times on a lake as landed (small files) and after compaction."""
    spec = spec or LakeSpec(nodes=128, seconds=900)
    params = query_params(spec)
    with tempfile.TemporaryDirectory(prefix="refinery-lake-penalty-") as tmp:
        root = Path(tmp) / "lake"
        w = LakeWriter(root)
        t0 = time.perf_counter()
        files = land_like_the_lander(w, spec, flush_s)
        land_s = time.perf_counter() - t0
        write_side_datasets(spec, w)
        small = time_queries({"small": root}, params, repeat)
        t0 = time.perf_counter()
        Compactor(root, grace_s=0).compact_closed(["samples"], close_after_s=-1e12, wait=True)
        compact_s = time.perf_counter() - t0
        after = len(w.live_paths("samples"))
        compacted = time_queries({"compacted": root}, params, repeat)
    per = {
        q: {
            "small_s": small[q]["small_s"],
            "compacted_s": compacted[q]["compacted_s"],
            "penalty": round(small[q]["small_s"] / compacted[q]["compacted_s"], 3),
            "same_results": small[q]["result_rows"] == compacted[q]["result_rows"],
        }
        for q in params
    }
    out = {
        "rows": spec.rows,
        "nodes": spec.nodes,
        "span_s": spec.seconds,
        "flush_s": flush_s,
        "files_small": files,
        "files_compacted": after,
        "land_s": round(land_s, 1),
        "compact_s": round(compact_s, 1),
        "penalty_total": round(
            sum(v["small_s"] for v in per.values()) / sum(v["compacted_s"] for v in per.values()),
            3,
        ),
        "queries": per,
    }
    print(
        f"lake small-file penalty ({files} files of {flush_s} s flushes -> {after}, "
        f"{spec.rows:,} samples): {out['penalty_total']}x "
        + json.dumps({k: v["penalty"] for k, v in per.items()})
    )
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m lab.lake.scalebench [--rows N] [--cache DIR] [--json FILE]``."""
    p = argparse.ArgumentParser(
        prog="python -m lab.lake.scalebench",
        description="Named queries at scale (compacted lake vs one sorted file) and the "
        "small-file penalty.",
    )
    p.add_argument("--rows", type=int, default=100_000_000, help="samples (default 10^8)")
    p.add_argument("--repeat", type=int, default=5, help="timed runs per query and lake")
    p.add_argument("--cache", type=Path, help="keep the generated lakes here and reuse them")
    p.add_argument("--penalty-nodes", type=int, default=128)
    p.add_argument("--penalty-seconds", type=int, default=900)
    p.add_argument("--no-penalty", action="store_true")
    p.add_argument("--json", type=Path, help="write the figures here")
    args = p.parse_args(argv)
    out: dict[str, Any] = {
        "queries": bench_queries_at_scale(args.rows, repeat=args.repeat, cache=args.cache)
    }
    if not args.no_penalty:
        spec = LakeSpec(nodes=args.penalty_nodes, seconds=args.penalty_seconds)
        out["small_file_penalty"] = bench_small_file_penalty(spec, repeat=max(1, args.repeat // 2))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
