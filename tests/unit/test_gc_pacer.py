"""GcPacer: full collections on a schedule, survivors frozen in between, and garbage among
once-frozen objects still collected at the next settle."""

from __future__ import annotations

import gc
import time
import weakref
from collections.abc import Iterator

import pytest

from services.gc_pacer import GcPacer


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> weakref.ref[_Node]:
    """A two-object reference cycle nothing else points to: only the collector frees it."""
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


@pytest.fixture(autouse=True)
def _unfrozen() -> Iterator[None]:
    yield
    gc.unfreeze()


def test_settle_collects_garbage_and_freezes_what_survives() -> None:
    dead = _cycle()
    alive = _Node()
    assert any(o is alive for o in gc.get_objects())  # tracked, in a collected generation
    pacer = GcPacer()
    t0 = time.perf_counter()
    pacer.settle()
    took = time.perf_counter() - t0
    assert dead() is None
    assert pacer.frozen == gc.get_freeze_count() > 0
    # the pause is the settle's own, measured: more than nothing, no more than the whole call
    assert pacer.settles == 1 and 0.0 < pacer.last_pause_s <= took
    # frozen: moved to the permanent generation, which no collection traverses
    assert not any(o is alive for o in gc.get_objects())


def test_garbage_among_frozen_objects_is_collected_at_the_next_settle() -> None:
    a = _Node()
    a.other = _Node()
    a.other.other = a
    ref = weakref.ref(a)
    pacer = GcPacer()
    pacer.settle()  # the cycle is alive: frozen
    del a
    gc.collect()
    assert ref() is not None  # frozen: a plain collection does not look at it
    pacer.settle()
    assert ref() is None


def test_settles_first_at_once_then_every_interval() -> None:
    now = [100.0]
    pacer = GcPacer(every_s=600.0, clock=lambda: now[0])
    assert pacer.maybe()
    assert not pacer.maybe()
    now[0] += 599.0
    assert not pacer.maybe()
    now[0] += 1.0
    assert pacer.maybe()
    assert pacer.settles == 2


def test_prime_settles_now_and_the_next_settle_only_adds_to_the_frozen_heap() -> None:
    now = [100.0]
    pacer = GcPacer(every_s=600.0, clock=lambda: now[0])
    a = _Node()
    a.other = _Node()
    a.other.other = a
    ref = weakref.ref(a)
    pacer.prime()  # the cycle is alive: frozen
    assert pacer.settles == 1
    del a  # garbage now, among the frozen objects
    made_after = _Node()  # what the first group builds
    assert any(o is made_after for o in gc.get_objects())
    assert pacer.maybe()  # due again at once, after the first group
    assert pacer.settles == 2
    assert not any(o is made_after for o in gc.get_objects())  # frozen too
    # that settle did not unfreeze: it left the frozen heap, garbage and all, untraversed
    assert ref() is not None
    assert not pacer.maybe()
    now[0] += 600.0
    assert pacer.maybe()  # the scheduled settle unfreezes first and collects it
    assert ref() is None
