"""freshness and alert_latency, from one live pipeline run.

Worker, detect and ``refinery land`` run as processes on fresh topics; the simulator publishes
at speed 1 (so broker time ≈ true time) with ``pfc_storm``, ``throttle`` and ``xid`` faults,
sized to about half the worker's measured maximum rate. Then:

- freshness to the refined topic, per sample: LogAppendTime of the refined record (the topic
  is created with ``message.timestamp.type=LogAppendTime``) - the sample's aligned ``ts``
  (≈ true source time: no clock fault is injected). Exporters batch 1 s of 10 Hz samples, so
  the oldest sample of a batch is ~0.9 s old when sent; the newest-sample figure excludes that.
  The ``*_warm_*`` figures leave out samples stamped in the run's first 10 s (a third of a
  short run): the worker meets every source for the first time then, and builds its state,
  layouts and topology joins on the first records (several ms a source), so a backlog forms
  and takes seconds to clear at half load. The whole-run figures keep them.
- freshness to DuckDB, per sample: a thread lists the lake's sample files every 0.25 s; rows
  of a file first seen at wall time W became queryable at W; it reads their ``ts`` with DuckDB.
- alert latency: LogAppendTime of the first firing alert matching an incident - the
  incident's true onset (simulator truth, in memory).

:func:`bench_worker_freshness` repeats the refined-topic figures at the same load with the
worker alone (and the broker): the setting of the freshness goal, where detect and the lander
do not take the same two cores; and once more with exporters that publish every 0.2 s instead
of every second (``worker_alone_200ms_*``, GPU and NIC series still at 10 Hz, the others
sampled at each publish): what the per-sample figure is once the exporter's own batching no
longer holds samples back for up to 0.9 s. Smaller records cost the worker more per sample
(its maximum at 0.2 s records is about half that at 1 s), so each cadence runs at half the
worker's maximum measured on a backlog of that cadence (``*_max_samples_per_s``), not at
half the 1 s maximum, which would load a 0.2 s run to its limit. In these runs every
node publishes within a few ms of the others (lockstep), so the worker meets one burst per
interval and the last record of a burst waits for all before it. ``worker_alone_spread_*``
gives each node a phase of its own, as exporters started at unrelated moments run, every 1 s
and every 0.5 s. ``worker_alone_scrape_1s_*`` publishes every 1 s at spread phases with one
reading per series, sent within ms of being read, as ``refinery export node`` scrapes and
sends: the per-sample figure then holds no exporter batching, only the pipeline.
"""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from lab.bench.accuracy import read_json_topic
from lab.bench.figures import BenchResult
from lab.bench.harness import BenchKafka, S, percentile, records, sim_topics
from lab.simulate.cluster import Cluster
from lab.simulate.engine import Simulation
from lab.simulate.faults import Incident
from lab.simulate.messages import Stream
from lab.simulate.publish import publish

FAULTS = "pfc_storm:count=1,throttle:count={n},xid:count={n}"
# raw samples per node per second of the default cluster (samples_per_node_s(S, 10); a unit
# test keeps them equal)
SAMPLES_PER_NODE_S = 1905


class LakePoller:
    """Lists ``lake/samples`` every ``every_s`` in a thread; per new file, reads its ``ts``
    with DuckDB and keeps ``visible_ns - ts`` per row."""

    def __init__(self, lake: Path, every_s: float = 0.25) -> None:
        self.lake, self.every_s = lake, every_s
        self.seen: set[Path] = set()
        self.lat_ns: list[np.ndarray] = []
        self.newest_lag_ns: list[int] = []
        self.newest = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lake-poller", daemon=True)
        self.error: str | None = None

    def __enter__(self) -> LakePoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        import duckdb

        con = duckdb.connect()
        try:
            while not self._stop.is_set():
                self.poll(con)
                self._stop.wait(self.every_s)
            self.poll(con)
        except Exception as e:  # reported in the result; the benchmark goes on
            self.error = f"{type(e).__name__}: {e}"
        finally:
            con.close()

    def poll(self, con: Any) -> None:
        files = set(self.lake.glob("samples/*/*/p*.parquet"))
        visible = time.time_ns()
        new = sorted(files - self.seen)
        if not new:
            return
        self.seen |= set(new)
        ts = con.execute(
            "SELECT ts FROM read_parquet($files)", {"files": [str(p) for p in new]}
        ).fetchnumpy()["ts"]
        if len(ts):
            self.lat_ns.append(visible - np.asarray(ts, dtype=np.int64))
            self.newest = max(self.newest, int(ts.max()))
            self.newest_lag_ns.append(visible - self.newest)

    def latencies_s(self) -> np.ndarray:
        if not self.lat_ns:
            return np.array([], dtype=np.float64)
        return np.concatenate(self.lat_ns).astype(np.float64) / S


