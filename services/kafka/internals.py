"""Every use of aiokafka's and Faust's internals, in one place, each with its reason (the
section "Faust internals we rely on" of docs/operations.md weighs each against Faust's public
settings and hooks):

- :func:`install`: a bound on the bytes one compressed record batch may inflate to (aiokafka);
- :func:`short_fetch_app`: a 50 ms fetch wait instead of Faust's fixed 1.5 s;
- :func:`delivered_inline`: a record delivered to its stream without Faust's per-record race
  when nothing can make it wait;
- :func:`declare_gap`: offsets the stream dropped count as acked once a later one is;
- :func:`set_without_changelog`: a table's state written without Faust sending its changelog
  record (the worker sends it with its outputs);
- :func:`without_spinner`: a Faust worker that leaves the root logger's level as configured.

Nothing else of the product reaches past Faust's and aiokafka's public API;
``tests/unit/test_kafka_adapter.py`` fails if a module outside this one starts to.

The bound on inflation (:func:`install`).

Why: a producer compresses a record batch; the broker bounds its *compressed* size
(``max.message.bytes``) and a consumer's fetch bounds bound what it fetches, but nothing bounds
what a batch inflates to. A few KiB of zstd or gzip can be gigabytes of zeros, and aiokafka
(the Faust worker's consumer) inflates every batch whole with no limit: one principal that may
write a raw topic could exhaust every worker's memory. librdkafka (the confluent-kafka
consumers) refuses a zstd batch beyond ``receive.message.max.bytes`` but inflates gzip, lz4 and
snappy batches whole too (see ``tests/security/test_kafka_bomb.py``).

What :func:`install` changes, all of it aiokafka 0.14's (``tests/security/test_kafka_bomb.py``
fails if any of it moves):

- ``gzip_decode``, ``snappy_decode``, ``lz4_decode`` and ``zstd_decode`` as the record-batch
  modules (``aiokafka.record.default_records`` and its compiled twin) look them up: bounded
  versions that stop at :data:`MAX_INFLATED_BYTES` and raise :class:`InflateRefused`;
- ``MemoryRecords`` as ``aiokafka.consumer.fetcher`` builds it from a fetch response: a wrapper
  whose batches, when one is refused, yield in its place one record per offset of the batch,
  with no key, an empty value and the header :data:`REFUSED_HEADER` saying why. The worker
  dead-letters each (reason ``oversized``) like any record it cannot accept, and the partition
  moves on: the offsets are delivered, so nothing is skipped and nothing stalls.

aiokafka's fetch size bound (``fetch_max_bytes``) is set by :func:`short_fetch_app` where the
consumer is built.
"""

from __future__ import annotations

import mmap
import struct
import zlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

# the largest a record batch may inflate to: the raw topics take batches of at most 16 MiB
# compressed from producers whose batches are at most a few MB (librdkafka's batch.size) and
# whose records are at most 16 MiB each (schemas.codec.MAX_MESSAGE_BYTES)
MAX_INFLATED_BYTES = 64 * 1024 * 1024
REFUSED_HEADER = "x-refinery-refused"

_XERIAL = b"\x82SNAPPY\x00"
_AppT = TypeVar("_AppT")


# the same bounds for the confluent-kafka (librdkafka) consumers: what a fetch carries, and the
# largest response, which librdkafka also applies to what a zstd batch inflates to (gzip, lz4
# and snappy batches it inflates whole: only aiokafka's are bounded here)
LIBRDKAFKA_CONSUMER_BOUNDS: dict[str, int] = {
    "fetch.max.bytes": 32 * 1024 * 1024,
    "max.partition.fetch.bytes": 32 * 1024 * 1024,
    "receive.message.max.bytes": MAX_INFLATED_BYTES + 512,
    "queued.max.messages.kbytes": 65_536,  # pre-fetched, per consumer
}


class InflateRefused(ValueError):
    """A compressed record batch would inflate past :data:`MAX_INFLATED_BYTES`."""


def _into_bounded(decompress_into: Callable[[Any, Any], int], codec: str) -> Callable[[Any], Any]:
    """A decoder writing into an anonymous mapping of the bound's size: its pages take memory
    only as they are written, and the codec stops at its end."""

    def decode(payload: Any) -> Any:
        out = mmap.mmap(-1, MAX_INFLATED_BYTES + 1)
        try:
            n = decompress_into(payload, out)
        except Exception as e:  # cramjam: "failed to write whole buffer", or corrupt data
            raise InflateRefused(
                f"{codec} batch inflates past {MAX_INFLATED_BYTES} bytes or is corrupt: {e}"
            ) from e
        if n > MAX_INFLATED_BYTES:
            raise InflateRefused(f"{codec} batch inflates past {MAX_INFLATED_BYTES} bytes")
        return memoryview(out)[:n]

    return decode


