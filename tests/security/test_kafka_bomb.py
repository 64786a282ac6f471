"""Kafka-level compression bombs: a producer compresses a 64 MiB message of zeros into a few
KiB, well under the broker's ``max.message.bytes`` (which bounds the *compressed* batch).

What bounds a consumer:
- ``fetch.max.bytes`` / ``max.partition.fetch.bytes`` bound the compressed bytes fetched;
- librdkafka (confluent-kafka: the lander, alert consumers, the worker's gap re-fetch)
  refuses to inflate a *zstd* batch beyond ``receive.message.max.bytes`` and reports an error
  for it (repeated at that offset); gzip, lz4 and snappy batches it inflates whole, whatever
  their size (measured: a 64 MiB gzip, lz4 or snappy bomb came back as one 64 MiB message);
- aiokafka (the Faust worker) inflates every batch whole, with no setting to bound it:
  ``services.kafka.internals`` bounds it (every codec) at ``MAX_INFLATED_BYTES``, and the
  worker dead-letters each record of a refused batch (``oversized``) and goes on.

``-s`` prints the worker's peak RSS under the bombs.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaError, Producer

pytestmark = pytest.mark.kafka
BOMB = 64 * 1024 * 1024


def test_librdkafka_consumer_refuses_to_inflate_a_bomb(
    kafka_bootstrap: str, unique_topic: Callable[..., str]
) -> None:
    topic = unique_topic("bomb")
    p = Producer(
        {
            "bootstrap.servers": kafka_bootstrap,
            "compression.type": "zstd",
            "message.max.bytes": 100_000_000,  # the producer's own (uncompressed) limit
        }
    )
    acked: list[KafkaError | None] = []
    p.produce(topic, b"\0" * BOMB, on_delivery=lambda err, _m: acked.append(err))
    p.produce(topic, b"after the bomb", on_delivery=lambda err, _m: acked.append(err))
    p.flush(60)
    assert acked == [None, None]  # the broker took it: compressed, it is tiny
    c = Consumer(
        {
            "bootstrap.servers": kafka_bootstrap,
            "group.id": uuid.uuid4().hex,
            "auto.offset.reset": "earliest",
            "fetch.max.bytes": 4 * 1024 * 1024,
            "receive.message.max.bytes": 8 * 1024 * 1024,
        }
    )
    c.subscribe([topic])
    sizes: list[int] = []
    errors: list[str] = []
    deadline = time.monotonic() + 30
    try:
        while time.monotonic() < deadline and not errors:
            m = c.poll(0.5)
            if m is None:
                continue
            if m.error() is not None:
                if m.error().code() != KafkaError._PARTITION_EOF:
                    errors.append(str(m.error()))
                continue
            sizes.append(len(m.value() or b""))
    finally:
        c.close()
    print(f"kafka bomb: consumer errors {errors[:1]}, message sizes {sizes}")
    assert BOMB not in sizes, "the consumer inflated the 64 MiB bomb"
    assert errors, "the consumer should report the message it refused to decompress"


# -- aiokafka, bounded by services.kafka.internals --------------------------------------------

CODECS = {"gzip": 1, "snappy": 2, "lz4": 3, "zstd": 4}


def _batch(codec: int, values: list[bytes]) -> bytes:
    from aiokafka.record.default_records import DefaultRecordBatchBuilder

    b = DefaultRecordBatchBuilder(
        magic=2, compression_type=codec, is_transactional=0, producer_id=-1,
        producer_epoch=-1, base_sequence=-1, batch_size=1 << 30,
    )  # fmt: skip
    for i, v in enumerate(values):
        b.append(i, timestamp=1_700_000_000_000, key=b"k", value=v, headers=[])
    return bytes(b.build())


@pytest.mark.parametrize("codec", CODECS)
def test_aiokafka_batches_inflate_within_the_bound_or_are_refused_record_by_record(
    codec: str,
) -> None:
    """Also the check that aiokafka's internals are still those ``services.kafka.internals``
    was written for: ``install`` raises, or the fetcher's records are not bounded, if not."""
    import aiokafka.consumer.fetcher as fetcher

    from services.kafka.internals import MAX_INFLATED_BYTES, REFUSED_HEADER, install

    install()
    small = fetcher.MemoryRecords(_batch(CODECS[codec], [b"a" * 1000, b"b"]))
    assert [(r.offset, r.value) for r in small.next_batch()] == [(0, b"a" * 1000), (1, b"b")]
    bomb = _batch(CODECS[codec], [b"\0" * (MAX_INFLATED_BYTES + 1), b"after"])
    assert len(bomb) < MAX_INFLATED_BYTES // 16
    batch = fetcher.MemoryRecords(bomb).next_batch()
    assert not batch.is_control_batch and batch.next_offset == 2
    got = list(batch)
    assert [(r.offset, r.key, r.value) for r in got] == [(0, None, b""), (1, None, b"")]
    for r in got:
        ((name, why),) = r.headers
        assert name == REFUSED_HEADER and b"inflates past" in why and b"offsets 0..1" in why


