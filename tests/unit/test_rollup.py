"""Rollups equal a straightforward recomputation; windows close on the watermark."""

from __future__ import annotations

import json
import math
import random
from collections import defaultdict
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelines.detect.rollup import (
    PARTIAL_SCHEMA,
    Rollup,
    RollupSettings,
    merge_partials,
    partials,
    samples,
)
from schemas.records import ROLLUP_SCHEMA
from tests.unit.derived_helpers import T0, S, refined


def naive(rows: list[dict[str, Any]], w: int) -> dict[tuple[Any, ...], dict[str, Any]]:
    acc: dict[tuple[Any, ...], list[tuple[int, int, float]]] = defaultdict(list)
    for i, r in enumerate(rows):
        if r["value"] is None:
            continue
        ws = r["ts"] // (w * S) * (w * S)
        acc[(w, ws, r["node"], r["device"], r["metric"])].append((r["ts"], i, r["value"]))
    out = {}
    for k, xs in acc.items():
        vs = [v for _, _, v in xs]
        out[k] = {
            "min": min(vs),
            "max": max(vs),
            "mean": sum(vs) / len(vs),
            "last": max(xs)[2],
            "count": len(vs),
        }
    return out


def gen_rows(rng: random.Random, n: int) -> list[dict[str, Any]]:
    rows = []
    for i in range(n):
        ts = T0 + i * S // 7 + rng.randrange(0, 2 * S)  # out of order within 2 s
        v = None if rng.random() < 0.05 else rng.uniform(-100, 100)
        rows.append(
            {
                "node": f"n{rng.randrange(3)}",
                "device": f"gpu{rng.randrange(2)}",
                "metric": rng.choice(["gpu.temp", "gpu.power"]),
                "ts": ts,
                "value": v,
            }
        )
    return rows


def roll(rows: list[dict[str, Any]], batch: int, merge_rows: int = 65_536) -> pa.Table:
    r = Rollup(RollupSettings(windows_s=(10, 60), allowed_lateness_ns=3 * S), merge_rows)
    outs = [r.update(refined(rows[i : i + batch])) for i in range(0, len(rows), batch)]
    outs.append(r.flush())
    assert r.late_dropped == 0
    return pa.concat_tables(outs)


def as_dict(t: pa.Table) -> dict[tuple[Any, ...], dict[str, Any]]:
    out = {}
    for r in t.to_pylist():
        k = (r["window_s"], r["window_start"], r["node"], r["device"], r["metric"])
        assert k not in out, "a window emitted twice"
        out[k] = {c: r[c] for c in ("min", "max", "mean", "last", "count")}
    return out


