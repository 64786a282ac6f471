"""What SASL_SSL costs, as a ratio to PLAINTEXT, measured side by side in one run.

:func:`bench_sasl` starts two single-node local brokers at once: a plaintext one and a
``secure=True`` one (SCRAM-SHA-512 over TLS, the ACLs of ``deploy/acls.yaml`` enforced). It
moves the same simulator raw batches (Arrow IPC, encoded once beforehand, as exporters send
them) into ``telemetry.raw`` of each with plain confluent-kafka clients:

- produce: one producer configured as :class:`services.kafka.producer.BatchProducer` is
  (idempotent, ``acks=all``, zstd), principal ``refinery-exporter`` when secure; timed from
  the first send until every record is acknowledged;
- consume: a consumer (principal ``refinery-worker``) reading exactly those records back,
  four times over (one pass is too short to time; the data is in the page cache for both).

Rounds alternate PLAINTEXT, SASL_SSL, SASL_SSL, PLAINTEXT, ... so that load drift on a shared
machine hits both modes alike. Per mode and direction it reports samples/s, the client's CPU
(this process, user + system, librdkafka threads included), the broker's CPU (its JVM) and
their sum per million samples; ratios are SASL_SSL / PLAINTEXT. With ``worker=True`` it
first times ``refinery worker`` through each broker, from the first publish until every
record is accounted for, and reports that ratio only if both workers drained.

Blocks for about half a minute (``quick``) to a few minutes; returns a dict, prints nothing.
Raises :class:`~schemas.errors.BrokerError` when a broker cannot start.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab.broker import LocalKafka
from services.settings import KafkaSettings

REPO = Path(__file__).resolve().parents[2]
_TICK = os.sysconf("SC_CLK_TCK")
MODES = ("PLAINTEXT", "SASL_SSL")
RAW = "telemetry.raw"
CONSUME_PASSES = 4


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


@dataclass
class Batch:
    key: bytes
    value: bytes
    headers: list[tuple[str, str | bytes | None]]
    samples: int


def raw_batches(nodes: int, seconds: int, seed: int = 3) -> list[Batch]:
    """The raw-topic records of a fault-free simulated cluster, encoded."""
    from lab.simulate.cluster import Cluster
    from lab.simulate.engine import Simulation, Stream

    sim = Simulation(Cluster.build(nodes, seed=seed), None, seed=seed, duration_ns=seconds * 10**9)
    out = []
    for tick in sim.ticks():
        for msg in tick.messages:
            if msg.stream is Stream.RAW:
                ct, body = msg.encode()
                out.append(Batch(msg.key, body, [("content-type", ct.encode())], msg.samples))
    return out


@dataclass
class Target:
    """One broker under test and the client options of each role on it."""

    mode: str
    broker: LocalKafka
    pid: int
    admin: dict[str, Any]
    exporter: dict[str, Any]
    consumer: dict[str, Any]
    worker_env: dict[str, str]


def _start(mode: str, root: Path) -> Target:
    from services.security.acls import apply_acls, load_acl_spec
    from services.topics import apply_topics, load_topic_specs

    secure = mode == "SASL_SSL"
    broker = LocalKafka(root / mode.lower(), heap="512m")
    state = broker.start(nodes=1, base_port=0, secure=secure, timeout=150)
    admin = broker.client_conf(state)
    if secure:
        apply_acls(admin, load_acl_spec())
        material = broker.security()
        exporter = material.client_settings("refinery-exporter", state.bootstrap).librdkafka()
        consumer = material.client_settings("refinery-worker", state.bootstrap).librdkafka()
        worker_env = material.client_environ("refinery-worker", state.bootstrap)
    else:
        exporter = consumer = KafkaSettings(bootstrap_servers=state.bootstrap).librdkafka()
        worker_env = {"REFINERY_BOOTSTRAP_SERVERS": state.bootstrap}
    apply_topics(admin, load_topic_specs())
    pid = state.nodes[0].pid
    assert pid is not None
    return Target(mode, broker, pid, admin, exporter, consumer, worker_env)


def _ends(conf: dict[str, Any], topic: str) -> dict[int, int]:
    """High watermark of every partition of ``topic`` (transient "not leader" retried)."""
    from services.topics import watermarks

    return {p: hi for p, (_lo, hi) in watermarks(conf, topic).items()}


def _produce(t: Target, batches: list[Batch]) -> tuple[float, float, float]:
    """Send every batch and wait for the acknowledgements: (wall s, client CPU s, broker
    CPU s). Raises RuntimeError if any record is not acknowledged."""
    from confluent_kafka import KafkaError, Message, Producer

    conf = {
        **t.exporter,
        "enable.idempotence": True,
        "acks": "all",
        "compression.type": "zstd",
        "linger.ms": 2,
        "batch.size": 1_000_000,
        "message.max.bytes": 8_000_000,
        "queue.buffering.max.kbytes": 512 * 1024,
        "message.timeout.ms": 120_000,
        "log_level": 3,
    }
    failed: list[KafkaError] = []

    def on_delivery(err: KafkaError | None, _msg: Message) -> None:
        if err is not None:
            failed.append(err)

    p = Producer(conf)
    p.list_topics(RAW, timeout=20)  # connected and authenticated before the clock starts
    c0, b0, t0 = time.process_time(), _cpu_s(t.pid), time.monotonic()
    for b in batches:
        while True:
            try:
                p.produce(RAW, b.value, b.key, headers=b.headers, on_delivery=on_delivery)
                break
            except BufferError:
                p.poll(0.05)
        p.poll(0)
    left = p.flush(120)
    wall, client, broker = time.monotonic() - t0, time.process_time() - c0, _cpu_s(t.pid) - b0
    if left or failed:
        raise RuntimeError(f"{t.mode}: {left} unacknowledged, {len(failed)} failed: {failed[:1]}")
    return wall, client, broker


def _consume(
    t: Target, start: dict[int, int], end: dict[int, int], passes: int
) -> tuple[float, float, float]:
    """Read partitions from ``start`` up to ``end`` (exclusive) ``passes`` times: (wall s,
    client CPU s, broker CPU s), per pass. Raises RuntimeError if a pass takes over 120 s."""
    c0, b0, t0 = time.process_time(), _cpu_s(t.pid), time.monotonic()
    for _ in range(passes):
        _consume_once(t, start, end)
    return (
        (time.monotonic() - t0) / passes,
        (time.process_time() - c0) / passes,
        (_cpu_s(t.pid) - b0) / passes,
    )


def _consume_once(t: Target, start: dict[int, int], end: dict[int, int]) -> None:
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer(
        {
            **t.consumer,
            "group.id": f"refinery-bench-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
            "max.partition.fetch.bytes": 8 * 2**20,
            "fetch.max.bytes": 64 * 2**20,
            "log_level": 3,
        }
    )
    want = {p: e for p, e in end.items() if e > start[p]}
    t0 = time.monotonic()
    try:
        c.assign([TopicPartition(RAW, p, start[p]) for p in want])
        while want:
            if time.monotonic() - t0 > 120:
                raise RuntimeError(f"{t.mode}: consuming did not finish: {want}")
            # consume() waits its whole timeout for a short batch: keep both small
            for m in c.consume(100, 0.05):
                if m.error() is not None:
                    continue
                p, off = m.partition(), m.offset()
                if p in want and off is not None and off + 1 >= want[p]:
                    del want[p]
    finally:
        c.close()


def _round(t: Target, batches: list[Batch], passes: int) -> dict[str, tuple[float, float, float]]:
    """Produce ``batches``, then read them back ``passes`` times (the consumer is several
    times faster: one pass is too short to time)."""
    start = _ends(t.admin, RAW)
    produced = _produce(t, batches)
    end = _ends(t.admin, RAW)
    if sum(end.values()) - sum(start.values()) != len(batches):
        raise RuntimeError(f"{t.mode}: {len(batches)} sent, watermarks moved otherwise")
    return {"produce": produced, "consume": _consume(t, start, end, passes)}


def _worker(t: Target, root: Path, batches: list[Batch], timeout: float) -> dict[str, Any]:
    """``refinery worker`` through ``t``: from the first publish until every record is
    accounted for (wall s, worker CPU s); ``drained`` False when it stalled."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("REFINERY_")}
    env.update(t.worker_env, REFINERY_HOME=str(root / f"{t.mode}-home"))
    data = root / f"{t.mode}-worker"
    data.mkdir(parents=True, exist_ok=True)
    with open(root / f"worker-{t.mode}.log", "wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.cli",
                "worker",
                "--web-port",
                "0",
                "--data-dir",
                str(data),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO,
        )
    try:
        time.sleep(15)  # joined its group and created its changelogs
        acc0 = sum(_ends(t.admin, "telemetry.accounting").values())
        cpu0, t0 = _cpu_s(proc.pid), time.monotonic()
        _produce(t, batches)
        accounted = 0
        while time.monotonic() - t0 < timeout and proc.poll() is None:
            accounted = sum(_ends(t.admin, "telemetry.accounting").values()) - acc0
            if accounted >= len(batches):
                break
            time.sleep(0.5)
        wall = time.monotonic() - t0
        cpu = _cpu_s(proc.pid) - cpu0 if proc.poll() is None else None
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    samples = sum(b.samples for b in batches)
    drained = accounted >= len(batches)
    return {
        "drained": drained,  # False: stalled or died; no rate
        "exit_code": proc.returncode,
        "records": len(batches),
        "records_accounted": accounted,
        "wall_s": round(wall, 2),
        "samples_per_s": round(samples / wall, 1) if drained else None,
        "cpu_s_per_million_samples": round(cpu / samples * 1e6, 2)
        if drained and cpu is not None
        else None,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    """``a / b`` (None when either is not a measurement)."""
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)) or b <= 0:
        return None
    return round(a / b, 3)


