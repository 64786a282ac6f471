"""worker_throughput: the simulator's publish rate, the raw consumer ceiling, one
``refinery worker`` process on the same preloaded topic, and the in-process refine step.

Ratio it exists to measure: worker / ceiling (how much of what one Python consumer process can
read and decode the worker keeps), plus the absolute 1 M samples/s goal.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import Counter
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from lab.bench.figures import BenchResult
from lab.bench.harness import (
    BenchKafka,
    CpuSampler,
    S,
    end_count,
    records,
    sim_topics,
)
from lab.bench.instructions import GROUP
from lab.bench.latency import samples_per_node_s
from lab.simulate.cluster import Cluster
from lab.simulate.engine import Simulation
from lab.simulate.publish import publish
from schemas.catalog import default_catalog
from schemas.codec import content_type_of, decode
from schemas.topics import TOPICS
from services.worker.refiner import RawRecord, Refiner

# the backlog's topics, stamped with the simulated arrival of each record
INPUT_STREAMS = ("telemetry.raw", "telemetry.events", "telemetry.collectives")
GROUP_GAP_MS = 100  # accounting records closer than this to a group's first are of that group
KEEP_RECORDS = 2400  # raw records kept for the in-process comparison (half warm-up)


@dataclass
class Ceiling:
    records: int
    samples: int
    seconds: float
    cpu_s: float
    kept: list[RawRecord]


# no goal: one worker's share of a plain consumer's ceiling is watched for regressions;
# throughput scales out by partitions and worker processes
RATIO_NOTE = "watched for regressions; scale-out is by partitions and processes"


def read_ceiling(k: BenchKafka, topic: str, expect: int, timeout: float) -> Ceiling:
    """One plain consumer in this process reads and decodes every record of ``topic``."""
    n = samples = 0
    kept: list[RawRecord] = []
    t_first = t_last = 0.0
    cpu0 = time.process_time()
    for m in records(k.conf, topic, lambda c: c >= expect, timeout):
        if n == 0:
            t_first = time.perf_counter()
        headers = list(m.headers() or [])
        batch = decode(m.value(), content_type_of(headers))
        n += 1
        samples += batch.table.num_rows
        t_last = time.perf_counter()
        if len(kept) < KEEP_RECORDS:
            kept.append(
                RawRecord(
                    m.topic(),
                    m.partition(),
                    m.offset(),
                    m.key(),
                    m.value(),
                    [(h, bytes(v or b"")) for h, v in headers],
                    m.timestamp()[1],
                )
            )
    return Ceiling(n, samples, t_last - t_first, time.process_time() - cpu0, kept)


def clock_bases(k: BenchKafka, topic: str, timeout: float) -> Counter[str]:
    """How many refined rows of ``topic`` say each ``clock_basis`` (every record in it)."""
    expect = end_count(k.conf, topic)
    counts: Counter[str] = Counter()
    for m in records(k.conf, topic, lambda c: c >= expect, timeout):
        col = pa.ipc.open_stream(m.value()).read_all().column("clock_basis")
        for row in pc.value_counts(col).to_pylist():
            counts[str(row["values"])] += int(row["counts"])
    return counts


def _in_process(kept: list[RawRecord], sim: Simulation, r: BenchResult) -> float:
    """Decode alone and Refiner.process_group (decode + refine + outputs, in calls of
    ``GROUP`` records: the worker's ``refine_chunk``, a unit test keeps them equal) in this
    process, on the same records: the first half warms the state
    (first sight of every source), the second half is measured. Plus bench_refine."""
    from lab.bench.refine import bench_refine
    from pipelines.refine.enrich import TopologyIndex

    assert sim.start_ns is not None
    topo = TopologyIndex(sim.cluster.topology(), sim.cluster.jobs(sim.start_ns))
    # in arrival order (the consumer read them partition by partition): the first half then
    # holds the earlier ticks of the same sources the second half continues
    kept = sorted(kept, key=lambda r: (r.append_ms, r.partition, r.offset))
    half = len(kept) // 2
    warm, measured = kept[:half], kept[half:]
    samples = 0
    t0 = time.process_time()
    for rec in measured:
        samples += decode(rec.value, content_type_of(rec.headers)).table.num_rows
    t_decode = time.process_time() - t0
    refiner = Refiner(default_catalog(), TOPICS, lambda: topo, _none, _none)
    now = time.time_ns()
    for i in range(0, len(warm), GROUP):
        refiner.process_group(warm[i : i + GROUP], now)
    t0 = time.process_time()
    for i in range(0, len(measured), GROUP):
        refiner.process_group(measured[i : i + GROUP], now)
    t_refiner = time.process_time() - t0
    synthetic = bench_refine(100, 2000)
    decode_rate = samples / t_decode if t_decode else math.nan
    refiner_rate = samples / t_refiner if t_refiner else math.nan
    r.add("decode_only_samples_per_cpu_s", decode_rate, "samples/CPU-s",
          note="schemas.codec.decode")  # fmt: skip
    r.add(
        "refiner_samples_per_cpu_s",
        refiner_rate,
        "samples/CPU-s",
        ">=",
        1_000_000,
        note="Refiner.process_group in-process, warm state, simulator records",
    )
    r.add(
        "bench_refine_samples_per_s",
        synthetic["samples_per_s"],
        "samples/s",
        note="lab.bench.refine.bench_refine, synthetic 2000-row batches",
    )
    r.add("refiner_share_decode", t_decode / t_refiner if t_refiner else math.nan, "x")
    r.details["in_process"] = {
        "records": len(measured),
        "samples": samples,
        "decode_cpu_s": t_decode,
        "refiner_cpu_s": t_refiner,
        "bench_refine": synthetic,
    }
    return refiner_rate


def _clock_share(k: BenchKafka, prefix: str, timeout: float, r: BenchResult) -> None:
    """The share of the worker's refined rows whose clock is bounded by exchanges: below 1
    the benchmark no longer measures the path live data takes."""
    bases = clock_bases(k, prefix + TOPICS.refined, timeout)
    rows = sum(bases.values())
    r.add(
        "worker_rows_clock_exchange_share",
        bases["exchange"] / rows if rows else math.nan,
        "x",
        ">=",
        0.99,
        note="refined rows with clock_basis exchange, as on live data",
    )
    r.details["clock_basis_rows"] = dict(bases)


def _none(_: str) -> bytes | None:
    return None


def bench_worker_throughput(
    k: BenchKafka,
    samples: int,
    nodes: int = 200,
    timeout: float = 120.0,
    interval_ns: int = S,
    substeps: int = 10,
    compare: bool = True,
) -> BenchResult:
    """Preload ``samples`` (rounded up to whole seconds of a ``nodes``-node cluster whose
    exporters publish every ``interval_ns`` with ``substeps`` GPU/NIC samples each) into a
    fresh raw topic as fast as possible, then measure the ceiling, the worker and the
    in-process refine over it; without ``compare``, the worker alone (its maximum rate at
    this cadence). Blocks; raises RuntimeError if the worker dies or stalls."""
    r = BenchResult("worker_throughput")
    per_s = round(nodes * samples_per_node_s(interval_ns, substeps))
    ticks = max(1, math.ceil(samples / per_s))
    # The backlog is simulated as the last ``ticks`` seconds before now and each record is
    # stamped with its simulated arrival (CreateTime), as a real backlog is stamped on append:
    # the worker's clock estimates and time joins then see what they would see catching up.
    # (Appended all at once, every source's clock would look up to ``ticks`` s ahead.) The
    # worker never aligns on a CreateTime stamp: each batch carries its node's exchanges with
    # the broker on that timeline (lab.simulate.publish), so it bounds every clock from
    # them as on live data; worker_rows_clock_exchange_share says whether it did.
    prefix = k.fresh_topics(create_time=INPUT_STREAMS)
    topics = sim_topics(prefix)
    start = time.time_ns() - (ticks + 5) * S
    sim = Simulation(Cluster.build(nodes), None, start_ns=start, duration_ns=ticks * S,
                     interval_ns=interval_ns, substeps=substeps)  # fmt: skip
    k.say(f"  preloading {ticks} s of {nodes} nodes (~{ticks * per_s:,} samples)")
    rep = publish(sim, k.kafka, topics, None, speed=0, progress_cb=None, stamp_due=True)
    if rep.unacked:
        raise RuntimeError(f"{rep.unacked} messages were not acknowledged while preloading")
    r.add(
        "simulator_publish_samples_per_s",
        rep.samples_per_s,
        "samples/s",
        ">=",
        1_000_000,
        note=f"{nodes} nodes, speed 0",
    )
    raw_records = end_count(k.conf, topics.raw)

    ceil: Ceiling | None = None
    ceil_rate = math.nan
    if compare:
        k.say(f"  ceiling: one confluent-kafka consumer decoding {raw_records:,} records")
        ceil = read_ceiling(k, topics.raw, raw_records, timeout)
        ceil_rate = ceil.samples / ceil.seconds if ceil.seconds > 0 else math.nan
        r.add("ceiling_samples_per_s", ceil_rate, "samples/s", note="plain consumer + decode")
        r.add("ceiling_cpu_s_per_million", ceil.cpu_s / ceil.samples * 1e6, "CPU-s/M samples")

    k.say("  one `refinery worker` process from the beginning of the topic")
    worker = k.start_worker(prefix, name=f"{prefix}tput-worker")
    spawned = time.time()
    acc = prefix + "telemetry.accounting"
    n = total = 0
    first_ms = last_ms = 0
    marks: list[tuple[int, int]] = []  # (append ms, samples) of each accounting record
    with CpuSampler(worker.proc.pid) as cpu:
        for m in records(k.conf, acc, lambda c: c >= raw_records, timeout):
            doc = json.loads(m.value())
            ts = m.timestamp()[1]
            if n == 0:
                first_ms = last_ms = ts
            first_ms, last_ms = min(first_ms, ts), max(last_ms, ts)
            total += int(doc["input_samples"])
            marks.append((ts, int(doc["input_samples"])))
            n += 1
        ended = time.time()
        time.sleep(0.3)  # one more CPU sample after the last record
    worker.stop(30)
    _clock_share(k, prefix, timeout, r)
    span = (last_ms - first_ms) / 1000
    complete = n >= raw_records
    marks.sort()
    # The worker acknowledges a group of records at once, so their accounting records share
    # one append time: a rate is counted from the end of one group to the end of a later one,
    # over the groups completed in between (records within 100 ms of the start belong to it).
    after = [(t, x) for t, x in marks if t > first_ms + GROUP_GAP_MS]
    if complete and after:
        span = (after[-1][0] - first_ms) / 1000
        w_samples = sum(x for _, x in after)
        w_rate = w_samples / span
        t0, t1 = first_ms / 1000, last_ms / 1000
        w_cpu = cpu.cpu_between(t0, t1)
        note = "one process, end of its first group to end of its last"
        # where the limit is: the main thread (Faust's loop and the refiner, one core at
        # most under the GIL) against what the machine had left (broker included)
        if t1 > t0:
            r.add(
                "worker_main_thread_busy",
                cpu.main_thread_between(t0, t1) / (t1 - t0),
                "cores",
                note="its main thread's CPU over the run: 1.0 is one core",
            )
            r.add("machine_idle_cores",
                  (os.cpu_count() or 1) - cpu.machine_busy_between(t0, t1) / (t1 - t0),
                  "cores", note="the machine's idle CPU over the run, broker included")  # fmt: skip
    else:  # it stalled (or did all in one group): what it did over the whole wait, say so
        w_rate, w_samples = total / (ended - spawned), total
        w_cpu = cpu.cpu_between(spawned, ended)
        why = "one group only" if complete else f"INCOMPLETE: {n}/{raw_records} records"
        note = f"{why}, {ended - spawned:.0f}s incl. start-up"
    r.add("worker_samples_per_s", w_rate, "samples/s", ">=", 1_000_000, note=note)
    if complete and after:  # the second half: every source seen, caches warm
        half = marks[len(marks) // 2][0]
        tail = [(t, x) for t, x in marks if t > half + GROUP_GAP_MS]
        t_span = (tail[-1][0] - half) / 1000 if tail else 0.0
        steady = sum(x for _, x in tail) / t_span if t_span > 0 else w_rate
        r.add("worker_steady_samples_per_s", steady, "samples/s", ">=", 1_000_000,
              note="groups ending in the second half of the run" if t_span > 0
              else "too few groups for a second half: whole run")  # fmt: skip
        if ceil is not None:
            r.add("worker_steady_to_ceiling_ratio", steady / ceil_rate, "x", note=RATIO_NOTE)
    r.add("worker_cpu_s_per_million", w_cpu / max(w_samples, 1) * 1e6, "CPU-s/M samples")
    if ceil is not None:
        r.add("worker_to_ceiling_ratio", w_rate / ceil_rate, "x", note=RATIO_NOTE)
    r.add("worker_records_accounted_share", n / raw_records, "x", note="1.0: all refined")
    r.details.update(
        {
            "nodes": nodes,
            "ticks": ticks,
            "raw_records": raw_records,
            "raw_samples": ceil.samples if ceil is not None else total,
            "publish": rep.as_dict(),
            "ceiling": {"seconds": ceil.seconds, "cpu_s": ceil.cpu_s} if ceil else None,
            "worker": {
                "accounted_records": n,
                "accounted_samples": total,
                "span_s": span,
                "cpu_s": w_cpu,
                "complete": complete,
                "log_tail": [ln[:300] for ln in worker.tail(20).splitlines()],
            },
        }
    )
    if ceil is None:
        return r
    k.say("  in-process: decode alone, Refiner.process_group, bench_refine")
    refiner_rate = _in_process(ceil.kept, sim, r)
    r.add(
        "worker_cpu_to_refiner_cpu_ratio",
        (w_samples / w_cpu) / refiner_rate if w_cpu > 0 else math.nan,
        "x",
        note="samples per CPU-s of the worker process / of the in-process refiner",
    )
    # Where the ceiling ratio can go while one thread refines: the refiner's samples per
    # CPU-second (decode and refine alone, no Kafka, no Faust) over the ceiling's samples
    # per second. A worker whose Kafka intake and output cost nothing and whose thread never
    # waited would reach this; the real one stays below it.
    r.add(
        "refiner_cpu_to_ceiling_ratio",
        refiner_rate / ceil_rate,
        "x",
        note="one refining thread's bound on worker_steady_to_ceiling_ratio",
    )
    return r