def close(a: dict[Any, Any], b: dict[Any, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        for c in ("min", "max", "last", "count"):
            if a[k][c] != b[k][c]:
                return False
        if abs(a[k]["mean"] - b[k]["mean"]) > 1e-9 * max(1.0, abs(b[k]["mean"])):
            return False
    return True


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    n=st.integers(1, 600),
    batch=st.integers(5, 200),
    merge_rows=st.sampled_from([0, 16, 65_536]),  # partials merged every batch .. at close
)
def test_rollup_equals_naive_recomputation(seed: int, n: int, batch: int, merge_rows: int) -> None:
    rows = gen_rows(random.Random(seed), n)
    got = roll(rows, batch, merge_rows)
    assert got.schema.equals(ROLLUP_SCHEMA)
    want = naive(rows, 10) | naive(rows, 60)
    assert close(as_dict(got), want)


def test_windows_close_on_the_watermark_and_late_samples_are_counted() -> None:
    r = Rollup(RollupSettings(windows_s=(10,), allowed_lateness_ns=2 * S))
    base = {"node": "n1", "device": "gpu0", "metric": "gpu.temp"}
    out = r.update(refined([base | {"ts": T0 + i * S, "value": float(i)} for i in range(11)]))
    assert out.num_rows == 0  # watermark T0+8s: window [T0, T0+10s) still open
    out = r.update(refined([base | {"ts": T0 + 12 * S, "value": 1.0}]))
    (row,) = out.to_pylist()
    assert (row["count"], row["min"], row["max"], row["last"]) == (10, 0.0, 9.0, 9.0)
    r.update(refined([base | {"ts": T0 + 3 * S, "value": 100.0}]))
    assert r.late_dropped == 1
    # state round trip
    r2 = Rollup.from_dict(json.loads(json.dumps(r.to_dict())), r.settings)
    assert r2.flush().to_pylist() == r.flush().to_pylist()


# values whose sum, min, max or last depend on the order they fold in, bit for bit
_ODD = [0.0, -0.0, math.nan, -math.nan, math.inf, -math.inf, 1e300, -1e-300, 0.1, 3.0]
_KEY = ["window_start", "node", "device", "metric"]


def _hash_partials(rows: list[dict[str, Any]], w: int) -> pa.Table:
    """A batch's partials as one Arrow hash aggregation gives them, its rows in ts order."""
    t = refined(rows)
    t = t.select(["node", "device", "metric", "ts", "value"]).filter(pc.is_valid(t["value"]))
    t = t.take(pc.sort_indices(t["ts"]))
    t = t.append_column("window_start", pc.multiply(pc.divide(t["ts"], w * S), w * S))
    aggs = [("value", fn) for fn in ("min", "max", "sum", "count", "last")] + [("ts", "max")]
    agg = t.group_by(_KEY, use_threads=False).aggregate(aggs)
    names = ["value_min", "value_max", "value_sum", "value_count", "value_last", "ts_max"]
    return pa.table([agg[c] for c in _KEY + names], names=PARTIAL_SCHEMA.names)


def _hash_merge(t: pa.Table) -> pa.Table:
    t = t.take(pc.sort_indices(t["last_ts"]))
    aggs = [("min", "min"), ("max", "max"), ("sum", "sum"), ("count", "sum"), ("last", "last")]
    agg = t.group_by(_KEY, use_threads=False).aggregate([*aggs, ("last_ts", "max")])
    names = ["min_min", "max_max", "sum_sum", "count_sum", "last_last", "last_ts_max"]
    return pa.table([agg[c] for c in _KEY + names], names=PARTIAL_SCHEMA.names)


def _bits(t: pa.Table) -> list[tuple[Any, ...]]:
    """Rows in key order, floats as their bits (every NaN and zero told apart)."""
    t = t.sort_by([(k, "ascending") for k in _KEY])
    cols = []
    for name in PARTIAL_SCHEMA.names:
        col = t[name].combine_chunks()
        floats = pa.types.is_floating(col.type)
        cols.append(col.to_numpy().view(np.int64).tolist() if floats else col.to_pylist())
    return list(zip(*cols, strict=True))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 400))
def test_partials_and_merges_give_the_hash_aggregation_to_the_bit(seed: int, n: int) -> None:
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    for i in range(n):
        ts = T0 + i * S // 20 + rng.randrange(0, 3 * S)  # out of order, across 10 s windows
        if rows and rng.random() < 0.2:
            ts = rows[-1]["ts"]  # a tie: the later row is the last
        r, node = rng.random(), rng.randrange(3)
        v = None if r < 0.05 else rng.choice(_ODD) if r < 0.5 else rng.uniform(-1e3, 1e3)
        if v is not None and node < 2:  # n0 never below zero, n1 never above: zero extremes
            v = math.copysign(v, 1 - 2 * node) if v != 0 else -v if rng.random() < 0.5 else v
        series = {"node": f"n{node}", "device": "gpu0", "metric": "gpu.power"}
        rows.append(series | {"ts": ts, "value": v})
    batches = [rows[i : i + 150] for i in range(0, n, 150)]
    for w in (10, 60):
        for b in batches:
            assert _bits(partials(samples(refined(b)), w)) == _bits(_hash_partials(b, w))
    # partials of every batch, latest first: a key's rows fold in last_ts order
    parts = pa.concat_tables([_hash_partials(b, 10) for b in reversed(batches)])
    assert _bits(merge_partials(parts)) == _bits(_hash_merge(parts))
    if parts.num_rows:  # one window: keyed on the series alone
        one = parts.filter(pc.equal(parts["window_start"], parts["window_start"][0]))
        assert _bits(merge_partials(one)) == _bits(_hash_merge(one))
