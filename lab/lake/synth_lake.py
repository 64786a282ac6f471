"""A large compacted lake, generated directly: the query benchmark's data at 10^8 samples.

Landing 10^8 samples through :class:`~services.lake.writer.LakeWriter` and compacting them
takes longer than the query benchmark itself, and builds 2 GB+ of Python strings on the way.
:func:`write_lakes` instead generates the refined samples of ``spec.nodes`` nodes (the same
106 series per node, value models and enrichment as :func:`lab.lake.synth.refined_samples`)
one node at a time, vectorised (numpy indices into shared Arrow dictionaries; no per-row
Python), in the samples dataset's sort order, and writes them twice:

- ``compacted``: what :class:`~services.lake.compact.Compactor` leaves after a run: per hour,
  one ``p<partition>-<first>-<last>.parquet`` per source partition (nodes spread over
  ``spec.partitions`` as the node-keyed topic does), in the compactor's time slabs, each
  sorted by the dataset's sort key and starting a row group, with the compactor's row-group
  size and zstd level, Hive layout ``date=/hour=`` (a test checks it against landing then
  compacting the same rows);
- ``single``: the same rows as one perfectly sorted Parquet file (same writer options), the
  limit the compacted lake is measured against.

Both get the same side datasets (topology, jobs, collectives with one straggling rank,
accounting, dead letters, alerts, episodes) and seed files, so every named query binds and
finds something: one port is stormed with PFC pauses while a rank on that node arrives late.
Rows are identical in both lakes; generation is deterministic for a spec.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from lab.lake import synth
from schemas.records import REFINED_SCHEMA
from services.lake.compact import Compactor
from services.lake.datasets import COLLECTIVES_LAKE_SCHEMA, DATASETS, JOBS_SCHEMA, conform
from services.lake.layout import HOUR_NS, LakePaths, file_name, hour_of
from services.lake.writer import LakeWriter, write_options

SERIES_PER_NODE = 106
STORM_NODE, STORM_PORT = 5, 3  # eth3/prio3 of node005 is stormed; rank 43 (its gpu3) is late


@dataclass(frozen=True)
class LakeSpec:
    """What to generate: ``nodes`` x 106 series, one sample per second for ``seconds``."""

    nodes: int = 128
    seconds: int = 600
    start_ns: int = synth.T0_NS
    seed: int = 0
    partitions: int = 8  # telemetry.refined partitions (deploy/topics.yaml)
    op_interval_s: int = 1  # one AllReduce per second across every rank

    @classmethod
    def of_rows(cls, rows: int, nodes: int = 128, **kw: Any) -> LakeSpec:
        """The spec with at least ``rows`` samples over ``nodes`` nodes."""
        return cls(nodes=nodes, seconds=max(10, math.ceil(rows / (SERIES_PER_NODE * nodes))), **kw)

    @property
    def rows(self) -> int:
        return self.nodes * SERIES_PER_NODE * self.seconds

    @property
    def storm(self) -> tuple[int, int]:
        """[start, end) seconds of the PFC storm: two minutes in the middle of the span."""
        mid = self.seconds // 2
        return mid, min(self.seconds, mid + 120)


def _dict(values: list[str]) -> pa.Array:
    return pa.array(values, pa.string())


class Dictionaries:
    """Every string column's dictionary, shared by all node blocks (so tables concatenate and
    the writer keeps one dictionary per column chunk)."""

    def __init__(self, nodes: int) -> None:
        per_node = synth._series(1)
        self.metrics = sorted({s[2] for s in per_node})
        units = {s[2]: s[3] for s in per_node}
        self.units = sorted(set(units.values()))
        self.devices = sorted({s[1] for s in per_node})
        self.node = _dict([f"node{n:03d}" for n in range(nodes)])
        self.rack = _dict([f"rack{i:02d}" for i in range(nodes // 8 + 1)])
        self.leaf = _dict([f"leaf{i:02d}-r{r}" for i in range(nodes // 4 + 1) for r in range(8)])
        self.boot = _dict([f"boot-{n}" for n in range(nodes)])
        self.small = {
            "metric": _dict(self.metrics),
            "unit": _dict(self.units),
            "device": _dict(self.devices),
            "pod": _dict(["pod0"]),
            "leaf_port": _dict(["1", "2", "3", "4"]),
            "nic": _dict([f"mlx5_{r}" for r in range(8)]),
            "gpu": _dict([f"gpu{r}" for r in range(8)]),
            "job": _dict(["job-1001"]),
            "exporter": _dict(["dcgm", "node"]),
            "instance": _dict(["0"]),
            "null_reason": _dict(["first_sample"]),
        }
        # one node's rows, in sort order (metric, ts, device): per metric, step-major
        self.device_of_series, self.series_index = [], []
        for m in self.metrics:
            series = sorted(
                (self.devices.index(s[1]), i) for i, s in enumerate(per_node) if s[2] == m
            )
            self.device_of_series.append(np.array([d for d, _ in series]))
            self.series_index.append(np.array([i for _, i in series]))
        self.per_node = per_node
        self.unit_index = np.array([self.units.index(units[m]) for m in self.metrics])


def _gauge(name: str, rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    k = shape[0] * shape[1]
    if name == "gpu.temp":
        walk = np.cumsum(rng.normal(0, 0.3, shape), axis=0)
        return np.asarray(np.round(np.clip(walk, -10.0, 15.0) + 62))
    out: np.ndarray
    if name == "gpu.power":
        out = np.round(rng.normal(620, 25, k), 3)
    elif name == "gpu.sm_clock":
        out = np.where(rng.random(k) < 0.03, 1410.0, 1980.0)
    elif name == "gpu.util":
        out = np.round(np.clip(rng.normal(92, 4, k), 0.0, 100.0))
    elif name == "gpu.clock_event_reasons":
        out = np.where(rng.random(k) < 0.03, 4.0, 0.0)
    elif name == "cpu.busy":
        out = np.round(rng.normal(35, 5, k), 1)
    else:  # mem.available
        out = np.round(rng.normal(8e11, 1e8, k), -6)
    return out.reshape(shape)


def _increments(name: str, rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    if name.endswith("_data"):
        return rng.integers(4_000_000_000, 5_000_000_000, shape).astype(np.float64)
    burst = rng.random(shape) < 0.02
    return np.where(burst, rng.integers(1, 50_000, shape), 0).astype(np.float64)


def node_samples(spec: LakeSpec, node: int, dicts: Dictionaries) -> pa.Table:
    """The refined samples of one node, sorted by (metric, ts, device); string columns are
    dictionary arrays over ``dicts``. Deterministic for (spec.seed, node)."""
    rng = np.random.default_rng([spec.seed, node])
    steps = spec.seconds
    jitter = rng.integers(0, 2_000_000, steps)
    offset0 = int(rng.integers(-40_000_000, 40_000_000))
    cols: dict[str, list[np.ndarray]] = {
        k: [] for k in ("m", "d", "s", "step", "value", "raw", "delta", "ctr")
    }
    k_steps = np.arange(steps)
    for mi, name in enumerate(dicts.metrics):
        devs, sidx = dicts.device_of_series[mi], dicts.series_index[mi]
        shape = (steps, len(devs))
        counter = dicts.per_node[int(sidx[0])][5]
        if counter:
            inc = _increments(name, rng, shape)
            if name == "nic.rx_prio_pause_duration" and node == STORM_NODE:
                a, b = spec.storm
                inc[a:b, STORM_PORT] = rng.integers(600_000, 950_000, b - a)  # us paused per s
            if name == "nic.rx_prio_pause" and node == STORM_NODE:
                a, b = spec.storm
                inc[a:b, STORM_PORT] = rng.integers(20_000, 40_000, b - a)
            cum = np.cumsum(inc, axis=0)
            delta = inc.copy()
            delta[0, :] = np.nan
            value, raw = cum, cum
        else:
            value = _gauge(name, rng, shape)
            raw = np.zeros(shape)
            delta = np.full(shape, np.nan)
        cols["m"].append(np.full(value.size, mi, np.int8))
        cols["d"].append(np.tile(devs, steps).astype(np.int8))
        cols["s"].append(np.tile(sidx, steps).astype(np.int16))
        cols["step"].append(np.repeat(k_steps, len(devs)))
        cols["value"].append(value.ravel())
        cols["raw"].append(raw.ravel())
        cols["delta"].append(delta.ravel())
        cols["ctr"].append(np.full(value.size, counter))
    m, d, s = (np.concatenate(cols[k]) for k in ("m", "d", "s"))
    step = np.concatenate(cols["step"])
    ctr = np.concatenate(cols["ctr"])
    delta = np.concatenate(cols["delta"])
    n = len(m)
    dev_no = d.astype(np.int64)
    ts_source = spec.start_ns + step * 1_000_000_000 + jitter[step] + dev_no * 3_000
    offset = offset0 + step * 20
    rail = np.array([max(x[6], 0) for x in dicts.per_node], np.int32)[s]
    exporter = np.array([x[4] == "node" for x in dicts.per_node], np.int8)[s]
    seq = step * 2 + exporter
    leaf_i = node // 4
    part = node % spec.partitions

    def dictionary(idx: np.ndarray, values: pa.Array, mask: np.ndarray | None = None) -> pa.Array:
        return pa.DictionaryArray.from_arrays(
            pa.array(idx, pa.int16(), mask=mask), values, safe=False
        )

    def const(values: pa.Array, i: int) -> pa.Array:
        return dictionary(np.full(n, i, np.int16), values)

    nan = np.isnan(delta)
    small = dicts.small
    out: dict[str, pa.Array] = {
        "node": const(dicts.node, node),
        "device": dictionary(d, small["device"]),
        "metric": dictionary(m, small["metric"]),
        "unit": dictionary(dicts.unit_index[m], small["unit"]),
        "ts": pa.array(ts_source - offset),
        "ts_source": pa.array(ts_source),
        "clock_offset_ns": pa.array(offset),
        "clock_error_ns": pa.array(np.full(n, 250_000, np.int64)),
        "value": pa.array(np.concatenate(cols["value"])),
        "raw": pa.array(np.concatenate(cols["raw"]).astype(np.uint64), mask=~ctr),
        "delta": pa.array(delta, mask=nan),
        "rate": pa.array(delta, mask=nan),  # one-second interval
        "null_reason": dictionary(np.zeros(n, np.int16), small["null_reason"], ~(ctr & nan)),
        "reset": pa.array(np.zeros(n, bool)),
        "late": pa.array(np.zeros(n, bool)),
        "rack": const(dicts.rack, leaf_i // 2),
        "pod": const(small["pod"], 0),
        "leaf": dictionary(leaf_i * 8 + rail, dicts.leaf),
        "leaf_port": const(small["leaf_port"], node % 4),
        "rail": pa.array(rail),
        "nic": dictionary(rail, small["nic"]),
        "gpu": dictionary(rail, small["gpu"]),
        "numa": pa.array(rail // 4),
        "job": const(small["job"], 0),
        "rank": pa.array((node * 8 + rail).astype(np.int32)),
        "exporter": dictionary(exporter, small["exporter"]),
        "instance": const(small["instance"], 0),
        "boot_id": const(dicts.boot, node),
        "seq": pa.array(seq),
        "raw_partition": pa.array(np.full(n, part, np.int32)),
        "raw_offset": pa.array(step * (spec.nodes // spec.partitions + 1) * 2 + exporter),
    }
    arrays = [out.get(f.name, pa.nulls(n, f.type)) for f in REFINED_SCHEMA]
    return pa.Table.from_arrays(arrays, names=REFINED_SCHEMA.names)


class _RowGroupWriter:
    """A Parquet file written in row groups of exactly ``rows`` (the last one shorter), as one
    ``write_table`` of the whole table would cut them. Buffers at most one row group."""

    def __init__(self, path: Path, schema: pa.Schema, options: dict[str, Any]) -> None:
        opts = dict(options)
        self.rows = int(opts.pop("row_group_size"))
        self.path = path
        self.writer = pq.ParquetWriter(path, schema, **opts)
        self.pending: list[pa.Table] = []
        self.buffered = 0
        self.written = 0

    def write(self, table: pa.Table) -> None:
        self.pending.append(table)
        self.buffered += table.num_rows
        while self.buffered >= self.rows:
            self._flush(self.rows)

    def _flush(self, n: int) -> None:
        t = pa.concat_tables(self.pending)
        self.writer.write_table(t.slice(0, n), row_group_size=n)
        rest = t.slice(n)
        self.pending, self.buffered = ([rest] if rest.num_rows else []), rest.num_rows
        self.written += n

    def cut(self) -> None:
        """End the current row group here, however short."""
        if self.buffered:
            self._flush(self.buffered)

    def close(self) -> None:
        self.cut()
        self.writer.close()


@dataclass(frozen=True)
class Lakes:
    """The two lake roots :func:`write_lakes` made and what is in them."""

    compacted: Path
    single: Path
    rows: int
    files: int  # samples data files in the compacted lake
    bytes_compacted: int
    bytes_single: int


def _time_slices(t: pa.Table, widths: list[int]) -> list[tuple[int, pa.Table]]:
    """``t`` (one node, sorted by metric then ts) cut at every multiple of each of ``widths``
    (ns) of ``ts``, as (start of the piece's interval, piece). Within each metric's run an
    interval's rows are contiguous, so a piece is slices, copied into one chunk."""
    ts = t.column("ts").to_numpy()
    metric = t.column("metric").chunk(0).indices.to_numpy()
    runs = [0, *(np.flatnonzero(np.diff(metric)) + 1).tolist(), len(ts)]
    lo, hi = int(ts.min()), int(ts.max())
    edges = sorted({k * w for w in widths for k in range(lo // w, hi // w + 2)})
    out = []
    for x, y in itertools.pairwise(edges):
        pieces = []
        for a, e in itertools.pairwise(runs):
            i, j = np.searchsorted(ts[a:e], [x, y])
            if j > i:
                pieces.append(t.slice(a + int(i), int(j - i)))
        if pieces:
            out.append((x, pa.concat_tables(pieces).combine_chunks()))
    return out


def write_lakes(
    spec: LakeSpec, compacted: Path, single: Path, *, compactor: Compactor | None = None
) -> Lakes:
    """Write both lakes of ``spec`` (see the module docstring), with the row-group size and
    zstd level of ``compactor`` (default: a Compactor's defaults). Blocks for minutes at 10^8
    rows. Each node's samples are generated twice (about 0.1 s a node), once per layout; the
    compacted lake is written one source partition at a time (about 1 GB held at 10^8)."""
    comp = compactor or Compactor(compacted)
    opts = write_options(DATASETS["samples"].schema, comp.row_group_rows, comp.compression_level)
    dicts = Dictionaries(spec.nodes)
    paths = LakePaths(compacted)
    slab_ns = comp.slab_ns.get("samples")
    widths = [HOUR_NS] if slab_ns is None else [HOUR_NS, slab_ns]
    files, size = 0, 0
    for part in range(spec.partitions):  # compacted: per hour, one file per partition
        pieces: dict[int, list[pa.Table]] = {}  # slab start -> its rows, node by node
        for node in range(part, spec.nodes, spec.partitions):
            for x, piece in _time_slices(node_samples(spec, node, dicts), widths):
                pieces.setdefault(x, []).append(piece)
        writers: dict[int, _RowGroupWriter] = {}
        for x in sorted(pieces):
            b = x // HOUR_NS
            w = writers.get(b)
            if w is None:
                hdir = paths.hour_dir("samples", *hour_of(b * HOUR_NS))
                hdir.mkdir(parents=True, exist_ok=True)
                first = b * 1_000_000  # offsets grow with the hour, as landed ranges do
                name = file_name(part, first, first + 999_999)
                w = writers[b] = _RowGroupWriter(hdir / name, pieces[x][0].schema, opts)
            for piece in pieces.pop(x):
                w.write(piece)
            w.cut()  # the compactor starts a new row group with each slab
        for w in writers.values():
            w.close()
            files, size = files + 1, size + w.path.stat().st_size
    one_dir = LakePaths(single).hour_dir("samples", *hour_of(spec.start_ns))
    one_dir.mkdir(parents=True, exist_ok=True)
    one: _RowGroupWriter | None = None
    for node in range(spec.nodes):  # single: every node in order
        t = node_samples(spec, node, dicts)
        if one is None:
            one = _RowGroupWriter(one_dir / file_name(0, 0, 1), t.schema, opts)
        one.write(t)
    assert one is not None
    one.close()
    for root in (compacted, single):
        write_side_datasets(spec, LakeWriter(root))
    return Lakes(compacted, single, spec.rows, files, size, one.path.stat().st_size)


def collectives(spec: LakeSpec) -> pa.Table:
    """One AllReduce every ``op_interval_s`` over all ``nodes x 8`` ranks of job-1001; the
    rank on the stormed port's GPU arrives 20 ms late during the storm (vectorised)."""
    rng = np.random.default_rng([spec.seed, 1_000_000])
    nranks = spec.nodes * 8
    ops = spec.seconds // spec.op_interval_s
    op = np.repeat(np.arange(ops), nranks)
    rank = np.tile(np.arange(nranks), ops)
    t = spec.start_ns + op * spec.op_interval_s * 1_000_000_000 + 300_000_000
    arrive = t + rng.integers(0, 200_000, len(op))
    slow_rank = STORM_NODE * 8 + STORM_PORT
    a, b = spec.storm
    late = (rank == slow_rank) & (op * spec.op_interval_s >= a) & (op * spec.op_interval_s < b)
    arrive = arrive + late * 20_000_000
    cols: dict[str, Any] = {
        "ts": arrive,
        "ts_ns": arrive,
        "end_ns": t + 40_000_000,
        "end_ts": t + 40_000_000,
        "job": pa.DictionaryArray.from_arrays(np.zeros(len(op), np.int8), ["job-1001"]),
        "comm": pa.DictionaryArray.from_arrays(np.zeros(len(op), np.int8), ["c0"]),
        "op": pa.DictionaryArray.from_arrays(np.zeros(len(op), np.int8), ["AllReduce"]),
        "op_seq": op,
        "rank": rank,
        "nranks": np.full(len(op), nranks),
        "device": pa.DictionaryArray.from_arrays(
            (rank % 8).astype(np.int8), [f"gpu{g}" for g in range(8)]
        ),
        "bytes": np.full(len(op), 1 << 28),
        "dtype": pa.DictionaryArray.from_arrays(np.zeros(len(op), np.int8), ["bf16"]),
        "algbw_gbps": np.full(len(op), 180.0),
        "busbw_gbps": 340.0 - late * 40.0,
        "node": pa.DictionaryArray.from_arrays(
            (rank // 8).astype(np.int16), [f"node{n:03d}" for n in range(spec.nodes)]
        ),
        "exporter": pa.DictionaryArray.from_arrays(np.zeros(len(op), np.int8), ["nccl"]),
        "boot_id": pa.DictionaryArray.from_arrays(np.zeros(len(op), np.int8), ["b"]),
        "seq": op,
        "ts_source": arrive,
        "clock_offset_ns": np.zeros(len(op), np.int64),
        "clock_error_ns": np.full(len(op), 1_000_000),
        "raw_partition": np.zeros(len(op), np.int32),
        "raw_offset": op,
    }
    return conform(pa.table(cols), COLLECTIVES_LAKE_SCHEMA)


def _jobs(spec: LakeSpec) -> pa.Table:
    ranks = [
        {"rank": r, "node": f"node{r // 8:03d}", "gpu": f"gpu{r % 8}"}
        for r in range(spec.nodes * 8)
    ]
    row = {
        "ts": spec.start_ns,
        "job": "job-1001",
        "start_ns": spec.start_ns,
        "nodes": [f"node{n:03d}" for n in range(spec.nodes)],
        "ranks": ranks,
        "kafka_partition": 0,
        "kafka_offset": 0,
    }
    return pa.Table.from_pylist([{k: row.get(k) for k in JOBS_SCHEMA.names}], schema=JOBS_SCHEMA)


def write_side_datasets(spec: LakeSpec, writer: LakeWriter) -> None:
    """Seeds, collectives, topology, jobs and the small datasets of synth.land_lake."""
    writer.ensure_seeds()
    c = collectives(spec)
    step = 3_600 // spec.op_interval_s * spec.nodes * 8  # about one landed file per hour
    for i in range(0, c.num_rows, step):
        writer.land("collectives", c.slice(i, step), partition=0, first=i, last=i + step - 1)
    writer.land("topology", synth.topology(spec.nodes), partition=0, first=0, last=0)
    writer.land("jobs", _jobs(spec), partition=0, first=0, last=0)
    synth.land_small_datasets(writer, spec.start_ns, spec.rows, jobs=False)
