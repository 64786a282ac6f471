"""What third-party producers send by default maps onto the catalog: of each producer's
fixture (tests/fixtures/ingest/, provenance in tests/fixtures/README.md), at most 1 % of the
samples the refiner takes in are dead-lettered as ``unknown_metric``.

Each fixture goes through the worker's :class:`~services.worker.refiner.Refiner` as the
ingest topic's records, and the share is counted from the outcomes' reasons: the same path
the dead letters take in production."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from pipelines.refine.enrich import TopologyIndex
from schemas.catalog import default_catalog
from schemas.ingest import IngestDecoder, Position
from schemas.topics import TOPICS
from services.worker.refiner import RawRecord, Refiner

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "ingest"
NOW = 1_800_000_000_000_000_000
MAX_UNKNOWN_SHARE = 0.01

Message = tuple[bytes | None, bytes]  # key, value


def _refine(fmt: str, msgs: list[Message]) -> tuple[int, int, Counter[str]]:
    """(samples in, samples dead-lettered as unknown_metric, each unmapped name's samples) of
    ``msgs`` refined as the records of one partition of a topic of format ``fmt``."""
    topo = TopologyIndex([], [])
    refiner = Refiner(default_catalog(), TOPICS, lambda: topo, lambda _: None,
                      lambda _: None, ingest=IngestDecoder({"t": fmt}))  # fmt: skip
    recs = [RawRecord("t", 0, i, key, value, [], NOW // 1_000_000) for i, (key, value)
            in enumerate(msgs)]  # fmt: skip
    outs = refiner.process_group(recs, NOW)
    unknown = sum(o.reasons.get("unknown_metric", 0) for o in outs)
    names = _unmapped_names(fmt, msgs)
    return sum(o.input_samples for o in outs), unknown, names


def _unmapped_names(fmt: str, msgs: list[Message]) -> Counter[str]:
    """The names the decoder leaves out of the catalog, with their samples (the message of a
    failing assertion)."""
    dec = IngestDecoder({"t": fmt})
    cat = default_catalog()
    got: Counter[str] = Counter()
    for i, (key, value) in enumerate(msgs):
        batch = dec.decode("t", value, None, Position(0, i, NOW, key))
        got.update(m for m in batch.table["metric"].to_pylist() if m not in cat)
    return got


def _lines(name: str) -> list[Message]:
    """One message per line (Telegraf's Kafka output: a metric a message), comments left out."""
    text = (FIX / name).read_bytes()
    return [(None, x) for x in text.splitlines() if x.strip() and not x.startswith(b"#")]


def _records(name: str) -> list[Message]:
    """Captured Kafka records, one JSON object a line: its key and value."""
    out: list[Message] = []
    for line in (FIX / name).read_text().splitlines():
        doc = json.loads(line)
        out.append((doc["key"].encode() if doc.get("key") else None, doc["value"].encode()))
    return out


def _assert_mapped(fmt: str, msgs: list[Message], at_least: int) -> None:
    n, unknown, names = _refine(fmt, msgs)
    assert n >= at_least  # the fixture is read whole
    assert unknown / n <= MAX_UNKNOWN_SHARE, f"{unknown} of {n} unknown: {names.most_common()}"
    assert unknown == sum(names.values())


def _whole(name: str, key: bytes | None = None) -> list[Message]:
    """The file as one message (an exposition pushed as is)."""
    return [(key, (FIX / name).read_bytes())]


def _records_plain(name: str) -> list[Message]:
    """One message a line, no key (the Collector's otlp_json, one document a line)."""
    return [(None, x) for x in (FIX / name).read_bytes().splitlines() if x.strip()]


# producer: (topic format, its messages, at least this many samples in them)
PRODUCERS: dict[str, tuple[str, Callable[[], list[Message]], int]] = {
    # real capture: prometheus-node-exporter 1.5.0 (Debian 12), every default collector
    "node_exporter": (
        "prometheus",
        lambda: _whole("node_exporter-1.5.0-defaults.prom", b"gpu-node-07"),
        500,
    ),
    # dcgm-exporter's default field list, 8 GPUs
    "dcgm-exporter": ("prometheus", lambda: _whole("dcgm-exporter-defaults.prom"), 200),
    # Telegraf's default inputs plus net, nvidia_smi and infiniband, one metric a message
    "telegraf": ("influx", lambda: _lines("telegraf-defaults.lp"), 300),
    # real capture: collectd 5.12 write_kafka, Debian's default plugins, StoreRates true/false
    "collectd": ("collectd", lambda: _records("collectd-5.12-write_kafka-storerates.jsonl"), 400),
    "collectd_counters": (
        "collectd_counters",
        lambda: _records("collectd-5.12-write_kafka-counters.jsonl"),
        400,
    ),
    # the Collector's hostmetrics receiver, every default scraper, as otlp_json
    "otelcol-hostmetrics": ("otlp", lambda: _records_plain("otelcol-hostmetrics.jsonl"), 100),
}


@pytest.mark.parametrize("producer", sorted(PRODUCERS))
def test_default_output_of_each_producer_maps_onto_the_catalog(producer: str) -> None:
    fmt, messages, at_least = PRODUCERS[producer]
    _assert_mapped(fmt, messages(), at_least)


# --- a producer without a host identity -----------------------------------------------------


def _outputs(
    fmt: str, msgs: list[Message]
) -> list[tuple[dict[str, object], list[dict[str, object]]]]:
    """Per record: its accounting document and its dead letters."""
    topo = TopologyIndex([], [])
    topics = TOPICS
    refiner = Refiner(default_catalog(), topics, lambda: topo, lambda _: None, lambda _: None,
                      ingest=IngestDecoder({"t": fmt}))  # fmt: skip
    recs = [RawRecord("t", 0, i, key, value, [], NOW // 1_000_000) for i, (key, value)
            in enumerate(msgs)]  # fmt: skip
    out = []
    for o in refiner.process_group(recs, NOW):
        docs = [(m.topic, json.loads(bytes(m.value))) for m in o.messages
                if m.topic in (topics.accounting, topics.deadletter)]  # fmt: skip
        acc = [d for t, d in docs if t == topics.accounting]
        assert len(acc) == 1
        out.append((acc[0], [d for t, d in docs if t == topics.deadletter]))
    return out


def _balanced(acc: dict[str, object]) -> bool:
    parts = ("refined_samples", "duplicate_samples", "quarantined_samples")
    return acc["input_samples"] == sum(int(acc[p]) for p in parts)  # type: ignore[call-overload]


def _samples(fmt: str, value: bytes) -> int:
    """How many samples ``value`` decodes to where it names its host (the Kafka key does)."""
    batch = IngestDecoder({"t": fmt}).decode("t", value, None, Position(0, 0, NOW, b"h"))
    return int(batch.table.num_rows)


def test_collector_without_resourcedetection_is_told_to_set_host_name() -> None:
    """The Collector's kafka exporter keys a record by a hash of the resource attributes: with
    no resourcedetection processor there is no host.name and the key is no name."""
    value = _records_plain("otelcol-hostmetrics-no-resourcedetection.jsonl")[0][1]
    key = bytes.fromhex("00008f3a1c0000000000e2d4b5a69788")
    ((acc, dls),) = _outputs("otlp", [(key, value)])  # decoded alone
    # decoded with a record of a Collector that has resourcedetection: that one flows
    named = _records_plain("otelcol-hostmetrics.jsonl")[0]
    (ok, _), (also, _) = _outputs("otlp", [named, (key, value)])
    assert ok["outcome"] != "deadletter" and ok["node"] == "gpu-node-07"
    assert {**also, "raw_offset": 0} == acc  # the same accounting, at offset 1
    (dl,) = dls
    assert dl["reason"] == "bad_envelope" and dl["scope"] == "record"
    detail = str(dl["detail"])
    assert "set resource attribute host.name" in detail and "resourcedetection" in detail
    assert "not a valid name" not in detail
    n = _samples("otlp", value)
    assert n > 100
    assert dl["samples"] == n  # accounted for, not lost
    assert (acc["outcome"], acc["input_samples"], acc["quarantined_samples"]) == (
        "deadletter",
        n,
        n,
    )
    assert _balanced(acc)


def test_telegraf_line_without_host_tag_names_the_tag_and_the_rest_flows() -> None:
    lines = [b"cpu,cpu=cpu0,host=gn1 usage_user=1,usage_idle=99 1733500000000000000",
             b"cpu,cpu=cpu1 usage_user=2,usage_idle=98,usage_system=0 1733500000000000000",
             b"mem,host=gn1 free=1024i 1733500000000000000"]  # fmt: skip
    got = _outputs("influx", [(None, x) for x in lines])
    assert [a["outcome"] for a, _ in got][1] == "deadletter"
    assert all(_balanced(a) for a, _ in got)
    acc, (dl,) = got[1]
    assert "host tag" in str(dl["detail"]) and "omit_hostname" in str(dl["detail"])
    assert acc["input_samples"] == acc["quarantined_samples"] == dl["samples"] == 3
    assert [a["input_samples"] for a, _ in got] == [2, 3, 1]
    assert got[0][0]["node"] == got[2][0]["node"] == "gn1"


def test_collectd_without_host_names_hostname() -> None:
    vl = {"values": [5], "dstypes": ["gauge"], "dsnames": ["value"], "time": 1733500000.0,
          "interval": 10.0, "host": "", "plugin": "load", "plugin_instance": "",
          "type": "entropy", "type_instance": ""}  # fmt: skip
    one = json.dumps([vl]).encode()
    ((acc, (dl,)),) = _outputs("collectd", [(None, one)])
    assert "Hostname" in str(dl["detail"])
    assert acc["input_samples"] == acc["quarantined_samples"] == 1 and _balanced(acc)
    # a Kafka key that is a host name stands in for the host (write_kafka's Key)
    ((acc, dls),) = _outputs("collectd", [(b"gn2", one)])
    assert acc["node"] == "gn2" and not [d for d in dls if d["reason"] == "bad_envelope"]


# --- the unknown_metric dead letter names what it rejects -----------------------------------


def test_unknown_metric_detail_names_every_name_or_says_how_many_more() -> None:
    few = b"cpu,cpu=cpu0,host=gn1 made_up_a=1,made_up_b=2,made_up_c=3 1733500000000000000"
    ((_, dls),) = _outputs("influx", [(None, few)])
    (dl,) = [d for d in dls if d["reason"] == "unknown_metric"]
    for name in ("cpu.made_up_a", "cpu.made_up_b", "cpu.made_up_c"):
        assert name in str(dl["detail"])
    fields = ",".join(f"field_number_{i:03d}={i}" for i in range(300))
    many = f"cpu,cpu=cpu0,host=gn1 {fields} 1733500000000000000".encode()
    ((_, dls),) = _outputs("influx", [(None, many)])
    (dl,) = [d for d in dls if d["reason"] == "unknown_metric"]
    detail = str(dl["detail"])
    assert dl["samples"] == 300 and len(detail) <= 1024
    shown = detail.count("cpu.field_number_")
    assert 5 < shown < 300 and detail.endswith(f" and {300 - shown} more")


def test_dead_letter_lands_and_its_position_reads_without_quotes(tmp_path: Path) -> None:
    """``offset`` is a DuckDB keyword: the deadletter view gives the position as raw_topic,
    raw_partition, raw_offset (as refine_accounting names it) for ``refinery sql``."""
    from schemas.codec import JSON
    from services.lake import sqlload
    from services.lake.decode import rows_of
    from services.lake.writer import LakeWriter

    ((_, (dl,)),) = _outputs("influx", [(None, b"cpu,cpu=cpu0 usage_user=1 1733500000000000000")])
    w = LakeWriter(tmp_path)
    w.ensure_seeds()
    rows = rows_of("deadletter", json.dumps(dl).encode(), JSON, partition=0, offset=17,
                   timestamp_ns=NOW)  # fmt: skip
    w.land("deadletter", rows, partition=0, first=17, last=17)
    con = sqlload.connect(tmp_path)
    got = con.execute(
        "SELECT raw_topic, raw_partition, raw_offset, samples, reason FROM deadletter "
        "WHERE raw_offset = 0 ORDER BY raw_offset"
    ).fetchall()
    assert got == [("t", 0, 0, 1, "bad_envelope")]
