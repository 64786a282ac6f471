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

import numpy as np
import pyarrow as pa

from schemas.errors import RejectedInput
from schemas.ingest.assemble import Points
from schemas.ingest.mapping import SeriesKey
from schemas.reasons import Reason

_SAMPLE = re.compile(
    rb'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{((?:[^"}\n]|"(?:[^"\\\n]|\\.)*")*)\})?'
    rb"[ \t]+([^ \t\n#]+)(?:[ \t]+([^ \t\n#]+))?[ \t]*(?:#[^\n]*)?$",
    re.M,
)
_IGNORED = re.compile(rb"^(?:#[^\n]*|[ \t\r]*)$", re.M)
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\]|\\.)*)"')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}

_keys: dict[tuple[bytes, bytes], SeriesKey] = {}


def _labels(block: bytes) -> tuple[tuple[str, str], ...]:
    text = block.decode("utf-8", "replace")
    pairs = _LABEL.findall(text)
    out = [(k, re.sub(r"\\[\\\"n]", lambda m: _UNESCAPE[m.group(0)], v)) for k, v in pairs]
    return tuple(sorted(out))


def _key(name: bytes, block: bytes) -> SeriesKey:
    k = _keys.get((name, block))
    if k is None:
        if len(_keys) > 200_000:
            _keys.clear()
        k = _keys[(name, block)] = (name.decode(), _labels(block), "")
    return k


def _first_bad_line(body: bytes) -> str:
    for i, line in enumerate(body.split(b"\n"), 1):
        if not _IGNORED.fullmatch(line) and not _SAMPLE.fullmatch(line):
            return f"line {i}: {line[:80].decode('utf-8', 'replace')!r}"
    return "a line is not a sample"


def decode_prometheus(body: bytes, openmetrics: bool = False) -> Points:
    """The samples of one exposition; :class:`RejectedInput` ``undecodable`` naming the
    first line that is neither a sample, a comment nor blank, or a value that is no number."""
    found = _SAMPLE.findall(body)
    lines = body.count(b"\n") + (0 if body.endswith(b"\n") else 1)
    if len(found) + len(_IGNORED.findall(body)) < lines:
        raise RejectedInput(Reason.UNDECODABLE, f"not Prometheus text: {_first_bad_line(body)}")
    index: dict[SeriesKey, int] = {}
    keys: list[SeriesKey] = []
    sid = np.empty(len(found), dtype=np.int64)
    for i, (name, block, _, _) in enumerate(found):
        k = _key(name, block)
        j = index.get(k)
        if j is None:
            j = index[k] = len(keys)
            keys.append(k)
        sid[i] = j
    try:
        values = pa.array([f[2] for f in found], pa.binary()).cast(pa.string())
        value = values.cast(pa.float64()).to_numpy(zero_copy_only=False)
        stamps = [f[3] or None for f in found]
        ts = np.full(len(found), -1, dtype=np.int64)
        if any(stamps):
            t = pa.array(stamps, pa.binary()).cast(pa.string()).cast(pa.float64())
            got = t.to_numpy(zero_copy_only=False)
            scale = 1e9 if openmetrics else 1e6
            ts = np.where(np.isnan(got), -1, np.rint(got * scale)).astype(np.int64)
    except (pa.ArrowInvalid, UnicodeDecodeError) as e:
        raise RejectedInput(Reason.UNDECODABLE, f"not a number: {e}"[:300]) from e
    return Points(keys, sid, ts, np.asarray(value, dtype=np.float64))