def _refined_freshness(
    k: BenchKafka, prefix: str, warmup_s: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(per sample, newest sample of each raw record, per sample once warm) seconds from
    aligned ts to the refined record's LogAppendTime (a refined record holds one or more raw
    records of a node). *Once warm*: the samples stamped ``warmup_s`` or more after the
    run's first sample, when every source is known to the worker (its state, layouts and
    topology joins built on its first records)."""
    import pyarrow as pa

    topic = prefix + "telemetry.refined"
    from lab.bench.harness import end_count

    n = end_count(k.conf, topic)
    per_sample: list[np.ndarray] = []
    stamps: list[np.ndarray] = []
    newest: list[int] = []
    for m in records(k.conf, topic, lambda c: c >= n, 120):
        append_ns = m.timestamp()[1] * 1_000_000
        t = pa.ipc.open_stream(m.value()).read_all()
        ts = t.column("ts").to_numpy()
        if len(ts):
            per_sample.append(append_ns - ts)
            stamps.append(ts)
            pos = t.column("raw_partition").to_numpy().astype(np.int64) << 40
            pos += t.column("raw_offset").to_numpy()
            for p in np.unique(pos):
                newest.append(append_ns - int(ts[pos == p].max()))
    if not per_sample:
        empty = np.array([], np.float64)
        return empty, empty, empty
    lat = np.concatenate(per_sample).astype(np.float64) / S
    return lat, np.asarray(newest, np.float64) / S, once_warm(lat, np.concatenate(stamps), warmup_s)


def worker_latency(
    docs: list[tuple[dict[str, Any], int]], raw_topic: str
) -> tuple[np.ndarray, np.ndarray]:
    """(seconds, raw append ms) per raw record of ``raw_topic``: from the broker's append of
    the raw record (its accounting record's ``append_ms``) to the append of its accounting
    record, which the worker sends with the record's refined rows. What the worker adds (its
    queue, group, refining and produce), without the exporter's batching or the publisher's
    lag that the per-sample figures include. ``docs``: (accounting document, its
    LogAppendTime ms); replays (a raw record accounted twice) keep the first."""
    first: dict[tuple[int, int], tuple[int, int]] = {}
    for d, at_ms in docs:
        if d.get("raw_topic") != raw_topic:
            continue
        pos = (int(d["raw_partition"]), int(d["raw_offset"]))
        seen = first.get(pos)
        if seen is None or at_ms < seen[0]:
            first[pos] = (at_ms, int(d["append_ms"]))
    if not first:
        return np.array([], np.float64), np.array([], np.int64)
    at, raw = (np.array(v, np.int64) for v in zip(*first.values(), strict=True))
    return (at - raw).astype(np.float64) / 1000, raw


def once_warm(latency_s: np.ndarray, ts_ns: np.ndarray, warmup_s: float) -> np.ndarray:
    """The latencies of the samples stamped ``warmup_s`` or more after the first sample
    (``ts_ns``: each sample's stamp, in the order of ``latency_s``)."""
    if not len(ts_ns):
        return latency_s[:0]
    return latency_s[ts_ns >= int(ts_ns.min()) + round(warmup_s * S)]


def _warm_note(warmup_s: float, whole: str) -> str:
    return (
        f"per sample, once warm: the first {warmup_s:g} s of samples (every source new to "
        f"the worker) left out; whole run: {whole}"
    )


def _warmup_s(seconds: int) -> float:
    """How much of a run's start the *once warm* figure leaves out: 10 s, a third of a
    short run."""
    return min(10.0, seconds / 3)


def _match(i: Incident, a: dict[str, Any]) -> bool:
    kind = i.kind.value
    if a.get("state") != "firing":
        return False
    if kind == "xid":
        return bool(a["rule"] == "gpu_xid" and a["entity"] == f"{i.node}/{i.device}")
    if kind == "throttle":
        return bool(a["rule"].endswith("_throttle") and a["entity"] == f"{i.node}/{i.device}")
    if kind == "pfc_storm":  # the straggler alert that names the storm as its cause
        return bool(a["rule"] == "nccl_straggler" and a.get("job") == i.job)
    return False


def _p(xs: list[float] | np.ndarray, q: float) -> float:
    return float(np.quantile(xs, q)) if len(xs) else math.nan


def _half_load_nodes(
    worker_max_rate: float | None, per_node_s: float = SAMPLES_PER_NODE_S
) -> tuple[float, int]:
    """(the maximum rate used, 30 k samples/s if unmeasured; nodes publishing about half)."""
    rate = worker_max_rate if worker_max_rate and math.isfinite(worker_max_rate) else 30_000.0
    return rate, max(8, min(400, round(0.5 * rate / per_node_s)))


def samples_per_node_s(interval_ns: int, substeps: int, seconds: int = 4) -> float:
    """Raw samples per node per second the simulator publishes at this interval and these
    GPU/NIC samples per interval (4 nodes, ``seconds`` simulated, counted)."""
    sim = Simulation(Cluster.build(4), None, interval_ns=interval_ns, substeps=substeps,
                     start_ns=1_800_000_000 * S, duration_ns=seconds * S)  # fmt: skip
    n = sum(m.samples for t in sim.ticks() for m in t.messages if m.stream is Stream.RAW)
    return n / (4 * seconds)


def bench_worker_freshness(
    k: BenchKafka,
    worker_max_rate: float | None,
    seconds: int,
    fresh: BenchResult,
    interval_ns: int = S,
    substeps: int = 10,
    label: str = "worker_alone",
    spread: bool = False,
) -> None:
    """Freshness to the refined topic with the worker alone (and the broker) on the machine,
    at the load :func:`bench_pipeline` uses: the issue's own setting, and what the worker
    adds when detect and the lander do not share its cores. Exporters publish every
    ``interval_ns`` with ``substeps`` GPU/NIC samples each; the node count gives the same
    samples/s at any interval. ``spread`` gives each node a phase of its own (see
    :class:`~lab.simulate.engine.Simulation`) instead of all publishing at once. Adds its
    figures, named ``label_*``, to ``fresh`` (the pipeline run's freshness result)."""
    per_node = samples_per_node_s(interval_ns, substeps)
    nodes = _half_load_nodes(worker_max_rate, per_node)[1]
    prefix = k.fresh_topics()
    worker = k.start_worker(prefix, name=f"{prefix}solo-worker")
    k.wait("the worker joins", lambda: k.joined(prefix + "worker"), 120, [worker])
    k.say(f"  worker alone, exporters publishing every {interval_ns / S:g}s: {nodes} nodes "
          f"(~{round(nodes * per_node):,} samples/s) for {seconds}s at speed 1")  # fmt: skip
    sim = Simulation(
        Cluster.build(nodes),
        None,
        interval_ns=interval_ns,
        substeps=substeps,
        duration_ns=seconds * S,
        spread=spread,
    )
    from lab.bench.harness import machine_busy_s, process_cpu_s

    cpu0, wall0, box0 = process_cpu_s(worker.proc.pid), time.monotonic(), machine_busy_s()
    rep = publish(sim, k.kafka, sim_topics(prefix), None, speed=1.0, progress_cb=None)
    raw = [prefix + t for t in ("telemetry.raw", "telemetry.events", "telemetry.collectives")]
    k.wait("the worker drains", lambda: k.lag(prefix + "worker", raw) == 0, 180, [worker])
    wall = time.monotonic() - wall0
    cpu1, box1 = process_cpu_s(worker.proc.pid), machine_busy_s()
    worker.stop(30)
    warmup = _warmup_s(seconds)
    per_sample, newest, warm = _refined_freshness(k, prefix, warmup)
    busy = (box1 - box0) / wall if box0 is not None and box1 is not None else float("nan")
    own = (cpu1 - cpu0) / wall if cpu0 is not None and cpu1 is not None else float("nan")
    phases = "phases spread" if spread else "in lockstep"
    note = (f"worker alone, {nodes} nodes publishing every {interval_ns / S:g}s {phases}, "
            f"{substeps} GPU/NIC readings a series each; machine {busy:.2f} cores, "
            f"worker {own:.2f}")  # fmt: skip
    fresh.add(f"{label}_publish_samples_per_s", rep.samples_per_s, "samples/s", note=note)
    fresh.add(f"{label}_refined_p99_s", _p(per_sample, 0.99), "s", "<=", 1.0,
              note="per sample")  # fmt: skip
    fresh.add(f"{label}_refined_newest_p99_s", _p(newest, 0.99), "s", "<=", 1.0,
              note="newest sample per record")  # fmt: skip
    fresh.add(f"{label}_refined_warm_p99_s", _p(warm, 0.99), "s", "<=", 1.0,
              note=_warm_note(warmup, f"{label}_refined_p99_s"))  # fmt: skip
    accounting = read_json_topic(k, prefix + "telemetry.accounting")
    worker_s, raw_ms = worker_latency(
        [(d, ns // 1_000_000) for d, ns in accounting], prefix + "telemetry.raw"
    )
    warm_worker = once_warm(worker_s, raw_ms * 1_000_000, warmup)
    what = "per raw record, its append to its accounting record's append: what the worker adds"
    fresh.add(f"{label}_worker_p50_s", _p(worker_s, 0.5), "s", note=what)
    fresh.add(f"{label}_worker_p99_s", _p(worker_s, 0.99), "s", note=what)
    later = f"the same, raw records appended {warmup:g} s or more after the first"
    fresh.add(f"{label}_worker_warm_p99_s", _p(warm_worker, 0.99), "s", note=later)


def bench_pipeline(
    k: BenchKafka, worker_max_rate: float | None, seconds: int, incidents_per_kind: int
) -> tuple[BenchResult, BenchResult]:
    """Run the pipeline once; returns (freshness, alert_latency). Blocks for the run."""
    fresh, alert = BenchResult("freshness"), BenchResult("alert_latency")
    rate, nodes = _half_load_nodes(worker_max_rate)
    prefix = k.fresh_topics()
    lake = k.workdir / f"{prefix}lake"
    worker = k.start_worker(prefix, name=f"{prefix}pipe-worker")
    detect = k.start(
        "pipe-detect", ["detect", "--topic-prefix", prefix, "--group", prefix + "detect"]
    )
    land = k.start(
        f"{prefix}pipe-land",
        [
            "land",
            "--group",
            prefix + "land",
            "--no-compact",
            "--topics",
            f"{prefix}telemetry.refined=samples",
        ],
        lake=lake,
    )
    kids = [worker, detect, land]
    k.wait("worker, detect and land join", lambda: all(
        k.joined(g) for g in (prefix + "worker", prefix + "detect", prefix + "land")
    ), 120, kids)  # fmt: skip
    faults = FAULTS.format(n=incidents_per_kind)
    k.say(f"  publishing {nodes} nodes (~{nodes * SAMPLES_PER_NODE_S:,} samples/s) for {seconds}s"
          f" at speed 1 with {faults}")  # fmt: skip
    sim = Simulation(Cluster.build(nodes), faults, duration_ns=seconds * S)
    from lab.bench.harness import machine_busy_s, process_cpu_s

    procs = {"worker": worker, "detect": detect, "land": land}
    cpu0 = {n: process_cpu_s(c.proc.pid) for n, c in procs.items()}
    own0, wall0, box0 = time.process_time(), time.monotonic(), machine_busy_s()
    with LakePoller(lake) as poller:
        rep = publish(sim, k.kafka, sim_topics(prefix), None, speed=1.0, progress_cb=None)
        raw = [
            prefix + "telemetry.raw",
            prefix + "telemetry.events",
            prefix + "telemetry.collectives",
        ]
        k.wait("the worker drains", lambda: k.lag(prefix + "worker", raw) == 0, 180, kids)
        derived = [prefix + t for t in ("telemetry.refined", "telemetry.events.aligned",
                                        "telemetry.collectives.aligned")]  # fmt: skip
        k.wait("detect and land drain", lambda: k.lag(prefix + "detect", derived) == 0
               and k.lag(prefix + "land", derived[:1]) == 0, 180, kids)  # fmt: skip
        time.sleep(2 * poller.every_s + 1)
    wall = time.monotonic() - wall0
    cpu_share = {"bench (simulator, poller)": (time.process_time() - own0) / wall}
    box1 = machine_busy_s()
    cpu_share["machine (all processes)"] = (
        (box1 - box0) / wall if box0 is not None and box1 is not None else float("nan")
    )
    for n, c in procs.items():
        a, b = cpu0[n], process_cpu_s(c.proc.pid)
        cpu_share[n] = (b - a) / wall if a is not None and b is not None else float("nan")
    for c in kids:
        c.stop(30)

    pub_rate = rep.samples_per_s
    warmup = _warmup_s(seconds)
    per_sample, newest, warm = _refined_freshness(k, prefix, warmup)
    lake_lat = poller.latencies_s()
    fresh.add("publish_samples_per_s", pub_rate, "samples/s", note=f"{nodes} nodes, speed 1")
    of = "target 0.5: of the lower of the worker's and the pipeline's maximum"
    fresh.add("load_vs_max", pub_rate / rate, "x", note=of)
    fresh.add("refined_p99_s", _p(per_sample, 0.99), "s", "<=", 1.0, note="per sample")
    fresh.add("refined_p50_s", _p(per_sample, 0.5), "s", note="per sample")
    fresh.add("refined_warm_p99_s", _p(warm, 0.99), "s", "<=", 1.0,
              note=_warm_note(warmup, "refined_p99_s"))  # fmt: skip
    fresh.add(
        "refined_newest_p99_s",
        _p(newest, 0.99),
        "s",
        "<=",
        1.0,
        note="newest sample per record: excludes the 1 s exporter batch",
    )
    fresh.add("duckdb_p99_s", _p(lake_lat, 0.99), "s", "<=", 10.0, note="per sample")
    fresh.add("duckdb_p50_s", _p(lake_lat, 0.5), "s", note="per sample")
    fresh.details.update(
        {
            "nodes": nodes,
            "seconds": seconds,
            "worker_max_rate_used": rate,
            "refined_samples": len(per_sample),
            "lake_samples": len(lake_lat),
            "lake_files": len(poller.seen),
            "lake_poll_error": poller.error,
            "land_flush_max_age_s": 2.0,
            "cpu_share_over_run": {n: round(v, 3) for n, v in cpu_share.items()},
            "run_wall_s": round(wall, 1),
            "publish": rep.as_dict(),
        }
    )

    alerts = read_json_topic(k, prefix + "telemetry.alerts", 60)
    rows: list[dict[str, Any]] = []
    for inc in sim.incidents:
        hits = [t for a, t in alerts if _match(inc, a)]
        rows.append(
            {
                "kind": inc.kind.value,
                "id": inc.id,
                "entity": f"{inc.node}/{inc.device}" if inc.device else inc.job,
                "latency_s": (min(hits) - inc.start_ns) / S if hits else None,
            }
        )
    direct = [
        r["latency_s"] for r in rows if r["kind"] != "pfc_storm" and r["latency_s"] is not None
    ]
    strag = [
        r["latency_s"] for r in rows if r["kind"] == "pfc_storm" and r["latency_s"] is not None
    ]
    missed = sum(1 for r in rows if r["latency_s"] is None)
    alert.add("alert_p50_s", percentile(direct, 0.5), "s", note="xid + throttle")
    alert.add("alert_p99_s", percentile(direct, 0.99), "s", "<=", 2.0, note="xid + throttle")
    alert.add("straggler_with_cause_p99_s", percentile(strag, 0.99), "s", "<=", 3.0,
              note="the straggler alert of each PFC storm's job")  # fmt: skip
    alert.add("incidents", len(rows), "incidents")
    alert.add("incidents_without_alert", missed, "incidents")
    alert.details.update(
        {
            "incidents": rows,
            "alerts": [
                {"rule": a["rule"], "state": a["state"], "entity": a["entity"],
                 "appended_ns": t, "cause": a.get("cause")}
                for a, t in alerts
            ],
        }
    )  # fmt: skip
    return fresh, alert