def gzip_decode(payload: Any) -> bytes:
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    out = d.decompress(bytes(payload), MAX_INFLATED_BYTES + 1)
    if len(out) > MAX_INFLATED_BYTES or d.unconsumed_tail:
        raise InflateRefused(f"gzip batch inflates past {MAX_INFLATED_BYTES} bytes")
    return out


def snappy_decode(payload: Any) -> Any:
    """The size of each raw snappy block is in its header: checked before anything inflates
    (the xerial framing Kafka producers use is a sequence of such blocks)."""
    import cramjam
    from aiokafka.codec import snappy_decode as inflate

    data = bytes(payload)
    blocks = [data]
    if data[:8] == _XERIAL and len(data) >= 16:
        blocks, pos = [], 16
        while pos + 4 <= len(data):
            (n,) = struct.unpack_from("!i", data, pos)
            blocks.append(data[pos + 4 : pos + 4 + n])
            pos += 4 + n
    total = 0
    for b in blocks:
        try:
            total += int(cramjam.snappy.decompress_raw_len(b))
        except Exception as e:
            raise InflateRefused(f"snappy batch: {e}") from e
        if total > MAX_INFLATED_BYTES:
            raise InflateRefused(f"snappy batch inflates past {MAX_INFLATED_BYTES} bytes")
    return inflate(data)


def _decoders() -> dict[str, Callable[[Any], Any]]:
    import cramjam

    return {
        "gzip_decode": gzip_decode,
        "snappy_decode": snappy_decode,
        "lz4_decode": _into_bounded(cramjam.lz4.decompress_into, "lz4"),
        "zstd_decode": _into_bounded(cramjam.zstd.decompress_into, "zstd"),
    }


class _RefusingBatch:
    """A record batch that, if it cannot be inflated within the bound, yields one refused
    record per offset instead of raising (every other attribute is the batch's own)."""

    def __init__(self, batch: Any) -> None:
        self._batch = batch

    def __getattr__(self, name: str) -> Any:
        return getattr(self._batch, name)

    def __iter__(self) -> Iterator[Any]:
        try:
            records = iter(self._batch)  # the batch inflates here, whole (or at the first next)
            first = next(records)
        except StopIteration:
            return
        except InflateRefused as e:
            yield from _refused(self._batch, str(e))
            return
        yield first
        while True:  # (not ``yield from``: it would call the batch's __iter__ a second time)
            try:
                yield next(records)
            except StopIteration:
                return

    def __next__(self) -> Any:  # PartitionRecords reads a control batch's first record
        return next(self._batch)


def _refused(batch: Any, why: str) -> Iterator[Any]:
    from aiokafka.record.default_records import DefaultRecord

    first, last = batch.base_offset, batch.next_offset - 1
    detail = f"{why} (offsets {first}..{last})".encode()
    for off in range(first, last + 1):
        yield DefaultRecord(
            off, batch.max_timestamp, batch.timestamp_type, None, b"", [(REFUSED_HEADER, detail)]
        )


class _BoundedRecords:
    """``MemoryRecords`` whose batches refuse to inflate past the bound (see the module)."""

    def __init__(self, data: bytes, records: type) -> None:
        self._records = records(data)

    def size_in_bytes(self) -> int:
        return int(self._records.size_in_bytes())

    def has_next(self) -> bool:
        return bool(self._records.has_next())

    def next_batch(self) -> Any:
        batch = self._records.next_batch()
        return _RefusingBatch(batch) if batch is not None else None


_installed = False


def install() -> None:
    """Bound what aiokafka's consumers of this process inflate (idempotent). Raises
    RuntimeError when aiokafka's internals are not those this module was written for."""
    global _installed
    if _installed:
        return
    import aiokafka.consumer.fetcher as fetcher
    import aiokafka.record.default_records as py_records

    modules: list[Any] = [py_records]
    try:
        from aiokafka.record._crecords import default_records as c_records

        modules.append(c_records)
    except ImportError:  # no compiled extensions: the Python module is the one in use
        pass
    decoders = _decoders()
    for m in modules:
        missing = [name for name in decoders if not callable(getattr(m, name, None))]
        if missing:
            raise RuntimeError(f"aiokafka changed: {m.__name__} has no {missing}")
    original = getattr(fetcher, "MemoryRecords", None)
    if not isinstance(original, type):
        raise RuntimeError("aiokafka changed: aiokafka.consumer.fetcher.MemoryRecords is gone")
    for m in modules:
        for name, fn in decoders.items():
            setattr(m, name, fn)
    fetcher.MemoryRecords = lambda data: _BoundedRecords(data, original)
    _installed = True


