"""The Faust (0.15.3) and aiokafka internals services.kafka.internals relies on are still there
and still do what it relies on: each test fails if an upgrade moves one. (The aiokafka
record-batch bounds are checked by tests/security/test_kafka_bomb.py; the fetch wait the
short-fetch app sets, by tests/unit/test_faust_app.py.)"""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path
from typing import Any

import faust
from aiokafka import AIOKafkaConsumer
from faust.transport.drivers import aiokafka as faust_aiokafka
from faust.types import TP, Message

from services.kafka import internals
from services.kafka.faust_app import App

BROKER = "kafka://127.0.0.1:1"


def _app(tmp_path: Path, name: str = "internals") -> faust.App:
    return App(name, broker=BROKER, autodiscover=False, datadir=str(tmp_path), store="memory://")


def test_the_short_fetch_app_overrides_hooks_faust_still_calls() -> None:
    # the overridden methods exist in Faust and the fields are what aiokafka's start() reads
    assert callable(faust.App._new_transport)
    assert callable(faust_aiokafka.Consumer._new_consumer_thread)
    assert callable(faust_aiokafka.AIOKafkaConsumerThread._create_worker_consumer)
    assert faust_aiokafka.Transport.Consumer is faust_aiokafka.Consumer
    start = inspect.getsource(AIOKafkaConsumer.start)
    assert "self._fetch_max_wait_ms" in start and "self._fetch_max_bytes" in start


def test_a_declared_gap_counts_as_acked_once_an_offset_after_it_is(tmp_path: Path) -> None:
    consumer: Any = _app(tmp_path).consumer
    tp = TP("t", 0)

    async def committable(gap: bool) -> int | None:
        consumer._acked[tp] = [10, 15]
        consumer._gap.pop(tp, None)
        if gap:
            await internals.declare_gap(consumer, "t", 0, 11, 14)
        got: int | None = consumer._new_offset(tp)
        return got

    assert asyncio.run(committable(gap=False)) == 11  # stops at the hole
    assert asyncio.run(committable(gap=True)) == 16  # past the declared offsets


def test_a_gap_whose_records_are_acked_after_all_counts_each_offset_once(tmp_path: Path) -> None:
    """Records of a declared gap handed over late and acked: the commit moves past the
    whole gap at once, not one offset per commit."""
    consumer: Any = _app(tmp_path).consumer
    tp = TP("t", 0)
    consumer._acked[tp] = [10, 15]
    asyncio.run(internals.declare_gap(consumer, "t", 0, 11, 14))
    consumer._acked[tp] += [12, 13]  # two of the gap's records, acked by the stream
    assert consumer._new_offset(tp) == 16
    consumer._acked[tp] = [16, 18]
    asyncio.run(internals.declare_gap(consumer, "t", 0, 17, 17))
    assert consumer._new_offset(tp) == 19  # another gap, the same consumer


def test_a_store_write_without_changelog_and_its_record_read_back_by_recovery(
    tmp_path: Path,
) -> None:
    app = _app(tmp_path)
    table: Any = app.Table("state", default=None, partitions=2, key_type=bytes, value_type=bytes)
    topic = internals.set_without_changelog(table, b"k", b"blob")
    assert topic == "internals-state-changelog"
    assert table[b"k"] == b"blob"  # read through the table: the write is its state
    # what Faust's recovery does with the record the worker sends (raw key and value, no
    # headers): decoded by the changelog topic into an event, applied to the table
    message = Message(topic, 1, 0, 0.0, 0, [], b"k2", b"blob2", None)

    async def recover() -> None:
        event = await table.changelog_topic.decode(message)
        table.apply_changelog_batch([event])

    asyncio.run(recover())
    assert table[b"k2"] == b"blob2"


def test_a_worker_without_its_spinner_leaves_the_root_loggers_level_as_configured(
    tmp_path: Path,
) -> None:
    """Faust sets up its spinner by putting the root logger at DEBUG (every aiokafka debug
    line then built and formatted for nothing); without the spinner the level stays."""
    import logging

    def level_after_setup(worker: Any) -> int:
        logger = logging.getLogger(f"refinery-test-root-{id(worker)}")
        logger.addHandler(logging.NullHandler())
        logger.setLevel(logging.WARNING)
        worker.on_setup_root_logger(logger, logging.WARNING)
        return logger.level

    faust_own = faust.Worker(_app(tmp_path, "spinner"), loglevel="warning", quiet=True)
    assert faust_own.spinner is not None
    assert level_after_setup(faust_own) == logging.DEBUG  # why without_spinner exists
    ours = internals.without_spinner(
        faust.Worker(_app(tmp_path, "quiet"), loglevel="warning", quiet=True)
    )
    assert ours.spinner is None
    assert level_after_setup(ours) == logging.WARNING


def test_the_fetcher_still_races_each_delivery_as_the_inline_delivery_expects(
    tmp_path: Path,
) -> None:
    """``delivered_inline`` recognizes Faust's per-record ``wait_first`` call by its second
    argument, ``suspend_flow.wait()``, and reads the state under which Conductor's
    ``on_message`` does not wait (flow control, the producer buffer, the channels' queues)."""
    from faust.transport.conductor import ConductorCompiler
    from faust.transport.consumer import Consumer as FaustConsumer

    drain = inspect.getsource(FaustConsumer._drain_messages)
    assert "self.wait_first(" in drain and "callback(message), self.suspend_flow.wait()" in drain
    build = inspect.getsource(ConductorCompiler.build)
    assert "await acquire_flow_control()" in build and "await wait_until_producer_ebb()" in build
    assert "if queue.full():" in build and "queue.put_nowait_enhanced(" in build
    app: Any = _app(tmp_path, "inline")
    consumer: Any = app.consumer
    assert isinstance(consumer.suspend_flow, asyncio.Event)
    assert consumer._crashed is not None and hasattr(app.topics, "_topics")
    buffer = app.producer.buffer
    assert isinstance(buffer.size, int) and isinstance(buffer.max_messages, int)
    assert not app.flow_control.is_active()  # suspended until partitions are assigned

    async def check() -> None:
        assert not internals._delivers_at_once(consumer)
        app.flow_control.resume()
        waits = consumer.suspend_flow.wait()
        assert internals._is_wait_of(waits, consumer.suspend_flow)
        other = asyncio.Event().wait()
        assert not internals._is_wait_of(other, consumer.suspend_flow)
        waits.close()
        other.close()
        assert internals._delivers_at_once(consumer)
        consumer.suspend_flow.set()  # a rebalance: Faust's race
        assert not internals._delivers_at_once(consumer)
        consumer.suspend_flow.clear()
        app.flow_control.suspend()
        assert not internals._delivers_at_once(consumer)
        app.flow_control.resume()
        chan = app.topic("t", key_type=bytes, value_type=bytes)
        app.topics.add(chan)
        for _ in range(chan.queue.maxsize):
            chan.queue.put_nowait(b"x")
        assert not internals._delivers_at_once(consumer)  # a full stream buffer: the race

    asyncio.run(check())
