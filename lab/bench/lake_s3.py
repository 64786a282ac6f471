"""``refinery bench --only lake_s3``: the lake on S3 (and as Iceberg tables on S3) against
the lake on local disk, on a loopback s3proxy this benchmark starts and stops itself.

Figures (goals of issue #40): landing throughput s3 / local (>= 0.7), the named queries'
total time s3 / local on small files and compacted (<= 1.5), bytes per sample of the
compacted lake on S3 (<= 6), queryable freshness p99 on S3 as Parquet (<= 10 s, the
lander's 2 s flushes) and as Iceberg (<= 30 s, 20 s flushes), and an Iceberg table's
snapshots per day (bound ``86400 / max_age_s``) and kept after expiry (bound
``keep_s / max_age_s + 2``). How each is measured: :mod:`lab.lake.s3bench`,
:mod:`lab.lake.s3fresh`.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
from pathlib import Path

from lab.bench.figures import BenchResult


def bench_sized(lake_rows: int) -> BenchResult:
    """At the size of the run (``Sizes.lake_rows`` of :mod:`lab.bench.cli`): 500,000 samples
    and 30 s + 60 s of freshness in quick and smoke runs, four times as much in full ones."""
    full = lake_rows >= 1_000_000
    return bench_lake_s3(2_000_000 if full else 500_000, *((60, 120) if full else (30, 60)))


def bench_lake_s3(rows: int, fresh_s: float, iceberg_s: float) -> BenchResult:
    """Run every part on one s3proxy; ``rows`` samples for landing and queries, ``fresh_s``
    and ``iceberg_s`` seconds of the two freshness runs. Blocks for the run."""
    from lab.lake import s3bench, s3fresh
    from lab.s3 import LocalS3

    r = BenchResult("lake_s3")
    with tempfile.TemporaryDirectory(prefix="lake-s3-") as tmp:
        proxy = LocalS3(Path(tmp) / "s3proxy")
        st = proxy.start()
        try:
            with contextlib.redirect_stdout(sys.stderr):
                base = s3bench.bench_s3(rows, st=st, tmp=Path(tmp))
                _, (_, s3) = s3bench._lake_pair(Path(tmp), st)
                pq = s3fresh.measure_freshness(
                    f"s3://{st.bucket}/fresh", s3, seconds=fresh_s, max_age_s=2.0
                )
                ice = s3fresh.measure_freshness(
                    f"s3://{st.bucket}/iceberg", s3, seconds=iceberg_s, max_age_s=20.0,
                    catalog=Path(tmp) / "catalog.db", keep_s=iceberg_s / 2,
                )  # fmt: skip
        finally:
            proxy.stop()
    land, q = base["landing"], base["queries"]
    note = f"{land['rows']:,} samples, {land['flushes']} flushes, medians of 5 warm rounds"
    r.add("landing_s3_to_local_ratio", land["ratio"], "x", ">=", 0.7, note=note)
    r.add("landing_s3_to_local_cpu_ratio", land["cpu_ratio"], "x", note="process CPU")
    for state in ("small_files", "compacted"):
        s = q[state]
        r.add(f"queries_{state}_s3_to_local_ratio", s["total_ratio"], "x", "<=", 1.5,
              note=f"6 named queries, total of medians; worst {s['worst_ratio']}x; "
              f"answers {'equal' if s['same_answers'] else 'DIFFER'}")  # fmt: skip
    r.add("bytes_per_sample_s3_compacted", q["bytes_per_sample"]["s3"], "B/sample", "<=", 6,
          note=f"local {q['bytes_per_sample']['local']}")  # fmt: skip
    r.add(
        "freshness_s3_parquet_p99_s",
        pq["p99_s"],
        "s",
        "<=",
        10.0,
        note=f"2 s flushes, {pq['samples_seen']:,}/{pq['samples_fed']:,} samples seen",
    )
    r.add(
        "freshness_s3_iceberg_p99_s",
        ice["p99_s"],
        "s",
        "<=",
        30.0,
        note=f"20 s flushes, {ice['samples_seen']:,}/{ice['samples_fed']:,} samples seen",
    )
    r.add("iceberg_snapshots_per_table_day", ice["snapshots_per_day"], "snapshots", "<=",
          ice["snapshots_per_day_bound"],
          note=f"{ice['snapshots_made']} in {ice['seconds']} s, extrapolated")  # fmt: skip
    r.add(
        "iceberg_snapshots_kept",
        ice["snapshots_kept"],
        "snapshots",
        "<=",
        ice["snapshots_kept_bound"],
        note=f"after expiry, keep_s {ice['keep_s']:.0f}",
    )
    r.details.update({"landing": land, "queries": q, "freshness_parquet": pq,
                      "freshness_iceberg": ice})  # fmt: skip
    for name, f in (("parquet", pq), ("iceberg", ice)):
        if f.get("error") or f["samples_seen"] != f["samples_fed"]:
            raise RuntimeError(f"lake_s3 {name} freshness: {f}")
    print(
        f"lake_s3: s3/local landing {land['ratio']}x, queries {q['small_files']['total_ratio']}x"
        f" (small files) {q['compacted']['total_ratio']}x (compacted)",
        file=sys.stderr,
    )
    return r
