"""The wave step of the refining chain (:class:`WaveStep`): the refined messages of a group.

:func:`wave_messages` writes each wave's refined rows as one record batch (:class:`WaveRows`),
cut into runs of one node's adjacent rows (:func:`_runs`), each run one message
(:func:`refined_messages`) unless that is over the refined topic's limit. The step hands each
refined record on to the outputs step (:class:`services.worker.outcomes.OutputsStep`) with the
messages it is the last record of.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from pipelines.refine.types import RefineResult
from schemas.codec import ARROW, ipc_stream_within
from schemas.records import lineage_header
from schemas.topics import Topics
from schemas.wire import Batch
from services.kafka.outputs import OutMessage
from services.worker.outcomes import OutputsStep
from services.worker.refiner_outputs import (
    ZSTD,
    Group,
    OutputLimits,
    OutputTooLarge,
    RawRecord,
    ipc_with,
)

Item = tuple[int, RawRecord, Batch, RefineResult]  # index in the group, record, batch, result


class WaveStep:
    """Writes the refined messages of refined samples records and submits each record to the
    outputs step (see the module). Raises :class:`OutputTooLarge` for a record whose rows
    alone are over the limit (the refine step dead-letters it); keeps nothing between calls.
    """

    def __init__(self, topics: Topics, outputs: OutputsStep, limits: OutputLimits) -> None:
        self.topics = topics
        self.outputs = outputs
        self.limits = limits

    def submit(self, group: Group, items: list[Item], alerts: list[list[OutMessage]]) -> None:
        """``items`` refined together, in group order, each with its clock ``alerts``: each
        record goes on with the refined messages it is the last record of (one message per
        run of one node's rows of a wave, its ``lineage`` header naming each record in it)."""
        fronts: dict[int, list[OutMessage]] = {}
        refined = [x for x in items if x[3].refined_count]
        for part, msg in wave_messages(self.topics, self.limits.max_refined_bytes, refined):
            fronts.setdefault(max(i for i, _, _, _ in part), []).insert(0, msg)
        for (i, rec, batch, res), al in zip(items, alerts, strict=True):
            self.outputs.samples(group, i, rec, batch, res, fronts.get(i, []), al)


def wave_messages(
    topics: Topics, limit: int, refined: list[Item]
) -> list[tuple[list[Item], OutMessage]]:
    """The refined messages of a group's records that have refined rows (``refined``, in
    group order), each with the records it holds: a message per run of one node's adjacent
    rows of a wave (:func:`refined_messages`). Raises :class:`OutputTooLarge` for a record
    whose rows alone are over ``limit`` (bytes)."""
    runs = _runs(refined)
    rows = [sum(x[3].refined_count for x in run) for run in runs]
    # each wave's rows as one record batch, with the runs (first row, rows) it sends
    by_wave: dict[int, tuple[pa.Table, list[tuple[int, int]]]] = {}
    for run, n in zip(runs, rows, strict=True):
        res = run[0][3]
        assert res.wave_rows is not None  # a batch with refined rows has its wave's
        by_wave.setdefault(id(res.wave_rows), (res.wave_rows, []))[1].append((res.wave_start, n))
    waves = {
        k: WaveRows(wave.combine_chunks().to_batches()[0], spans)
        for k, (wave, spans) in by_wave.items()
    }
    out: list[tuple[list[Item], OutMessage]] = []
    for run, n in zip(runs, rows, strict=True):
        out += refined_messages(topics, limit, run, waves[id(run[0][3].wave_rows)], n)
    return out


def refined_messages(
    topics: Topics, limit: int, run: list[Item], whole: WaveRows, n: int
) -> list[tuple[list[Item], OutMessage]]:
    """The refined messages of a run (see :func:`_runs`) with the records each holds: one
    for the whole run, or one per record where that is over ``limit`` (bytes); raises
    :class:`OutputTooLarge` for a record whose rows alone are."""
    bound = whole.bounds.get(run[0][3].wave_start)
    msg = _refined_message(topics, run, whole, n, bound)
    if (bound is not None and bound <= limit) or len(msg.value) <= limit:
        return [(run, msg)]
    msg = _refined_message(topics, run, whole, n, None, ZSTD)
    if len(msg.value) <= limit:
        return [(run, msg)]
    if len(run) == 1:
        raise OutputTooLarge(
            f"{n} refined rows are {len(msg.value)} bytes with zstd > {limit}"
            " (a record's rows go out in one message)"
        )
    return [
        out for x in run for out in refined_messages(topics, limit, [x], whole, x[3].refined_count)
    ]


def _refined_message(
    topics: Topics,
    run: list[Item],
    whole: WaveRows,
    n: int,
    bound: int | None,
    options: pa.ipc.IpcWriteOptions | None = None,
) -> OutMessage:
    """One refined message for adjacent rows of one node's batches (see :func:`_runs`),
    ``n`` rows of its wave (``whole``: a record batch's slice is serialized as it is, a
    table's is first cut into batches) written into ``bound`` bytes when known, with the
    lineage of each raw record in it."""
    _, _, batch, first = run[0]
    rows = whole.batch.slice(first.wave_start, n)
    lineage = [res.header_fields(r.topic, b, (r.partition, r.offset)) for _, r, b, res in run]
    return OutMessage(
        topics.refined,
        batch.envelope.source.node.encode(),
        ipc_stream_within(rows, bound) if options is None else ipc_with(rows, options),
        [("content-type", ARROW.encode()), ("lineage", lineage_header(lineage))],
    )


class WaveRows:
    """A wave's refined rows as one record batch, and for each run of its rows that goes out
    as one message (``spans``: first row and rows) a bound on its IPC stream's bytes, from
    the string columns' offsets at the runs' ends only, for writing each refined message
    straight into one buffer (:func:`schemas.codec.ipc_stream_within`)."""

    SLACK = 65_536  # the schema and record batch messages' metadata, padding, end marker

    def __init__(self, batch: pa.RecordBatch, spans: list[tuple[int, int]]) -> None:
        self.batch = batch
        self.bounds: dict[int, int] = {}  # first row of a run → bound (none: not known)
        starts = np.array([a for a, _ in spans], dtype=np.int64)
        rows = np.array([n for _, n in spans], dtype=np.int64)
        ends = starts + rows
        data = np.zeros(len(spans), dtype=np.int64)
        fixed = 0
        for col in batch.columns:
            if pa.types.is_string(col.type):
                off = np.frombuffer(col.buffers()[1], dtype=np.int32)[col.offset :]
                data += off[ends] - off[starts]
                fixed += 4  # an offset per row
            elif pa.types.is_primitive(col.type):
                fixed += max(col.type.bit_width // 8, 1)
            else:  # no bound known: every message serialized the plain way
                return
            fixed += 1  # its validity bitmap, at a byte per row at most
        size = self.SLACK + 8 * 3 * int(batch.num_columns) + rows * fixed + data
        self.bounds = dict(zip(starts.tolist(), size.tolist(), strict=True))


def _runs(refined: list[Item]) -> list[list[Item]]:
    """The batches with refined rows grouped into runs that can go out as one message: of one
    node, refined in one wave, their rows adjacent there (:func:`pipelines.refine.refine_group`
    puts a node's batches of a wave next to each other), in row order."""
    by: dict[tuple[int, str], list[Item]] = {}
    for item in refined:
        res = item[3]
        by.setdefault((id(res.wave_rows), item[2].envelope.source.node), []).append(item)
    runs = []
    for group in by.values():
        group.sort(key=lambda x: x[3].wave_start)
        run = [group[0]]
        for item in group[1:]:
            prev = run[-1][3]
            if prev.wave_rows is None or prev.wave_start + prev.refined_count != item[3].wave_start:
                runs.append(run)
                run = []
            run.append(item)
        runs.append(run)
    return runs
