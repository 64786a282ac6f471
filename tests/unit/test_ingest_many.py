"""Many messages of an ingest topic decoded in one call: per source one table, each row's
message known, each message exactly as decoding it alone gives it, a bad one rejected alone."""

from __future__ import annotations

import json

import pytest

from schemas.ingest import IngestDecoder, Message, Position
from schemas.reasons import Reason

NOW = 1_700_000_000_000_000_000
DEC = IngestDecoder({"lp": "influx", "cd": "collectd", "cdc": "collectd_counters",
                     "otlp": "otlp"})  # fmt: skip


def _influx(k: int) -> bytes:
    host, cpu = f"h{k % 3}", k % 4
    return (f"cpu,cpu=cpu{cpu},host={host} usage_user={k}.5,time_user={100 + k}.25 "
            f"{NOW + k * 10**9}").encode()  # fmt: skip


def _collectd(k: int, host: str | None = None) -> bytes:
    vl = {"values": [10**9 + k * 4096, 2**60 + k], "dstypes": ["derive", "derive"],
          "dsnames": ["rx", "tx"], "time": 1.7e9 + k, "interval": 1.0,
          "host": f"h{k % 3}" if host is None else host, "plugin": "interface",
          "plugin_instance": f"eth{k % 2}",
          "type": "if_octets", "type_instance": ""}  # fmt: skip
    return json.dumps([vl]).encode()


def _msgs(bodies: list[bytes], partition: int = 2, key: bytes | None = None) -> list[Message]:
    return [(b, None, Position(partition, 100 + k, NOW + k, key)) for k, b in enumerate(bodies)]


def _same_as_alone(topic: str, msgs: list[Message]) -> set[int]:
    """Every unit's members decode alone to their rows of the unit; returns the members."""
    got = DEC.decode_many(topic, msgs)
    seen: set[int] = set()
    for unit in got.units:
        row = 0
        for m, n, sent in zip(unit.members, unit.counts, unit.sent_ns, strict=True):
            alone = DEC.decode(topic, *msgs[m])
            assert alone.envelope.source == unit.source
            assert alone.envelope.sent_ns == sent
            assert unit.table.slice(row, n).equals(alone.table), m
            row += n
        assert row == unit.table.num_rows
        assert unit.members == sorted(unit.members)
        seen |= set(unit.members)
    assert not seen & set(got.rejected)
    assert seen | set(got.rejected) == set(range(len(msgs)))
    return seen


@pytest.mark.parametrize("topic", ["lp", "cd", "cdc"])
def test_a_wave_decodes_as_each_message_alone_one_unit_per_host(topic: str) -> None:
    make = _influx if topic == "lp" else _collectd
    msgs = _msgs([make(k) for k in range(30)])
    assert _same_as_alone(topic, msgs) == set(range(30))
    got = DEC.decode_many(topic, msgs)
    assert sorted(u.source.node for u in got.units) == ["h0", "h1", "h2"]
    assert {u.source.instance for u in got.units} == {"p2"}
    # lineage: each member's batch says its own offset as its seq
    for u in got.units:
        batches = u.batches([m[2] for m in msgs])
        assert [b.envelope.seq for b in batches] == [100 + m for m in u.members]


@pytest.mark.parametrize("topic", ["lp", "cd"])
def test_a_poison_message_among_good_ones_is_rejected_alone(topic: str) -> None:
    make = _influx if topic == "lp" else _collectd
    bodies = [make(k) for k in range(12)]
    bodies[3] = b"cpu,host=h0 usage_user" if topic == "lp" else b'[{"values": [1]}]'
    bodies[7] = b"\xff\xfe not text" if topic == "lp" else b"[{not json"
    msgs = _msgs(bodies, key=b"h0")  # keyed: a rejected message still names a node
    assert _same_as_alone(topic, msgs) == set(range(12)) - {3, 7}
    got = DEC.decode_many(topic, msgs)
    assert set(got.rejected) == {3, 7}
    assert len(got.units) == 3  # the others still read in one pass, one unit per host
    assert {e.reason for e in got.rejected.values()} == {Reason.UNDECODABLE}