def _summary(runs: dict[str, list[dict[str, tuple[float, float, float]]]], samples: int) -> Any:
    out: dict[str, Any] = {m.lower(): {} for m in MODES}
    for mode in MODES:
        for d in ("produce", "consume"):
            rs = [r[d] for r in runs[mode]]
            n = samples * len(rs) / 1e6  # millions of samples
            wall, client, broker = (sum(x[i] for x in rs) for i in range(3))
            out[mode.lower()][d] = {
                "samples_per_s": round(n * 1e6 / wall, 1),
                "client_cpu_s_per_million": round(client / n, 3),
                "broker_cpu_s_per_million": round(broker / n, 3),
                "total_cpu_s_per_million": round((client + broker) / n, 3),
                "rounds_samples_per_s": [round(samples / x[0], 1) for x in rs],
            }
    plain, sec = out["plaintext"], out["sasl_ssl"]
    for d in ("produce", "consume"):
        out[f"{d}_throughput_ratio"] = _ratio(sec[d]["samples_per_s"], plain[d]["samples_per_s"])
        for who in ("client", "broker", "total"):
            key = f"{who}_cpu_s_per_million"
            out[f"{d}_{who}_cpu_ratio"] = _ratio(sec[d][key], plain[d][key])
    return out


def bench_sasl(
    quick: bool = True,
    *,
    nodes: int | None = None,
    seconds: int | None = None,
    rounds: int | None = None,
    worker: bool | None = None,
    work_dir: Path | None = None,
) -> dict[str, Any]:
    """Both brokers, ``rounds`` alternating rounds per mode of ``nodes`` simulated nodes x
    ``seconds`` of raw batches (quick: 48 x 40, about 3.7 M samples a round, 3 rounds, no
    worker; else 64 x 60, 4 rounds, with the worker). ``work_dir`` keeps the brokers' data
    and logs afterwards."""
    nodes = nodes or (48 if quick else 64)
    seconds = seconds or (40 if quick else 60)
    rounds = rounds or (3 if quick else 4)
    worker = (not quick) if worker is None else worker
    if work_dir is None:
        with tempfile.TemporaryDirectory(prefix="refinery-secbench-") as tmp:
            return _run(Path(tmp), nodes, seconds, rounds, worker)
    work_dir.mkdir(parents=True, exist_ok=True)
    return _run(work_dir, nodes, seconds, rounds, worker)


