"""Foreign formats decode to the native batch: identity, catalog mapping, counters."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest

from schemas.errors import RejectedInput
from schemas.ingest import IngestDecoder, Position
from schemas.reasons import Reason

FIX = Path(__file__).resolve().parents[1] / "fixtures"
NOW = 1_700_000_000_000_000_000
DEC = IngestDecoder(
    {
        "prom": "prometheus",
        "lp": "influx",
        "cd": "collectd",
        "cdc": "collectd_counters",
        "otlp": "otlp",
    }
)


def _rows(table: pa.Table) -> dict[tuple[str, str], dict[str, object]]:
    return {(r["metric"], r["device"]): r for r in table.to_pylist()}


def test_node_exporter_exposition_maps_cpu_seconds_ib_words_and_memory() -> None:
    body = (FIX / "real-data/sysfs-procfs/node_exporter-e2e-output.txt").read_bytes()
    b = DEC.decode("prom", body, "text/plain; version=0.0.4", Position(3, 41, NOW, b"n7"))
    src = b.envelope.source
    assert (src.node, src.exporter, src.instance, b.envelope.seq) == ("n7", "prometheus", "p3", 41)
    rows = _rows(b.table)
    # node_cpu_seconds_total{cpu="0",mode="user"} 444.9 -> 44490 USER_HZ ticks, exact
    assert rows[("cpu.user_seconds", "cpu0")]["raw"] == 44490
    # node_infiniband_port_data_received_bytes_total{device="mlx4_0",port="1"} 1.8527668e+07
    # is bytes (x4 already): the catalog's raw is 4-byte words
    assert rows[("ib.port_rcv_data", "mlx4_0/1")]["raw"] == 18527668 // 4
    assert rows[("mem.total_bytes", "node")]["value"] == 3.831959552e09 / 1024
    # every sample line is in the table, mapped or not; no timestamp -> arrival time
    lines = [x for x in body.splitlines() if x and not x.startswith(b"#")]
    assert b.table.num_rows == len(lines)
    assert set(b.table["ts_ns"].to_pylist()) == {NOW}
    names = set(b.table["metric"].to_pylist())
    assert "net.arp_entries" in names  # a default collector's series: mapped
    # a collector off by default (bcache statistics) is left for unknown_metric, named
    assert "node_bcache_btree_nodes" in names


def _dcgm_exposition() -> bytes:
    """dcgm-exporter's exposition of its default field list, one value per field, two GPUs."""
    csv = (FIX / "real-data/gpu/dcgm-exporter-default-counters.csv").read_text()
    out = []
    for line in csv.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        field, kind, help_ = (p.strip() for p in line.split(",", 2))
        out += [f"# HELP {field} {help_}", f"# TYPE {field} {kind}"]
        for gpu in (0, 3):
            labels = (f'gpu="{gpu}",UUID="GPU-{gpu:08d}",device="nvidia{gpu}",'
                      f'modelName="NVIDIA H100 80GB HBM3",Hostname="dgx-a7"')  # fmt: skip
            out.append(f"{field}{{{labels}}} {7 + gpu}")
    return ("\n".join(out) + "\n").encode()


def test_dcgm_exporter_fields_are_catalog_aliases_with_gpu_devices() -> None:
    b = DEC.decode("prom", _dcgm_exposition(), None, Position(0, 1, NOW, None))
    assert b.envelope.source.node == "dgx-a7"  # the Hostname label
    rows = _rows(b.table)
    assert rows[("gpu.temp", "gpu3")]["value"] == 10.0
    assert rows[("gpu.sm_clock", "gpu0")]["value"] == 7.0
    from schemas.catalog import default_catalog

    cat = default_catalog()
    unmapped = {m for m in b.table["metric"].to_pylist() if m not in cat}
    assert len(unmapped) < 10, unmapped  # nearly every default field is in the catalog


