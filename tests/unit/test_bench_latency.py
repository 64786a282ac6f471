"""The freshness benchmark's load: nodes are sized from the samples the simulator publishes
per node-second at the run's publish interval; its once-warm figure's samples."""

from __future__ import annotations

import numpy as np

from services.bench.harness import S
from services.bench.latency import (
    SAMPLES_PER_NODE_S,
    _half_load_nodes,
    once_warm,
    samples_per_node_s,
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
