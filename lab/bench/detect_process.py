"""The ``stages`` benchmark's detect runs alone, repeatable on one prepared input, with a
profiler attached if asked: where the deployed process spends what the in-process replay
(``detect_stage``) does not.

``python -m lab.bench.detect_process prepare STATE NODES SECONDS`` publishes a simulated
backlog (as ``stages`` does) to the cluster at ``REFINERY_BOOTSTRAP_SERVERS`` and has one
worker refine it; ``STATE`` (JSON) records the refined prefix and the samples.
``python -m lab.bench.detect_process run STATE [--py-spy OUT] [--replicas N]`` then runs
detect as :func:`lab.bench.stages.run_stage` does (joined on empty topics, the input copied
in at live pace, measured until its group has committed all of it) and prints one JSON line:
samples per CPU-second, peak RSS, wall and CPU seconds. ``--py-spy OUT`` records the detect
process (``py-spy record``, collapsed stacks per thread, CPU only) from the copy's start to
the drain. Two runs of one state read the same records: their figures compare.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from lab.bench.harness import BenchKafka
from lab.bench.stages import publish_backlog, run_stage
from lab.demo.procs import Child
from services.settings import KafkaSettings


def _kafka(work: Path) -> BenchKafka:
    boot = os.environ["REFINERY_BOOTSTRAP_SERVERS"]
    return BenchKafka(KafkaSettings(bootstrap_servers=boot), work, _say)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def prepare(state: Path, nodes: int, seconds: int, seed: int = 41) -> dict[str, Any]:
    """Publish ``nodes`` x ``seconds`` and refine it once; what ``run`` reads."""
    with tempfile.TemporaryDirectory(prefix="detect-process-") as tmp:
        k = _kafka(Path(tmp))
        try:
            prefix, samples = publish_backlog(k, nodes, seconds, seed)
            run, refined = run_stage(k, "worker", prefix, 1, nodes, samples, 0.0)
        finally:
            k.stop_all()
    doc = {"raw": prefix, "refined": refined, "nodes": nodes, "seconds": seconds,
           "samples": samples, "worker": asdict(run)}  # fmt: skip
    state.write_text(json.dumps(doc))
    return doc


def smaps(pid: int) -> dict[str, float]:
    """Resident MiB of ``pid`` by kind of mapping: the brk heap, anonymous mappings by size
    (glibc's thread arenas are 64 MiB reservations; allocators' segments differ), files."""
    out: dict[str, float] = {}
    kind, size = "", 0
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and not head[0].endswith(":"):
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            size = (hi - lo) >> 20
            name = head[5] if len(head) > 5 else ""
            kind = name if name.startswith("[") else "file" if name else f"anon {size} MiB"
            if kind.startswith("anon") and size > 64:
                kind = "anon >64 MiB"
        elif head[0] == "Rss:":
            out[kind] = out.get(kind, 0.0) + int(head[1]) / 1024
    return {k: round(v) for k, v in sorted(out.items(), key=lambda kv: -kv[1]) if v >= 4}


def _memory(pid: int) -> dict[str, float]:
    """The process's resident memory by kind (``/proc/PID/status``), MiB."""
    got = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, val = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            got[key] = int(val.split()[0]) / 1024
    return got


class Watch:
    """What the drain of one detect process cost, per thread, and its memory at the end;
    with ``spy``, a ``py-spy`` recording of it."""

    def __init__(self, spy: Path | None) -> None:
        self.spy = spy
        self.threads: dict[str, float] = {}
        self.memory: dict[str, float] = {}
        self.rss: list[float] = []  # VmRSS (MiB) each second from the copy's start

    def __call__(self, kids: list[Child]) -> Callable[[], None]:
        pid = kids[0].proc.pid
        pids = [c.proc.pid for c in kids]
        before = {p: task_cpu_s(p) for p in pids}
        stop_spy = _py_spy(self.spy, pid) if self.spy is not None else None
        done = threading.Event()

        def sample() -> None:
            while not done.wait(1.0):
                self.rss.append(round(_memory(pid).get("VmRSS", 0.0)))

        threading.Thread(target=sample, daemon=True).start()

        def stop() -> None:
            done.set()
            for i, p in enumerate(pids):
                after, names = task_cpu_s(p), thread_names(p)
                for tid, (comm, cpu) in after.items():
                    name = f"{i}:{names.get(tid, comm)}"
                    spent = cpu - before[p].get(tid, (comm, 0.0))[1]
                    self.threads[name] = round(self.threads.get(name, 0.0) + spent, 2)
            self.memory = {**_memory(pid), **smaps(pid)}
            if stop_spy is not None:
                stop_spy()

        return stop


def task_cpu_s(pid: int) -> dict[int, tuple[str, float]]:
    """Per thread id of ``pid``: its name as the kernel has it and its CPU seconds."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, tuple[str, float]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        out[int(task.name)] = (comm, (int(fields[11]) + int(fields[12])) / tick)
    return out


def thread_names(pid: int) -> dict[int, str]:
    """Python's names of the threads of ``pid`` by thread id (``py-spy dump``; empty
    without it): the kernel names every Python thread after the program."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    try:
        text = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True,
                              text=True, timeout=30).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return {}
    return {int(m.group(1)): m.group(2) for m in _THREAD.finditer(text)}


_THREAD = re.compile(r'^Thread (\d+) \([^)]*\): "([^"]*)"', re.M)


def _py_spy(out: Path, pid: int) -> Callable[[], None]:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    proc = subprocess.Popen(
        [spy, "record", "--pid", str(pid), "--format", "raw", "--threads", "--rate", "50",
         "--nonblocking", "--output", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip

    def stop() -> None:
        proc.send_signal(2)  # SIGINT: py-spy writes what it recorded
        proc.wait(60)

    return stop


def run(state: Path, spy: Path | None, replicas: int = 1) -> dict[str, Any]:
    doc = json.loads(state.read_text())
    with tempfile.TemporaryDirectory(prefix="detect-process-") as tmp:
        k = _kafka(Path(tmp))
        try:
            watch = Watch(spy)
            r, _ = run_stage(k, "detect", doc["refined"], replicas, doc["nodes"],
                             doc["samples"], doc["seconds"], watch)  # fmt: skip
        finally:
            k.stop_all()
    return {**asdict(r), "samples_per_cpu_s": r.samples_per_cpu_s, "threads": watch.threads,
            "memory": watch.memory, "rss": watch.rss}  # fmt: skip


def main(argv: list[str]) -> dict[str, Any]:
    if argv[0] == "prepare":
        return prepare(Path(argv[1]), int(argv[2]), int(argv[3]))
    spy = Path(argv[argv.index("--py-spy") + 1]) if "--py-spy" in argv else None
    replicas = int(argv[argv.index("--replicas") + 1]) if "--replicas" in argv else 1
    return run(Path(argv[1]), spy, replicas)


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
