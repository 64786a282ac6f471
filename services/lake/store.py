"""The object-store seam: the few operations a lake on object storage needs, and their errors.

An :class:`ObjectStore` holds objects by key (``date=.../p0-1-2.parquet``, relative to the
lake root). There is no rename: what makes a write a commit is a *conditional* put —
``create=True`` fails with :class:`ObjectExists` when the key exists (``If-None-Match: *``),
``if_match=ETAG`` fails with :class:`PreconditionFailed` when the object changed
(compare-and-swap). Every put is atomic: readers see the whole object or none.

Two implementations: :class:`~services.lake.s3store.S3ObjectStore` (any S3-compatible
service, through obstore) and :class:`DirectoryObjectStore` (a local directory with the
same semantics, for tests and for the shared suite of the object-lake protocol).

Errors::

    LakeError
    └── StoreError               a store operation failed; the message is one line
        ├── ObjectExists         create=True, and the key exists
        ├── PreconditionFailed   if_match=..., and the object changed (or is gone)
        ├── ObjectMissing        get/copy of a key that does not exist
        ├── StoreAccessError     credentials refused, bucket missing: fix the settings
        └── StoreUnavailable     endpoint unreachable or failing after retries (transient)

A writer waits out a store that cannot be reached with :func:`patiently`: one retry rule
(backoff, budget) for every lake on object storage, Parquet or Iceberg.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import random
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from services.lake.layout import LakeError


class StoreError(LakeError):
    """A store operation failed (one line, naming the store and the key)."""


class ObjectExists(StoreError):
    """A conditional create found the key taken."""


class PreconditionFailed(StoreError):
    """A compare-and-swap put found another version than the one it expected."""


class ObjectMissing(StoreError):
    """The object asked for does not exist."""


class StoreAccessError(StoreError):
    """The store refused us (credentials, permissions) or the bucket does not exist."""


class StoreUnavailable(StoreError):
    """The store could not be reached, or kept failing through the client's retries."""


T = TypeVar("T")


def _unavailable(e: Exception) -> StoreUnavailable | None:
    return e if isinstance(e, StoreUnavailable) else None


def patiently(
    call: Callable[[], T],
    reconnect_s: float,
    retrying: Callable[[StoreUnavailable], None],
    unavailable: Callable[[Exception], StoreUnavailable | None] = _unavailable,
) -> T:
    """``call()``, retried with backoff (0.2 s doubling to 5 s, jittered) while it fails
    because the store cannot be reached, for up to ``reconnect_s``; then that
    :class:`StoreUnavailable` propagates. ``unavailable`` says which errors those are (as a
    StoreUnavailable; None: any other error, which propagates at once), ``retrying`` is told
    of each retry (to log and count it). The caller makes ``call`` safe to run again:
    idempotent, or re-reading first what an interrupted run may have done."""
    deadline, attempt = time.monotonic() + reconnect_s, 0
    while True:
        try:
            return call()
        except Exception as e:
            err = unavailable(e)
            if err is None:
                raise
            if time.monotonic() >= deadline:
                if err is e:
                    raise
                raise err from e
            retrying(err)
        time.sleep(min(0.2 * 2**attempt, 5.0) * random.uniform(0.8, 1.2))
        attempt += 1


@dataclass(frozen=True)
class ObjectInfo:
    """One object: its key (relative to the store root), size, modification time (epoch
    seconds, the store's clock) and ETag (opaque; what ``if_match`` compares)."""

    key: str
    size: int
    modified: float
    etag: str