def test_a_value_that_is_no_number_fails_the_joined_pass_and_only_its_message() -> None:
    bodies = [_influx(k) for k in range(80)]
    bodies[40] = f"cpu,cpu=cpu0,host=h1 usage_user=abc {NOW}".encode()
    got = DEC.decode_many("lp", _msgs(bodies))
    assert set(got.rejected) == {40}
    assert _same_as_alone("lp", _msgs(bodies)) == set(range(80)) - {40}


def test_messages_of_two_nodes_or_of_none_are_rejected_alone() -> None:
    two = json.dumps([json.loads(_collectd(0, "a"))[0], json.loads(_collectd(1, "b"))[0]])
    nameless = _collectd(5, "")
    msgs = _msgs([_collectd(1), two.encode(), _collectd(2), nameless])
    got = DEC.decode_many("cd", msgs)
    assert got.rejected[1].reason is Reason.BAD_ENVELOPE and "2 nodes" in got.rejected[1].detail
    assert got.rejected[3].reason is Reason.BAD_ENVELOPE  # no host and no Kafka key
    assert _same_as_alone("cd", msgs) == {0, 2}


def test_a_content_type_that_disagrees_or_an_empty_value_is_rejected_alone() -> None:
    msgs = _msgs([_influx(k) for k in range(4)])
    msgs[1] = (msgs[1][0], "application/json", msgs[1][2])
    msgs[2] = (b"", None, msgs[2][2])
    got = DEC.decode_many("lp", msgs)
    assert got.rejected[1].reason is Reason.UNSUPPORTED_CONTENT_TYPE
    assert got.rejected[2].reason is Reason.UNDECODABLE
    assert _same_as_alone("lp", msgs) == {0, 3}


def test_mixed_collectd_shapes_and_exact_counters_past_2_53() -> None:
    pretty = json.dumps(json.loads(_collectd(4)), indent=2).encode()  # not one line
    floats = json.dumps([{**json.loads(_collectd(5))[0], "values": [1.5, 2.25]}]).encode()
    two = json.dumps([json.loads(_collectd(6))[0], json.loads(_collectd(9))[0]]).encode()
    msgs = _msgs([_collectd(0), pretty, _collectd(1), floats, _collectd(2), two])
    assert _same_as_alone("cdc", msgs) == set(range(6))
    got = DEC.decode_many("cdc", msgs)
    assert len(got.units) == 3  # one pass for all: the odd shapes one by one within it
    raws = [r for u in got.units for r in u.table.column("raw").to_pylist()]
    assert 2**60 + 1 in raws  # an integer counter stays exact past 2**53


def test_other_formats_decode_one_by_one_with_the_same_contract() -> None:
    msgs: list[Message] = [(b"\x0a\x00", None, Position(0, 1, NOW, b"n1")), (b"{x", None,
                           Position(0, 2, NOW, b"n1"))]  # fmt: skip
    got = DEC.decode_many("otlp", msgs)
    assert set(got.rejected) | {m for u in got.units for m in u.members} == {0, 1}
    assert got.rejected[1].reason is Reason.UNDECODABLE


def _otlp_json(k: int, host: str, histogram: bool = False, ints_as_numbers: bool = False) -> bytes:
    """An OTLP metrics request in the Collector's otlp_json spelling: a gauge, a cumulative
    and a delta monotonic sum, a non-monotonic sum, int and double points."""
    from google.protobuf import json_format
    from opentelemetry.proto.metrics.v1 import metrics_pb2 as pb

    data = pb.MetricsData()
    rm = data.resource_metrics.add()
    for key, v in (("host.name", host), ("service.name", "svc")):
        a = rm.resource.attributes.add()
        a.key, a.value.string_value = key, v
    sm = rm.scope_metrics.add()
    t = NOW + k * 10**9
    for name, kind, delta, mono in (("system.cpu.utilization", "gauge", False, False),
                                     ("system.network.io", "sum", False, True),
                                     ("system.network.packets", "sum", True, True),
                                     ("system.memory.usage", "sum", False, False)):  # fmt: skip
        m = sm.metrics.add()
        m.name = name
        body = m.gauge if kind == "gauge" else m.sum
        if kind == "sum":
            m.sum.is_monotonic = mono
            m.sum.aggregation_temporality = 1 if delta else 2
        for d in range(3):
            p = body.data_points.add()
            p.time_unix_nano, p.start_time_unix_nano = t, NOW - 10**9 * (1 + k % 2)
            a = p.attributes.add()
            a.key, a.value.string_value = "device", f"eth{d}"
            if d == 1:
                a2 = p.attributes.add()
                a2.key, a2.value.int_value = "cpu", d
            if d == 2:
                p.as_double = 1.5 + k
            else:
                p.as_int = 2**60 + k * 1000 + d
    if histogram:
        h = sm.metrics.add()
        h.name = "rpc.duration"
        hp = h.histogram.data_points.add()
        hp.time_unix_nano, hp.count, hp.sum = t, 3, 1.5
    text = json_format.MessageToJson(data, indent=None)
    if ints_as_numbers:  # the Collector writes the temporality as a number
        text = text.replace('"AGGREGATION_TEMPORALITY_DELTA"', "1").replace(
            '"AGGREGATION_TEMPORALITY_CUMULATIVE"', "2")  # fmt: skip
    return text.encode()


