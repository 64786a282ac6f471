"""An agent's checkpoints (the state changed since the last one, written to its changelog-backed
tables only after the outputs of the groups it covers are acknowledged) and the ends of its
refined groups still in flight."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from services.kafka.internals import set_without_changelog
from services.kafka.outputs import OutMessage
from services.worker.guard import DeadLetterStep
from services.worker.refiner import Refiner


class Checkpoints:
    """What one agent refined since its state was last written: the events of the groups
    whose outputs are acknowledged (acked only once a checkpoint covers them), the latest
    event that changed each stream or node (its changelog record goes to that event's
    partition), and whether the refiner's state is that after whole groups only."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self.saved_at = -math.inf
        self.ended: list[Any] = []
        self.last_for: dict[str, Any] = {}
        # False from the start of a group's refining until its end is started: the state
        # then holds rows whose records may never be acked, and no checkpoint is taken
        self.clean = True
        self.epoch = 0  # moves when the partitions are revoked: earlier groups replay
        self.stream: Any = None

    def due(self) -> bool:
        return time.monotonic() - self.saved_at >= self.every_s

    def waiting(self) -> bool:
        return bool(self.ended or self.last_for)

    def changed(self, stream: str, event: Any) -> None:
        """``event`` changed the state of ``stream`` (``node|...``) and of its node."""
        self.last_for[stream] = event
        self.last_for["node:" + stream.split("|", 1)[0]] = event

    def take(self, proc: Refiner, stream_table: Any, node_table: Any | None) -> list[OutMessage]:
        """The changelog records of every stream and node changed since the last
        checkpoint, as the state is now."""
        streams, nodes = proc.dirty_blobs()
        changelog = [_put(stream_table, self.last_for[k], k, b) for k, b in streams.items()]
        if node_table is not None:
            changelog += [_put(node_table, self.last_for["node:" + n], n, b)
                          for n, b in nodes.items()]  # fmt: skip
        self.last_for = {}
        self.saved_at = time.monotonic()
        return changelog

    def drop(self) -> None:
        """Forget the groups not yet in a checkpoint (partitions revoked): they replay."""
        self.ended, self.last_for, self.epoch = [], {}, self.epoch + 1


@dataclass
class Lane:
    """One agent's refining: its refiner, the tables its state is written to (the node table
    only for raw input), its checkpoints and its dead-letter limit."""

    proc: Refiner
    streams: Any  # faust Table: stream -> state
    nodes: Any | None  # faust Table: node -> state
    cp: Checkpoints
    dead_letters: DeadLetterStep

    def take(self) -> list[OutMessage]:
        return self.cp.take(self.proc, self.streams, self.nodes)


class GroupEnds:
    """The ends of refined groups still in flight (see :class:`services.worker.groups.
    GroupRunner`). A failed end is kept in :attr:`error` for a caller that is not awaiting it
    (the worker's watch timer raises it when no next group comes to do so)."""

    def __init__(self, settle_s: float) -> None:
        self.settle_s = settle_s
        self._tasks: set[asyncio.Task[None]] = set()
        self.error: BaseException | None = None

    def start(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self.error is None:
            self.error = task.exception()

    @property
    def idle(self) -> bool:
        return not self._tasks

    async def settle(self) -> None:
        """Wait (at most ``settle_s``) for every end in flight; failures stay in :attr:`error`
        and with their own awaiters."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=self.settle_s)


def _put(table: Any, event: Any, key: str, blob: bytes) -> OutMessage:
    """Set a table key and return its changelog record, on the partition of the input record
    that changed it (the table is co-partitioned with its input topic), for the output
    producer to send: the record Faust's ``table[key] = blob`` would send, built here because
    the group's records come from several partitions and the stream's current event is only
    the last one, and sent by librdkafka with the outputs. Faust's recovery reads it back as
    its own."""
    k = key.encode()
    topic = set_without_changelog(table, k, blob)
    return OutMessage(topic, k, blob, partition=event.message.partition)
