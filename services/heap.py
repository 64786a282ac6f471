"""Allocator settings for the streaming services: glibc's heap and Arrow's mimalloc pages.

Their messages are hundreds of kilobytes (a refined message, a fetch response), and every one
is copied into a fresh allocation: librdkafka copies each produced value, Python reads each
fetch into new ``bytes``. glibc serves an allocation over its mmap threshold (128 KiB, raised
only after a freed mapping) with a new ``mmap`` whose pages fault in one by one, and returns
freed memory at the top of the heap to the system past 128 KiB, to fault in again on the next
message. :func:`keep_heap` serves allocations up to 32 MiB from the heap and keeps up to 1 GiB
of freed heap: the process keeps its high-water heap instead of paying page faults per message
(produce of a 190 KB value: ~130 → ~45 µs measured here). Off glibc it does nothing.

Arrow's buffers do not come from glibc: pyarrow's default pool is mimalloc, which purges
(decommits) freed pages 10 ms after they empty. The refiner frees and allocates hundreds of
megabytes of Arrow buffers a second (a wave's tables, every refined message's IPC bytes), so
the next allocation faulted those pages in again and the kernel zeroed each one (perf over the
in-process refiner: 8 % of its time in ``clear_page_erms``, half of it under mimalloc's page
refills). :func:`keep_arrow_pages` sets ``MIMALLOC_PURGE_DELAY=-1`` (never purge: freed pages
are reused) unless the environment has it already. mimalloc reads it when pyarrow loads, so it
must run first: the ``refinery`` command calls it before anything imports pyarrow. The
process keeps its high-water mark of Arrow memory in exchange, as with the glibc heap.

Detect (:data:`RETURNS_ARROW_PAGES`) keeps mimalloc's purge: its groups' Arrow buffers are a
few megabytes each, and its process spent the same CPU per sample with purged pages (5.08 and
5.03 CPU-s over the same input at 64 simulated nodes) while its peak RSS fell from 420-490 to
369 MiB: the high-water mark it kept was its first seconds' (every source new), not its
steady state. For the same reason detect hands glibc's free pages back once a second
(:func:`trimmer`, ``malloc_trim``): its fetches and records are decoded on Faust's consumer
thread, whose glibc arena otherwise stays at its high-water mark (64 MiB resident at 64
simulated nodes, 14 MiB with the trim; the process settled at 254-260 MiB instead of 344-377).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Callable, MutableMapping
from typing import Any

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for this setting on 64-bit
TRIM_THRESHOLD = 1 << 30
# ``refinery`` commands that leave mimalloc's purge on (see the module)
RETURNS_ARROW_PAGES = frozenset({"detect"})


def _glibc(function: str) -> Any:
    """``function`` of the C library, or None off glibc (musl has neither of ours)."""
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), function) if name is not None else None
    except (OSError, AttributeError):
        return None


def keep_heap() -> bool:
    """Apply the settings to this process; True if glibc accepted both."""
    mallopt = _glibc("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
        and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    )


def trimmer() -> Callable[[], None]:
    """A call that hands glibc's free memory back to the system (``malloc_trim(0)``: every
    arena, free pages inside a heap too, not only at its top); a no-op off glibc."""
    trim = _glibc("malloc_trim")
    if trim is None:
        return lambda: None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int

    def call() -> None:
        trim(0)

    return call


def keep_arrow_pages(environ: MutableMapping[str, str] | None = None) -> bool:
    """Ask mimalloc (pyarrow's default pool) never to purge freed pages; True if this call
    set it, False if the environment already says otherwise. Effective only before pyarrow
    loads in this process (and in every child that inherits the environment)."""
    env = os.environ if environ is None else environ
    if "MIMALLOC_PURGE_DELAY" in env:
        return False
    env["MIMALLOC_PURGE_DELAY"] = "-1"
    return True
