"""Prometheus text exposition (0.0.4) and OpenMetrics text, as dcgm-exporter and
node_exporter serve it and as a site pushes it to Kafka (``kcat -k node``).

One regex pass over the body finds every sample line (name, label block, value,
timestamp); values and timestamps are parsed by Arrow casts. Python work per sample is one
dict look-up of its ``(name, label block)``: the label block is parsed once per distinct
series. ``# TYPE``/``# HELP`` lines are not needed: the catalog says what a metric is.
Timestamps are optional: absent, the broker's arrival time stands in (Prometheus text:
integer milliseconds; OpenMetrics: seconds).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pyarrow as pa

from schemas.errors import RejectedInput
from schemas.ingest.assemble import Points, SeriesRegistry
from schemas.reasons import Reason

_SAMPLE = re.compile(
    rb"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^\n]*\})?[ \t]+([^ \t\n]+)(?:[ \t]+([^ \t\n#]+))?"
    rb"[ \t]*(?:#[^\n]*)?$",
    re.M,
)
_IGNORED = re.compile(rb"^(?:#[^\n]*|[ \t\r]*)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\]|\\.)*)"')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}

_REG = SeriesRegistry()
_ids: dict[tuple[bytes, bytes], int] = {}
_gen = [0]


def _labels(block: bytes) -> tuple[tuple[str, str], ...]:
    text = block[1:-1].decode("utf-8", "replace")
    pairs = _LABEL.findall(text)
    out = [(k, re.sub(r"\\[\\\"n]", lambda m: _UNESCAPE[m.group(0)], v)) for k, v in pairs]
    return tuple(sorted(out))


def _id(pair: tuple[bytes, bytes]) -> int:
    i = _ids[pair] = _REG.id_of((pair[0].decode(), _labels(pair[1]), ""))
    return i


def _check_lines(body: bytes, found: int) -> None:
    """Every line is a sample, a comment or blank: counted first, read line by line only
    when the count differs (lines of blanks only)."""
    lines = body.split(b"\n")
    comments = body.count(b"\n#") + body.startswith(b"#")
    if found + comments + lines.count(b"") >= len(lines):
        return
    for i, line in enumerate(lines, 1):
        if not _IGNORED.fullmatch(line) and not _SAMPLE.fullmatch(line):
            shown = line[:80].decode("utf-8", "replace")
            raise RejectedInput(Reason.UNDECODABLE, f"not Prometheus text: line {i}: {shown!r}")


def _numbers(found: list[tuple[bytes, bytes, bytes, bytes]], openmetrics: bool) -> Any:
    try:
        values = pa.array([f[2] for f in found], pa.binary()).cast(pa.string())
        value = values.cast(pa.float64()).to_numpy(zero_copy_only=False)
        ts = np.full(len(found), -1, dtype=np.int64)
        stamps = [f[3] or None for f in found]
        if any(stamps):
            t = pa.array(stamps, pa.binary()).cast(pa.string()).cast(pa.float64())
            got = t.to_numpy(zero_copy_only=False)
            scale = 1e9 if openmetrics else 1e6
            ts = np.where(np.isnan(got), -1, np.rint(got * scale)).astype(np.int64)
    except (pa.ArrowInvalid, UnicodeDecodeError) as e:
        raise RejectedInput(Reason.UNDECODABLE, f"not a number: {e}"[:300]) from e
    return np.asarray(value, dtype=np.float64), ts


def decode_prometheus(body: bytes, openmetrics: bool = False) -> Points:
    """The samples of one exposition; :class:`RejectedInput` ``undecodable`` naming the
    first line that is neither a sample, a comment nor blank, or a value that is no number."""
    if _REG.begin() != _gen[0]:
        _ids.clear()
        _gen[0] = _REG.generation
    if b"\r" in body:
        body = body.replace(b"\r\n", b"\n")
    found = _SAMPLE.findall(body)
    _check_lines(body, len(found))
    get = _ids.get
    pairs = [(f[0], f[1]) for f in found]
    gid = [get(p) for p in pairs]
    if None in gid:
        gid = [_id(p) if g is None else g for p, g in zip(pairs, gid, strict=True)]
    value, ts = _numbers(found, openmetrics)
    return Points(_REG, np.array(gid, dtype=np.int64), ts, value)
