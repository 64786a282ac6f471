"""Rows of int64 values kept packed (little-endian) for checkpoints and numpy, up to date as
rows come at the end and leave at the front: only what changed is packed again."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import chain

import numpy as np


class PackedRows:
    """The packed bytes of an owner's rows of ``width`` ints (a cache, not state). The owner
    reports each row it appends (:meth:`append`) and each it drops from the front
    (:meth:`drop_first`), and :meth:`invalidate` when it replaces them otherwise;
    :meth:`get` returns the bytes of its rows as they are, packing all of them anew only
    after an invalidation."""

    def __init__(self, width: int) -> None:
        self.width = width
        self._bytes: bytes | None = None
        self._added: list[int] = []
        self._dropped = 0

    def append(self, row: Iterable[int]) -> None:
        if self._bytes is not None:
            self._added += row

    def drop_first(self) -> None:
        self._dropped += 1

    def invalidate(self) -> None:
        self._bytes = None

    def get(self, rows: Callable[[], Iterable[Iterable[int]]], n: int) -> bytes | None:
        """The owner's ``n`` rows packed (``rows()`` gives them, in order, for a full pack);
        None when a value is past int64."""
        if self._bytes is not None:
            try:
                added = np.array(self._added, dtype="<i8").tobytes() if self._added else b""
            except OverflowError:
                self._bytes = None
            else:
                self._bytes = (self._bytes + added)[8 * self.width * self._dropped :]
        self._added, self._dropped = [], 0
        if self._bytes is None:
            try:
                flat = np.fromiter(chain.from_iterable(rows()), np.int64, self.width * n)
            except OverflowError:
                return None
            self._bytes = flat.astype("<i8", copy=False).tobytes()
        return self._bytes