def test_telegraf_line_protocol_from_plugin_docs() -> None:
    text = (FIX / "ingest/telegraf-samples.lp").read_bytes()
    lines = [x for x in text.splitlines() if x.startswith(b"nvidia_smi")]
    b = DEC.decode("lp", b"\n".join(lines), None, Position(1, 5, NOW, None))
    assert b.envelope.source.node == "8218cf"
    rows = _rows(b.table)
    assert rows[("gpu.temp", "gpu1")]["value"] == 50.0
    assert rows[("gpu.fb_used", "gpu0")]["value"] == 549.0
    assert rows[("gpu.temp", "gpu0")]["ts_ns"] == 1523991122000000000
    ib = next(x for x in text.splitlines() if x.startswith(b"infiniband"))
    b = DEC.decode("lp", ib, "text/plain; charset=utf-8", Position(1, 6, NOW, b"hop-12"))
    rows = _rows(b.table)
    assert b.envelope.source.node == "hop-12"  # no host tag: the Kafka key
    assert rows[("ib.port_rcv_data", "mlx5_0/1")]["raw"] == 237159415345822  # words, exact
    assert rows[("ib.vl15_dropped", "mlx5_0/1")]["raw"] == 0


def test_telegraf_cpu_net_mem_and_unmapped_fields_keep_their_names() -> None:
    text = (FIX / "ingest/telegraf-samples.lp").read_bytes()
    for prefix, node in ((b"cpu,", "loaner"), (b"net,", "HOST"), (b"mem,", "host")):
        line = next(x for x in text.splitlines() if x.startswith(prefix))
        b = DEC.decode("lp", line, None, Position(0, 1, NOW, None))
        assert b.envelope.source.node == node
        rows = _rows(b.table)
        if prefix == b"cpu,":
            assert rows[("cpu.user_seconds", "cpu0")]["raw"] == 15432434
            assert ("cpu.time_active", "cpu0") in rows  # not a catalog metric: keeps its name
        elif prefix == b"net,":
            assert rows[("net.rx_bytes", "eth0")]["raw"] == 3284081640
        else:
            assert rows[("mem.total_bytes", "node")]["value"] == 20913917952 / 1024


def test_line_protocol_big_integers_stay_exact_and_bad_lines_are_rejected() -> None:
    line = b"infiniband,device=mlx5_0,port=1,host=h port_xmit_data=18446744073709551615i 1"
    b = DEC.decode("lp", line, None, Position(0, 1, NOW, None))
    assert b.table["raw"].to_pylist() == [2**64 - 1]
    with pytest.raises(RejectedInput) as e:
        DEC.decode("lp", b"cpu,host=h usage_user=abc 1", None, Position(0, 1, NOW, None))
    assert e.value.reason is Reason.UNDECODABLE
    with pytest.raises(RejectedInput) as e:
        DEC.decode("lp", b"cpu,host=h\n", None, Position(0, 1, NOW, None))
    assert e.value.reason is Reason.UNDECODABLE


def _collectd(values: list[int], dstype: str = "derive") -> bytes:
    return json.dumps([{
        "values": values, "dstypes": [dstype] * len(values), "dsnames": ["rx", "tx"],
        "time": 1700000000.125, "interval": 10.0, "host": "leeloo", "plugin": "interface",
        "plugin_instance": "eth0", "type": "if_octets", "type_instance": "",
    }]).encode()  # fmt: skip


def test_collectd_store_rates_is_the_topics_word_and_rates_never_become_counters() -> None:
    at = Position(0, 1, NOW, None)
    counters = _rows(DEC.decode("cdc", _collectd([100, 200]), None, at).table)
    assert counters[("net.rx_bytes", "eth0")]["raw"] == 100
    assert counters[("net.tx_bytes", "eth0")]["ts_ns"] == 1700000000125000000
    rates = _rows(DEC.decode("cd", _collectd([100, 200]), None, Position(0, 1, NOW, None)).table)
    assert rates[("net.tx_bytes_rate", "eth0")]["value"] == 200.0
    assert rates[("net.tx_bytes_rate", "eth0")]["raw"] is None
    assert not any(m == "net.tx_bytes" for m, _ in rates)


