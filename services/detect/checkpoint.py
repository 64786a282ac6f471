"""Where detect commits an offset: consume → publish → commit, in one object.

The shape is quix-streams' ``Checkpoint``, as the worker's
(:mod:`services.worker.checkpoint`). Detect keeps no state in Faust tables (a replica that
takes partitions over rebuilds the detector's state by its warm-up, from the records before
the committed offsets), so a group's checkpoint has two steps, always in this order:

1. **outputs**: every record derived from the group (alerts, episodes, rollups, this
   replica's progress record) is published through the process's output producer and
   acknowledged by the broker (:meth:`Checkpoint.commit`);
2. **offsets**: only then is every record of the group acked to Faust's consumer, which
   commits acked offsets (every ``broker_commit_interval``, 1 s, and when partitions are
   revoked or detect stops). Faust commits an offset only once every offset before it is
   acked, or declared a gap (:meth:`Checkpoint.fetch_skipped`: records the stream never
   handed over, fetched directly and routed in the group that acks past them).

A record is acked nowhere else: the groups come from :meth:`Checkpoint.groups`, whose
stream acks nothing by itself, also after a crash. A group whose outputs are not
acknowledged raises, the agent crashes, and the next owner replays its records: their
outputs are then published again, the same records with the same ids, which consumers drop
by ``(id, state)``. Time-driven outputs (the tick's, the warm-up's, the final flush's) go
through :meth:`Checkpoint.publish`: acknowledged, and no record acked.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import faust

from services.kafka.group import manual_acks
from services.kafka.internals import declare_gap
from services.kafka.outputs import OutMessage, OutputProducer
from services.kafka.watch import fetch_range

log = logging.getLogger(__name__)

# (librdkafka conf, topic, partition, start, end) → the records [start, end), blocking
FetchRange = Callable[[dict[str, Any], str, int, int, int], list[Any]]


class Checkpoint:
    """Detect's checkpoint (see the module). ``conf``: librdkafka settings to fetch the
    records the stream skipped with, by ``fetch``. Not thread-safe: the event loop only."""

    def __init__(
        self,
        app: faust.App,
        conf: dict[str, Any],
        outputs: OutputProducer,
        fetch: FetchRange = fetch_range,
    ) -> None:
        self._app = app
        self._conf = conf
        self._outputs = outputs
        self._fetch = fetch
        self._stream: Any = None  # the agent's Faust stream: its records are acked through it

    @contextlib.asynccontextmanager
    async def groups(self, stream: Any, take_max: int, within_s: float) -> AsyncIterator[Any]:
        """The agent's groups of events (Faust's ``noack_take``): acked only by
        :meth:`commit`, also after the groups end (:func:`services.kafka.group.manual_acks`)."""
        self._stream = stream
        async with manual_acks(stream, take_max, within_s) as groups:
            yield groups

    async def commit(self, events: list[Any], outputs: list[OutMessage]) -> None:
        """A group's checkpoint: ``outputs`` published and acknowledged (1), then ``events``
        acked for Faust to commit (2). Raises when the producer does; nothing is acked then."""
        await self._outputs.publish(outputs)
        for ev in events:
            await self._stream.ack(ev)

    async def publish(self, outputs: list[OutMessage]) -> None:
        """Outputs no record waits for (time-driven), published and acknowledged; raises
        when the producer does."""
        await self._outputs.publish(outputs)

    async def fetch_skipped(self, topic: str, partition: int, start: int, end: int) -> list[Any]:
        """Records ``[start, end)`` of a partition that the stream never handed over (input
        offsets are contiguous: a jump is records skipped), fetched directly (blocking work
        in a thread), for the caller to route in the group of the event after them.

        Faust's consumer counts those offsets read but never sees them acked, and commits
        nothing past an offset never acked: the partition's commits would stand still at
        that offset until it is reassigned. Declared as a gap (as the worker does,
        :mod:`services.worker.gaps`), they count as acked once an offset after them is, and
        those are acked only by the :meth:`commit` of the group that routes these records."""
        got: list[Any] = await asyncio.get_running_loop().run_in_executor(
            None, self._fetch, self._conf, topic, partition, start, end
        )
        log.warning("%s[%d]: offsets %d..%d never reached the agent; fetched %d",
                    topic, partition, start, end - 1, len(got))  # fmt: skip
        await declare_gap(self._app.consumer, topic, partition, start, end - 1)
        return got
