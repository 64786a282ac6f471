"""The worker's commit contract (services/worker/checkpoint.py): a group's outputs are
acknowledged, then a checkpoint's state is produced, then its records are acked (what Faust
commits), in that order; nothing is acked when a step fails or the partitions moved."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from services.kafka.faust_app import App
from services.kafka.outputs import OutMessage
from services.worker.checkpoint import Checkpoint, GroupEnds


@dataclass(frozen=True)
class _Message:
    topic: str
    partition: int
    offset: int


@dataclass(frozen=True)
class _Event:
    message: _Message


def _ev(partition: int, offset: int) -> _Event:
    return _Event(_Message("telemetry.raw", partition, offset))


@dataclass
class _Outputs:
    """The output producer's seam: what it was asked to do, in order."""

    log: list[str]
    fail_publish: bool = False
    published: list[OutMessage] = field(default_factory=list)

    async def wait(self, sent: list[Any]) -> None:
        self.log.append(f"outputs {sent}")

    async def publish(self, messages: list[OutMessage]) -> None:
        if self.fail_publish:
            raise OSError("changelog not acknowledged")
        self.published += messages
        self.log.append(f"state {sorted(m.key for m in messages)}")


@dataclass
class _Stream:
    log: list[str]

    async def ack(self, ev: _Event) -> None:
        self.log.append(f"ack {ev.message.partition}@{ev.message.offset}")


class _Refiner:
    """The refiner's seam: the state changed since the last checkpoint."""

    def __init__(self) -> None:
        self.streams: dict[str, bytes] = {}
        self.nodes: dict[str, bytes] = {}

    def change(self, cp: Checkpoint, ev: _Event) -> None:
        self.streams["n1|node|0"], self.nodes["n1"] = b"s1", b"o1"
        cp.changed("n1|node|0", ev)

    def dirty_blobs(self) -> tuple[dict[str, bytes], dict[str, bytes]]:
        out = (self.streams, self.nodes)
        self.streams, self.nodes = {}, {}
        return out


def _checkpoint(
    tmp_path: Path, log: list[str], every_s: float = 0.0
) -> tuple[Checkpoint, _Refiner, Any]:
    app: Any = App("cp", broker="kafka://127.0.0.1:1", autodiscover=False,
                   datadir=str(tmp_path), store="memory://")  # fmt: skip
    streams = app.Table("streams", default=None, partitions=4, key_type=bytes, value_type=bytes)
    nodes = app.Table("nodes", default=None, partitions=4, key_type=bytes, value_type=bytes)
    ref = _Refiner()
    cp = Checkpoint(every_s, _Outputs(log), streams, nodes, ref.dirty_blobs)
    cp.stream = _Stream(log)
    return cp, ref, streams


def test_outputs_then_state_then_offsets(tmp_path: Path) -> None:
    log: list[str] = []
    cp, ref, streams = _checkpoint(tmp_path, log, every_s=3600)
    first, second = [_ev(1, 7), _ev(2, 3)], [_ev(1, 8)]
    ref.change(cp, first[1])

    async def run() -> None:
        await cp.end_group(first, ["d1"], None, cp.epoch)  # no checkpoint due: nothing acked
        assert cp.offsets() == {("telemetry.raw", 1): 8, ("telemetry.raw", 2): 4}
        changelog = cp.take()  # due (the first one): the state after both groups
        await cp.end_group(second, ["d2"], changelog, cp.epoch)

    asyncio.run(run())
    assert log == [
        "outputs ['d1']",
        "outputs ['d2']",
        "state [b'n1', b'n1|node|0']",
        "ack 1@7",
        "ack 2@3",
        "ack 1@8",
    ]
    assert cp.offsets() == {} and not cp.waiting()
    # the state went to the tables, and its records to the partition of the record that
    # changed it, on the tables' changelog topics
    assert streams[b"n1|node|0"] == b"s1"
    published = cp._outputs.published  # type: ignore[attr-defined]
    assert {(m.topic, m.partition) for m in published} == {
        ("cp-streams-changelog", 2),
        ("cp-nodes-changelog", 2),
    }


def test_a_failed_state_write_acks_nothing_and_no_later_commit_does(tmp_path: Path) -> None:
    log: list[str] = []
    cp, ref, _ = _checkpoint(tmp_path, log)
    cp._outputs.fail_publish = True  # type: ignore[attr-defined]
    ref.change(cp, _ev(0, 1))
    ends = GroupEnds(settle_s=5.0)

    async def run() -> None:
        ends.start(cp.end_group([_ev(0, 1)], ["d"], cp.take(), cp.epoch))
        await ends.settle()
        await cp.commit_now(ends)  # the end failed: no commit, whatever is waiting

    asyncio.run(run())
    assert isinstance(ends.error, OSError)
    assert not [line for line in log if line.startswith("ack")]


def test_records_of_revoked_partitions_are_never_acked(tmp_path: Path) -> None:
    log: list[str] = []
    cp, ref, _ = _checkpoint(tmp_path, log, every_s=3600)
    epoch = cp.epoch

    async def run() -> None:
        ref.change(cp, _ev(0, 1))
        await cp.end_group([_ev(0, 1)], ["d"], None, epoch)
        cp.drop()  # revoked: the next owner replays them (the refiner forgets its state)
        ref.dirty_blobs()
        await cp.end_group([_ev(0, 2)], ["d"], cp.take(), epoch)  # began before the revocation
        await cp.commit_now(GroupEnds(settle_s=1.0))

    asyncio.run(run())
    assert not [line for line in log if line.startswith("ack")]


def test_commit_now_waits_for_whole_groups(tmp_path: Path) -> None:
    log: list[str] = []
    cp, ref, _ = _checkpoint(tmp_path, log, every_s=3600)
    ends = GroupEnds(settle_s=1.0)

    async def run() -> None:
        ref.change(cp, _ev(0, 1))
        await cp.end_group([_ev(0, 1)], ["d"], None, cp.epoch)
        cp.clean = False  # a group is being refined: its rows are in the state
        await cp.commit_now(ends)
        assert log == ["outputs ['d']"]
        cp.clean = True  # its end started: the state is that after whole groups
        await cp.commit_now(ends)

    asyncio.run(run())
    assert log == ["outputs ['d']", "state [b'n1', b'n1|node|0']", "ack 0@1"]


@pytest.mark.parametrize("every_s", [0.0, 3600.0])
def test_commit_if_due_commits_only_when_due(tmp_path: Path, every_s: float) -> None:
    log: list[str] = []
    cp, ref, _ = _checkpoint(tmp_path, log, every_s=every_s)
    cp.saved_at = time.monotonic()  # a checkpoint was just taken

    async def run() -> None:
        ref.change(cp, _ev(0, 1))
        await cp.end_group([_ev(0, 1)], ["d"], None, cp.epoch)
        await cp.commit_if_due(GroupEnds(settle_s=1.0))

    asyncio.run(run())
    assert ("ack 0@1" in log) == (every_s == 0.0)
