"""The worker's watch (every 5 s: a failed feed or group end, or committed offsets that stand
still while input waits, crash the worker; telemetry gauges) and what ``/health`` answers."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import faust

from pipelines.refine.dedupe import SeqWindow
from services.kafka.feed import TopologyFeed
from services.kafka.watch import CommitWatch
from services.telemetry import ServiceTelemetry
from services.worker.gaps import GapGuard
from services.worker.groups import GroupRunner

log = logging.getLogger(__name__)


class WorkerWatch:
    def __init__(
        self,
        app: faust.App,
        inputs: set[str],
        runner: GroupRunner,
        commits: CommitWatch,
        guard: GapGuard,
        feed: TopologyFeed,
        telemetry: ServiceTelemetry,
        stall_after_s: float,
    ) -> None:
        self._app = app
        self._inputs = inputs
        self._runner = runner
        self._commits = commits
        self._guard = guard
        self._feed = feed
        self._telemetry = telemetry
        self._stall_after_s = stall_after_s

    async def watch(self) -> None:
        """Raise (the worker crashes, non-zero) on a failure no agent raises; reread every
        partition whose commits stood still ``stall_after_s``, crash at twice that."""
        progress, commits = self._runner.progress, self._commits
        if self._feed.error is not None:
            raise RuntimeError(f"topology feed failed: {self._feed.error}")
        if self._runner.ends.error is not None:  # no next group came to raise it
            raise RuntimeError(f"a refined group did not end: {self._runner.ends.error}")
        owned = [(tp.topic, tp.partition) for tp in self._app.consumer.assignment()
                 if tp.topic in self._inputs]  # fmt: skip
        try:
            stalled = await asyncio.get_running_loop().run_in_executor(None, commits.check, owned)
        except Exception as e:  # the broker did not answer: not evidence of a stall
            log.warning("commit watch: %s", e)
            stalled = 0.0
        progress.commit_stalled_s = stalled
        # every partition stalled that long is read again, not only the worst: after a
        # restart on a backlog several may be (tens of them with 64 raw partitions)
        for tp in commits.stalled(self._stall_after_s) if stalled > self._stall_after_s else []:
            await self._guard.reread(tp)
        t = self._telemetry
        t.gauge("worker.groups", progress.groups)
        t.gauge("worker.lag", commits.lag)
        t.gauge("worker.seq_gaps_forgotten", SeqWindow.forgotten_total)
        t.gauge("worker.healthy", 1.0 if progress.healthy(self._stall_after_s) else 0.0)
        if stalled > 2 * self._stall_after_s:
            raise RuntimeError(
                f"no commit progress on {commits.stalled_partition} for {stalled:.0f}s"
                f" ({commits.lag} records waiting in all)"
            )

    def health(self) -> tuple[dict[str, Any], bool]:
        """``/health``'s body, and whether the worker is healthy (200; else 503)."""
        progress, commits = self._runner.progress, self._commits
        ok = progress.healthy(self._stall_after_s)
        stalled_s = progress.commit_stalled_s
        body = {
            "healthy": ok,
            "groups": progress.groups,
            "records": progress.records,
            "since_last_group_s": round(time.monotonic() - progress.last_group_done, 1),
            "commit_stalled_s": round(progress.commit_stalled_s, 1),
            "lag": commits.lag,
            "stalled_partition": list(commits.stalled_partition or ()) if stalled_s else None,
        }
        return body, ok
