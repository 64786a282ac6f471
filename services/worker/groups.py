"""The group runner: how an agent's groups of records are refined, published, checkpointed and
acked (see :mod:`services.worker.app` for the contract).

Per group (``noack_take``, whose events only the runner acks): refine it in chunks, hand each
chunk's outputs to the output producer, then start the group's *end* (wait for the outputs'
acknowledgements; when a checkpoint is due, send the state changed since the last one and
ack every group the checkpoint covers) while the next group is refined. The ends run one at a
time, in group order; a group that failed is never acked and the next owner replays it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Sequence
from typing import Any

from services.gc_pacer import GcPacer
from services.kafka.feed import TopologyFeed
from services.kafka.group import Progress, manual_acks
from services.kafka.outputs import Delivery, OutMessage, OutputProducer
from services.telemetry import ServiceTelemetry
from services.worker.checkpoints import GroupEnds, Lane
from services.worker.config import WorkerConfig
from services.worker.gaps import GapGuard
from services.worker.tally import GroupTally

End = Coroutine[Any, Any, None]


class GroupRunner:
    """Runs the groups of every agent of the worker (one :class:`Lane` each)."""

    def __init__(
        self,
        cfg: WorkerConfig,
        lanes: Sequence[Lane],
        outputs: OutputProducer,
        guard: GapGuard,
        feed: TopologyFeed,
        telemetry: ServiceTelemetry,
    ) -> None:
        self.cfg = cfg
        self.lanes = lanes
        self.outputs = outputs
        self.guard = guard
        self.feed = feed
        self.telemetry = telemetry
        self.progress = Progress()
        # a group's end waits at most the producer's deadline plus its 5 s of delivery polling
        self.ends = GroupEnds(settle_s=outputs.deadline_s + 10.0)
        # primed when the first agent starts (the long first settle before any record
        # waits), then again after the first group, once that has built the refiner's caches
        self.gc_pacer = GcPacer(cfg.gc_settle_every_s)

    async def run(self, stream: Any, lane: Lane) -> None:
        """The agent's body: refine ``stream``'s groups until it stops or one fails.

        noack_take: Faust's take_events acks a group when its generator closes, also when
        processing it failed, and this process would then commit records whose outputs the
        broker never acknowledged. Here a group is acked only once it is done and in a
        checkpoint. Its end runs while the next group is refined: the refining thread does
        not sit idle through the broker round trips."""
        cp = lane.cp
        ending: asyncio.Task[None] | None = None
        cp.stream = stream
        if self.gc_pacer.prime():
            self.telemetry.record("worker.gc_settle_s", self.gc_pacer.last_pause_s, unit="s")
        async with manual_acks(stream, self.cfg.take_max, self.cfg.take_within_s) as groups:
            try:
                async for events in groups:
                    epoch, cp.clean = cp.epoch, False
                    end, saves = await self._refine(events, lane, epoch)
                    if epoch != cp.epoch:
                        # the partitions were revoked while it was refined: its rows leave
                        # the state (which reloads from the tables) and its records replay
                        lane.proc.forget()
                    if ending is not None:
                        try:
                            await ending  # the previous group's end; raises its failure here
                        except BaseException:
                            end.close()  # this group's end never starts: its records stay unacked
                            raise
                    ending = self.ends.start(self._acked(lane, events, end, saves, epoch))
                    cp.clean = True
            finally:
                # a stop or a crash lets the last group end first; a stop (the state that of
                # whole groups) writes a last checkpoint and acks them
                if ending is not None:
                    await self.save_now(lane)

    async def _refine(self, events: list[Any], lane: Lane, epoch: int) -> tuple[End, bool]:
        """Refine a group and hand its outputs to the producer; returns the coroutine that
        ends the group (wait for the outputs' acknowledgements, then write the state when a
        checkpoint is due) and whether it writes one."""
        progress, cp = self.progress, lane.cp
        progress.last_group_started = time.monotonic()
        if not progress.groups and not self.feed.wait_caught_up(0):
            # the first group waits for the topology and jobs to be read whole: no sample is
            # enriched against a half-loaded view (and no join index rebuilt for each part)
            await asyncio.get_running_loop().run_in_executor(None, self.feed.wait_caught_up, 60)
        with self.telemetry.span("refine.group", {"records": len(events)}):
            sent = await self._refine_chunks(events, lane)
            # a checkpoint's state is encoded now (the next group changes this refiner's
            # state) and sent only once the outputs of its groups are acknowledged
            changelog = lane.take() if cp.due() and cp.epoch == epoch else None
        progress.groups += 1
        progress.records += len(events)
        progress.last_group_done = time.monotonic()
        if self.gc_pacer.maybe():  # between groups: the one full collection it takes
            self.telemetry.record("worker.gc_settle_s", self.gc_pacer.last_pause_s, unit="s")
        return self._end(sent, changelog), changelog is not None

    async def _refine_chunks(self, events: list[Any], lane: Lane) -> list[Delivery]:
        now = time.time_ns()
        sent: list[Delivery] = []
        tally = GroupTally()
        step = self.cfg.refine_chunk
        for lo in range(0, len(events), step):
            chunk, recs = await self.guard.with_skipped(events[lo : lo + step])
            pending: list[OutMessage] = []
            for ev, rec, out in zip(chunk, recs, lane.proc.process_group(recs, now), strict=True):
                # past the dead-letter limit this raises: the chunk's outputs are never sent,
                # the group never acked, the worker stops
                lane.dead_letters.submit(out, rec)
                tally.add(out, rec)
                pending += out.messages
                if out.stream is not None:
                    lane.cp.changed(out.stream, ev)
            # librdkafka sends a chunk's outputs while the next chunk is refined
            sent.append(await self.outputs.enqueue(pending))
            await asyncio.sleep(0)  # let heartbeats and fetches run
        tally.report(self.telemetry)
        return sent

    async def _end(self, sent: list[Delivery], changelog: list[OutMessage] | None) -> None:
        await self.outputs.wait(sent)  # outputs acknowledged first
        if changelog is not None:  # then the state; the caller acks the groups after
            await self.outputs.publish(changelog)

    async def _acked(
        self, lane: Lane, events: list[Any], end: End, saves: bool, epoch: int
    ) -> None:
        cp = lane.cp
        await end
        if epoch != cp.epoch:  # revoked meanwhile: no checkpoint holds this group, it replays
            return
        cp.ended += events
        if saves:  # the checkpoint covers this group and every one before it
            done, cp.ended = cp.ended, []
            for ev in done:
                await cp.stream.ack(ev)

    async def save_now(self, lane: Lane) -> None:
        """Write the state and ack every group refined so far, when the state is that after
        whole groups whose ends are all done (a stop, a revocation, input pausing);
        otherwise leave them to a later checkpoint or to replay."""
        cp, ends = lane.cp, self.ends
        await ends.settle()
        if not (cp.clean and ends.idle and ends.error is None and cp.waiting()):
            return
        changelog = lane.take()
        events, cp.ended = cp.ended, []
        await self.outputs.publish(changelog)
        for ev in events:
            await cp.stream.ack(ev)

    async def checkpoint_paused(self) -> None:
        """Input paused: the last groups are written and acked without waiting for more."""
        for lane in self.lanes:
            cp = lane.cp
            if cp.clean and self.ends.idle and cp.waiting() and cp.due():
                await self.save_now(lane)

    async def revoked(self, _partitions: set[Any]) -> None:
        """Another worker may own the partitions now: the groups refined so far end first
        (outputs, state, acks), so that their offsets commit now and none of them is replayed
        there (unless one was being refined: then those not in a checkpoint replay)."""
        for lane in self.lanes:
            await self.save_now(lane)
        for lane in self.lanes:
            lane.cp.drop()
        for lane in self.lanes:
            lane.proc.forget()  # state must come back from the tables
        self.guard.forget()  # the next assignment starts from the committed offsets
