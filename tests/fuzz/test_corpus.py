"""Regression cases kept in tests/fuzz/corpus: each must get the reason its name states, pass
the hostile-input contract, and the compression bombs must be refused within a memory bound.

Memory bound (measured in a fresh subprocess with ``resource.getrusage``): decoding a
compression bomb raises peak RSS by less than :data:`BOMB_RSS_BOUND`; decoding any record
raises it by less than :data:`ANY_RSS_BOUND` (a few copies of ``MAX_DECODED_BYTES``).
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from schemas.codec import ARROW, JSON, MAX_DECODED_BYTES, decode
from schemas.errors import RejectedInput
from tests.fuzz.harness import check_record

CORPUS = Path(__file__).resolve().parent / "corpus"
REPO = Path(__file__).resolve().parents[2]
BOMB_RSS_BOUND = 16 << 20
ANY_RSS_BOUND = 4 * MAX_DECODED_BYTES
CASES = sorted(CORPUS.iterdir())


def load(path: Path) -> tuple[bytes, str, str]:
    """(body, content type, expected reason) of a corpus file."""
    data = path.read_bytes()
    name = path.name
    if name.endswith(".gz"):
        data, name = gzip.decompress(data), name[:-3]
    _, reason, ext = name.rsplit(".", 2)
    return data, {"arrows": ARROW, "json": JSON}[ext], reason


def test_corpus_is_there() -> None:
    assert len(CASES) >= 7


@pytest.mark.parametrize("path", CASES, ids=[p.name for p in CASES])
def test_case_gets_its_reason_and_keeps_the_contract(path: Path) -> None:
    body, ct, reason = load(path)
    with pytest.raises(RejectedInput) as e:
        decode(body, ct)
    assert e.value.reason.value == reason, e.value.detail
    verdict = check_record(body, ct)
    assert verdict.outcome == "deadletter" and verdict.reason == reason


_MEASURE = """
import gzip, json, resource, sys
from schemas.codec import ARROW, JSON, decode
from schemas.errors import RejectedInput
name = sys.argv[1]
with open(name, "rb") as f:
    body = f.read()
if name.endswith(".gz"):
    body, name = gzip.decompress(body), name[:-3]
ct = ARROW if name.endswith(".arrows") else JSON
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    decode(body, ct)
    reason = None
except RejectedInput as e:
    reason = e.reason.value
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"reason": reason, "growth": (after - before) * 1024, "peak": after * 1024}))
"""


def peak_growth(path: Path) -> dict[str, object]:
    """Decode ``path`` in a fresh interpreter; its reason and peak RSS growth in bytes."""
    # Linux carries a process's peak RSS across fork and exec (signal->maxrss): a python
    # forked straight from this large pytest process would report pytest's peak. ``sh``
    # forks it instead, so its baseline is its own.
    out = subprocess.run(
        ["sh", "-c", '"$0" -c "$1" "$2"', sys.executable, _MEASURE, str(path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=True,
    )
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize("name", ["bomb-zstd-1gib", "bomb-lz4-1gib"])
def test_compression_bomb_is_refused_without_memory_growth(name: str) -> None:
    (path,) = [p for p in CASES if p.name.startswith(name)]
    r = peak_growth(path)
    print(f"{name}: peak RSS growth {int(r['growth']) / 2**20:.1f} MiB")  # type: ignore[call-overload]
    assert r["reason"] == "oversized"
    assert int(r["growth"]) < BOMB_RSS_BOUND  # type: ignore[call-overload]


def test_near_bound_record_stays_within_the_stated_bound() -> None:
    (path,) = [p for p in CASES if p.name.startswith("near-bound")]
    r = peak_growth(path)
    print(f"near-bound: peak RSS growth {int(r['growth']) / 2**20:.1f} MiB")  # type: ignore[call-overload]
    assert r["reason"] == "oversized"
    assert int(r["growth"]) < ANY_RSS_BOUND  # type: ignore[call-overload]
