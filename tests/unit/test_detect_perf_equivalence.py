"""The faster evaluators give what the plain ones gave: rollup partials grouped on series
codes, rules reading their rows by position, congestion rows dropped before port keys are
built. Each is checked against the plain Arrow formulation it replaced (kept here as the
reference) over a simulated, refined cluster run with incidents."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from lab.bench.detect_input import DETECT_TOPICS, read_detect_input, write_detect_input
from lab.bench.detect_stage import fit_slope
from pipelines._arrow import column, nxt, prev, true_mask, where
from pipelines.detect import rollup
from pipelines.detect.alerts import classify
from pipelines.detect.episodes import CONGESTION_THRESHOLDS, EpisodeSettings, EpisodeTracker
from pipelines.detect.rule_eval import SEP, MetricIndex, _positions, _rows, _runs

_KEY = ["window_start", "node", "device", "metric"]


@pytest.fixture(scope="module")
def batches(tmp_path_factory: pytest.TempPathFactory) -> list[pa.Table]:
    path = tmp_path_factory.mktemp("detect") / "input.bin"
    write_detect_input(path, nodes=8, seconds=8, seed=3)
    tables = [
        pa.ipc.open_stream(v).read_all()
        for topic, _, _, v in read_detect_input(path)
        if topic == DETECT_TOPICS.refined
    ]
    # groups of a few refined records, as detect concatenates them
    out = []
    for i in range(0, len(tables), 12):
        part = [t for t in tables[i : i + 12] if t.num_rows]
        if part:
            out.append(pa.concat_tables(part, promote_options="permissive").combine_chunks())
    return out


def _plain_partials(refined: pa.Table, window_s: int) -> pa.Table:
    v = column(refined, "value")
    t = pa.table({c: column(refined, c) for c in ("node", "device", "metric", "ts")})
    t = t.append_column("value", v).filter(pc.is_valid(v))
    t = t.take(pc.sort_indices(t["ts"]))
    w = window_s * 1_000_000_000
    t = t.append_column("window_start", pc.multiply(pc.divide(t["ts"], w), w))
    aggs = [("value", fn) for fn in ("min", "max", "sum", "count")]
    agg = t.group_by(_KEY, use_threads=False).aggregate([*aggs, ("value", "last"), ("ts", "max")])
    names = ["value_min", "value_max", "value_sum", "value_count", "value_last", "ts_max"]
    cols = [agg[k] for k in _KEY] + [agg[n] for n in names]
    return pa.table(cols, names=rollup.PARTIAL_SCHEMA.names).cast(rollup.PARTIAL_SCHEMA)


def _plain_merge(t: pa.Table) -> pa.Table:
    t = t.take(pc.sort_indices(t["last_ts"]))
    aggs = [("min", "min"), ("max", "max"), ("sum", "sum"), ("count", "sum")]
    agg = t.group_by(_KEY, use_threads=False).aggregate(
        [*aggs, ("last", "last"), ("last_ts", "max")]
    )
    names = ["min_min", "max_max", "sum_sum", "count_sum", "last_last", "last_ts_max"]
    cols = [agg[k] for k in _KEY] + [agg[n] for n in names]
    return pa.table(cols, names=rollup.PARTIAL_SCHEMA.names).cast(rollup.PARTIAL_SCHEMA)


def _by_series(t: pa.Table) -> pa.Table:
    # partial rows have unique keys: their order is the hash grouping's, which no output
    # depends on (merges combine per key in batch order; emitted windows are sorted)
    return t.sort_by([(k, "ascending") for k in _KEY])


def test_rollup_partials_and_merges_equal_the_plain_group_by(batches: list[pa.Table]) -> None:
    for w in (10, 60):
        got = [rollup.partials(rollup.samples(b), w) for b in batches]
        want = [_plain_partials(b, w) for b in batches]
        assert all(_by_series(g).equals(_by_series(x)) for g, x in zip(got, want, strict=True))
        both = pa.concat_tables(want)
        assert _by_series(rollup.merge_partials(both)).equals(_by_series(_plain_merge(both)))


def _plain_runs(t: pa.Table, cls: Any) -> tuple[pa.Table, list[int]]:
    key = pc.binary_join_element_wise(column(t, "node"), column(t, "device"), SEP)
    t = t.append_column("_key", key).append_column("_cls", cls)
    t = t.sort_by([("_key", "ascending"), ("ts", "ascending")])
    k, c = column(t, "_key"), column(t, "_cls")
    start = pc.or_(pc.not_equal(k, prev(k)), pc.not_equal(c, prev(c)))
    end = pc.or_(pc.not_equal(k, nxt(k)), pc.not_equal(c, nxt(c)))
    sel = t.take(where(pc.or_(pc.fill_null(start, True), pc.fill_null(end, True))))
    return sel, [int(x) for x in column(sel, "_cls").to_pylist()]


@pytest.mark.parametrize(
    ("metric", "where_", "regex"),
    [
        ("gpu.temp", {}, None),
        ("gpu.temp", {"device": ["gpu0", "gpu3"]}, None),
        ("gpu.temp", {}, r"gpu[12]"),
        ("nic.rx_prio_pause", {}, None),
    ],
)
def test_rules_read_by_position_the_rows_they_filtered(
    batches: list[pa.Table], metric: str, where_: dict[str, Any], regex: str | None
) -> None:
    field = "rate" if metric.startswith("nic.") else "value"
    for b in batches:
        t = b.filter(pc.equal(column(b, "metric"), metric))
        for col, want in where_.items():
            t = t.filter(pc.is_in(column(t, col), value_set=pa.array(want)))
        if regex is not None:
            t = t.filter(pc.match_substring_regex(column(t, "device"), regex))
        t = t.filter(pc.is_valid(column(t, field)))
        ix = MetricIndex(b)
        pos = _positions(ix, metric, field, where_, regex)
        assert (pos is None) == (t.num_rows == 0)
        if pos is None:
            continue
        want_sel, want_cls = _plain_runs(t, classify(column(t, field), 60.0, 50.0, False))
        cls = classify(pc.take(column(b, field), pos), 60.0, 50.0, False)
        got_sel = _runs(ix, pos, cls)
        assert got_sel["_cls"].to_pylist() == want_cls
        assert _rows(got_sel) == _rows(want_sel)


def _plain_congestion(tracker: EpisodeTracker, refined: pa.Table) -> pa.Table | None:
    from pipelines.detect.episodes import _port_keys

    th = tracker.settings.thresholds
    t = refined.filter(pc.is_in(column(refined, "metric"), value_set=pa.array(list(th))))
    t = t.filter(pc.is_valid(column(t, "rate")))
    if t.num_rows == 0:
        return None
    key, prio = _port_keys(t)
    names = pa.array(list(th))
    limit = pc.take(pa.array(list(th.values())), pc.index_in(column(t, "metric"), names))
    hot = true_mask(pc.greater(column(t, "rate"), limit))
    nic = pc.binary_join_element_wise(
        column(t, "node"), pc.coalesce(column(t, "nic"), column(t, "device")), "/"
    )
    cols = {"port": key, "prio": prio, "metric": column(t, "metric"), "rate": column(t, "rate")}
    cols |= {"ts": column(t, "ts"), "hot": hot, "nic": nic, "node": column(t, "node")}
    t = pa.table(cols | {"job": column(t, "job")})
    t = t.filter(pc.or_(hot, pc.is_in(t["port"], value_set=tracker._open_ports())))
    return t if t.num_rows else None


@pytest.mark.parametrize("scale", [1.0, 1e-3])  # the defaults; low enough for open episodes
def test_congestion_rows_equal_the_plain_filter(batches: list[pa.Table], scale: float) -> None:
    th = {m: v * scale for m, v in CONGESTION_THRESHOLDS.items()}
    tracker = EpisodeTracker(EpisodeSettings(thresholds=th))
    opened = 0
    for b in batches:
        want = _plain_congestion(tracker, b)
        got = tracker._congestion_rows(b)
        assert (got is None and want is None) or (got is not None and got.equals(want))
        opened += len(tracker.update(b, 0))
        # open episodes whose ports take rows under the threshold too
        tracker.settings.thresholds.update({m: v * 50 for m, v in th.items()})
    assert scale == 1.0 or opened


def test_fit_slope_of_rss_over_nodes() -> None:
    slope, base = fit_slope([24.0, 96.0, 384.0], [500.0, 572.0, 860.0])
    assert slope == pytest.approx(1.0)
    assert base == pytest.approx(476.0)


def test_input_file_streams_back_what_was_written(tmp_path: Path) -> None:
    facts = write_detect_input(tmp_path / "i.bin", nodes=2, seconds=2, seed=1)
    got: dict[str, int] = {}
    for topic, _, _, _ in read_detect_input(tmp_path / "i.bin"):
        got[topic] = got.get(topic, 0) + 1
    assert got == {t: n for t, n in facts.records.items() if n}
    assert facts.refined_rows > 0
