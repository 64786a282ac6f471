"""keep_heap: on glibc, a multi-megabyte allocation comes from the heap afterwards instead
of a fresh mapping (whose pages would fault in again for every message). keep_arrow_pages:
``refinery`` sets it before pyarrow loads, and mimalloc then keeps freed pages."""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from services.heap import keep_arrow_pages, keep_heap

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


def test_keep_arrow_pages_leaves_a_setting_of_the_user_alone() -> None:
    env: dict[str, str] = {}
    assert keep_arrow_pages(env) and env == {"MIMALLOC_PURGE_DELAY": "-1"}
    env = {"MIMALLOC_PURGE_DELAY": "250"}
    assert not keep_arrow_pages(env) and env == {"MIMALLOC_PURGE_DELAY": "250"}


# Through the CLI's own entry point (``--help``: it loads every command module, pyarrow among
# them), then Arrow buffers allocated, touched and freed, with idle time for mimalloc's purge
# in between: the page faults of the cycles after the first.
_CYCLES = """
import resource, sys, time
import services.cli as cli
loaded_before = "pyarrow" in sys.modules
try:
    cli.main(["--help"])
except SystemExit:
    pass
import numpy as np
import pyarrow as pa

def cycle():
    bufs = [pa.allocate_buffer(600_000) for _ in range(100)]
    for b in bufs:
        np.frombuffer(b, dtype=np.uint8)[::4096] = 1

cycle()
time.sleep(0.3)
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    cycle()
    time.sleep(0.3)
print(loaded_before, pa.default_memory_pool().backend_name,
      resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


def _faults(**env: str) -> tuple[str, str, int]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MIMALLOC_")}
    out = subprocess.run([sys.executable, "-c", _CYCLES], env={**base, **env},
                         cwd=Path(__file__).resolve().parents[2], capture_output=True,
                         text=True, check=True)  # fmt: skip
    loaded, backend, faults = out.stdout.split()[-3:]
    return loaded, backend, int(faults)


def test_the_cli_keeps_arrow_pages_from_before_pyarrow_loads() -> None:
    loaded, backend, faults = _faults()
    if backend != "mimalloc":
        pytest.skip(f"pyarrow's default pool here is {backend}")
    assert loaded == "False"  # importing the CLI must not load pyarrow: the setting comes first
    assert faults < 50  # freed pages were kept and reused
    # the control: a purge delay the user set is respected, and then the pages go and come back
    assert _faults(MIMALLOC_PURGE_DELAY="10")[2] > 200


def test_detect_leaves_mimallocs_purge_on_and_the_other_commands_keep_pages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from services.cli import main

    monkeypatch.delenv("MIMALLOC_PURGE_DELAY", raising=False)
    with pytest.raises(SystemExit):
        main(["detect", "--help"])
    assert "MIMALLOC_PURGE_DELAY" not in os.environ
    with pytest.raises(SystemExit):
        main(["worker", "--help"])
    assert os.environ["MIMALLOC_PURGE_DELAY"] == "-1"


_TRIM_CHILD = """
import ctypes, sys
from services.heap import keep_heap, trimmer
assert keep_heap()

def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError

libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
blocks = [libc.malloc(256 << 10) for _ in range(1024)]  # 256 MiB of the kept heap
for b in blocks:
    ctypes.memset(b, 1, 256 << 10)  # resident
for b in blocks[:-1]:
    libc.free(b)  # freed below the last one, which pins the heap's top
freed = rss_mib()
trimmer()()
print(freed, rss_mib())
"""


def test_the_trim_hands_freed_heap_below_a_live_block_back() -> None:
    """With the heap kept (detect's setting), memory freed below a block still in use stays
    resident until :func:`trimmer`'s call hands it back."""
    out = subprocess.run([sys.executable, "-c", _TRIM_CHILD], capture_output=True, text=True,
                         timeout=60, check=True)  # fmt: skip
    freed, trimmed = (float(x) for x in out.stdout.split())
    assert freed - trimmed > 200, (freed, trimmed)
