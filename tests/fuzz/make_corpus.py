"""Regenerate the hand-made part of tests/fuzz/corpus (``python -m tests.fuzz.make_corpus``).

File names say what decode must answer: ``<name>.<reason>.<arrows|json>[.gz]`` (``.gz``
only keeps the repository small; the test decompresses it first). Cases the fuzzer found are
added the same way, by hand, with the reason they must get.
"""

from __future__ import annotations

import gzip
import json
import struct
from pathlib import Path

import pyarrow as pa

from schemas.codec import ARROW, JSON, encode
from schemas.wire import SAMPLES_SCHEMA, Envelope, SourceId
from tests.fuzz.harness import arrow_compressed

CORPUS = Path(__file__).resolve().parent / "corpus"
ENV = Envelope(
    source=SourceId(node="n1", exporter="node", instance="0", boot_id="b"), seq=1, sent_ns=10
)


def samples(text: str | None, rows: int = 1) -> pa.Table:
    return pa.table(
        {
            "ts_ns": pa.array([1_700_000_000_000_000_000] * rows, pa.int64()),
            "metric": ["cpu.busy"] * rows,
            "device": ["cpu0"] * rows,
            "value": pa.array([1.0] * rows),
            "raw": pa.array([None] * rows, pa.uint64()),
            "text": pa.array([text] * rows, pa.string()),
        },
        schema=SAMPLES_SCHEMA,
    )


def write(name: str, body: bytes, gz: bool = False) -> None:
    path = CORPUS / (name + (".gz" if gz else ""))
    path.write_bytes(gzip.compress(body, 9, mtime=0) if gz else body)
    print(f"{path.name}: {path.stat().st_size} bytes")


def main() -> None:
    CORPUS.mkdir(exist_ok=True)
    gib = "a" * (1 << 30)
    # 1 GiB of text in one value: 34 KB as zstd, 4.4 MB as lz4 (20 KB gzipped here)
    write("bomb-zstd-1gib.oversized.arrows", arrow_compressed(ENV, samples(gib), "zstd"))
    write("bomb-lz4-1gib.oversized.arrows", arrow_compressed(ENV, samples(gib), "lz4"), True)
    del gib
    # just under the decompressed-size bound: decoded, then refused for its string length
    near = "b" * (60 << 20)
    write("near-bound-60mib.oversized.arrows", arrow_compressed(ENV, samples(near), "zstd"))
    del near
    # one 64 KiB string value
    write("long-text.oversized.json", encode(ENV, samples("c" * 65536), JSON)[1])
    # a record batch that claims 2**31 rows
    _, body = encode(ENV, samples("x", rows=3), ARROW)
    data = bytearray(body)
    at = data.find(struct.pack("<q", 3), 8)
    data[at : at + 8] = struct.pack("<q", 1 << 31)
    write("claims-2g-rows.oversized.arrows", bytes(data))
    # JSON: too many rows (columns of 200 001 values), and nesting deeper than the parser
    doc = json.loads(encode(ENV, samples(None), JSON)[1])
    doc["columns"] = {k: v * 200_001 for k, v in doc["columns"].items()}
    write("rows-200001.oversized.json", json.dumps(doc).encode(), True)
    write("deep-nesting.undecodable.json", b"[" * 200_000 + b"]" * 200_000, True)


if __name__ == "__main__":
    main()
