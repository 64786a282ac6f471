"""nccl-tests stdout (``all_reduce_perf`` & co.) → :data:`~schemas.wire.COLLECTIVES_SCHEMA` rows.

Both column layouts are read by header name, not position:

- older: ``size count type redop [root] | time algbw busbw error | time algbw busbw error``
  (``error`` is ``N/A``; alltoall rows leave ``redop`` blank);
- current: ``size count type redop root | time algbw busbw #wrong | …`` (``root`` -1 where it
  does not apply). Extra per-iteration columns (``-I 1``) are tolerated.

Numbers may print as ``16215``, ``112.0`` or ``1.2e+04``; ``N/A`` becomes NULL. Interleaved
``NCCL INFO``/``WARN`` lines and anything else unrecognised are skipped and counted.

One row per (size, placement): out-of-place first, then in-place, ``comm`` =
``nccl-tests/<placement>``, ``op_seq`` = the size row's index in file order. nccl-tests prints
aggregates, so ``rank`` is 0, ``device`` the rank-0 device (``gpu<N>`` from the ``#  Rank 0 …
device N`` line), ``nranks`` the number of ``#  Rank`` lines. Timestamps: the log carries none,
so ``ts_ns`` is ``start_ns`` plus the sum of the measured times before it (file order) and
``end_ns = ts_ns + time``. The op comes from ``# Collective test concluded: all_reduce_perf``,
else the ``op`` argument, else the file name (``nccl_allreduce.log`` → ``AllReduce``).

Example::

    >>> log = Path("tests/fixtures/real-data/nccl/superbench-nccl_allreduce.log")
    >>> r = import_nccl_tests(log, job="j1")  # doctest: +SKIP
    >>> r.op, r.table.num_rows, r.nranks, r.avg_busbw_gbps  # doctest: +SKIP
    ('AllReduce', 68, 8, 68.4048)
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from schemas.errors import ConfigError
from schemas.wire import COLLECTIVES_SCHEMA

# nccl-tests binary / file-name stem (underscores dropped) → NCCL collective name
OPS: dict[str, str] = {
    "reducescatter": "ReduceScatter",
    "allreduce": "AllReduce",
    "allgather": "AllGather",
    "alltoall": "AllToAll",
    "broadcast": "Broadcast",
    "reduce": "Reduce",
    "sendrecv": "SendRecv",
    "gather": "Gather",
    "scatter": "Scatter",
    "hypercube": "HyperCube",
}

# busbw = algbw * factor (nccl-tests doc/PERFORMANCE.md)
BUS_FACTOR: dict[str, str] = {
    "AllReduce": "2(n-1)/n",
    "ReduceScatter": "(n-1)/n",
    "AllGather": "(n-1)/n",
    "AllToAll": "(n-1)/n",
    "Gather": "(n-1)/n",
    "Scatter": "(n-1)/n",
    "Broadcast": "1",
    "Reduce": "1",
    "SendRecv": "1",
    "HyperCube": "1",
}


def bus_factor(op: str, nranks: int) -> float:
    """The busbw/algbw factor nccl-tests applies for ``op`` on ``nranks`` ranks."""
    kind = BUS_FACTOR.get(op, "1")
    if kind == "2(n-1)/n":
        return 2 * (nranks - 1) / nranks
    if kind == "(n-1)/n":
        return (nranks - 1) / nranks
    return 1.0


def op_from_name(text: str) -> str | None:
    """``all_reduce_perf``, ``nccl_allreduce.log``, ``reduce_scatter`` → the NCCL op name."""
    flat = re.sub(r"[^a-z]", "", text.lower())
    for key in sorted(OPS, key=len, reverse=True):
        if key in flat:
            return OPS[key]
    return None


_RANK_RE = re.compile(r"^#\s+Rank\s+(\d+)\b.*?\bdevice\s+(\d+)")
_AVG_RE = re.compile(r"^#\s*Avg bus bandwidth\s*:\s*(\S+)")
_CONCLUDED_RE = re.compile(r"^#\s*Collective test concluded:\s*(\S+)")
_PERF = ("time", "algbw", "busbw")
_PLACEMENTS = ("out-of-place", "in-place")


def _num(tok: str) -> float | None:
    if tok.upper() == "N/A":
        return None
    v = float(tok)
    return v if math.isfinite(v) else None


@dataclass
class NcclTestsResult:
    """Rows plus what the log says about itself."""

    table: pa.Table
    op: str
    nranks: int
    avg_busbw_gbps: float | None = None
    out_of_bounds: int | None = None
    skipped_lines: list[str] = field(default_factory=list)


@dataclass
class _Log:
    """What has been read of one log so far: its comment lines' facts and its rows."""

    start_ns: int
    ranks: dict[int, int] = field(default_factory=dict)
    prefix: list[str] = field(default_factory=list)  # the header's columns before the times
    n_perf: int = 0
    perf_idx: dict[str, int] = field(default_factory=dict)
    avg: float | None = None
    oob: int | None = None
    concluded: str | None = None
    skipped: list[str] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    seq: int = 0  # the next size row's op_seq
    t: int = field(init=False)  # the next row's ts_ns

    def __post_init__(self) -> None:
        self.t = self.start_ns

    def comment(self, line: str) -> None:
        """A ``#`` line: a rank, the average bus bandwidth, the test's name, the
        out-of-bounds count, or the column header."""
        if m := _RANK_RE.match(line):
            self.ranks[int(m.group(1))] = int(m.group(2))
        elif m := _AVG_RE.match(line):
            self.avg = _num(m.group(1))
        elif m := _CONCLUDED_RE.match(line):
            self.concluded = m.group(1)
        elif "Out of bounds values" in line:
            found = re.search(r":\s*(\d+)", line)
            self.oob = int(found.group(1)) if found else None
        else:
            names = line[1:].split()
            if names[:3] == ["size", "count", "type"] and "busbw" in names:
                first = names.index("time")
                self.prefix = names[:first]
                group = names[first:]
                self.n_perf = len(group)
                half = group[: self.n_perf // 2]
                self.perf_idx = {name: half.index(name) for name in _PERF if name in half}

    def data(self, raw: str, toks: list[str]) -> None:
        """A size row: one row per placement (a malformed one is skipped)."""
        if not self.prefix or len(toks) < 3 + self.n_perf or not toks[0].isdigit():
            self.skipped.append(raw)
            return
        try:
            size, _count, dtype = int(toks[0]), int(toks[1]), toks[2]
            perf = toks[-self.n_perf :]
            half_n = self.n_perf // 2
            for p, placement in enumerate(_PLACEMENTS):
                vals = perf[p * half_n : (p + 1) * half_n]
                time_us = _num(vals[self.perf_idx["time"]])
                dur = None if time_us is None else round(time_us * 1000)
                self.rows.append(
                    {
                        "ts_ns": self.t,
                        "end_ns": None if dur is None else self.t + dur,
                        "comm": f"nccl-tests/{placement}",
                        "op_seq": self.seq,
                        "bytes": size,
                        "dtype": dtype,
                        "algbw_gbps": _num(vals[self.perf_idx["algbw"]]),
                        "busbw_gbps": _num(vals[self.perf_idx["busbw"]]),
                    }
                )
                self.t += dur or 0
        except (ValueError, KeyError, IndexError):
            self.skipped.append(raw)
            return
        self.seq += 1


def parse_nccl_tests(
    text: str,
    *,
    job: str,
    op: str | None = None,
    start_ns: int = 0,
    source_name: str = "",
) -> NcclTestsResult:
    """Parse one nccl-tests stdout. Raises ConfigError when no header or op can be found."""
    log = _Log(start_ns)
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            log.comment(line)
        else:
            log.data(raw, line.split())
    if not log.prefix:
        raise ConfigError(f"{source_name or 'nccl-tests log'}: no nccl-tests column header found")
    concluded = log.concluded
    name = op or (op_from_name(concluded) if concluded else None) or op_from_name(source_name)
    if name is None:
        raise ConfigError(
            f"{source_name or 'nccl-tests log'}: cannot tell the collective; give the op"
        )
    nranks = len(log.ranks) or 1
    table = _table(log.rows, job, name, nranks, f"gpu{log.ranks.get(0, 0)}")
    return NcclTestsResult(table, name, nranks, log.avg, log.oob, log.skipped)


def _table(rows: list[dict[str, Any]], job: str, op: str, nranks: int, device: str) -> pa.Table:
    n = len(rows)
    cols: dict[str, Any] = {k: [r[k] for r in rows] for k in rows[0]} if rows else {}
    return pa.table(
        {
            "ts_ns": pa.array(cols.get("ts_ns", []), pa.int64()),
            "end_ns": pa.array(cols.get("end_ns", []), pa.int64()),
            "job": pa.array([job] * n, pa.string()),
            "comm": pa.array(cols.get("comm", []), pa.string()),
            "op": pa.array([op] * n, pa.string()),
            "op_seq": pa.array(cols.get("op_seq", []), pa.int64()),
            "rank": pa.array([0] * n, pa.int32()),
            "nranks": pa.array([nranks] * n, pa.int32()),
            "device": pa.array([device] * n, pa.string()),
            "bytes": pa.array(cols.get("bytes", []), pa.int64()),
            "dtype": pa.array(cols.get("dtype", []), pa.string()),
            "algbw_gbps": pa.array(cols.get("algbw_gbps", []), pa.float64()),
            "busbw_gbps": pa.array(cols.get("busbw_gbps", []), pa.float64()),
        },
        schema=COLLECTIVES_SCHEMA,
    )


def import_nccl_tests(
    path: Path, *, job: str, op: str | None = None, start_ns: int = 0
) -> NcclTestsResult:
    """Read and parse one log file (its name helps find the op)."""
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from e
    return parse_nccl_tests(text, job=job, op=op, start_ns=start_ns, source_name=path.name)
