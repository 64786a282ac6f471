"""Lake paths and file names: the only place that turns values into path components.

Layout::

    <root>/<dataset>/date=YYYY-MM-DD/hour=HH/p<partition>-<first>-<last>.parquet   landed data
    <root>/<dataset>/date=1970-01-01/hour=00/seed.parquet      zero rows, current schema
    <root>/<dataset>/date=.../hour=.../.land-*.parquet.partial  being written (not *.parquet)
    <root>/<dataset>/date=.../hour=.../.compact-*.parquet.partial
    <root>/.landing/<dataset>/p<partition>-<first>-<last>.json  multi-file landing in flight

``first``/``last`` are the source Kafka offsets the file holds (inclusive). A file whose range
lies inside the range of another file of the same partition in the same hour directory is
*covered*: compaction wrote the covering file from it and readers skip it. Temporary names end
in ``.partial`` because DuckDB's ``**/*.parquet`` glob does match dot-files.

Every path built here is checked, after resolving symlinks, to lie inside the lake root;
:class:`LakeError` is raised otherwise and for any value that cannot be a partition value.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from schemas.errors import RefineryError
from services.lake.datasets import DATASETS
from services.lake.location import local_root

HOUR_NS = 3_600_000_000_000
MAX_TS_NS = 2**63 - 1  # 2262-04-11T23:47:16Z, the largest int64 ns
SEED_NAME = "seed.parquet"
PARTIAL_SUFFIX = ".parquet.partial"
LANDING_DIR = ".landing"

FILE_RE = re.compile(r"^p(\d{1,10})-(\d{1,19})-(\d{1,19})\.parquet$")
_KEY_RE = re.compile(r"^[a-z_][a-z0-9_]{0,63}$")
_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
_MAX_COMPONENT = 200


class LakeError(RefineryError):
    """Root of the lake's errors: bad partition values, paths outside the root, bad names."""


@dataclass(frozen=True, order=True)
class LandedFile:
    """A data file in the lake and the source offsets it holds (inclusive)."""

    path: Path
    partition: int
    first: int
    last: int

    def covers(self, other: LandedFile) -> bool:
        """True when ``other`` is another file of the same partition and hour whose range
        lies inside this one's: this file was compacted from it."""
        return (
            self.path != other.path
            and self.partition == other.partition
            and self.path.parent == other.path.parent
            and self.first <= other.first
            and other.last <= self.last
        )


def file_name(partition: int, first: int, last: int) -> str:
    """``p<partition>-<first>-<last>.parquet``; raises LakeError for impossible values."""
    for label, v, hi in (("partition", partition, 2**31), ("offset", first, 2**63)):
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < hi:
            raise LakeError(f"{label} {v!r} is not a non-negative integer in range")
    if not isinstance(last, int) or isinstance(last, bool) or not first <= last < 2**63:
        raise LakeError(f"offset range {first!r}..{last!r} is not valid")
    return f"p{partition}-{first}-{last}.parquet"


def parse_file_name(path: Path) -> LandedFile | None:
    """The LandedFile for a data file name, None for anything else (seed, temp, foreign)."""
    m = FILE_RE.match(path.name)
    if m is None:
        return None
    return LandedFile(path, int(m.group(1)), int(m.group(2)), int(m.group(3)))


def encode_value(value: str) -> str:
    """Encode one partition value as a single safe path component.

    Bytes outside ``[A-Za-z0-9_-]`` (so ``.``, ``/``, ``%``, NUL and every non-ASCII code point,
    including look-alike slashes and bidi marks) become ``%XX`` of their UTF-8 bytes; the result
    can never be ``.``/``..`` or contain a separator. Values whose encoding exceeds 200
    characters are cut and suffixed with a hash of the whole value so distinct values stay
    distinct. Raises LakeError for an empty value or one that is not valid text.
    """
    if not isinstance(value, str) or value == "":
        raise LakeError("a partition value must be a non-empty string")
    try:
        raw = value.encode("utf-8")
    except UnicodeEncodeError as e:  # lone surrogates
        raise LakeError("a partition value must be valid Unicode") from e
    out = "".join(chr(b) if b in _SAFE else f"%{b:02X}" for b in raw)
    if len(out) > _MAX_COMPONENT:
        out = out[:180].rstrip("%0123456789ABCDEF") + "~" + hashlib.sha256(raw).hexdigest()[:16]
    return out