def refused_detail(headers: list[tuple[str, bytes]]) -> str | None:
    """Why the record with these headers was refused by the bound (None: it was not)."""
    for k, v in headers:
        if k == REFUSED_HEADER:
            return v.decode("utf-8", "replace")
    return None


# --- Faust 0.15.3's internals (faust-streaming is pinned; tests/unit/test_faust_internals.py
# fails if any of these moves). docs/operations.md, "Faust internals we rely on", says why
# each stays and what Faust's public API offers instead.

FETCH_MAX_WAIT_MS = 50
# what one fetch response may carry, compressed (aiokafka's default is 50 MiB; the broker still
# returns a first batch larger than this, so no record is too large to fetch). What a batch
# inflates to is bounded by install() above.
FETCH_MAX_BYTES = 32 * 1024 * 1024


def short_fetch_app(base: type[_AppT], min_bytes: int = 1) -> type[_AppT]:
    """``base`` (``faust.App``) whose aiokafka consumer waits at most :data:`FETCH_MAX_WAIT_MS`
    per fetch and fetches at most :data:`FETCH_MAX_BYTES` at a time; the broker answers a
    fetch once ``min_bytes`` are there for it, or that wait has passed.

    Why: Faust builds its consumer with ``fetch_max_wait_ms=1500`` and no setting changes it
    (``AIOKafkaConsumerThread._create_worker_consumer``; see :mod:`services.kafka.faust_app` for
    what the wait cost). The consumer reads ``_fetch_max_wait_ms`` and ``_fetch_max_bytes`` in
    ``start()``, when it builds its fetcher; the consumer thread, the consumer and the
    transport are reached through ``App._new_transport`` and ``Consumer._new_consumer_thread``."""
    from faust.transport.drivers import aiokafka as faust_aiokafka

    class ConsumerThread(faust_aiokafka.AIOKafkaConsumerThread):
        def _create_worker_consumer(self, transport: Any) -> Any:
            consumer = super()._create_worker_consumer(transport)
            consumer._fetch_max_wait_ms = FETCH_MAX_WAIT_MS
            consumer._fetch_max_bytes = FETCH_MAX_BYTES
            consumer._fetch_min_bytes = min_bytes
            return consumer

    class ShortFetchConsumer(faust_aiokafka.Consumer):
        def _new_consumer_thread(self) -> ConsumerThread:
            return ConsumerThread(self, loop=self.loop, beacon=self.beacon)

        async def wait_first(self, *coros: Any, timeout: Any = None) -> Any:
            return await delivered_inline(self, super().wait_first, coros, timeout)

    class Transport(faust_aiokafka.Transport):
        Consumer = ShortFetchConsumer

    def _new_transport(self: Any) -> Any:
        return Transport(self.conf.broker_consumer, self)

    return cast("type[_AppT]", type(base.__name__, (base,), {"_new_transport": _new_transport}))


async def delivered_inline(
    consumer: Any, wait_first: Callable[..., Any], coros: tuple[Any, ...], timeout: Any
) -> Any:
    """Faust's fetcher hands each record to the app as
    ``consumer.wait_first(callback(message), consumer.suspend_flow.wait())``: the delivery raced
    against a rebalance suspending the flow (and the consumer stopping or crashing). Each
    call makes four tasks and an ``asyncio.wait``, three turns of the event loop a record:
    ~40 % of the ~120 us of CPU a one-line record cost a Faust agent that did nothing else.

    A delivery waits only when the flow is suspended, a stream's buffer is full or Faust's
    producer buffer is over its bound (``Conductor`` ``on_message``: otherwise each step runs
    straight through, ``put_nowait`` included). When none of that holds, the record is
    delivered here directly, with what the race would have given in its first turn;
    otherwise, and for any other ``wait_first`` call, Faust's race runs unchanged.

    Why here: ``Consumer._drain_messages`` calls ``self.wait_first`` for every record and no
    setting changes that; the consumer is Faust's aiokafka ``Consumer`` subclass built by
    :func:`short_fetch_app`, and the state read is the app's flow control, its producer buffer
    and the conductor's iterated channels (``Conductor._topics``, their queues)."""
    from mode.services import WaitResults

    if (
        timeout is not None
        or len(coros) != 2
        or not _is_wait_of(coros[1], consumer.suspend_flow)
        or not _delivers_at_once(consumer)
    ):
        return await wait_first(*coros, timeout=timeout)
    deliver, suspended = coros
    suspended.close()
    return WaitResults([deliver], [await deliver], False)


