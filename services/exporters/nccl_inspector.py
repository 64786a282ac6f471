"""NCCL Inspector JSON output (``NCCL_INSPECTOR_DUMP_DIR``) → COLLECTIVES_SCHEMA rows, one per
(collective instance, rank), following a directory of growing files.

Each line of an Inspector file is one JSON object (format ``v4.0``)::

    {"header": {"id": "0x7f8c496ae9f661", "rank": 2, "n_ranks": 8, "nnodes": 1},
     "metadata": {"inspector_output_format_version": "v4.0", "dump_timestamp_us": …,
                  "hostname": "…", "pid": …},
     "coll_perf": {"coll": "AllReduce", "coll_sn": 1407, "coll_msg_size_bytes": 17179869184,
                   "coll_exec_time_us": 61974, "coll_algobw_gbs": 277.21,
                   "coll_busbw_gbs": 485.12}}

Mapping: ``comm`` = ``header.id``, ``op`` = ``coll``, ``op_seq`` = ``coll_sn``, ``rank``,
``nranks`` = ``n_ranks``, ``bytes``, ``algbw_gbps``/``busbw_gbps`` as printed, ``dtype`` NULL
(Inspector does not report it). Time: verbose output's ``event_trace_ts.coll_start_ts`` (µs
since the epoch) when present, else ``dump_timestamp_us - coll_exec_time_us`` (the dump follows
completion, so this is an upper bound on the start); ``end_ns = ts_ns + exec time``. Device:
``gpu<rank mod (n_ranks / nnodes)>``, the layout of one rank per GPU in order (the ``jobs``
placement is the authority when it disagrees). Records without ``coll_perf`` (P2P, other
kinds) are skipped and counted.

:class:`InspectorDirSource` remembers, per file, its inode and the byte offset after the last
complete line: a file that grows is read from there; a partial last line waits for its newline;
a file replaced (new inode) or truncated is read again from the start. It never blocks.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from schemas.wire import COLLECTIVES_SCHEMA

MAX_READ_BYTES = 64 * 1024 * 1024


def _us(v: object) -> int | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return int(v)


def record_to_row(obj: Mapping[str, Any], job: str) -> dict[str, Any] | None:
    """One Inspector object → one row dict, or None if it is not a collective record."""
    header, meta, perf = obj.get("header"), obj.get("metadata"), obj.get("coll_perf")
    if not isinstance(header, Mapping) or not isinstance(perf, Mapping):
        return None
    meta = meta if isinstance(meta, Mapping) else {}
    rank, nranks = header.get("rank"), header.get("n_ranks")
    if not isinstance(rank, int) or not isinstance(nranks, int) or not perf.get("coll"):
        return None
    exec_us = _us(perf.get("coll_exec_time_us"))
    trace = obj.get("event_trace_ts") or perf.get("event_trace_ts")
    start_us = _us(trace.get("coll_start_ts")) if isinstance(trace, Mapping) else None
    if start_us is None:
        dump = _us(meta.get("dump_timestamp_us"))
        if dump is None:
            return None
        start_us = dump - (exec_us or 0)
    nnodes = header.get("nnodes")
    per_node = max(1, nranks // max(1, nnodes if isinstance(nnodes, int) else 1))
    ts = start_us * 1000

    def num(key: str) -> float | None:
        v = perf.get(key)
        return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None

    size = perf.get("coll_msg_size_bytes")
    seq = perf.get("coll_sn")
    return {
        "ts_ns": ts,
        "end_ns": None if exec_us is None else ts + exec_us * 1000,
        "job": job,
        "comm": str(header.get("id", "")),
        "op": str(perf["coll"]),
        "op_seq": seq if isinstance(seq, int) else -1,
        "rank": rank,
        "nranks": nranks,
        "device": f"gpu{rank % per_node}",
        "bytes": size if isinstance(size, int) else None,
        "dtype": None,
        "algbw_gbps": num("coll_algobw_gbs"),
        "busbw_gbps": num("coll_busbw_gbs"),
    }


def rows_to_table(rows: Iterable[Mapping[str, Any]]) -> pa.Table:
    """Row dicts → a table of :data:`COLLECTIVES_SCHEMA`."""
    return pa.Table.from_pylist(list(rows), schema=COLLECTIVES_SCHEMA)


@dataclass
class _FileState:
    inode: int
    offset: int


@dataclass
class InspectorPoll:
    """What one :meth:`InspectorDirSource.poll` produced."""

    table: pa.Table
    bad_lines: int = 0
    skipped_records: int = 0
    errors: list[str] = field(default_factory=list)


class InspectorDirSource:
    """Follow every Inspector output file in ``directory`` (recursively; hidden files and
    Prometheus ``*.prom`` files are ignored). :meth:`poll` returns the rows of the complete
    lines written since the previous poll."""

    def __init__(self, directory: Path, job: str) -> None:
        self.directory = directory
        self.job = job
        self._files: dict[Path, _FileState] = {}

    def _paths(self) -> list[Path]:
        out = []
        for p in sorted(self.directory.rglob("*")):
            if p.name.startswith(".") or p.suffix == ".prom" or not p.is_file():
                continue
            out.append(p)
        return out

    def poll(self) -> InspectorPoll:
        rows: list[dict[str, Any]] = []
        result = InspectorPoll(rows_to_table([]))
        if not self.directory.is_dir():
            result.errors.append(f"{self.directory}: not a directory")
            return result
        for path in self._paths():
            try:
                self._read(path, rows, result)
            except OSError as e:
                result.errors.append(f"{path}: {e.strerror or e}")
        result.table = rows_to_table(rows)
        return result

    def _read(self, path: Path, rows: list[dict[str, Any]], result: InspectorPoll) -> None:
        with path.open("rb") as f:
            st = os.fstat(f.fileno())
            state = self._files.get(path)
            if state is None or state.inode != st.st_ino or st.st_size < state.offset:
                state = _FileState(st.st_ino, 0)  # new, replaced or truncated: from the start
                self._files[path] = state
            if st.st_size == state.offset:
                return
            f.seek(state.offset)
            chunk = f.read(min(st.st_size - state.offset, MAX_READ_BYTES))
        end = chunk.rfind(b"\n")
        if end < 0:
            return  # a partial line only: wait for the rest
        state.offset += end + 1
        for line in chunk[: end + 1].splitlines():
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                result.bad_lines += 1
                continue
            row = record_to_row(obj, self.job) if isinstance(obj, dict) else None
            if row is None:
                result.skipped_records += 1
            else:
                rows.append(row)
