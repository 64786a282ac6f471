"""A wave of collectd write_kafka messages read by byte scans: every message exactly as the
JSON path reads it alone, and any wave the scan cannot vouch for left to that path."""

from __future__ import annotations

import json
import math
import random
from typing import Any

import pyarrow as pa
import pytest

import schemas.ingest.collectd as collectd
from schemas.ingest import IngestDecoder, Message, Position
from schemas.ingest.collectd_scan import scan_wave

NOW = 1_700_000_000_000_000_000
DEC = IngestDecoder({"cd": "collectd", "cdc": "collectd_counters"})


def _vl(k: int, **over: Any) -> dict[str, Any]:
    vl = {"values": [10**9 + k * 4096, 2**60 + k], "dstypes": ["derive", "derive"],
          "dsnames": ["rx", "tx"], "time": round(1.7e9 + k * 0.25, 3), "interval": 10.0,
          "host": f"h{k % 3}", "plugin": "interface", "plugin_instance": f"eth{k % 2}",
          "type": "if_octets", "type_instance": ""}  # fmt: skip
    vl.update(over)
    return vl


def _body(vl: dict[str, Any], compact: bool = False) -> bytes:
    return json.dumps([vl], separators=(",", ":") if compact else None).encode()


def _msgs(bodies: list[bytes]) -> list[Message]:
    return [(b, None, Position(1, 50 + k, NOW + k, None)) for k, b in enumerate(bodies)]


def _scanned(bodies: list[bytes], store_rates: bool) -> bool:
    collectd._REG.begin()
    return scan_wave(bodies, store_rates, collectd._REG,
                     lambda vl: collectd._describe(vl, store_rates)) is not None  # fmt: skip


def _rows(table: pa.Table) -> list[tuple[Any, ...]]:
    """The rows of ``table``, NaN shown as a string (NaN is not equal to itself)."""
    cols = [[("nan" if isinstance(v, float) and math.isnan(v) else v) for v in c.to_pylist()]
            for c in table.columns]  # fmt: skip
    return list(zip(*cols, strict=True))


def _same_as_alone(topic: str, msgs: list[Message]) -> set[int]:
    """Each unit member's rows are those of the message decoded alone; returns the
    rejected messages (each rejected alone too, with the same reason)."""
    got = DEC.decode_many(topic, msgs)
    for unit in got.units:
        row = 0
        for m, n, sent in zip(unit.members, unit.counts, unit.sent_ns, strict=True):
            alone = DEC.decode(topic, *msgs[m])
            assert alone.envelope.source == unit.source
            assert alone.envelope.sent_ns == sent
            assert _rows(unit.table.slice(row, n)) == _rows(alone.table), m
            row += n
    for k, e in got.rejected.items():
        with pytest.raises(type(e)) as alone:
            DEC.decode("cd" if topic == "cd" else "cdc", *msgs[k])
        assert alone.value.reason == e.reason
    return set(got.rejected)


def _mixed(k: int, rng: random.Random) -> dict[str, Any]:
    """Value lists as collectd writes them: gauges (floats, whole numbers, null), derives
    (negative too), counters past 2**53, absolute counts, several data sources."""
    kind = k % 5
    if kind == 0:
        return _vl(k, plugin="load", type="load", plugin_instance="", dsnames=["shortterm",
                   "midterm", "longterm"], dstypes=["gauge"] * 3,
                   values=[rng.random() * 4, 2, None])  # fmt: skip
    if kind == 1:
        return _vl(k, values=[-5 - k, 2**64 - 1 - k])
    if kind == 2:
        return _vl(k, plugin="cpu", type="cpu", plugin_instance=str(k % 4),
                   type_instance="user", dsnames=["value"], dstypes=["counter"],
                   values=[2**53 + 1 + k])  # fmt: skip
    if kind == 3:
        return _vl(k, dstypes=["absolute", "gauge"], values=[30 + k, float("nan")])
    if k % 10 == 4:  # many data sources in one list
        return _vl(k, dstypes=["gauge"] * 200, dsnames=[f"d{i}" for i in range(200)],
                   values=[i * 0.5 for i in range(200)])  # fmt: skip
    return _vl(k, time=int(1.7e9) + k, interval=1)


