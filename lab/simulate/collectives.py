"""NCCL collective records per job: ``ops`` AllReduce instances per tick, one record per rank.

Ring AllReduce of 256 MiB (bfloat16). A rank arrives (``ts_ns``) within ~30 µs of the others
unless something on its path slows it: a rank whose GPU sits on the rail of a PFC-stormed leaf
port arrives 5-25 ms late (its previous sends were paused), a thermally or power throttled GPU
1-4 ms late. Every rank of an instance ends together (``end_ns``) once the last has arrived and
the data moved at the job's bus bandwidth (~45 GB/s across NDR rails, ~360 GB/s inside one
NVLink domain). ``algbw``/``busbw`` are per rank as nccl-tests prints them.

Timestamps are in the clock of the job's first node: the collector on that node has put every
rank's times on its own clock, as an NCCL profiler plugin collector does.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from lab.simulate.cluster import Cluster, Job
from lab.simulate.faults import FaultKind, Incident
from schemas.wire import COLLECTIVES_SCHEMA

BYTES = 256 * 1024 * 1024


@dataclass
class CollectiveTick:
    """One job's collectives of one tick, plus the truth of who straggled and why."""

    table: pa.Table
    true_start: np.ndarray  # int64 per record (true clock)
    straggle_ns: np.ndarray  # int64 per record
    cause: list[str | None]  # incident id per record
    node: list[str]  # node per record
    last_end_true: int


class CollectiveGen:
    """Generates one job's collectives; deterministic given its rng."""

    def __init__(self, cluster: Cluster, job: Job, rng: np.random.Generator, ops: int = 4) -> None:
        self.cluster, self.job, self.rng, self.ops = cluster, job, rng, ops
        g = cluster.gpus
        self.nranks = len(job.node_idx) * g
        self.rank_node = np.repeat(np.asarray(job.node_idx), g)
        self.rank_gpu = np.tile(np.arange(g), len(job.node_idx))
        self.comm = f"0x{zlib.crc32(job.job.encode()):08x}{cluster.seed & 0xFFFF:04x}"
        self.busbw = 45e9 if len(job.node_idx) > 1 else 360e9
        self.op_seq = 0
        self.node_names = [cluster.node_name(int(i)) for i in self.rank_node]
        self.devices = [f"gpu{int(x)}" for x in self.rank_gpu]

    def _straggle(self, t: int, incidents: list[Incident]) -> tuple[np.ndarray, list[str | None]]:
        delay = np.zeros(self.nranks, np.int64)
        cause: list[str | None] = [None] * self.nranks
        for inc in incidents:
            if not inc.active(t) or inc.kind not in (FaultKind.PFC_STORM, FaultKind.THROTTLE):
                continue
            hit = np.isin(self.rank_node, inc.node_idx) & (self.rank_gpu == inc.unit)
            lo, hi = (5e6, 25e6) if inc.kind is FaultKind.PFC_STORM else (1e6, 4e6)
            d = self.rng.uniform(lo, hi, self.nranks).astype(np.int64)
            newly = hit & (d > delay)
            delay = np.where(newly, d, delay)
            for r in np.flatnonzero(newly):
                cause[int(r)] = inc.id
        return delay, cause

    def tick(
        self, t0: int, interval_ns: int, offset_ns: int, incidents: list[Incident]
    ) -> CollectiveTick:
        """Records of the tick starting at true time ``t0``; ``offset_ns`` = source - true."""
        n, r = self.nranks, self.rng
        starts, ends, delays, causes = [], [], [], []
        alg_factor = 2.0 * (n - 1) / n if n > 1 else 1.0
        for o in range(self.ops):
            base = t0 + int((o + 0.1) * interval_ns / self.ops)
            delay, cause = self._straggle(base, incidents)
            arrive = base + np.abs(r.normal(0, 30_000, n)).astype(np.int64) + delay
            slow = 1.5 if delay.any() else 1.0
            dur = int(BYTES * alg_factor / self.busbw * 1e9 * slow * r.uniform(0.97, 1.05))
            end = int(arrive.max()) + dur
            starts.append(arrive)
            ends.append(np.full(n, end, np.int64))
            delays.append(delay)
            causes.extend(cause)
        start = np.concatenate(starts)
        end_all = np.concatenate(ends)
        el = np.maximum(end_all - start, 1).astype(np.float64)
        algbw = BYTES / el  # bytes per ns == GB/s
        op_seq = np.repeat(np.arange(self.op_seq, self.op_seq + self.ops, dtype=np.int64), n)
        self.op_seq += self.ops
        m = n * self.ops
        table = pa.Table.from_arrays(
            [
                pa.array(start + offset_ns),
                pa.array(end_all + offset_ns),
                pa.array([self.job.job] * m, pa.string()),
                pa.array([self.comm] * m, pa.string()),
                pa.array(["AllReduce"] * m, pa.string()),
                pa.array(op_seq),
                pa.array(np.tile(np.arange(n, dtype=np.int32), self.ops)),
                pa.array(np.full(m, n, np.int32)),
                pa.array(self.devices * self.ops, pa.string()),
                pa.array(np.full(m, BYTES, np.int64)),
                pa.array(["bfloat16"] * m, pa.string()),
                pa.array(np.round(algbw, 3)),
                pa.array(np.round(algbw * alg_factor, 3)),
            ],
            schema=COLLECTIVES_SCHEMA,
        )
        return CollectiveTick(
            table,
            start,
            np.concatenate(delays),
            causes,
            self.node_names * self.ops,
            int(end_all.max()),
        )