def test_the_worker_dead_letters_bombs_of_every_codec_and_goes_on(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    import json

    from schemas.codec import ARROW, encode
    from tests.integration.test_worker import batch
    from tests.integration.worker_helpers import accounting, fresh_topics, running_worker

    prefix = fresh_topics(kafka_bootstrap)
    raw = prefix + "telemetry.raw"
    now = time.time_ns()
    with running_worker(kafka_bootstrap, prefix, tmp_path) as w:
        n = 0
        for i, codec in enumerate(CODECS):
            p = Producer({"bootstrap.servers": kafka_bootstrap, "compression.type": codec,
                          "message.max.bytes": 100_000_000, "linger.ms": 0})  # fmt: skip
            env, t = batch("n1", 2 * i, now - 10_000_000_000 + i)
            ct, body = encode(env, t, ARROW)
            p.produce(raw, body, key=b"n1", partition=0, headers=[("content-type", ct)])
            p.flush(30)
            p.produce(raw, b"\0" * BOMB, key=b"n1", partition=0, headers=[("content-type", ct)])
            p.flush(30)
            n += 2
        env, t = batch("n1", 99, now)
        ct, body = encode(env, t, ARROW)
        p.produce(raw, body, key=b"n1", partition=0, headers=[("content-type", ct)])
        assert p.flush(30) == 0
        n += 1
        acc = accounting(kafka_bootstrap, prefix, expect=n, timeout=120)
        assert w.proc.poll() is None, w.tail()
        by = sorted((int(str(a["raw_offset"])), a["outcome"], a["reason"]) for a in acc)
        assert by == [
            *((k, "refined", None) if k % 2 == 0 else (k, "deadletter", "oversized")
              for k in range(n - 1)),
            (n - 1, "refined", None),
        ], w.tail()  # fmt: skip
        dls = read_all_json(kafka_bootstrap, prefix + "telemetry.deadletter")
        assert len(dls) == len(CODECS)
        assert all("inflates past" in d["detail"] for d in dls), dls
        status = Path(f"/proc/{w.proc.pid}/status").read_text()
        peak = int(next(x for x in status.splitlines() if x.startswith("VmHWM")).split()[1])
        print(f"\nkafka bombs ({', '.join(CODECS)}, 64 MiB each): worker peak RSS "
              f"{peak / 1024:.0f} MiB")  # fmt: skip
        assert peak < 1024 * 1024, "the worker inflated a bomb"  # KiB: under 1 GiB
        assert json.loads(json.dumps(dls))  # (plain JSON)
        assert w.stop() == 0, w.tail()


def read_all_json(bootstrap: str, topic: str) -> list[dict[str, object]]:
    import json

    from tests.integration.worker_helpers import read_all

    return [json.loads(v or b"") for _, v, _ in read_all(bootstrap, topic, idle=5)]