def _run(root: Path, nodes: int, seconds: int, rounds: int, worker: bool) -> dict[str, Any]:
    t_all = time.monotonic()
    targets: dict[str, Target] = {}
    errors: list[BaseException] = []

    def start(mode: str) -> None:
        try:
            targets[mode] = _start(mode, root)
        except BaseException as e:  # surfaced below, after both starts ended
            errors.append(e)

    threads = [threading.Thread(target=start, args=(m,)) for m in MODES]
    for th in threads:
        th.start()
    batches = raw_batches(nodes, seconds)  # meanwhile
    for th in threads:
        th.join()
    try:
        if errors:
            raise errors[0]
        samples = sum(b.samples for b in batches)
        out: dict[str, Any] = {}
        if worker:
            small = raw_batches(8, 15, seed=5)  # ~230 k samples: ~10 s at 25 k/s
            w = {m.lower(): _worker(targets[m], root, small, 180.0) for m in MODES}
            plain, sec = w["plaintext"], w["sasl_ssl"]
            out["worker"] = {
                **w,
                "throughput_ratio": _ratio(sec["samples_per_s"], plain["samples_per_s"]),
                "cpu_ratio": _ratio(
                    sec["cpu_s_per_million_samples"], plain["cpu_s_per_million_samples"]
                ),
            }
        warm = batches[: max(1, len(batches) // 10)]
        for mode in MODES:  # connections, JIT, page cache: unrecorded
            _round(targets[mode], warm, 1)
        runs: dict[str, list[dict[str, tuple[float, float, float]]]] = {m: [] for m in MODES}
        for i in range(rounds):
            order = MODES if i % 2 == 0 else MODES[::-1]  # P S, S P, P S, ...
            for mode in order:
                runs[mode].append(_round(targets[mode], batches, CONSUME_PASSES))
        out.update(_summary(runs, samples))
        out["workload"] = {
            "nodes": nodes,
            "simulated_s": seconds,
            "records_per_round": len(batches),
            "samples_per_round": samples,
            "mib_per_round": round(sum(len(b.value) for b in batches) / 2**20, 1),
            "rounds_per_mode": rounds,
            "consume_passes_per_round": CONSUME_PASSES,
            "producer": "idempotent, acks=all, zstd (as BatchProducer)",
            "secure": "SASL_SSL SCRAM-SHA-512 over TLS, ACLs enforced",
        }
        out["wall_s"] = round(time.monotonic() - t_all, 1)
        return out
    finally:
        for t in targets.values():
            t.broker.stop()
