"""The group runner: how an agent's groups of records are consumed, refined and handed to
the checkpoint that produces and commits them (:mod:`services.worker.checkpoint`, the one
place an offset is committed).

Per group (``noack_take``, whose events only the checkpoint acks): fill the gaps the stream
left (:class:`~services.worker.gaps.GapGuard`), refine it in chunks (each handed to the first
step of the agent's refining chain, :mod:`services.worker.refiner`), pass each record's outcome
through the dead-letter limit (:class:`~services.worker.guard.DeadLetterStep`), hand each
chunk's outputs to the output producer, then start the group's end
(:meth:`Checkpoint.end_group <services.worker.checkpoint.Checkpoint.end_group>`) while the
next group is refined. The ends run one at a time, in group order; a group that failed is
never acked and the next owner replays it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from services.gc_pacer import GcPacer
from services.kafka.feed import TopologyFeed
from services.kafka.group import Progress, manual_acks
from services.kafka.outputs import Delivery, OutMessage, OutputProducer
from services.telemetry import ServiceTelemetry
from services.worker.checkpoint import Checkpoint, GroupEnds
from services.worker.config import WorkerConfig
from services.worker.gaps import GapGuard
from services.worker.guard import DeadLetterStep
from services.worker.refiner import Refiner
from services.worker.tally import GroupTally


@dataclass
class Lane:
    """One agent's refining: its refiner, its checkpoint (which writes the refiner's state to
    the agent's tables) and its dead-letter limit."""

    proc: Refiner
    cp: Checkpoint
    dead_letters: DeadLetterStep


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
        broker never acknowledged. Here a group is acked only by its checkpoint, once it is
        done. Its end runs while the next group is refined: the refining thread does not sit
        idle through the broker round trips."""
        cp = lane.cp
        ending: asyncio.Task[None] | None = None
        cp.stream = stream
        if self.gc_pacer.prime():
            self.telemetry.record("worker.gc_settle_s", self.gc_pacer.last_pause_s, unit="s")
        async with manual_acks(stream, self.cfg.take_max, self.cfg.take_within_s) as groups:
            try:
                async for events in groups:
                    epoch, cp.clean = cp.epoch, False
                    sent, changelog = await self._refine(events, lane, epoch)
                    end = cp.end_group(events, sent, changelog, epoch)
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
                    ending = self.ends.start(end)
                    cp.clean = True
            finally:
                # a stop or a crash lets the last group end first; a stop (the state that of
                # whole groups) writes a last checkpoint and acks them
                if ending is not None:
                    await cp.commit_now(self.ends)

    async def _refine(
        self, events: list[Any], lane: Lane, epoch: int
    ) -> tuple[list[Delivery], list[OutMessage] | None]:
        """Refine a group and hand its outputs to the producer; returns their deliveries and,
        when a checkpoint is due, its state (:meth:`Checkpoint.take`)."""
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
            changelog = cp.take() if cp.due() and cp.epoch == epoch else None
        progress.groups += 1
        progress.records += len(events)
        progress.last_group_done = time.monotonic()
        if self.gc_pacer.maybe():  # between groups: the one full collection it takes
            self.telemetry.record("worker.gc_settle_s", self.gc_pacer.last_pause_s, unit="s")
        return sent, changelog

    async def _refine_chunks(self, events: list[Any], lane: Lane) -> list[Delivery]:
        now = time.time_ns()
        sent: list[Delivery] = []
        tally = GroupTally()
        step = self.cfg.refine_chunk
        for lo in range(0, len(events), step):
            chunk, recs = await self.guard.with_skipped(events[lo : lo + step])
            pending: list[OutMessage] = []
            # the refining chain's first step (decode → refine → waves → outputs) hands back
            # each record's outcome
            outs = lane.proc.decode.submit(recs, now)
            for ev, rec, out in zip(chunk, recs, outs, strict=True):
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

    async def checkpoint_paused(self) -> None:
        """Input paused: the last groups are committed without waiting for more."""
        for lane in self.lanes:
            await lane.cp.commit_if_due(self.ends)

    async def revoked(self, _partitions: set[Any]) -> None:
        """Another worker may own the partitions now: the groups refined so far end first
        (outputs, state, acks), so that their offsets commit now and none of them is replayed
        there (unless one was being refined: then those not in a checkpoint replay)."""
        for lane in self.lanes:
            await lane.cp.commit_now(self.ends)
        for lane in self.lanes:
            lane.cp.drop()
        for lane in self.lanes:
            lane.proc.forget()  # state must come back from the tables
        self.guard.forget()  # the next assignment starts from the committed offsets
