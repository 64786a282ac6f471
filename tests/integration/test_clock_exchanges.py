"""Clock bounds from the producer's exchanges, against the real broker: the delivery report
carries the append time on LogAppendTime topics only, batches carry the exchanges, and a
loaded exporter host (delays that grow for tens of seconds) keeps every sample within its
stated bound where the minimum-delay model alone does not."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from confluent_kafka import TIMESTAMP_LOG_APPEND_TIME, Consumer, Message

from lab.simulate.cluster import Cluster
from lab.simulate.engine import Simulation
from lab.simulate.publish import Topics, publish
from lab.simulate.truth import load_truth
from pipelines.refine.clock import ClockEstimator, align, row_errors
from schemas.codec import content_type_of, decode
from schemas.errors import RejectedInput
from schemas.wire import SAMPLES_SCHEMA, Envelope, PayloadKind, SourceId
from services.kafka.producer import BatchProducer
from services.settings import KafkaSettings

pytestmark = pytest.mark.kafka

LOG_APPEND = {"message.timestamp.type": "LogAppendTime", "max.message.bytes": "16777216"}
S = 1_000_000_000


def _consume(bootstrap: str, topic: str, expected: int, group: str) -> list[Message]:
    c = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": group,
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    c.subscribe([topic])
    out: list[Message] = []
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline and len(out) < expected:
            out += [m for m in c.consume(500, 1.0) if m.error() is None]
    finally:
        c.close()
    return out


def _envelope(seq: int) -> Envelope:
    src = SourceId(node="n1", exporter="node", instance="0", boot_id="b1")
    return Envelope(kind=PayloadKind.SAMPLES, source=src, seq=seq, sent_ns=time.time_ns())


def test_delivery_reports_give_exchanges_on_log_append_time_topics_only(
    kafka_bootstrap: str, unique_topic: Callable[..., str], unique_group: str
) -> None:
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap)
    row = {"ts_ns": time.time_ns(), "metric": "gpu.temp", "device": "gpu0", "value": 50.0}
    table = pa.Table.from_pylist([row | {"raw": None, "text": None}], SAMPLES_SCHEMA)
    log_topic = unique_topic("log", partitions=3, config=LOG_APPEND)
    create_topic = unique_topic("create", partitions=1)
    prod = BatchProducer(kafka, topic=log_topic)
    other = BatchProducer(kafka, topic=create_topic)
    for seq in range(6):
        for p in (prod, other):
            p.send(_envelope(seq), table)
            assert p.flush(30) == 0  # acked before the next batch is made
    assert prod.close(30) == 0 and other.close(30) == 0
    assert other.exchanges.carried() == []  # a CreateTime stamp is the producer's own
    carried = prod.exchanges.carried()
    assert 1 <= len(carried) <= 4  # fewer only if this host's wall clock stepped meanwhile
    for ex in carried:
        # this host's clock is the broker's: the offset 0 is inside every interval
        assert ex.lo <= 0 <= ex.hi
        assert ex.hi - ex.lo < 2 * S
    msgs = _consume(kafka_bootstrap, log_topic, 6, unique_group)
    assert len(msgs) == 6
    blocks = []
    for m in msgs:
        assert m.timestamp()[0] == TIMESTAMP_LOG_APPEND_TIME
        env = decode(m.value(), content_type_of(m.headers())).envelope
        blocks.append(env.clock.exchanges if env.clock is not None else None)
    # the first batch had no exchange yet; the later ones carry the earlier acks
    assert blocks[0] is None or min(len(b or []) for b in blocks) == 0
    assert max(len(b or []) for b in blocks) >= 1


def test_a_greeting_earns_the_first_batch_with_rows_its_exchange(
    kafka_bootstrap: str, unique_topic: Callable[..., str], unique_group: str
) -> None:
    """``greet`` sends a batch with no rows and waits for its report: the first batch with
    rows then carries an exchange, so no row of the source rests on an assumed delay."""
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap)
    row = {"ts_ns": time.time_ns(), "metric": "gpu.temp", "device": "gpu0", "value": 50.0}
    table = pa.Table.from_pylist([row | {"raw": None, "text": None}], SAMPLES_SCHEMA)
    topic = unique_topic("greet", partitions=3, config=LOG_APPEND)
    prod = BatchProducer(kafka, topic=topic)
    assert prod.greet(_envelope(0), timeout_s=30)
    prod.send(_envelope(1), table)
    assert prod.close(30) == 0
    msgs = sorted(_consume(kafka_bootstrap, topic, 2, unique_group), key=lambda m: m.offset())
    batches = [decode(m.value(), content_type_of(m.headers())) for m in msgs]
    assert [(b.envelope.seq, b.table.num_rows) for b in batches] == [(0, 0), (1, 1)]
    assert batches[0].envelope.clock is None  # nothing acknowledged before it
    clock = batches[1].envelope.clock
    assert clock is not None and clock.exchanges
    for sent, append_ms, ack, part in clock.exchanges:
        assert part == msgs[0].partition()  # the greeting's, the same key's partition
        assert sent - append_ms * 1_000_000 - 1_000_000 <= 0 <= ack - append_ms * 1_000_000
    # a CreateTime topic's report bounds nothing: the greeting says so once it is back,
    # without waiting out its timeout
    plain = BatchProducer(kafka, topic=unique_topic("greet-create", partitions=1))
    t0 = time.monotonic()
    assert not plain.greet(_envelope(0), timeout_s=60)
    assert time.monotonic() - t0 < 30
    assert plain.close(30) == 0


def test_a_loaded_exporter_host_keeps_every_sample_within_its_bound(
    kafka_bootstrap: str, unique_topic: Callable[..., str], unique_group: str, tmp_path: Path
) -> None:
    """Batches handed to the producer later and later (0 → 3 s over 30 s, then back): the
    one-way delays tilt like a drift and jump back like a step. Rows aligned with the
    exchanges stay within their stated bound."""
    seed = int(time.time()) % 1000
    topics = Topics(
        raw=unique_topic("raw", partitions=2, config=LOG_APPEND),
        events=unique_topic("events", partitions=1, config=LOG_APPEND),
        collectives=unique_topic("coll", partitions=1, config=LOG_APPEND),
        topology=unique_topic("topology"),
        jobs=unique_topic("jobs"),
    )
    sim = Simulation(Cluster.build(3, seed=seed), "clock", seed=seed, duration_ns=40 * S)
    truth_path = tmp_path / "truth.parquet"
    rep = publish(
        sim,
        KafkaSettings(bootstrap_servers=kafka_bootstrap),
        topics,
        truth_path,
        speed=1.0,
        progress_cb=None,
        hold_s=lambda t: 0.1 * t if t < 30 else 0.0,
    )
    assert rep.unacked == 0
    tr = load_truth(truth_path).samples
    true_ts = {
        (r["node"], r["seq"], r["metric"], r["device"], r["ts_source_ns"]): r["ts_true_ns"]
        for r in tr.select(
            ["node", "seq", "metric", "device", "ts_source_ns", "ts_true_ns"]
        ).to_pylist()
    }
    msgs = _consume(kafka_bootstrap, topics.raw, 1, unique_group)
    msgs.sort(key=lambda m: (m.timestamp()[1], m.partition(), m.offset()))
    ests: dict[str, ClockEstimator] = {}
    delays: dict[str, list[int]] = {}
    bounded = inside = 0
    for m in msgs:
        try:
            batch = decode(m.value(), content_type_of(m.headers()))
        except RejectedInput:
            continue
        env = batch.envelope
        key = env.source.stream_key()
        append = m.timestamp()[1] * 1_000_000
        est = ests.setdefault(key, ClockEstimator()).observe(env.sent_ns, append, env.clock)
        delays.setdefault(key, []).append(append - env.sent_ns)
        if est.basis != "exchange":
            continue
        ts_src = batch.table.column("ts_ns")
        n = len(ts_src)
        ts, _, err = align(ts_src, est)
        errs = row_errors(
            ts_src,
            pa.repeat(pa.scalar(est.anchor_ns, pa.int64()), n),
            pa.repeat(pa.scalar(err, pa.int64()), n),
            pa.repeat(pa.scalar(est.error_rate, pa.float64()), n),
        ).to_numpy()
        keys = zip(
            batch.table.column("metric").to_pylist(),
            batch.table.column("device").to_pylist(),
            ts_src.to_pylist(),
            strict=True,
        )
        truth = np.array(
            [true_ts.get((env.source.node, env.seq, k[0], k[1], k[2]), -1) for k in keys]
        )
        known = truth >= 0
        bounded += int(known.sum())
        inside += int((np.abs(ts.to_numpy() - truth) <= errs)[known].sum())
    assert bounded > 10_000
    assert inside == bounded, f"{bounded - inside} of {bounded} samples outside their bound"
    # the load is real: every source's one-way delays spanned seconds (a minimum-delay
    # model alone would read that tilt as a drift far past any real oscillator's)
    assert delays and all(max(d) - min(d) > 2 * S for d in delays.values())