def hour_of(ts_ns: int) -> tuple[str, str]:
    """``("YYYY-MM-DD", "HH")`` of a timestamp in UTC; values outside 1970..2262 are clamped."""
    ts = min(max(int(ts_ns), 0), MAX_TS_NS)
    d = datetime.fromtimestamp(ts // 1_000_000_000, UTC)
    return d.strftime("%Y-%m-%d"), d.strftime("%H")


def parse_hour(text: str) -> tuple[str, str]:
    """``YYYY-MM-DDTHH`` → ``("YYYY-MM-DD", "HH")``; raises LakeError for anything else."""
    if not isinstance(text, str) or not re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}", text):
        raise LakeError(f"hour {text!r} is not YYYY-MM-DDTHH")
    try:
        d = datetime.strptime(text, "%Y-%m-%dT%H")
    except ValueError as e:
        raise LakeError(f"hour {text!r} is not a valid hour") from e
    return d.strftime("%Y-%m-%d"), d.strftime("%H")


class LakePaths:
    """Builds and checks every path under one lake root. Touches no file itself."""

    def __init__(self, root: Path | str) -> None:
        self.root = local_root(root)  # ConfigError for s3://...: never a directory "s3:"

    def inside(self, path: Path) -> Path:
        """``path`` itself; raises LakeError when it resolves outside the root."""
        resolved = path.resolve()
        if not resolved.is_relative_to(self.root.resolve()):
            raise LakeError(f"{path} resolves outside the lake root")
        return path

    def dataset_dir(self, dataset: str) -> Path:
        """``<root>/<dataset>``; raises LakeError for an unknown dataset name."""
        if not isinstance(dataset, str) or dataset not in DATASETS:
            raise LakeError(f"unknown dataset {dataset!r}")
        return self.inside(self.root / dataset)

    def partition_dir(self, dataset: str, values: list[tuple[str, str]]) -> Path:
        """``<root>/<dataset>/k1=v1/k2=v2...`` with every value encoded by encode_value."""
        path = self.dataset_dir(dataset)
        for key, value in values:
            if not isinstance(key, str) or not _KEY_RE.match(key):
                raise LakeError(f"partition key {key!r} is not an identifier")
            path = path / f"{key}={encode_value(value)}"
        return self.inside(path)

    def hour_dir(self, dataset: str, date: str, hour: str) -> Path:
        """The directory of one dataset hour; date and hour are validated as a real hour."""
        date, hour = parse_hour(f"{date}T{hour}")
        return self.partition_dir(dataset, [("date", date), ("hour", hour)])

    def landing_dir(self, dataset: str) -> Path:
        self.dataset_dir(dataset)
        return self.inside(self.root / LANDING_DIR / dataset)

    def hour_dirs(self, dataset: str) -> list[tuple[str, str, Path]]:
        """``(date, hour, dir)`` of every hour directory present, oldest first."""
        base = self.dataset_dir(dataset)
        out: list[tuple[str, str, Path]] = []
        if not base.is_dir():
            return out
        for d in sorted(os.listdir(base)):
            if not d.startswith("date="):
                continue
            for h in sorted(os.listdir(base / d)):
                if h.startswith("hour="):
                    out.append((d[5:], h[5:], base / d / h))
        return out

    def data_files(self, dataset: str) -> list[LandedFile]:
        """Every landed or compacted data file of a dataset, covered ones included."""
        files: list[LandedFile] = []
        for _, _, hdir in self.hour_dirs(dataset):
            for name in os.listdir(hdir):
                lf = parse_file_name(hdir / name)
                if lf is not None:
                    files.append(lf)
        files.sort()
        return files


def live_files(files: list[LandedFile]) -> list[LandedFile]:
    """The files a reader must read: those not covered by another (see LandedFile.covers)."""
    groups: dict[tuple[Path, int], list[LandedFile]] = {}
    for f in files:
        groups.setdefault((f.path.parent, f.partition), []).append(f)
    live: list[LandedFile] = []
    for group in groups.values():
        # widest first: a file is covered iff some earlier (wider or equal-start) file covers it
        group.sort(key=lambda f: (f.first, -f.last))
        reach = -1
        for f in group:
            if f.last <= reach:
                continue  # inside an earlier file's range
            live.append(f)
            reach = f.last
    live.sort()
    return live


def fsync_dir(path: Path) -> None:
    """Make a rename or unlink in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
