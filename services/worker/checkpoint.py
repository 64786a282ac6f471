"""Where the worker commits an offset: consume → produce → commit, in one object per agent.

The shape is quix-streams' ``Checkpoint``. A :class:`Checkpoint` holds what one agent has
refined since its state was last written: the input records of the groups whose outputs are
acknowledged (per partition: :meth:`Checkpoint.offsets`), and, per stream and node whose state
changed, the latest record that changed it. Committing is always, in this order:

1. **outputs**: every output of the groups it covers is acknowledged by the broker (the
   output producer flushed; :meth:`Checkpoint.end_group` waits for each group's);
2. **state**: the state changed since the last checkpoint is written to the changelog-backed
   tables and its changelog records are produced and acknowledged (the same librdkafka
   producer as the outputs);
3. **offsets**: every record it covers is acked to Faust's consumer, which commits acked
   offsets (every ``broker_commit_interval``, 1 s, and when partitions are revoked or the
   worker stops). Faust commits an offset only once every offset before it is acked, or
   declared a gap (:meth:`services.worker.gaps.GapGuard.with_skipped`: records the stream
   never handed over, fetched directly and refined in the group that acks past them).

A record is acked nowhere else: a group that failed, or whose partitions were revoked while
it was refined, is never acked, and the next owner replays it. A crash anywhere thus replays
records whose outputs were either never published (recomputed identically from the older
state) or already published and remembered in the state (skipped as ``replay``), or published
but not yet in a checkpoint (published again: the same rows with the same lineage, which a
consumer drops by its raw partition and offset).

A checkpoint is taken when one is due (``every_s`` after the last) at the end of a group
(:meth:`Checkpoint.end_group`), or at once (:meth:`Checkpoint.commit_now`) when the worker
stops, its partitions are revoked or its input pauses, provided the state is that after
whole groups whose ends are all done. :class:`GroupEnds` runs the ends of groups one at a
time, in order, while the next group is refined (:class:`services.worker.groups.GroupRunner`).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Coroutine
from typing import Any

from services.kafka.internals import set_without_changelog
from services.kafka.outputs import Delivery, OutMessage, OutputProducer

# the state changed since the last call: (stream key → blob, node → blob)
DirtyState = Callable[[], tuple[dict[str, bytes], dict[str, bytes]]]


class Checkpoint:
    """One agent's checkpoint (see the module). ``streams`` and ``nodes`` are its Faust tables
    (stream → state, node → state; ``nodes`` None for an agent without node state), ``dirty``
    hands over the state changed since its last call. Not thread-safe: the agent's loop only.
    """

    def __init__(
        self,
        every_s: float,
        outputs: OutputProducer,
        streams: Any,
        nodes: Any | None,
        dirty: DirtyState,
    ) -> None:
        self.every_s = every_s
        self._outputs = outputs
        self._streams = streams
        self._nodes = nodes
        self._dirty = dirty
        self.saved_at = -math.inf
        self.stream: Any = None  # the agent's Faust stream: its records are acked through it
        self._ended: list[Any] = []  # records whose outputs are acknowledged, not yet acked
        self._last_for: dict[str, Any] = {}  # stream or "node:" + node → the latest record
        # False from the start of a group's refining until its end is started: the state
        # then holds rows whose records may never be acked, and no checkpoint is taken
        self.clean = True
        self.epoch = 0  # moves when the partitions are revoked: earlier groups replay

    def due(self) -> bool:
        return time.monotonic() - self.saved_at >= self.every_s

    def waiting(self) -> bool:
        """Whether anything waits for a checkpoint (records to ack, state to write)."""
        return bool(self._ended or self._last_for)

    def offsets(self) -> dict[tuple[str, int], int]:
        """Per input partition, the next offset after the records this checkpoint would ack
        (what Faust commits once the offsets before them are acked too)."""
        out: dict[tuple[str, int], int] = {}
        for ev in self._ended:
            m = ev.message
            tp = (m.topic, m.partition)
            out[tp] = max(out.get(tp, 0), m.offset + 1)
        return out

    def changed(self, stream: str, event: Any) -> None:
        """``event`` changed the state of ``stream`` (``node|...``) and of its node: their
        changelog records go to that event's partition (the tables are co-partitioned with
        the input topics)."""
        self._last_for[stream] = event
        self._last_for["node:" + stream.split("|", 1)[0]] = event

    def take(self) -> list[OutMessage]:
        """The changelog records of every stream and node changed since the last checkpoint,
        as the state is now (encoded now: the next group changes the state), written to the
        tables' local stores; the caller produces them."""
        streams, nodes = self._dirty()
        last = self._last_for
        changelog = [_put(self._streams, last[k], k, b) for k, b in streams.items()]
        if self._nodes is not None:
            changelog += [_put(self._nodes, last["node:" + n], n, b) for n, b in nodes.items()]
        self._last_for = {}
        self.saved_at = time.monotonic()
        return changelog

    async def end_group(
        self, events: list[Any], sent: list[Delivery], changelog: list[OutMessage] | None,
        epoch: int,
    ) -> None:  # fmt: skip
        """A refined group's end: its outputs acknowledged (1), then, when ``changelog`` is
        a checkpoint's state (:meth:`take` after the group), that state (2) and every record
        refined so far acked (3). Raises when the producer does; nothing is acked then.
        ``epoch``: the checkpoint's when the group began (moved: revoked meanwhile, and no
        checkpoint holds the group: it replays)."""
        await self._outputs.wait(sent)
        if changelog is not None:
            await self._outputs.publish(changelog)
        if epoch != self.epoch:
            return
        self._ended += events
        if changelog is not None:  # the checkpoint covers this group and every one before
            done, self._ended = self._ended, []
            await self._ack(done)

    async def commit_now(self, ends: GroupEnds) -> None:
        """Write the state and ack every record refined so far, when the state is that after
        whole groups whose ends are all done (a stop, a revocation, input pausing);
        otherwise leave them to a later checkpoint or to replay."""
        await ends.settle()
        if not (self.clean and ends.idle and ends.error is None and self.waiting()):
            return
        changelog = self.take()
        # taken out before the state is produced: if that fails, no later checkpoint (whose
        # state would not hold theirs) may ack them
        done, self._ended = self._ended, []
        await self._outputs.publish(changelog)
        await self._ack(done)

    async def commit_if_due(self, ends: GroupEnds) -> None:
        """Input paused: the last groups are committed without waiting for more."""
        if self.clean and ends.idle and self.waiting() and self.due():
            await self.commit_now(ends)

    def drop(self) -> None:
        """Forget the records not yet in a checkpoint (partitions revoked): they replay."""
        self._ended, self._last_for, self.epoch = [], {}, self.epoch + 1

    async def _ack(self, events: list[Any]) -> None:
        for ev in events:
            await self.stream.ack(ev)


class GroupEnds:
    """The ends of refined groups still in flight (:meth:`Checkpoint.end_group`). A failed
    end is kept in :attr:`error` for a caller that is not awaiting it (the worker's watch
    timer raises it when no next group comes to do so)."""

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
    that changed it, for the output producer to send: the record Faust's ``table[key] = blob``
    would send, built here because the group's records come from several partitions and the
    stream's current event is only the last one. Faust's recovery reads it back as its own."""
    k = key.encode()
    topic = set_without_changelog(table, k, blob)
    return OutMessage(topic, k, blob, partition=event.message.partition)
