"""The freshness benchmark's load: nodes are sized from the samples the simulator publishes
per node-second at the run's publish interval; its once-warm figure's samples."""

from __future__ import annotations

import numpy as np

from lab.bench.harness import S
from lab.bench.latency import (
    SAMPLES_PER_NODE_S,
    _half_load_nodes,
    once_warm,
    samples_per_node_s,
    worker_latency,
)


def test_the_constant_is_what_the_default_cluster_publishes() -> None:
    assert samples_per_node_s(S, 10) == SAMPLES_PER_NODE_S


def test_publishing_every_200ms_keeps_10hz_series_and_samples_the_rest_at_each_publish() -> None:
    fast = samples_per_node_s(S // 5, 2)
    # GPU/NIC series keep their 10 Hz; the once-per-scrape series are sampled five times as
    # often, so a node publishes more samples per second and fewer nodes make the same load
    assert SAMPLES_PER_NODE_S < fast < 5 * SAMPLES_PER_NODE_S
    rate = 400_000.0
    slow_nodes = _half_load_nodes(rate)[1]
    fast_nodes = _half_load_nodes(rate, fast)[1]
    assert fast_nodes < slow_nodes
    assert abs(fast_nodes * fast - 0.5 * rate) <= fast / 2


def test_once_warm_keeps_the_samples_stamped_from_the_warm_up_on_in_any_order() -> None:
    t0 = 1_800_000_000 * S
    # out of stamp order, as refined records of several partitions come: by stamp, not place
    ts = np.array([t0 + 12 * S, t0, t0 + 10 * S - 1, t0 + 10 * S, t0 + 3 * S], np.int64)
    lat = np.array([0.1, 2.0, 1.5, 0.2, 1.9])
    assert once_warm(lat, ts, 10.0).tolist() == [0.1, 0.2]
    assert once_warm(lat, ts, 0.0).tolist() == lat.tolist()
    assert once_warm(lat[:0], ts[:0], 10.0).size == 0


def _acc(topic: str, part: int, off: int, append_ms: int) -> dict[str, object]:
    return {"raw_topic": topic, "raw_partition": part, "raw_offset": off, "append_ms": append_ms}


def test_worker_latency_is_raw_append_to_accounting_append_once_per_raw_record() -> None:
    docs = [
        (_acc("p.telemetry.raw", 0, 5, 1_000), 1_250),
        (_acc("p.telemetry.raw", 1, 5, 1_100), 1_900),
        # a replay of (0, 5) after a restart, accounted again later: the first one counts
        (_acc("p.telemetry.raw", 0, 5, 1_000), 9_000),
        # another input topic's records are not the raw topic's
        (_acc("p.telemetry.events", 0, 5, 1_000), 5_000),
    ]
    seconds, raw_ms = worker_latency(docs, "p.telemetry.raw")
    pairs = sorted(zip(raw_ms.tolist(), seconds.tolist(), strict=True))
    assert pairs == [(1_000, 0.25), (1_100, 0.8)]
    # a replay that lands before the first copy (partitions read out of order) still counts
    # the earliest append
    seconds, _ = worker_latency(list(reversed(docs)), "p.telemetry.raw")
    assert sorted(seconds.tolist()) == [0.25, 0.8]
    empty, none = worker_latency([], "p.telemetry.raw")
    assert empty.size == 0 and none.size == 0
