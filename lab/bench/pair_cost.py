"""What running two processes at once costs this machine on memory-bound work: the same
fixed work (numpy gathers and sorts over 64 MB, as detect's Arrow and numpy passes touch tens
of megabytes per group) timed in CPU-seconds alone, then in two processes started together.
On a host whose cores share caches and memory bandwidth (a VM's vCPUs, a busy host), each of
two such processes spends more CPU-seconds on the same work than one alone. It is context for
the ``stages`` benchmark's second-replica ratios, not a floor under them: a stage whose
replicas seldom run at the same moment, or whose work fits the caches, pays less.

``python -m lab.bench.pair_cost`` prints one JSON line; :func:`pair_cpu_ratio` is what the
``stages`` benchmark reports beside its second-replica figures.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

# how many rounds of work one timing does (about 3 CPU-s on this machine)
ROUNDS = 15


def work(rounds: int = ROUNDS, seed: int = 7) -> float:
    """The fixed work; returns the CPU-seconds it took this process."""
    import numpy as np

    rng = np.random.default_rng(seed)
    a = rng.random(8_000_000)
    idx = rng.integers(0, len(a), len(a))
    t0 = time.process_time()
    for _ in range(rounds):
        b = a[idx]
        np.argsort(b[: len(a) // 4])
        a = a + 1.0
    return time.process_time() - t0


def _spawn(rounds: int) -> subprocess.Popen[str]:
    code = f"from lab.bench.pair_cost import work; print(work({rounds}))"
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def _timed(n: int, rounds: int) -> list[float]:
    procs = [_spawn(rounds) for _ in range(n)]
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=600)
        if p.returncode != 0:
            raise RuntimeError(f"pair_cost child exited {p.returncode}")
        out.append(float(stdout.strip()))
    return out


def pair_cpu_ratio(tries: int = 3, rounds: int = ROUNDS) -> dict[str, float]:
    """CPU-seconds of the work in each of two processes at once / alone, the least of
    ``tries`` timings each (alone and paired interleaved, so a neighbour's load touches
    both alike)."""
    alone: list[float] = []
    paired: list[float] = []
    for _ in range(tries):
        alone += _timed(1, rounds)
        paired.append(max(_timed(2, rounds)))
    return {"alone_cpu_s": min(alone), "paired_cpu_s": min(paired),
            "ratio": min(paired) / min(alone)}  # fmt: skip


if __name__ == "__main__":
    print(json.dumps(pair_cpu_ratio()))
