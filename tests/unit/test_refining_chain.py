"""One raw record walks the worker's refining chain forward, decode → refine → waves →
outputs, and never comes back to the refiner (which only wires the chain): the steps it
enters are in chain order, each one entered after the last, and what comes out is what the
refiner hands back for it."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from schemas.topics import TOPICS, Topics
from services.worker.outcomes import OutputsStep
from services.worker.refiner import Outcome, OutputLimits, RawRecord, Refiner
from services.worker.refiner_outputs import Group
from tests.unit.test_guard import _rec
from tests.unit.test_refine import CAT, NOW, TOPO, S

CHAIN = ["decoding.py", "refining.py", "waves.py", "outcomes.py"]  # the steps, in order


def _refiner() -> Refiner:
    return Refiner(CAT, TOPICS, lambda: TOPO, lambda _: None, lambda _: None)


def _walk(run: Callable[[], Any]) -> list[str]:
    """The worker files whose functions ``run`` enters, in order (a file once per stretch;
    ``join``, the group's end, left out: it follows every record of the group)."""
    files: list[str] = []

    def profile(frame: FrameType, event: str, _arg: object) -> None:
        path = Path(frame.f_code.co_filename)
        if event != "call" or path.parent.name != "worker" or frame.f_code.co_name == "join":
            return
        if not files or files[-1] != path.name:
            files.append(path.name)

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return files


def _forward(files: list[str]) -> list[str]:
    """The chain steps among ``files``, asserting each is entered once, in chain order."""
    steps: list[str] = []
    for f in files:
        if f in CHAIN and (not steps or steps[-1] != f):
            steps.append(f)
    assert steps == sorted(set(steps), key=CHAIN.index), steps
    return steps


def test_a_samples_record_walks_forward_through_every_step() -> None:
    ref = _refiner()
    rec = _rec(1, 10, rows=3)
    got: list[Outcome] = []
    files = _walk(lambda: got.extend(ref.decode.submit([rec], NOW + 60 * S)))
    assert _forward(files) == CHAIN
    assert "refiner.py" not in files
    # what the chain hands back is the refiner's outcome of that record
    (out,) = got
    want = _refiner().process(rec, NOW + 60 * S)
    assert out == want and out.outcome == "refined" and out.refined == 3
    topics = [m.topic for m in out.messages]
    assert topics == ["telemetry.refined", "telemetry.accounting"]


def test_a_rejected_or_replayed_record_goes_straight_to_the_outputs_step() -> None:
    ref = _refiner()
    bad = RawRecord("telemetry.raw", 0, 9, b"n1", b"not a batch", [], NOW // 1_000_000)
    files = _walk(lambda: ref.decode.submit([bad], NOW))
    assert _forward(files) == ["decoding.py", "outcomes.py"]
    rec = _rec(1, 10)
    ref.decode.submit([rec], NOW)
    replay: list[Outcome] = []
    files = _walk(lambda: replay.extend(ref.decode.submit([rec], NOW)))
    assert _forward(files) == ["decoding.py", "outcomes.py"]
    assert [o.outcome for o in replay] == ["replay"]


class _Recording(OutputsStep):
    """The outputs step, saying which of its entries each record came in by."""

    def __init__(self, topics: Topics, limits: OutputLimits) -> None:
        super().__init__(topics, limits)
        self.entries: list[tuple[str, int]] = []

    def reject(self, group: Group, i: int, *args: Any) -> None:
        self.entries.append(("reject", i))
        super().reject(group, i, *args)

    def replay(self, group: Group, i: int, *args: Any) -> None:
        self.entries.append(("replay", i))
        super().replay(group, i, *args)

    def samples(self, group: Group, i: int, *args: Any) -> None:
        self.entries.append(("samples", i))
        super().samples(group, i, *args)


def test_each_record_of_a_group_reaches_the_outputs_step_once_in_its_slot() -> None:
    ref = _refiner()
    rec = _rec(1, 10)
    ref.process(rec, NOW)
    # the same chain as the refiner's, its last step recording (a seam, not a patch)
    from services.worker.decoding import DecodeStep
    from services.worker.refining import RefineStep
    from services.worker.waves import WaveStep

    outputs = _Recording(ref.topics, ref.limits)
    waves = WaveStep(ref.topics, outputs, ref.limits)
    refine = RefineStep(CAT, lambda: TOPO, ref.settings, ref.state, waves, outputs)
    chain = DecodeStep(None, ref.state, refine, outputs)
    bad = RawRecord("telemetry.raw", 0, 12, b"n1", b"\x00", [], NOW // 1_000_000)
    outs = chain.submit([_rec(2, 11), rec, bad, _rec(3, 13)], NOW + 60 * S)
    assert [o.outcome for o in outs] == ["refined", "replay", "deadletter", "refined"]
    assert sorted(outputs.entries, key=lambda e: e[1]) == [
        ("samples", 0), ("replay", 1), ("reject", 2), ("samples", 3),
    ]  # fmt: skip
