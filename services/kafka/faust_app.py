"""The Faust app classes the stream processors use: Faust's own, with a shorter fetch wait.

Faust builds its aiokafka consumer with ``fetch_max_wait_ms=1500``, fixed. aiokafka keeps one
fetch request in flight per broker and leaves out of it every partition whose fetched records
the application has not consumed yet. Exporters publish a tick's batches at about the same
moment, so a request sent while some partitions still held records covered only the others;
the broker held it until new data reached those (the next tick, ~1 s later) or 1.5 s passed,
and the records that reached the left-out partitions meanwhile waited with it. Measured on
the worker alone at 182 k samples/s: groups that started with records 0.8-0.9 s old while
the worker sat idle. With a short wait the request comes back and the next one covers every
partition; the cost is a few more fetch requests per second when the topic is quiet.

How the wait is changed reaches into Faust's internals: :func:`services.kafka.internals.
short_fetch_app`.
"""

from __future__ import annotations

import faust

from services.kafka.internals import FETCH_MAX_BYTES, FETCH_MAX_WAIT_MS, short_fetch_app

__all__ = ["FETCH_MAX_BYTES", "FETCH_MAX_WAIT_MS", "GATHERED_FETCH_BYTES", "App", "GatheringApp"]

# ``faust.App`` whose consumer waits at most FETCH_MAX_WAIT_MS per fetch and fetches at most
# FETCH_MAX_BYTES at a time
App = short_fetch_app(faust.App)

# what a fetch of GatheringApp waits to gather (compressed), at most FETCH_MAX_WAIT_MS. The
# broker answers a fetch with fetch.min.bytes 1 as soon as one record is there: under a live
# stream of records each fetch carried a few, and each cost its request, its response's
# unpacking and two crossings between Faust's consumer thread and its event loop. Gathered
# for up to 50 ms, detect's process spent ~12 % less CPU per sample at the live load of 64
# simulated nodes (``python -m lab.bench.detect_process``); its judgements wait those 50 ms
# at most, well inside the alert latency goal. The worker keeps App: its refined latency
# would pay them on every record.
GATHERED_FETCH_BYTES = 1024 * 1024
GatheringApp = short_fetch_app(faust.App, min_bytes=GATHERED_FETCH_BYTES)