def test_collectd_cpu_jiffies_are_ticks() -> None:
    body = json.dumps(
        [
            {
                "values": [44490],
                "dstypes": ["derive"],
                "dsnames": ["value"],
                "time": 1700000000.0,
                "interval": 10,
                "host": "h",
                "plugin": "cpu",
                "plugin_instance": "2",
                "type": "cpu",
                "type_instance": "user",
            }
        ]
    )
    rows = _rows(DEC.decode("cdc", body.encode(), None, Position(0, 1, NOW, None)).table)
    assert rows[("cpu.user_seconds", "cpu2")]["raw"] == 44490


def test_header_must_agree_with_the_topic_format() -> None:
    with pytest.raises(RejectedInput) as e:
        DEC.decode("lp", b"x,host=h f=1 1", "application/x-protobuf", Position(0, 1, NOW, None))
    assert e.value.reason is Reason.UNSUPPORTED_CONTENT_TYPE


def test_native_topic_accepts_content_type_parameters() -> None:
    from schemas.codec import JSON, encode
    from schemas.wire import SAMPLES_SCHEMA, Envelope, SourceId

    env = Envelope(source=SourceId(node="n", exporter="e", instance="0", boot_id="b"),
                   seq=1, sent_ns=5)  # fmt: skip
    t = pa.table({"ts_ns": [5], "metric": ["gpu.temp"], "device": ["gpu0"], "value": [1.0],
                  "raw": pa.array([None], pa.uint64()), "text": pa.array([None], pa.string())},
                 schema=SAMPLES_SCHEMA)  # fmt: skip
    _, body = encode(env, t, JSON)
    b = DEC.decode("telemetry.raw", body, "application/json; charset=utf-8",
                   Position(0, 1, NOW, None))  # fmt: skip
    assert b.table.equals(t)


def test_several_hosts_in_one_message_are_rejected_by_name() -> None:
    body = b"cpu,host=a,cpu=cpu0 usage_user=1 1\ncpu,host=b,cpu=cpu0 usage_user=1 1\n"
    with pytest.raises(RejectedInput) as e:
        DEC.decode("lp", body, None, Position(0, 1, NOW, None))
    assert e.value.reason is Reason.BAD_ENVELOPE and "2 nodes" in e.value.detail


def _sdk_otlp(delta: bool) -> list[bytes]:
    """Two collections of the OpenTelemetry SDK, encoded by its own OTLP encoder."""
    from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
    from opentelemetry.sdk.metrics import Counter, Histogram, MeterProvider
    from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader
    from opentelemetry.sdk.resources import Resource

    temporality = AggregationTemporality.DELTA if delta else AggregationTemporality.CUMULATIVE
    reader = InMemoryMetricReader(
        preferred_temporality={Counter: temporality, Histogram: temporality}
    )
    provider = MeterProvider(resource=Resource.create({"host.name": "g7"}), metric_readers=[reader])
    meter = provider.get_meter("t")
    net = meter.create_counter("system.network.io", unit="By")
    util = meter.create_gauge("hw.gpu.utilization", unit="1")
    lat = meter.create_histogram("rpc.duration", unit="ms")
    out = []
    for i in range(2):
        net.add(4096, {"device": "ib0", "direction": "transmit"})
        util.set(0.25 * (i + 1), {"hw.id": "gpu3"})
        lat.record(5.0)
        data = reader.get_metrics_data()
        assert data is not None
        out.append(encode_metrics(data).SerializeToString())
    provider.shutdown()
    return out


def test_otlp_cumulative_sums_are_counters_with_the_start_time_as_boot() -> None:
    first, second = (
        DEC.decode("otlp", b, None, Position(0, 1, NOW, None)) for b in _sdk_otlp(False)
    )
    assert first.envelope.source.node == "g7" and first.envelope.source.exporter == "otlp"
    assert first.envelope.source.boot_id.startswith("start-")
    assert first.envelope.source.boot_id == second.envelope.source.boot_id
    r1, r2 = _rows(first.table), _rows(second.table)
    assert (r1[("net.tx_bytes", "ib0")]["raw"], r2[("net.tx_bytes", "ib0")]["raw"]) == (4096, 8192)
    assert r2[("gpu.util", "gpu3")]["value"] == 50.0  # a ratio, in the catalog's %
    assert r2[("rpc.duration.count", "node")]["value"] == 2.0  # histograms: count and sum
    # a restarted process starts counting again: a new start time, a new boot id
    again = DEC.decode("otlp", _sdk_otlp(False)[0], None, Position(0, 2, NOW, None))
    assert again.envelope.source.boot_id != first.envelope.source.boot_id


