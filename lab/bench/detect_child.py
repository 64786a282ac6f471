"""detect_stage's subprocess. ``python -m lab.bench.detect_child write FILE NODES SECONDS SEED``
writes an input file (:mod:`lab.bench.detect_input`); ``python -m lab.bench.detect_child run
FILE [--take N] [--profile OUT] [--tracemalloc N]`` replays one through a
:class:`~services.detect.core.DetectCore` in this process, as the agent feeds it, and prints
one JSON line: samples, CPU seconds of detect's calls, RSS before any data, peak and final RSS,
and a digest of everything it emitted (alerts, episodes, rollups: equal digests, equal
output). A process of its own so that the peak RSS belongs to detect alone, with detect's
allocator settings.

The replay: the file's records in groups of ``take_max`` (the agent's ``noack_take``), each
group routed, the detector advanced to the watermark of the refined partitions (their high
watermarks: the file's end, a backlog being read) and its records built, as the agent's group
does, and ticked once a second of the engine's clock, as the agent's timer is. The engine's
clock is data time (the newest ``ts`` read plus one second), so the output is a function of
the file.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from services.heap import keep_heap

keep_heap()  # detect's allocator settings: its glibc heap kept, mimalloc's purge left on

import pyarrow as pa  # noqa: E402

from lab.bench.detect_input import (  # noqa: E402
    DETECT_TOPICS,
    InputFacts,
    read_detect_input,
    topology,
    write_detect_input,
)
from schemas.catalog import default_catalog  # noqa: E402
from services.detect.core import DetectCore  # noqa: E402
from services.detect.detector import Detector, Emitted  # noqa: E402
from services.detect.runner import DetectConfig  # noqa: E402
from services.telemetry import ServiceTelemetry  # noqa: E402

S = 1_000_000_000


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


class Digest:
    """sha256 over every emitted record, in order (rollups row by row: chunking aside)."""

    def __init__(self) -> None:
        self.h = hashlib.sha256()
        self.counts = {"alerts": 0, "firing": 0, "episodes": 0, "rollup_rows": 0}

    def add(self, out: Emitted) -> None:
        for a in out.alerts:
            self.h.update(a.model_dump_json().encode())
            self.counts["alerts"] += 1
            self.counts["firing"] += a.state == "firing"
        for e in out.episodes:
            self.h.update(e.model_dump_json().encode())
            self.counts["episodes"] += 1
        for t in out.rollups:
            for piece in _json_pieces(t):
                self.h.update(piece.encode())
            self.counts["rollup_rows"] += t.num_rows


def _json_pieces(t: pa.Table, rows: int = 4096) -> Iterator[str]:
    """``json.dumps(t.to_pydict(), sort_keys=True, default=str)`` in pieces of ``rows``
    rows a column, the same text: a closed window of hundreds of nodes as Python lists cost
    the replay hundreds of megabytes of its peak RSS, which is detect's figure."""
    yield "{"
    for i, name in enumerate(sorted(t.column_names)):
        yield (", " if i else "") + json.dumps(name) + ": ["
        first = True
        for off in range(0, t.num_rows, rows):
            body = json.dumps(t.column(name).slice(off, rows).to_pylist(), default=str)[1:-1]
            if body:
                yield body if first else ", " + body
                first = False
        yield "]"
    yield "}"


def replay(path: Path, digest: bool = True, take: int | None = None) -> dict[str, Any]:
    """Feed the file at ``path`` (and its ``.json`` facts) to a fresh detector, in groups of
    ``take`` records (default the agent's ``take_max``; a live stage's groups are smaller:
    what arrives within ``take_within_s``)."""
    facts = InputFacts(**json.loads(path.with_suffix(".json").read_text()))
    ends = {int(p): n for p, n in facts.ends[DETECT_TOPICS.refined].items()}
    detector = Detector(default_catalog())
    core = DetectCore(DETECT_TOPICS, detector, ServiceTelemetry("detect-bench"))
    topo, jobs = topology(facts.nodes, facts.seed)
    detector.set_topology(topo)
    detector.set_jobs(jobs)
    take = take or DetectConfig().take_max
    dig = Digest()
    base = status_kib("VmRSS")
    cpu = 0.0
    samples = groups = 0

    tick_ns = int(DetectConfig().tick_s * S)
    last_tick = 0

    def high(p: int) -> int:
        return ends.get(p, -1)

    def step(group: list[tuple[str, int, int, bytes]]) -> None:
        nonlocal cpu, samples, groups, last_tick
        now = max(detector.newest, detector.watermark) + S
        t0 = time.process_time()
        out = core.route_group(group, now)
        wm = core.watermark(high)
        if wm is not None:
            out.extend(detector.advance(wm, now))
        if now - last_tick >= tick_ns:  # the agent's timer: once a second
            out.extend(detector.tick(now, refined_pending=core.refined_pending(high)))
            last_tick = now
        core.messages(out)
        cpu += time.process_time() - t0
        groups += 1
        if digest:
            dig.add(out)

    group: list[tuple[str, int, int, bytes]] = []
    for rec in read_detect_input(path):
        if rec[0] == DETECT_TOPICS.refined:
            samples += pa.ipc.open_stream(rec[3]).read_all().num_rows
        group.append(rec)
        if len(group) >= take:
            step(group)
            group = []
    if group:
        step(group)
    t0 = time.process_time()
    last = detector.flush()
    core.messages(last)
    cpu += time.process_time() - t0
    if digest:
        dig.add(last)
    return {
        "nodes": facts.nodes,
        "seconds": facts.seconds,
        "samples": samples,
        "groups": groups,
        "cpu_s": cpu,
        "samples_per_cpu_s": samples / cpu if cpu else 0.0,
        "baseline_rss_bytes": base * 1024,
        "rss_bytes": status_kib("VmRSS") * 1024,
        "peak_rss_bytes": status_kib("VmHWM") * 1024,
        # Arrow's pool: what its buffers hold at the end and at most (the rest is Python's)
        "arrow_bytes": pa.total_allocated_bytes(),
        "arrow_peak_bytes": pa.default_memory_pool().max_memory(),
        "digest": dig.h.hexdigest() if digest else "",
        "emitted": dig.counts,
    }


def main(argv: list[str]) -> dict[str, Any]:
    if argv[0] == "write":
        path, nodes, seconds, seed = Path(argv[1]), int(argv[2]), int(argv[3]), int(argv[4])
        facts = write_detect_input(path, nodes, seconds, seed)
        path.with_suffix(".json").write_text(json.dumps(facts.as_dict()))
        return facts.as_dict()
    path = Path(argv[1])
    take = int(argv[argv.index("--take") + 1]) if "--take" in argv else None
    if "--profile" in argv:  # where the CPU goes: a pstats file
        import cProfile

        prof = cProfile.Profile()
        got: dict[str, Any] = prof.runcall(replay, path, False, take)
        prof.dump_stats(argv[argv.index("--profile") + 1])
        return got
    if "--tracemalloc" in argv:  # where Python's memory goes: the top allocation sites at peak
        import tracemalloc

        tracemalloc.start(8)
        got = replay(path, False, take)
        snap = tracemalloc.take_snapshot()
        top = snap.statistics("lineno")[: int(argv[argv.index("--tracemalloc") + 1])]
        got["tracemalloc_peak_bytes"] = tracemalloc.get_traced_memory()[1]
        got["tracemalloc_top"] = [str(s) for s in top]
        return got
    return replay(path, take=take)


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
