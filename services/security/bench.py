"""What SASL_SSL costs the worker: throughput and CPU per million samples, as a ratio to
PLAINTEXT, measured on the same machine in one run.

:func:`bench_secure_worker` runs the same workload twice, each on a fresh local broker of its
own (a plaintext one, then a ``secure=True`` one with the ACLs of ``deploy/acls.yaml``): it
starts the worker (principal ``refinery-worker`` when secure) and waits until it is consuming,
publishes a simulated cluster flat out (principal ``refinery-exporter``), and measures from
the first publish until the worker has accounted for every record: wall time, and the
worker's CPU time (user + system, from ``/proc/<pid>/stat``). Blocks for a few minutes.
Someone wires it into ``refinery bench``; it returns a dict and prints nothing.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from services.broker import LocalKafka
from services.settings import KafkaSettings

REPO = Path(__file__).resolve().parents[2]
_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime + stime


def _accounted(conf: dict[str, Any], topic: str) -> int:
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({**conf, "group.id": "refinery-bench-probe", "log_level": 0})
    try:
        md = c.list_topics(topic, timeout=10)
        return sum(
            c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
            for p in md.topics[topic].partitions
        )
    finally:
        c.close()


def _one(mode: str, root: Path, nodes: int, seconds: int, timeout: float) -> dict[str, Any]:
    from services.security.acls import apply_acls, load_acl_spec
    from services.simulate.cluster import Cluster
    from services.simulate.engine import Simulation
    from services.simulate.publish import publish
    from services.topics import apply_topics, load_topic_specs

    secure = mode == "SASL_SSL"
    broker = LocalKafka(root / mode.lower())
    state = broker.start(nodes=1, base_port=0, secure=secure)
    try:
        admin = broker.client_conf(state)
        if secure:
            apply_acls(admin, load_acl_spec())
        apply_topics(admin, load_topic_specs())
        if secure:
            material = broker.security()
            worker_env = material.client_environ("refinery-worker", state.bootstrap)
            exporter = material.client_settings("refinery-exporter", state.bootstrap)
        else:
            worker_env = {"REFINERY_BOOTSTRAP_SERVERS": state.bootstrap}
            exporter = KafkaSettings(bootstrap_servers=state.bootstrap)
        env = {k: v for k, v in os.environ.items() if not k.startswith("REFINERY_")}
        env.update(worker_env, REFINERY_HOME=str(root / f"{mode}-home"))
        data = str(root / f"{mode}-worker")
        os.makedirs(data, exist_ok=True)
        log = open(root / f"worker-{mode}.log", "wb")  # noqa: SIM115 - closed below
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "worker", "--web-port", "0", "--data-dir", data],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO,
        )
        try:
            time.sleep(15)  # joined its group and created its changelogs
            sim = Simulation(
                Cluster.build(nodes, seed=3), "none", seed=3, duration_ns=seconds * 10**9
            )
            cpu0, t0 = _cpu_s(proc.pid), time.monotonic()
            rep = publish(sim, exporter, None, None, math.inf, progress_cb=None)
            expect = rep.messages_acked
            while time.monotonic() - t0 < timeout:
                if proc.poll() is not None:
                    raise RuntimeError(f"worker exited {proc.returncode} during the {mode} run")
                if _accounted(admin, "telemetry.accounting") >= expect:
                    break
                time.sleep(0.5)
            wall = time.monotonic() - t0
            cpu = _cpu_s(proc.pid) - cpu0
            drained = _accounted(admin, "telemetry.accounting") >= expect
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
            log.close()
        return {
            "mode": mode,
            "records": expect,
            "drained": drained,  # False: the worker stalled; the figures are not a rate
            "samples": rep.samples_acked,
            "wall_s": round(wall, 2),
            "worker_cpu_s": round(cpu, 2),
            "samples_per_s": round(rep.samples_acked / wall, 1),
            "cpu_s_per_million_samples": round(cpu / rep.samples_acked * 1e6, 2),
        }
    finally:
        broker.stop()


def bench_secure_worker(
    nodes: int = 8, seconds: int = 20, timeout: float = 300.0, work_dir: Path | None = None
) -> dict[str, Any]:
    """Run the plaintext and SASL_SSL workloads; returns both and the ratios
    (``throughput_ratio`` = secure / plaintext samples per second, ``cpu_ratio`` = secure /
    plaintext CPU per million samples). Raises RuntimeError if a worker dies."""
    if work_dir is not None:  # kept afterwards: brokers' and workers' logs
        work_dir.mkdir(parents=True, exist_ok=True)
        plain = _one("PLAINTEXT", work_dir, nodes, seconds, timeout)
        secure = _one("SASL_SSL", work_dir, nodes, seconds, timeout)
    else:
        with tempfile.TemporaryDirectory(prefix="refinery-secbench-") as tmp:
            plain = _one("PLAINTEXT", Path(tmp), nodes, seconds, timeout)
            secure = _one("SASL_SSL", Path(tmp), nodes, seconds, timeout)
    return {
        "plaintext": plain,
        "sasl_ssl": secure,
        "throughput_ratio": round(secure["samples_per_s"] / plain["samples_per_s"], 3),
        "cpu_ratio": round(
            secure["cpu_s_per_million_samples"] / plain["cpu_s_per_million_samples"], 3
        ),
    }
