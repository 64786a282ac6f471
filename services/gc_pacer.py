"""When the stream processors let Python's cyclic garbage collector look at the whole heap.

CPython runs a full (generation 2) collection whenever the long-lived objects have grown by a
quarter since the last one. In the worker that was every ~8 s at 182 k samples/s, and each
traversed everything the process holds (Faust, aiokafka, pydantic models, the catalog, the
refiner's per-stream state): 60-150 ms with the refining thread stopped, measured with
``gc.callbacks``, in the tail of every freshness figure. Almost none of it is garbage: those
collections freed 0-60 objects, once 1,134.

:class:`GcPacer` collects everything once and freezes the survivors (``gc.freeze``: the
collector skips them from then on), first once the process is warm, then every
``every_s`` seconds, unfreezing first, so that garbage among once-frozen objects is still
collected then and nothing is kept for good. Between two of these, collections look only at
objects created since the last. The caller runs :meth:`GcPacer.maybe` between groups, on the
thread that refines; the pause it takes (one full collection) is reported. :meth:`GcPacer.prime`
takes the first, long one before the process reads any data.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class GcPacer:
    """Full collections on a schedule instead of on heap growth. Not thread-safe."""

    def __init__(self, every_s: float = 600.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s = every_s
        self._clock = clock
        self._next: float | None = None  # None: not settled yet
        self.settles = 0
        self.last_pause_s = 0.0
        self.frozen = 0
        self._primed = False  # the next settle need not unfreeze (see prime)

    def due(self) -> bool:
        return self._next is None or self._clock() >= self._next

    def maybe(self) -> bool:
        """Settle the heap if it is time; True if it did."""
        if not self.due():
            return False
        self.settle(unfreeze=not self._primed)
        self._primed = False
        return True

    def prime(self) -> bool:
        """Unless it has settled before (True if it settles now): settle now, before any
        data comes, and once more at the next :meth:`maybe`
        without unfreezing: the first settle of a fresh process traverses all it has loaded
        (~120-190 ms in the worker), which had stopped the worker's first group with records
        waiting; the next one collects only what was made since (what the first group built,
        the refiner's caches and state among it) and freezes it too."""
        if self.settles:
            return False
        self.settle()
        self._next = None
        self._primed = True
        return True

    def settle(self, unfreeze: bool = True) -> None:
        """Unfreeze (unless told not to), collect everything, freeze what survived."""
        t0 = time.perf_counter()
        if unfreeze:
            gc.unfreeze()
        gc.collect()
        gc.freeze()
        self.last_pause_s = time.perf_counter() - t0
        self.frozen = gc.get_freeze_count()
        self.settles += 1
        self._next = self._clock() + self.every_s
        log.info("heap settled in %.3f s: %d objects frozen", self.last_pause_s, self.frozen)
