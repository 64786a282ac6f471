"""services.allocator: what it sets, in a fresh process each (the settings are process-wide)."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Whether a 16 MiB malloc is served by its own mmap (mallinfo2's hblks), after configure() or not.
PROBE = """
import ctypes, json, os, sys
from services.allocator import configure

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
applied = configure() if sys.argv[1] == "configure" else {}
before = libc.mallinfo2().hblks
p = libc.malloc(16 << 20)
mmapped = libc.mallinfo2().hblks - before
libc.free(p)
print(json.dumps({"applied": applied, "mmapped": mmapped,
                  "purge": os.environ.get("MIMALLOC_PURGE_DELAY")}))
"""


def _glibc() -> bool:
    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")
    except OSError:
        return False


pytestmark = pytest.mark.skipif(not _glibc(), reason="needs glibc >= 2.33 (mallinfo2)")


def _probe(mode: str, **env: str) -> dict[str, object]:
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("MALLOC_", "MIMALLOC_", "REFINERY_ALLOCATOR"))}  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode],
        cwd=ROOT,
        env={**base, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    doc: dict[str, object] = json.loads(out.stdout)
    return doc


def test_large_blocks_come_from_the_heap_once_configured() -> None:
    plain = _probe("plain")
    assert plain["mmapped"] == 1 and plain["purge"] is None  # glibc's default: its own mmap
    tuned = _probe("configure")
    assert tuned["mmapped"] == 0
    assert tuned["applied"] == {
        "MIMALLOC_PURGE_DELAY": "-1",
        "MALLOC_MMAP_THRESHOLD": str(32 << 20),
        "MALLOC_TRIM_THRESHOLD": str(256 << 20),
    }
    assert tuned["purge"] == "-1"


def test_what_the_user_set_is_left_alone() -> None:
    got = _probe("configure", MIMALLOC_PURGE_DELAY="250", MALLOC_MMAP_THRESHOLD_="131072")
    assert got["purge"] == "250"
    assert got["applied"] == {"MALLOC_TRIM_THRESHOLD": str(256 << 20)}
    assert got["mmapped"] == 1  # the user's 128 KiB threshold holds


def test_refinery_allocator_default_turns_it_off() -> None:
    got = _probe("configure", REFINERY_ALLOCATOR="default")
    assert got == {"applied": {}, "mmapped": 1, "purge": None}


def test_the_cli_configures_before_pyarrow_loads() -> None:
    """mimalloc reads MIMALLOC_PURGE_DELAY when pyarrow loads: ``refinery`` must set it
    before any import of pyarrow, i.e. importing the CLI must not load pyarrow."""
    code = (
        "import os, sys, services.cli as c\n"
        "loaded = 'pyarrow' in sys.modules\n"
        "try:\n    c.main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(loaded, os.environ.get('MIMALLOC_PURGE_DELAY'))\n"
    )
    base = {k: v for k, v in os.environ.items() if not k.startswith("MIMALLOC_")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=base,
                         capture_output=True, text=True, check=True)  # fmt: skip
    assert out.stdout.split()[-2:] == ["False", "-1"]
