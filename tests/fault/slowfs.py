"""A slow disk for fault tests: a passthrough FUSE file system over a backing directory that
sleeps before every ``write``, ``fsync``, ``fsyncdir`` and ``rename`` (reads, lookups and
directory listings run at full speed, as on a disk whose write queue is saturated).

Run it as a process of its own; it stays in the foreground until unmounted (``umount``,
``fusermount3 -u``) or killed, then prints one JSON line of what it delayed to stderr::

    python tests/fault/slowfs.py BACKING MOUNTPOINT --delay-ms 50:300 --write-delay-ms 5:20

A delay ``LO:HI`` is drawn uniformly per call (jitter); ``N`` is a fixed delay. Needs
``/dev/fuse``, libfuse 3 (or 2) and the ``mfusepy`` binding; mounting needs root or
``fusermount3``. Requests are served by several threads, so one slow ``fsync`` does not hold
up a reader, as on a real disk.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import random
import sys
import threading
import time
from collections import Counter
from typing import Any

from mfusepy import FUSE, FuseOSError, Operations

STAT_KEYS = (
    "st_atime",
    "st_ctime",
    "st_gid",
    "st_mode",
    "st_mtime",
    "st_nlink",
    "st_size",
    "st_uid",
    "st_blocks",
    "st_blksize",
    "st_atime_ns",
    "st_mtime_ns",
    "st_ctime_ns",
)
STATVFS_KEYS = (
    "f_bavail",
    "f_bfree",
    "f_blocks",
    "f_bsize",
    "f_favail",
    "f_ffree",
    "f_files",
    "f_flag",
    "f_frsize",
    "f_namemax",
)


def parse_delay(text: str) -> tuple[float, float]:
    """``"LO:HI"`` or ``"N"`` milliseconds → (lo, hi) seconds; raises ValueError."""
    lo, _, hi = text.partition(":")
    a, b = float(lo), float(hi or lo)
    if not 0 <= a <= b:
        raise ValueError(f"delay {text!r}: want 0 <= LO <= HI")
    return a / 1000, b / 1000


class SlowPassthrough(Operations):  # type: ignore[misc]
    """Every path is served from ``backing``; ``delays`` maps an operation name to its
    (lo, hi) delay in seconds, slept before the operation is done."""

    use_ns = True

    def __init__(self, backing: str, delays: dict[str, tuple[float, float]], seed: int) -> None:
        self.backing = os.path.realpath(backing)
        self.delays = delays
        self.rng = random.Random(seed)
        self._mutex = threading.Lock()
        self.calls: Counter[str] = Counter()
        self.slept: Counter[str] = Counter()

    def _full(self, path: str) -> str:
        return os.path.join(self.backing, path.lstrip("/"))

    def _slow(self, op: str) -> None:
        lo, hi = self.delays.get(op, (0.0, 0.0))
        with self._mutex:
            d = self.rng.uniform(lo, hi)
            self.calls[op] += 1
            self.slept[op] += d
        if d > 0:
            time.sleep(d)

    def summary(self) -> dict[str, Any]:
        with self._mutex:
            return {
                "calls": dict(self.calls),
                "slept_s": {k: round(v, 2) for k, v in self.slept.items()},
            }

    # --- metadata -------------------------------------------------------------------------

    def access(self, path: str, amode: int) -> int:
        if not os.access(self._full(path), amode):
            raise FuseOSError(errno.EACCES)
        return 0

    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        st = os.fstat(fh) if fh is not None else os.lstat(self._full(path))
        return {k: getattr(st, k) for k in STAT_KEYS}

    def statfs(self, path: str) -> dict[str, int]:
        sv = os.statvfs(self._full(path))
        return {k: getattr(sv, k) for k in STATVFS_KEYS}

    def chmod(self, path: str, mode: int) -> int:
        os.chmod(self._full(path), mode)
        return 0

    def chown(self, path: str, uid: int, gid: int) -> int:
        os.lchown(self._full(path), uid, gid)
        return 0

    def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
        os.utime(self._full(path), ns=times)
        return 0

    def readlink(self, path: str) -> str:
        return os.readlink(self._full(path))

    def symlink(self, target: str, source: str) -> int:
        os.symlink(source, self._full(target))
        return 0

    def link(self, target: str, source: str) -> int:
        os.link(self._full(source), self._full(target))
        return 0

    # --- directories ----------------------------------------------------------------------

    def mkdir(self, path: str, mode: int) -> int:
        os.mkdir(self._full(path), mode)
        return 0

    def rmdir(self, path: str) -> int:
        os.rmdir(self._full(path))
        return 0

    def readdir(self, path: str, fh: int) -> list[str]:
        return [".", "..", *os.listdir(self._full(path))]

    def opendir(self, path: str) -> int:
        return os.open(self._full(path), os.O_RDONLY | os.O_DIRECTORY)

    def releasedir(self, path: str, fh: int) -> int:
        os.close(fh)
        return 0

    def fsyncdir(self, path: str, datasync: int, fh: int) -> int:
        self._slow("fsyncdir")
        os.fsync(fh)
        return 0

    def rename(self, old: str, new: str) -> int:
        self._slow("rename")
        os.rename(self._full(old), self._full(new))
        return 0

    def unlink(self, path: str) -> int:
        os.unlink(self._full(path))
        return 0

    # --- files ----------------------------------------------------------------------------

    def open(self, path: str, flags: int) -> int:
        return os.open(self._full(path), flags)

    def create(self, path: str, mode: int, fi: Any = None) -> int:
        return os.open(self._full(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        return os.pread(fh, size, offset)

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        self._slow("write")
        return os.pwrite(fh, data, offset)

    def truncate(self, path: str, length: int, fh: int | None = None) -> int:
        if fh is not None:
            os.ftruncate(fh, length)
        else:
            os.truncate(self._full(path), length)
        return 0

    def flush(self, path: str, fh: int) -> int:
        return 0

    def fsync(self, path: str, datasync: int, fh: int) -> int:
        self._slow("fsync")
        if datasync:
            os.fdatasync(fh)
        else:
            os.fsync(fh)
        return 0

    def release(self, path: str, fh: int) -> int:
        os.close(fh)
        return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("backing")
    p.add_argument("mountpoint")
    p.add_argument("--delay-ms", default="50:300", help="fsync, fsyncdir, rename: LO:HI or N")
    p.add_argument("--write-delay-ms", default=None, help="write: LO:HI or N (default --delay-ms)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    slow = parse_delay(args.delay_ms)
    write = parse_delay(args.write_delay_ms) if args.write_delay_ms else slow
    delays = {"fsync": slow, "fsyncdir": slow, "rename": slow, "write": write}
    ops = SlowPassthrough(args.backing, delays, args.seed)
    try:
        FUSE(ops, args.mountpoint, foreground=True, fsname="slowfs")
    except RuntimeError as e:  # libfuse printed why (fuse: ..., fusermount3: ...) above
        print(f"slowfs: mount failed (libfuse status {e})", file=sys.stderr, flush=True)
        return 1
    finally:
        print(json.dumps({"slowfs": ops.summary()}), file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