@pytest.mark.parametrize("numbers", [False, True])
def test_otlp_json_many_messages_read_in_one_pass_as_each_alone(numbers: bool) -> None:
    msgs = _msgs([_otlp_json(k, f"h{k % 2}", ints_as_numbers=numbers) for k in range(8)])
    assert _same_as_alone("otlp", msgs) == set(range(8))
    got = DEC.decode_many("otlp", msgs)
    # one unit per host and start time (boot id): the joined pass, not one by one
    assert len(got.units) == 2
    assert {u.source.boot_id for u in got.units} == {f"start-{NOW - 10**9}",
                                                      f"start-{NOW - 2 * 10**9}"}  # fmt: skip


def test_otlp_json_with_histograms_or_a_bad_message_still_decodes_each_as_alone() -> None:
    bodies = [_otlp_json(k, "h0") for k in range(4)]
    bodies[1] = _otlp_json(1, "h0", histogram=True)
    bodies[2] = b'{"resourceMetrics": [{"scopeMetrics": 7}]}'
    msgs = _msgs(bodies)
    assert _same_as_alone("otlp", msgs) == {0, 1, 3}
    assert DEC.decode_many("otlp", msgs).rejected[2].reason is Reason.UNDECODABLE


def _odd_collectd() -> list[bytes]:
    """Bodies that each break one of the joined pass's one-line checks, or nearly."""
    vl = json.loads(_collectd(7))[0]
    return [
        json.dumps([{**vl, "type_instance": "values"}]).encode(),  # "values" twice
        json.dumps([vl]).replace(", ", ",\r", 1).encode(),  # a CR (JSON whitespace)
        b" " + _collectd(8),  # not starting with [{
        _collectd(9) + b" ",  # not ending with }]
        json.dumps([{k: v for k, v in vl.items() if k != "values"}]).encode(),  # none
        b"[]",
        b"[{}]",
        json.dumps({**vl, "host": "h9"}).encode(),  # an object, not an array
    ]


@pytest.mark.parametrize("odd", range(len(_odd_collectd()) + 1))
def test_one_line_value_lists_are_found_on_the_joined_text_as_one_by_one(odd: int) -> None:
    from schemas.ingest.collectd import _one_line, _one_line_list

    bodies = [_collectd(k) for k in range(12)]
    if odd < len(_odd_collectd()):
        bodies[5] = _odd_collectd()[odd]
    fast, joined = _one_line(bodies)
    assert fast == [k for k, b in enumerate(bodies) if _one_line_list(b)]
    assert (joined is None) == (len(fast) < len(bodies))
    for topic in ("cd", "cdc"):
        seen = _same_as_alone(topic, _msgs(bodies))
        assert seen >= set(range(12)) - {5}


def test_otlp_json_series_seen_in_an_earlier_wave_keep_their_ids_new_ones_join() -> None:
    first = _msgs([_otlp_json(k, f"h{k % 2}") for k in range(4)])
    later = _msgs([_otlp_json(k, f"h{k % 3}") for k in range(4, 10)])  # h2 is new
    assert _same_as_alone("otlp", first) == set(range(4))
    assert _same_as_alone("otlp", later) == set(range(6))
    hosts = {u.source.node for u in DEC.decode_many("otlp", later).units}
    assert hosts == {"h0", "h1", "h2"}