class ObjectStore(Protocol):
    """Objects under one root. Implementations are safe to share between threads; every
    call may block on the network and raises :class:`StoreError` subclasses only."""

    @property
    def root_url(self) -> str:
        """The root as DuckDB reads it (``s3://bucket/prefix`` or an absolute path)."""
        ...

    def url(self, key: str) -> str:
        """The URL (or path) of ``key`` as DuckDB reads it."""
        ...

    def put(
        self, key: str, data: bytes, *, create: bool = False, if_match: str | None = None
    ) -> str:
        """Store ``data`` at ``key`` atomically; returns the new ETag. ``create``: only if
        absent (else ObjectExists); ``if_match``: only if the current ETag is that (else
        PreconditionFailed)."""
        ...

    def get(self, key: str) -> bytes:
        """The object's bytes; ObjectMissing if absent."""
        ...

    def head(self, key: str) -> ObjectInfo | None:
        """The object's metadata, None if absent."""
        ...

    def list(self, prefix: str) -> list[ObjectInfo]:
        """Every object under the "directory" ``prefix`` (``a/b`` lists ``a/b/...``; ``""``
        everything), in no promised order; ``etag`` may be empty in a listing."""
        ...

    def delete(self, key: str) -> None:
        """Remove ``key``; no error if it is absent."""
        ...

    def copy(self, src: str, dst: str) -> None:
        """Copy ``src`` to ``dst`` (unconditionally); ObjectMissing if ``src`` is absent."""
        ...

    def check(self) -> None:
        """Raise StoreAccessError / StoreUnavailable unless the root can be listed."""
        ...

    def register(self, con: Any) -> None:
        """Let DuckDB connection ``con`` read this store's URLs."""
        ...


def etag_of(data: bytes) -> str:
    """The ETag a single-part S3 PUT of ``data`` gets: its MD5, quoted."""
    return f'"{hashlib.md5(data, usedforsecurity=False).hexdigest()}"'


class DirectoryObjectStore:
    """An :class:`ObjectStore` in a local directory, with S3's conditional semantics: a put
    writes a temp file, fsyncs it and links (create) or renames (otherwise) it into place;
    conditional puts are serialised by an ``flock`` on ``<root>/.store.lock``. Keys may not
    start with ``.store``. ETags are MD5s of the content, as S3's are for single-part puts."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(os.path.abspath(root))

    @property
    def root_url(self) -> str:
        return str(self.root)

    def _path(self, key: str) -> Path:
        parts = key.split("/")
        if not key or any(p in ("", ".", "..") for p in parts) or parts[0].startswith(".store"):
            raise StoreError(f"{self.root}: invalid key {key!r}")
        return self.root.joinpath(*parts)

    def url(self, key: str) -> str:
        return str(self._path(key))

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / ".store.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def put(
        self, key: str, data: bytes, *, create: bool = False, if_match: str | None = None
    ) -> str:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".store-{uuid.uuid4().hex}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            with self._locked():
                if create:
                    try:
                        os.link(tmp, path)
                    except FileExistsError:
                        raise ObjectExists(f"{self.root}: {key} exists") from None
                else:
                    if if_match is not None:
                        now = self.head(key)
                        if now is None or now.etag != if_match:
                            raise PreconditionFailed(f"{self.root}: {key} changed")
                    os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return etag_of(data)

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise ObjectMissing(f"{self.root}: no object {key}") from None

    def head(self, key: str) -> ObjectInfo | None:
        path = self._path(key)
        try:
            data = path.read_bytes()
            st = path.stat()
        except FileNotFoundError:
            return None
        return ObjectInfo(key, st.st_size, st.st_mtime, etag_of(data))

    def list(self, prefix: str) -> list[ObjectInfo]:
        pre = prefix.strip("/")
        top = self.root.joinpath(*pre.split("/")) if pre else self.root
        out: list[ObjectInfo] = []
        for dirpath, dirs, files in os.walk(top):
            dirs[:] = [d for d in dirs if not d.startswith(".store")]
            for name in files:
                if name.startswith(".store"):
                    continue
                full = os.path.join(dirpath, name)
                key = os.path.relpath(full, self.root).replace(os.sep, "/")
                st = os.stat(full)
                out.append(ObjectInfo(key, st.st_size, st.st_mtime, ""))
        return out

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def copy(self, src: str, dst: str) -> None:
        self.put(dst, self.get(src))

    def check(self) -> None:
        if self.root.exists() and not self.root.is_dir():
            raise StoreAccessError(f"{self.root}: not a directory")

    def register(self, con: Any) -> None:
        """Nothing to do: DuckDB reads local paths."""
