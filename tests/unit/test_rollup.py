"""Rollups equal a straightforward recomputation; windows close on the watermark."""

from __future__ import annotations

import json
import random
from collections import defaultdict
from typing import Any

import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelines.detect.rollup import Rollup, RollupSettings
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
