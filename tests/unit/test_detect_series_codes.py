"""Detect's cheaper paths give what the plain ones gave: rollup series codes kept between
batches, the group's refined tables as one, closed rollups split per node, and the rows a
rule's hysteresis walk steps."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from pipelines.detect.alerts import HI, LO, AlertBook
from pipelines.detect.rollup import SeriesIds, coded, merge_coded, merge_partials, named
from pipelines.detect.rule_eval import MetricIndex, _hot
from services.detect.core import _by_node, _one_table


def _series(rows: list[tuple[str, str, str]]) -> pa.Table:
    node, device, metric = (list(c) for c in zip(*rows, strict=True))
    return pa.table({"node": node, "device": device, "metric": metric})


def test_series_codes_are_kept_between_batches_and_map_back_to_their_names() -> None:
    ids = SeriesIds()
    first = _series([("n1", "gpu0", "gpu.temp"), ("n2", "gpu0", "gpu.temp")])
    second = _series([("n3", "gpu1", "gpu.power"), ("n2", "gpu0", "gpu.temp")])
    a, b = ids.codes(first).to_pylist(), ids.codes(second).to_pylist()
    assert a[1] == b[1]  # the same series, the same code, whatever the batch
    assert len({*a, *b}) == 3
    node, device, metric = ids.names(ids.codes(second))
    assert node.to_pylist() == ["n3", "n2"]
    assert device.to_pylist() == ["gpu1", "gpu0"]
    assert metric.to_pylist() == ["gpu.power", "gpu.temp"]


def test_partials_merge_the_same_through_codes_of_any_numbering() -> None:
    partial = pa.table(
        {
            "window_start": [0, 0, 10, 0],
            "node": ["n1", "n2", "n1", "n1"],
            "device": ["gpu0", "gpu0", "gpu0", "gpu0"],
            "metric": ["m", "m", "m", "m"],
            "min": [1.0, 2.0, 3.0, 0.5],
            "max": [1.0, 2.0, 3.0, 4.0],
            "sum": [1.0, 2.0, 3.0, 0.1],
            "count": [1, 1, 1, 2],
            "last": [1.0, 2.0, 3.0, 4.0],
            "last_ts": [5, 6, 15, 7],
        }
    )
    ids = SeriesIds()
    ids.codes(_series([("n9", "gpu9", "other")]))  # an older numbering
    via_ids = named(merge_coded(coded(partial, ids)), ids)
    order = [(k, "ascending") for k in ("window_start", "node", "device", "metric")]
    got = via_ids.sort_by(order).to_pylist()
    assert got == merge_partials(partial).sort_by(order).to_pylist()
    (n1,) = [r for r in got if r["node"] == "n1" and r["window_start"] == 0]
    assert (n1["min"], n1["max"], n1["count"], n1["last"]) == (0.5, 4.0, 3, 4.0)


def test_one_table_holds_every_row_and_value_of_the_group() -> None:
    parts = [
        pa.table({"node": ["a"] * 3, "ts": [1, 2, 3], "boot_id": ["x"] * 3}),
        pa.table({"node": ["b"] * 2, "ts": [4, 5], "boot_id": ["y"] * 2}),
    ]
    one = _one_table(parts)
    assert one.to_pylist() == pa.concat_tables(parts).to_pylist()
    assert one.column("ts").num_chunks == 1  # read on every row: one chunk
    assert one.column("boot_id").num_chunks == 2  # read by nothing: left as it came


def test_closed_rollups_split_per_node_as_filtering_per_node_did() -> None:
    t = pa.table({"node": ["b", "a", "b", "c", "a"], "x": [1, 2, 3, 4, 5]})
    got = {node: part.to_pylist() for node, part in _by_node(t)}
    want = {n: t.filter(pc.equal(t["node"], n)).to_pylist() for n in set(t["node"].to_pylist())}
    assert got == want
    assert [n for n, _ in _by_node(t)] == ["b", "a", "c"]  # in order of first row
    assert _by_node(t.slice(0, 0)) == []


def test_the_walk_keeps_the_rows_of_series_it_may_step() -> None:
    t = pa.table(
        {
            "node": ["n1", "n2", "n1", "n2", "n3"],
            "device": ["g0", "g0", "g0", "g0", "mlx5_0/1"],  # a device name may hold a "/"
            "metric": ["m"] * 5,
            "ts": [2, 3, 1, 4, 5],
        }
    )
    ix = MetricIndex(t)
    pos = ix.positions("m")
    assert pos.to_pylist() == [2, 0, 1, 3, 4]  # in (series, ts) order
    cls = pa.array([LO, HI, LO, LO, LO], pa.int8())  # per position
    book = AlertBook()
    book.get("r", "n3/mlx5_0/1")  # a series with state (pending or firing) from a batch before
    book.get("other", "n2/g0")  # another rule's: not this one's
    got = _hot("r", ix, book, pos, cls)
    assert got is not None
    kept, kept_cls = got
    assert pc.take(t["node"], kept).to_pylist() == ["n1", "n1", "n3"]
    assert kept_cls.to_pylist() == [LO, HI, LO]
    assert _hot("r", ix, AlertBook(), pos, pa.array([LO] * 5, pa.int8())) is None
