"""keep_heap: on glibc, a multi-megabyte allocation comes from the heap afterwards instead
of a fresh mapping (whose pages would fault in again for every message)."""

from __future__ import annotations

import ctypes
import platform
from pathlib import Path

import pytest

from services.heap import keep_heap

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")


def _in_heap(address: int) -> bool:
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith("[heap]"):
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return True
    return False


def test_a_large_allocation_comes_from_the_heap() -> None:
    assert keep_heap()
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    p = libc.malloc(4 << 20)
    try:
        assert p and _in_heap(p)
    finally:
        libc.free(p)
    assert keep_heap()  # applying it again is harmless
