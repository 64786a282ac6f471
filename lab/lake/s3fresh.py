"""Queryable freshness of a lake on object storage, and an Iceberg table's snapshot count.

A feeder thread hands the sink one scrape of refined samples (:mod:`lab.lake.synth`, stamped
``ts`` = now) every ``interval_s``, as the lander receives them; it flushes what it holds when
the oldest row is ``max_age_s`` old (the lander's rule: ``refinery land --max-age``, 2 s for
Parquet, 20 s for Iceberg), through the same sink the lander uses
(:func:`services.lake.backend.open_writer`: conditional creates on S3, or one Iceberg append
per flush). A poller re-reads the lake through the views every ``poll_s`` exactly as
``refinery query`` does (:func:`services.lake.sqlload.refresh`, then ``SELECT ts FROM
samples`` past the newest seen) and keeps, per sample, *seen - ts*: from the sample reaching
the lander to a query over the lake returning it. Kafka and the worker are not in the path
(the ``freshness`` benchmark measures those); what this adds is the store and the format.

For Iceberg, the table's snapshots are counted after the run (one per flush) and again after
expiry with ``keep_s`` (what ``refinery lake compact`` does every 300 s), against the bounds
``86400 / max_age_s`` a day and ``keep_s / max_age_s + 2`` kept.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from pydantic import SecretStr

from lab.lake import synth
from services.lake import sqlload
from services.lake.backend import BatchLakeSink, Flush, open_compactor, open_writer
from services.lake.s3store import S3Settings

S = 1_000_000_000


class _Feed:
    """Scrapes into the sink, flushed by age; ``stop`` ends it after a last flush."""

    def __init__(self, sink: Any, nodes: int, interval_s: float, max_age_s: float) -> None:
        self.sink, self.nodes = sink, nodes
        self.interval_s, self.max_age_s = interval_s, max_age_s
        self.pending: list[pa.Table] = []
        self.since = 0.0
        self.offset = 0
        self.flushes = 0
        self.rows = 0
        self.flush_s: list[float] = []
        self.stop = threading.Event()
        self.error: str | None = None

    def _flush(self) -> None:
        if not self.pending:
            return
        t = pa.concat_tables(self.pending)
        first, last = self.offset, self.offset + len(self.pending) - 1
        t0 = time.perf_counter()
        if isinstance(self.sink, BatchLakeSink):
            offsets = np.repeat(np.arange(first, last + 1), [p.num_rows for p in self.pending])
            self.sink.land_flushes("samples", [Flush(0, first, last, t, offsets)])
        else:
            self.sink.land("samples", t, partition=0, first=first, last=last)
        self.flush_s.append(time.perf_counter() - t0)
        self.offset, self.pending = last + 1, []
        self.rows += t.num_rows
        self.flushes += 1

    def run(self) -> None:
        try:
            tick = time.monotonic()
            while not self.stop.is_set():
                if time.monotonic() >= tick:
                    scrape = synth.refined_samples(
                        self.nodes, 1, start_ns=time.time_ns(), seed=self.offset
                    )
                    if not self.pending:
                        self.since = time.monotonic()
                    self.pending.append(scrape)
                    tick += self.interval_s
                if self.pending and time.monotonic() - self.since >= self.max_age_s:
                    self._flush()
                due = self.since + self.max_age_s if self.pending else tick
                self.stop.wait(max(0.0, min(tick, due) - time.monotonic()))
            self._flush()
        except Exception as e:  # reported with the figures
            self.error = f"{type(e).__name__}: {e}"


def _poll(con: Any, until: threading.Event, poll_s: float) -> tuple[list[np.ndarray], float]:
    """Refresh and read new samples until ``until`` is set (and once more); per-sample
    latencies and the median seconds of one refresh + query."""
    newest, lat, took = 0, [], []
    while True:
        done = until.is_set()
        t0 = time.perf_counter()
        sqlload.refresh(con)
        ts = con.execute("SELECT ts FROM samples WHERE ts > $n", {"n": newest}).fetchnumpy()["ts"]
        seen = time.time_ns()
        took.append(time.perf_counter() - t0)
        if len(ts):
            ts = np.asarray(ts, dtype=np.int64)
            lat.append((seen - ts) / S)
            newest = max(newest, int(ts.max()))
        if done:
            return lat, float(np.median(took))
        time.sleep(poll_s)


def measure_freshness(
    lake: str,
    s3: S3Settings,
    *,
    seconds: float,
    max_age_s: float,
    nodes: int = 8,
    poll_s: float = 0.25,
    catalog: Path | None = None,
    keep_s: float | None = None,
) -> dict[str, Any]:
    """Feed ``lake`` (Iceberg when ``catalog``, a SQLite file, is given) for ``seconds``;
    freshness percentiles, flushes and (Iceberg) the snapshot counts before and after expiry
    with ``keep_s``."""
    from services.lake.iceberg import IcebergSettings, SnapshotFiles

    ice = None
    if catalog is not None:
        ice = IcebergSettings(lake_format="iceberg",
                              iceberg_catalog=SecretStr(f"sqlite:///{catalog}"))  # fmt: skip
    sink = open_writer(lake, s3=s3, iceberg=ice)
    sink.ensure_seeds()
    files = None
    if ice is not None:
        files = SnapshotFiles(sink.catalog, ice.iceberg_namespace, sink.seed_path)  # type: ignore[attr-defined]
    con = sqlload.connect(lake, s3=s3, iceberg=files)
    feed = _Feed(sink, nodes, 1.0, max_age_s)
    thread = threading.Thread(target=feed.run, name="lake-feed", daemon=True)
    started = time.monotonic()
    thread.start()
    stop_poll = threading.Event()
    out: dict[str, Any] = {}

    def poll() -> None:
        out["lat"], out["poll_s"] = _poll(con, stop_poll, poll_s)

    poller = threading.Thread(target=poll, name="lake-poll", daemon=True)
    poller.start()
    time.sleep(seconds)
    feed.stop.set()
    thread.join(120)
    elapsed = time.monotonic() - started
    stop_poll.set()
    poller.join(60)
    lat = np.concatenate(out.get("lat") or [np.array([])])
    res: dict[str, Any] = {
        "seconds": round(elapsed, 1),
        "max_age_s": max_age_s,
        "samples_fed": feed.rows,
        "samples_seen": int(lat.size),
        "flushes": feed.flushes,
        "flush_p50_s": round(float(np.median(feed.flush_s)), 3) if feed.flush_s else None,
        "refresh_query_p50_s": round(out.get("poll_s", float("nan")), 3),
        "p50_s": round(float(np.percentile(lat, 50)), 2) if lat.size else float("nan"),
        "p99_s": round(float(np.percentile(lat, 99)), 2) if lat.size else float("nan"),
        "max_s": round(float(lat.max()), 2) if lat.size else float("nan"),
        "error": feed.error,
    }
    if ice is not None:
        res |= _snapshots(lake, s3, ice, sink, elapsed, max_age_s, keep_s or 3600.0)
    return res


def _snapshots(
    lake: str, s3: S3Settings, ice: Any, sink: Any, elapsed: float, max_age_s: float, keep_s: float
) -> dict[str, Any]:
    """Snapshots of the samples table: made during the run (a day's worth extrapolated),
    and kept after expiry with ``keep_s``."""
    made = len(sink.catalog.load_table((ice.iceberg_namespace, "samples")).metadata.snapshots)
    maint = open_compactor(lake, s3=s3, iceberg=ice.model_copy(update={"iceberg_keep_s": keep_s}))
    maint.compact_closed(None, close_after_s=0.0, wait=True)
    kept = len(sink.catalog.load_table((ice.iceberg_namespace, "samples")).metadata.snapshots)
    return {
        "snapshots_made": made,
        "snapshots_per_day": round(made / elapsed * 86400),
        "snapshots_per_day_bound": round(86400 / max_age_s),
        "keep_s": keep_s,
        "snapshots_kept": kept,
        "snapshots_kept_bound": int(keep_s / max_age_s + 2),
    }
