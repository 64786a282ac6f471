"""Instructions per refined sample, counted by valgrind (callgrind), for comparing commits on a
noisy machine: unlike CPU time the count barely moves between runs of the same code (a few
instructions per sample), so a change of 1 % is visible where ``refinery bench`` needs many
runs. It counts instructions, not time: a change that moves memory rather than computing
(fewer copies of a large buffer) can cost fewer instructions and no less time.

``python -m lab.bench.instructions [--nodes 100] [--ticks 4]`` runs the refiner
(:meth:`~services.worker.refiner.Refiner.process_group` in the worker's chunks of records, then the
state encode of each group) over simulator records twice under valgrind: once stopping after
the warm-up half, once through the measured half; the difference divided by the measured
samples is the figure. ``--group 10 --interval-ms 500 --spread`` counts what a worker does
when exporters publish every 0.5 s at phases of their own and records come to it in small
groups (the freshness runs), instead of a backlog's large ones. Needs ``valgrind`` on the
PATH; takes minutes (valgrind runs Python about fifty times slower). ``run`` is what each
valgrind child executes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

S = 1_000_000_000
# records per refine call: WorkerConfig.refine_chunk (a unit test keeps them equal). Not read
# from services.worker.app: importing Faust there leaves tens of thousands more objects for
# the garbage collector to walk in the measured half (+150 instructions per sample, measured)
GROUP = 300


def run(
    nodes: int,
    ticks: int,
    measure: bool,
    group: int = GROUP,
    interval_ms: int = 1000,
    spread: bool = False,
) -> int:
    """Refine the first half of the records (warm-up) and, when ``measure``, the second half,
    ``group`` records per call; returns the samples of the measured half (0 without it)."""
    from lab.simulate.cluster import Cluster
    from lab.simulate.engine import Simulation
    from lab.simulate.messages import Stream
    from pipelines.refine.enrich import TopologyIndex
    from schemas.catalog import default_catalog
    from schemas.topics import TOPICS
    from services.worker.refiner import RawRecord, Refiner

    start = 1_800_000_000 * S  # fixed: the same records every run
    sim = Simulation(
        Cluster.build(nodes),
        None,
        start_ns=start,
        duration_ns=ticks * S,
        interval_ns=interval_ms * 1_000_000,
        spread=spread,
    )
    recs: list[RawRecord] = []
    for tick in sim.ticks():
        for m in tick.messages:
            if m.stream is Stream.RAW:
                ct, body = m.encode()
                headers = [("content-type", ct.encode())]
                off = len(recs)
                recs.append(
                    RawRecord("raw", off % 12, off, m.key, body, headers, m.due_ns // 10**6)
                )
    topo = TopologyIndex(sim.cluster.topology(), sim.cluster.jobs(start))
    ref = Refiner(default_catalog(), TOPICS, lambda: topo, lambda _: None, lambda _: None)
    now = start + (ticks + 2) * S
    half = len(recs) // 2
    for i in range(0, half, group):
        ref.process_group(recs[i : min(i + group, half)], now)
    ref.dirty_blobs()
    samples = 0
    if measure:
        for i in range(half, len(recs), group):
            samples += sum(o.input_samples for o in ref.process_group(recs[i : i + group], now))
            ref.dirty_blobs()
    return samples


def _count(a: argparse.Namespace, measure: bool) -> tuple[int, int]:
    """(instructions, measured samples) of one child under callgrind."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            "valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/out",
            sys.executable, "-m", "lab.bench.instructions", "--child",
            "--nodes", str(a.nodes), "--ticks", str(a.ticks), "--group", str(a.group),
            "--interval-ms", str(a.interval_ms), *(["--spread"] if a.spread else []),
            *(["--measure"] if measure else []),
        ]  # fmt: skip
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    found = re.search(r"Collected : (\d+)", p.stderr)
    if p.returncode or found is None:
        raise RuntimeError(f"valgrind run failed ({p.returncode}): {p.stderr.strip()[-300:]}")
    return int(found.group(1)), int(p.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lab.bench.instructions", description=__doc__)
    ap.add_argument("--nodes", type=int, default=100)
    ap.add_argument("--ticks", type=int, default=4, help="seconds simulated; half are measured")
    ap.add_argument("--group", type=int, default=GROUP, help="records per refine call")
    ap.add_argument("--interval-ms", type=int, default=1000, help="exporters' publish interval")
    ap.add_argument("--spread", action="store_true", help="each node at a phase of its own")
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.nodes < 1 or a.ticks < 2:
        ap.error("--nodes must be >= 1 and --ticks >= 2")
    if a.group < 1 or not 10 <= a.interval_ms <= 60_000:
        ap.error("--group must be >= 1 and --interval-ms in 10..60000")
    if a.child:
        print(run(a.nodes, a.ticks, a.measure, a.group, a.interval_ms, a.spread))
        return 0
    if shutil.which("valgrind") is None:
        print("error: valgrind is not on the PATH", file=sys.stderr)
        return 2
    setting = (f"{a.nodes} nodes, {a.ticks} s, every {a.interval_ms} ms"
               f"{' spread' if a.spread else ''}, groups of {a.group}")  # fmt: skip
    print(f"counting: {setting}, two valgrind runs...", file=sys.stderr)
    with ThreadPoolExecutor(2) as pool:  # the two runs side by side
        warm = pool.submit(_count, a, False)
        full, samples = _count(a, True)
        base, _ = warm.result()
    per = (full - base) / samples
    if a.json:
        doc = {"instructions_per_sample": per, "samples": samples, "nodes": a.nodes,
               "group": a.group, "interval_ms": a.interval_ms, "spread": a.spread}  # fmt: skip
        print(json.dumps(doc))
    else:
        print(f"{per:,.0f} instructions per sample ({samples} samples, {setting})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