@pytest.mark.parametrize("topic", ["cd", "cdc"])
@pytest.mark.parametrize("compact", [False, True])
def test_a_regular_wave_is_scanned_and_reads_as_each_message_alone(
    topic: str, compact: bool
) -> None:
    rng = random.Random(7)
    bodies = [_body(_mixed(k, rng), compact) for k in range(60)]
    assert _scanned(bodies, topic == "cd")
    assert _same_as_alone(topic, _msgs(bodies)) == set()


BAD: list[bytes] = [
    b'[{"values":[1],"dstypes":["derive"],"dsnames":["v"],"time":5,"time":6,'
    b'"interval":1,"host":"h","plugin":"p","type":"t"}]',  # a second time
    _body(_vl(1, time="1700000000")),  # a time as a string
    _body(_vl(1, time=-3.5)),  # a negative time
    _body(_vl(1, host="h\\x")),  # an escape
    b"[" + _body(_vl(1))[1:-1] + b"," + _body(_vl(2))[1:-1] + b"]",  # two value lists
    _body(_vl(1, values=[1])),  # fewer values than data sources
    _body(_vl(1, values=["1", 2])),  # a value as a string
    _body(_vl(1, values=[True, 2])),  # a value true
    _body(_vl(1, dstypes=[["derive"], "derive"])),  # a data source type as a list
    _body(_vl(1, meta={"time": 1})),  # a time in a nested object
    _body(_vl(1)).replace(b'"time": ', b'"time": +'),  # not JSON
    _body(_vl(1)).replace(b'"time": 1', b'"time": 01'),  # not JSON
    _body(_vl(1)).replace(b"]", b", ]", 1),  # not JSON
    _body(_vl(1)).replace(b"4096", b"4096 7", 1),  # not JSON
    _body(_vl(1))[:-1],  # cut short
    _body(_vl(1, values=[], dstypes=[], dsnames=[])),  # no values
    _body(_vl(1, values=[{"a": 1, "b": 2}])),  # an object
]


@pytest.mark.parametrize("bad", range(len(BAD)))
def test_a_wave_with_an_irregular_message_reads_as_each_message_alone(bad: int) -> None:
    bodies = [_body(_vl(k)) for k in range(20)]
    bodies[7] = BAD[bad]
    assert not _scanned(bodies, False)
    rejected = _same_as_alone("cdc", _msgs(bodies))
    assert rejected <= {7}
    members = {m for u in DEC.decode_many("cdc", _msgs(bodies)).units for m in u.members}
    assert members | {7} == set(range(20))  # the others all flow


def test_templates_are_remembered_across_waves_values_and_times_are_not() -> None:
    first = [_body(_vl(k)) for k in range(12)]
    later = [_body(_vl(k, values=[k, 2**63 + k], time=1.8e9 + k)) for k in range(12)]
    assert _same_as_alone("cdc", _msgs(first)) == set()
    assert _scanned(later, False)
    got = DEC.decode_many("cdc", _msgs(later))
    raw = [r for u in got.units for r in u.table.column("raw").to_pylist()]
    assert sorted(raw) == sorted([k for k in range(12)] + [2**63 + k for k in range(12)])
    assert _same_as_alone("cdc", _msgs(later)) == set()


def test_a_scanned_wave_of_two_partitions_and_keyed_hosts_reads_as_each_alone() -> None:
    bodies = [_body(_vl(k, host="" if k % 4 == 3 else f"h{k % 3}")) for k in range(24)]
    msgs: list[Message] = [
        (b, None, Position(k % 2, 50 + k, NOW + k, b"keyed" if k % 8 == 3 else None))
        for k, b in enumerate(bodies)
    ]
    assert _scanned(bodies, False)
    rejected = _same_as_alone("cdc", msgs)
    assert rejected == {k for k in range(24) if k % 4 == 3 and k % 8 != 3}  # no host, no key
    got = DEC.decode_many("cdc", msgs)
    assert {(u.source.node, u.source.instance) for u in got.units} == {
        (f"h{h}", f"p{p}") for h in range(3) for p in range(2)
    } | {("keyed", "p1")}