def test_otlp_delta_sums_become_rates_never_counters() -> None:
    b = DEC.decode("otlp", _sdk_otlp(True)[1], "application/x-protobuf", Position(0, 1, NOW, None))
    rows = _rows(b.table)
    assert ("net.tx_bytes", "ib0") not in rows
    assert ("net.tx_bytes_rate", "ib0") in rows and rows[("net.tx_bytes_rate", "ib0")][
        "raw"
    ] is None
    assert rows[("net.tx_bytes_rate", "ib0")]["value"] > 0


def test_otlp_json_decodes_like_protobuf() -> None:
    from google.protobuf import json_format
    from opentelemetry.proto.metrics.v1 import metrics_pb2

    pb = _sdk_otlp(False)[1]
    js = json_format.MessageToJson(metrics_pb2.MetricsData.FromString(pb)).encode()
    a = DEC.decode("otlp", pb, None, Position(0, 1, NOW, None))
    b = DEC.decode("otlp", js, "application/json", Position(0, 1, NOW, None))
    assert a.table.equals(b.table) and a.envelope == b.envelope


def test_every_bench_adapter_message_refines_whole() -> None:
    """The ingest bench measures what the worker does with mapped data: each adapter's
    messages refine entirely (no sample dead-lettered), counters with deltas after the first."""
    from lab.bench.ingest import SECOND, adapters, decode_rate
    from pipelines.refine.enrich import TopologyIndex
    from schemas.catalog import default_catalog
    from schemas.topics import TOPICS
    from services.worker.refiner import RawRecord, Refiner

    for a in adapters():
        assert decode_rate(a, 0.01) > 0
        start = NOW - 10 * SECOND
        topo = TopologyIndex([], [])
        refiner = Refiner(default_catalog(), TOPICS, lambda t=topo: t, lambda _: None,
                          lambda _: None, ingest=IngestDecoder({"t": a.format}))  # fmt: skip
        recs = [RawRecord("t", 0, i, b"b000", a.message(i, start + i * SECOND), [],
                          (start + i * SECOND) // 1_000_000) for i in range(3)]  # fmt: skip
        outs = refiner.process_group(recs, NOW)
        assert [o.outcome for o in outs] == ["refined"] * 3, a.name
        assert all(o.refined == o.input_samples == a.samples for o in outs), a.name


def test_float_counters_above_2_53_are_counted_as_inexact() -> None:
    from schemas.ingest.assemble import INEXACT

    before = INEXACT.inexact.get("net.rx_bytes", 0)
    body = b'node_network_receive_bytes_total{device="eth0"} 1.8446744073709e+19\n' \
        b'node_network_receive_bytes_total{device="eth1"} 12345\n'  # fmt: skip
    b = DEC.decode("prom", body, None, Position(0, 1, NOW, b"n"))
    assert INEXACT.inexact["net.rx_bytes"] == before + 1  # eth0 only
    assert b.table["raw"].to_pylist()[1] == 12345


def test_telegraf_ethtool_priorities_map_to_the_native_nic_devices() -> None:
    line = (
        b"ethtool,driver=mlx5_core,host=gn1,interface=eth2 rx_prio3_pause=17i,"
        b"tx_prio3_pause_duration=250i,rx_discards_phy=4i,tx_queue_1_packets=9i 1\n"
    )
    rows = _rows(DEC.decode("lp", line, None, Position(0, 1, NOW, None)).table)
    assert rows[("nic.rx_prio_pause", "eth2/prio3")]["raw"] == 17  # as refinery export node
    assert rows[("nic.tx_prio_pause_duration", "eth2/prio3")]["raw"] == 250
    assert rows[("nic.rx_discards_phy", "eth2")]["raw"] == 4
    assert ("ethtool.tx_queue_1_packets", "eth2") in rows  # unmapped: keeps its name