def _delivers_at_once(consumer: Any) -> bool:
    """Whether a record's delivery runs through without waiting: the flow on, the consumer
    running, no stream buffer full, Faust's producer buffer within its bound."""
    app = consumer.app
    if consumer.suspend_flow.is_set() or consumer.should_stop or consumer._crashed.is_set():
        return False
    if not app.flow_control.is_active():
        return False
    buffer = app.producer.buffer
    if buffer.size > buffer.max_messages:
        return False
    for chan in app.topics._topics:
        queue = chan._queue
        if queue is not None and queue.full():
            return False
    return True


def _is_wait_of(coro: Any, event: Any) -> bool:
    """Whether ``coro`` is ``event.wait()`` of the asyncio event ``event``, not started."""
    import asyncio

    frame = getattr(coro, "cr_frame", None)
    return (
        getattr(coro, "cr_code", None) is asyncio.Event.wait.__code__
        and frame is not None
        and frame.f_locals.get("self") is event
    )


async def declare_gap(consumer: Any, topic: str, partition: int, first: int, last: int) -> None:
    """Tell Faust's consumer that offsets ``first..last`` of a partition will never be acked
    by an agent: they count as acked once an offset after them is, so commits move past them.

    Why: the consumer counts offsets read that its stream dropped (its buffer on a rebalance,
    ``take_events`` under backlog) and commits nothing past an offset never acked: the
    partition would stall for good. The worker refines those records after fetching them
    directly; ``Consumer._add_gap`` is how Faust's own fetcher declares offsets it will not
    deliver (compacted away), and there is no public equivalent."""
    from faust.types import TP

    _merge_gaps_once(consumer)
    await consumer._add_gap(TP(topic, partition), first, last)


def _merge_gaps_once(consumer: Any) -> None:
    """Have ``consumer`` count each offset once when it merges declared gaps into its acked
    offsets (installed on the instance, once).

    Why: Faust's ``_new_offset`` appends a gap's offsets to the acked ones as they are; when
    the stream hands over records of the gap after all (late, not lost) and they are acked,
    those offsets are there twice, and its run of consecutive offsets ends at each duplicate:
    the partition's commit then moves one offset per commit interval through the gap (seen
    after a restart: minutes for a gap of a hundred records). Merged here first, without
    duplicates, the gap's offsets count once."""
    if getattr(consumer, "_refinery_gaps_merged", False):
        return
    original = consumer._new_offset

    def new_offset(tp: Any) -> int | None:
        acked, gaps = consumer._acked[tp], consumer._gap[tp]
        if acked and gaps:
            top = max(acked)
            spans = sorted(gaps.overlap(0, top), key=lambda iv: iv.begin)
            if spans:
                acked.extend(o for iv in spans for o in range(iv.begin, iv.end))
                gaps.chop(0, max(spans[-1].end - 1, top + 1))
        if len(acked) > 1:
            once = sorted(set(acked))
            if len(once) != len(acked):
                acked[:] = once
        got: int | None = original(tp)
        return got

    consumer._new_offset = new_offset
    consumer._refinery_gaps_merged = True


def set_without_changelog(table: Any, key: bytes, value: bytes) -> str:
    """Set ``table[key]`` in its local store only, and return the name of its changelog topic:
    the caller sends the changelog record (raw key and value, no headers: what Faust's
    ``table[key] = value`` sends for a raw-serialized table, and what its recovery reads back).

    Why: ``table[key] = value`` sends the record through the app's aiokafka producer, keyed
    to the partition of the stream's *current* event; the worker's groups span several
    partitions and its records must be acknowledged with its outputs by the librdkafka
    producer, so it builds the record itself and writes ``Table.data`` (the store) directly."""
    table.data[key] = value
    return str(table.changelog_topic.get_topic_name())


def without_spinner(worker: Any) -> Any:
    """``worker`` (a ``faust.Worker``) without its terminal spinner; returns it.

    Why: a Faust worker always makes a progress spinner, and when its log level is WARNING or
    above it sets up the spinner by setting the *root* logger to DEBUG (with the console
    handler at the requested level): every ``log.debug`` of aiokafka, Faust and mode then
    builds its record and formats it (aiokafka logs each request's whole struct) for a handler
    to drop. That cost an idle worker about half its CPU and a loaded one several per cent.
    ``Worker.spinner`` is a documented attribute; ``None`` is what Faust itself sets below
    WARNING, and the root logger then keeps the level the service asked for. The spinner only
    draws on a terminal, which a service does not have."""
    worker.spinner = None
    return worker
