"""Detect's commit contract (services/detect/checkpoint.py): a group's outputs are acknowledged,
then its records are acked (what Faust commits), in that order; nothing is acked when the
outputs fail; records the stream skipped are fetched and declared a gap, so Faust's commits
move past them once the group after them is acked."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from faust.types import TP

from services.detect.checkpoint import Checkpoint
from services.kafka.faust_app import App
from services.kafka.outputs import OutMessage


@dataclass(frozen=True)
class _Message:
    topic: str
    partition: int
    offset: int


@dataclass(frozen=True)
class _Event:
    message: _Message


@dataclass
class _Outputs:
    """The output producer's seam: what it was asked to publish, in order."""

    log: list[str]
    fail: bool = False

    async def publish(self, messages: list[OutMessage]) -> None:
        if self.fail:
            raise OSError("not acknowledged")
        self.log.append(f"publish {[m.key for m in messages]}")


@dataclass
class _Stream:
    """Faust's stream seam: ``noack_take`` groups and acks."""

    log: list[str]
    groups: list[list[_Event]] = field(default_factory=list)
    enable_acks: bool = True

    def noack_take(self, take_max: int, within: float) -> AsyncIterator[list[_Event]]:
        async def gen() -> AsyncIterator[list[_Event]]:
            for g in self.groups:
                yield g

        return gen()

    async def ack(self, ev: _Event) -> None:
        self.log.append(f"ack {ev.message.offset}")


def _checkpoint(tmp_path: Path, outputs: _Outputs, fetch: Any = None) -> Checkpoint:
    app = App("detect-cp", broker="kafka://127.0.0.1:1", autodiscover=False,
              datadir=str(tmp_path), store="memory://")  # fmt: skip
    if fetch is None:
        return Checkpoint(app, {}, outputs)  # type: ignore[arg-type]
    return Checkpoint(app, {}, outputs, fetch)  # type: ignore[arg-type]


def _msg(key: bytes) -> OutMessage:
    return OutMessage("telemetry.alerts", key, b"v")


def test_a_group_is_acked_only_after_its_outputs_are_acknowledged(tmp_path: Path) -> None:
    log: list[str] = []
    cp = _checkpoint(tmp_path, _Outputs(log))
    stream = _Stream(log, groups=[[_Event(_Message("telemetry.refined", 0, o)) for o in (4, 5)]])

    async def run() -> None:
        async with cp.groups(stream, 10, 0.1) as groups:
            async for events in groups:
                await cp.commit(events, [_msg(b"a1")])
        await cp.publish([_msg(b"tick")])  # time-driven: published, nothing acked

    asyncio.run(run())
    assert log == ["publish [b'a1']", "ack 4", "ack 5", "publish [b'tick']"]
    assert stream.enable_acks is False  # the stream acks nothing by itself after the groups


def test_nothing_is_acked_when_the_outputs_fail(tmp_path: Path) -> None:
    log: list[str] = []
    cp = _checkpoint(tmp_path, _Outputs(log, fail=True))
    stream = _Stream(log, groups=[[_Event(_Message("telemetry.refined", 0, 4))]])

    async def run() -> None:
        async with cp.groups(stream, 10, 0.1) as groups:
            async for events in groups:
                await cp.commit(events, [_msg(b"a1")])

    with pytest.raises(OSError):
        asyncio.run(run())
    assert log == []
    assert stream.enable_acks is False


def test_records_the_stream_skipped_are_fetched_and_declared_a_gap(tmp_path: Path) -> None:
    asked: list[tuple[str, int, int, int]] = []

    def fetch(conf: dict[str, Any], topic: str, p: int, start: int, end: int) -> list[Any]:
        asked.append((topic, p, start, end))
        return [f"record {o}" for o in range(start, end)]

    cp = _checkpoint(tmp_path, _Outputs([]), fetch)
    consumer: Any = cp._app.consumer
    tp = TP("telemetry.refined", 0)

    async def run() -> tuple[list[Any], int | None]:
        got = await cp.fetch_skipped("telemetry.refined", 0, 11, 15)
        consumer._acked[tp] = [10, 15]  # the events on either side, acked by their groups
        return got, consumer._new_offset(tp)

    got, committable = asyncio.run(run())
    assert asked == [("telemetry.refined", 0, 11, 15)]
    assert got == [f"record {o}" for o in range(11, 15)]
    assert committable == 16  # past the fetched records, not stalled at 11
