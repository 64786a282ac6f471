"""Facts that make benchmark numbers comparable: library versions and the machine."""

from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("pyarrow", "duckdb", "faust-streaming", "aiokafka", "confluent-kafka", "numpy")


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def versions(broker_version: str) -> dict[str, str]:
    """Python, the libraries on the data path, librdkafka and the broker."""
    import confluent_kafka

    out = {"python": platform.python_version()}
    out.update({d: _version(d) for d in PACKAGES})
    out["librdkafka"] = str(confluent_kafka.libversion()[0])
    out["kafka_broker"] = broker_version
    return out


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ram_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return float("nan")


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine() -> dict[str, Any]:
    """CPU model, cores this process may use, RAM, kernel, load at the start of the run."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        usable = os.cpu_count() or 0
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": usable,
        "ram_gib": _ram_gib(),
        "kernel": platform.release(),
        "loadavg_at_start": [round(x, 2) for x in load],
    }


def run_facts(broker_version: str, bootstrap: str, mode: str) -> dict[str, Any]:
    """Everything the JSON header holds besides the results."""
    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "commit": _commit(),
        "mode": mode,
        "bootstrap": bootstrap,
        "versions": versions(broker_version),
        "machine": machine(),
    }
