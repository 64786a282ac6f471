"""A series resolves to the same target whatever hosts a mapping resolved before: families
whose rules read no node label resolve each host's series through one shared resolution
(only ``node`` differs), families whose rules do read one resolve each host's apart."""

from __future__ import annotations

import pytest

from schemas.catalog import default_catalog
from schemas.ingest.mapping import Family, Mapping, Rule, SeriesKey, load_mapping

SERIES: list[tuple[str, str, dict[str, str], str]] = [
    ("influx", "cpu_usage_user", {"cpu": "cpu3"}, ""),
    ("influx", "cpu_usage_user", {"cpu": "cpu-total"}, ""),
    ("influx", "net_bytes_recv", {"interface": "eth0"}, ""),
    ("influx", "no_such_metric", {"cpu": "cpu1"}, ""),
    ("collectd", "interface_rx", {"plugin_instance": "eth1", "type": "if_octets"}, "rate"),
    ("prometheus", "node_cpu_seconds_total", {"cpu": "2", "mode": "user"}, ""),
    ("prometheus", "DCGM_FI_DEV_GPU_TEMP", {"gpu": "1"}, ""),
    ("otlp", "system.cpu.time", {"cpu": "cpu0", "state": "user"}, ""),
]


def _key(name: str, labels: dict[str, str], hint: str) -> SeriesKey:
    return name, tuple(sorted(labels.items())), hint


@pytest.mark.parametrize(("family", "name", "labels", "hint"), SERIES)
def test_target_does_not_depend_on_hosts_seen_before(
    family: str, name: str, labels: dict[str, str], hint: str
) -> None:
    shared = load_mapping(family)
    node_label = shared.family.node_labels[0]
    for host in ("h1", "h2", "h3"):
        key = _key(name, {**labels, node_label: host}, hint)
        alone = load_mapping(family).resolve(key)  # a mapping that saw no other host
        got = shared.resolve(key)
        assert got == alone
        assert got.node == host


def test_rules_that_read_the_node_label_resolve_each_host_apart() -> None:
    family = Family(
        node_labels=("host",),
        rules=(Rule(name="clk", metric="gpu.sm_clock", device="gpu-{host}"),),
    )
    m = Mapping(family, [], default_catalog())
    a = m.resolve(_key("clk", {"host": "a"}, ""))
    b = m.resolve(_key("clk", {"host": "b"}, ""))
    assert (a.device, a.node) == ("gpu-a", "a")
    assert (b.device, b.node) == ("gpu-b", "b")
