"""Detect's runner: the agent's groups, the warm-up of newly assigned partitions, the tick, the
final flush and ``/health``, around one :class:`~services.detect.core.DetectCore` (see
:mod:`services.detect.agent` for the contract). Everything it publishes, and every record it
acks, goes through its :class:`~services.detect.checkpoint.Checkpoint`, the one place detect
commits an offset."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import faust
from faust.types import TP

from services.detect.checkpoint import Checkpoint
from services.detect.core import DetectCore, read_topics
from services.detect.detector import Emitted
from services.detect.progress_feed import ProgressFeed
from services.detect.warmup import warm_up
from services.gc_pacer import GcPacer
from services.heap import trimmer
from services.kafka.feed import TopologyFeed
from services.kafka.group import Progress
from services.kafka.outputs import OutMessage
from services.telemetry import ServiceTelemetry

log = logging.getLogger(__name__)

Partition = tuple[str, int]


@dataclass(frozen=True)
class DetectConfig:
    group: str = "refinery-detect"  # the Faust app id, hence the consumer group
    lookback_s: float = 600.0
    idle_exit_s: float | None = None
    web_port: int | None = None  # /health and /metrics on web_host (None: off)
    web_host: str = "127.0.0.1"  # the bind address (a pod's IP where probes call it)
    data_dir: Path = Path(".refinery/detect")
    # records a group takes at most. A smaller bound would hold fewer records and tables at
    # once when the process reads faster than records come (a backlog, the start), but it
    # counts records, not samples: replayed, 128 took 0.68-1.02 M samples/CPU-s at 24-192
    # simulated nodes against 500's 1.09-1.44 M, for a peak RSS at the live load of 64 nodes
    # of 407 MiB against 470-500
    take_max: int = 500
    # how long a group waits to fill (take_max records) before it is judged: alerts wait up
    # to this much longer. A group's fixed cost (~100 Arrow calls over its rules, rollups and
    # episodes) is paid per group: at a live load well below a replica's capacity, groups of
    # 0.2 s of input replayed at ~550 k samples/CPU-s, of 1.7 s at ~830 k; a replica near its
    # capacity fills its groups to take_max and pays it per 500 records whatever this is
    take_within_s: float = 0.2
    tick_s: float = 1.0
    # how often the free pages of glibc's heap go back to the system (services.heap.trimmer):
    # at 64 simulated nodes the process then settled at 254-260 MiB instead of 344-377, for
    # the same CPU (6.2-6.4 against 6.3-6.7 CPU-s over the same input, two runs each)
    trim_every_s: float = 1.0
    warmup_stall_s: float = 60.0  # warm-up reads nothing this long: crash
    stall_after_s: float = 30.0  # /health: a group in flight this long is unhealthy
    gc_settle_every_s: float = 600.0  # full garbage collections on this schedule (GcPacer)


@dataclass
class _State:
    owned: set[Partition] = field(default_factory=set)
    next_offset: dict[Partition, int] = field(default_factory=dict)  # next to feed
    warmups: int = 0  # warm-ups under way
    last_data: float = field(default_factory=time.monotonic)
    flushed: bool = False
    skipped: int = 0  # records at offsets already fed, or of partitions no longer owned
    refetched: int = 0  # records after an offset jump, fetched directly


class DetectRunner:
    def __init__(
        self,
        app: faust.App,
        conf: dict[str, Any],
        core: DetectCore,
        feed: TopologyFeed,
        progress_feed: ProgressFeed,
        checkpoint: Checkpoint,
        telemetry: ServiceTelemetry,
        cfg: DetectConfig,
    ) -> None:
        self.app, self.conf, self.core, self.feed = app, conf, core, feed
        self.progress_feed = progress_feed
        self.checkpoint, self.telemetry, self.cfg = checkpoint, telemetry, cfg
        self.state = _State()
        self.progress = Progress()
        # primed when the agent starts (the long first settle before any record waits), then
        # again after the first group
        self.gc_pacer = GcPacer(cfg.gc_settle_every_s)
        self._trim = trimmer()  # free heap pages back to the system, every trim_every_s
        self._trimmed = time.monotonic()
        self.lock = asyncio.Lock()  # one user of the detector at a time, outputs in order
        self.ready = asyncio.Event()  # set while no warm-up is under way
        self.inputs = set(read_topics(core.topics))
        # the detector's one thread (one user at a time anyway): its allocations stay in one
        # thread's heaps, which keep what they freed (services.heap), instead of in those
        # of whichever of the loop's pool threads ran a group
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="detect")

    def _high(self, p: int) -> int:
        try:
            h = self.app.consumer.highwater(TP(self.core.topics.refined, p))
        except Exception:  # not assigned (any more), or not started
            return -1
        return -1 if h is None else int(h)

    def _advanced(self, out: Emitted, now: int) -> list[OutMessage]:
        """``out`` and what the watermark makes due, after this replica's progress record
        (applied to its view first: its collectives are judged on it), as records."""
        marker = self.core.progress(self._high, now)
        wm = self.core.watermark(self._high)
        if wm is not None:
            out.extend(self.core.detector.advance(wm, now))
        return self.core.messages(out) + ([marker] if marker is not None else [])

    async def run(self, stream: Any) -> None:
        """The agent's body: per group, route its records to the detector and commit the
        group (:meth:`Checkpoint.commit`: what came out published and acknowledged, then the
        records acked)."""
        progress, telemetry, cp = self.progress, self.telemetry, self.checkpoint
        if self.gc_pacer.prime():
            telemetry.record("detect.gc_settle_s", self.gc_pacer.last_pause_s, unit="s")
        async with cp.groups(stream, self.cfg.take_max, self.cfg.take_within_s) as groups:
            async for events in groups:
                await self.ready.wait()
                progress.last_group_started = time.monotonic()
                async with self.lock:
                    with telemetry.span("detect.group", {"records": len(events)}):
                        await cp.commit(events, await self._route(events))
                progress.groups += 1
                progress.records += len(events)
                progress.last_group_done = self.state.last_data = time.monotonic()
                if self.gc_pacer.maybe():  # between groups: the one full collection it takes
                    telemetry.record("detect.gc_settle_s", self.gc_pacer.last_pause_s, unit="s")

    async def _route(self, events: list[Any]) -> list[OutMessage]:
        """Feed a group of events to the detector; the records to publish."""
        state, core = self.state, self.core
        core.sync_topology(self.feed)
        now = time.time_ns()
        todo: list[tuple[str, int, int, bytes]] = []
        for ev in events:
            m = ev.message
            tp = (m.topic, m.partition)
            nxt = state.next_offset.get(tp)
            if tp not in state.owned or (nxt is not None and m.offset < nxt):
                state.skipped += 1
                continue
            if nxt is not None and m.offset > nxt:  # records skipped: declared a gap
                for g in await self.checkpoint.fetch_skipped(m.topic, m.partition, nxt, m.offset):
                    state.refetched += 1
                    todo.append((m.topic, m.partition, g.offset(), g.value()))
            todo.append((m.topic, m.partition, m.offset, m.value))
            state.next_offset[tp] = m.offset + 1
        # in a thread: a group's evaluation is one long Arrow call sequence, and the loop
        # meanwhile serves fetches, sends, heartbeats and the web page
        loop = asyncio.get_running_loop()
        out = await loop.run_in_executor(self.pool, core.route_group, todo, now)
        return self._advanced(out, now)

    async def assigned(self, assigned: set[TP]) -> None:
        """Partitions newly assigned are warmed up in the background (the rebalance
        completes); the agent holds its records back until that is done."""
        state = self.state
        mine = {(tp.topic, tp.partition) for tp in assigned if tp.topic in self.inputs}
        new = sorted(mine - state.owned)
        state.owned = mine
        self.core.own(mine)
        for tp in list(state.next_offset):
            if tp not in mine:
                del state.next_offset[tp]
        if not new:
            return
        self.ready.clear()
        state.warmups += 1
        keep = [p for t, p in mine if t == self.core.topics.refined and (t, p) not in new]
        self.app.add_future(self._warm_up(new, keep))

    async def _warm_up(self, parts: list[Partition], keep: list[int]) -> None:
        loop, core, cfg = asyncio.get_running_loop(), self.core, self.cfg
        try:
            async with self.lock:
                await loop.run_in_executor(None, self.feed.wait_caught_up, 60)
                await loop.run_in_executor(None, self.progress_feed.wait_caught_up, 60)
                core.sync_topology(self.feed)
                t0, n0 = time.monotonic(), core.stats["warmup"]
                spans, out = await loop.run_in_executor(
                    self.pool, warm_up, self.conf, cfg.group, core, parts, keep, cfg.lookback_s,
                    cfg.warmup_stall_s,
                )  # fmt: skip
                await self.checkpoint.publish(core.messages(out))
                for s in spans:
                    self.state.next_offset[(s.topic, s.partition)] = s.resume
                log.info(
                    "warm-up of %d partitions: %d records in %.1fs",
                    len(spans), core.stats["warmup"] - n0, time.monotonic() - t0,
                )  # fmt: skip
        finally:
            self.state.warmups -= 1
        if self.state.warmups == 0:
            self.state.last_data = time.monotonic()
            self.ready.set()

    async def tick(self) -> None:
        """Advance to the watermark and run the time-driven checks; stop after
        ``idle_exit_s`` without input."""
        if not self.ready.is_set() or self.state.flushed:
            return
        if self.progress_feed.error is not None:
            raise RuntimeError(f"progress feed failed: {self.progress_feed.error}")
        async with self.lock:
            self.core.sync_topology(self.feed)
            now = time.time_ns()
            msgs = self._advanced(Emitted(), now)  # the watermark first, then what it makes due
            pending = self.core.refined_pending(self._high)
            out = self.core.detector.tick(now, refined_pending=pending)
            await self.checkpoint.publish(msgs + self.core.messages(out))
        self.telemetry.gauge("detect.groups", self.progress.groups)
        if time.monotonic() - self._trimmed >= self.cfg.trim_every_s:
            self._trim()
            self._trimmed = time.monotonic()
        idle = time.monotonic() - self.state.last_data
        if self.cfg.idle_exit_s is not None and idle > self.cfg.idle_exit_s:
            log.info("no input for %.0fs: stopping", idle)
            await self._flush()
            signal.raise_signal(signal.SIGTERM)  # the worker's own clean stop

    async def _flush(self) -> None:
        if self.state.flushed:
            return
        self.state.flushed = True
        await asyncio.wait_for(self.lock.acquire(), 10)
        try:
            await self.checkpoint.publish(self.core.messages(self.core.detector.flush()))
        finally:
            self.lock.release()

    async def stopping(self) -> None:
        """Publish what the detector still holds, and stop the topology feed."""
        try:
            await self._flush()
        except Exception as e:  # stopping anyway; the next process warms up again
            log.warning("detect: final flush not published: %s", e)
        self.feed.stop()
        self.progress_feed.stop()
        self.pool.shutdown(wait=False)

    def health(self) -> tuple[dict[str, Any], bool]:
        """``/health``'s body, and whether detect is healthy (200; else 503)."""
        progress, state = self.progress, self.state
        ok = self.ready.is_set() and progress.healthy(self.cfg.stall_after_s)
        body = {
            "healthy": ok,
            "warm": self.ready.is_set(),
            "groups": progress.groups,
            "records": progress.records,
            "since_last_group_s": round(time.monotonic() - progress.last_group_done, 1),
            "stats": {
                **self.core.stats,
                "skipped": state.skipped,
                "refetched": state.refetched,
                "collectives_judged_early": self.core.detector.collectives.early,
            },
        }
        return body, ok
