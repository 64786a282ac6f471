"""All plain threshold rules in one pass give what each rule alone gives: the same alerts, in
the same order, and the same hysteresis states after every batch. Checked over a simulated
cluster run with incidents, under rules whose thresholds sit inside the data (so series fire,
pend, resolve and go quiet across batches), above and below, with and without a band, on
values and on rates, and with rows the pass must skip (NULL and NaN values)."""

from __future__ import annotations

import random

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from lab.bench.detect_input import DETECT_TOPICS, read_detect_input, write_detect_input
from pipelines.detect.alerts import AlertBook
from pipelines.detect.rule_config import ThresholdRule
from pipelines.detect.rule_eval import MetricIndex, eval_threshold
from pipelines.detect.threshold_pass import eval_plain_thresholds, plain


@pytest.fixture(scope="module")
def batches(tmp_path_factory: pytest.TempPathFactory) -> list[pa.Table]:
    path = tmp_path_factory.mktemp("detect") / "input.bin"
    write_detect_input(path, nodes=6, seconds=12, seed=11)
    tables = [
        pa.ipc.open_stream(v).read_all()
        for topic, _, _, v in read_detect_input(path)
        if topic == DETECT_TOPICS.refined
    ]
    out = []
    for i in range(0, len(tables), 5):
        part = [t for t in tables[i : i + 5] if t.num_rows]
        if part:
            out.append(pa.concat_tables(part, promote_options="permissive").combine_chunks())
    return out


def _rules(batches: list[pa.Table], seed: int) -> list[tuple[ThresholdRule, str]]:
    """Rules on metrics of the data, thresholds at quantiles of their values."""
    rnd = random.Random(seed)
    t = pa.concat_tables(batches)
    metrics = sorted(set(t.column("metric").to_pylist()))
    out = []
    for i, m in enumerate(rnd.sample(metrics, 8)):
        field = rnd.choice(["value", "rate"])
        vals = t.filter(pc.equal(t["metric"], m)).column(field).drop_null().to_pylist()
        if not vals:
            field = "value"
            vals = t.filter(pc.equal(t["metric"], m)).column(field).drop_null().to_pylist() or [0]
        vals.sort()
        fire = vals[int(len(vals) * rnd.uniform(0.3, 0.95))]
        lo = vals[int(len(vals) * rnd.uniform(0.05, 0.3))]
        hi = vals[int(len(vals) * rnd.uniform(0.95, 0.999))]
        below = rnd.random() < 0.4
        spec = {"name": f"r{i}", "kind": "threshold", "metric": m, "summary": "{entity} {value}"}
        spec |= {"below": fire} if below else {"above": fire}
        if rnd.random() < 0.6:
            spec["resolve"] = hi if below else lo
        spec["for"] = rnd.choice(["0s", "1s", "3s"])
        out.append((ThresholdRule.model_validate(spec), field))
    return out


def _spoil(t: pa.Table, rnd: random.Random) -> pa.Table:
    """Some values NULL, some NaN."""
    v = t.column("value").to_pylist()
    for i in rnd.sample(range(len(v)), len(v) // 50):
        v[i] = None if rnd.random() < 0.5 else float("nan")
    return t.set_column(t.schema.get_field_index("value"), "value", pa.array(v, pa.float64()))


def _states(book: AlertBook) -> dict[tuple[str, str], object]:
    return {k: s.to_dict() for k, s in sorted(book.states.items())}


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_one_pass_equals_each_rule_alone(batches: list[pa.Table], seed: int) -> None:
    rules = _rules(batches, seed)
    assert plain([r for r, _ in rules]) == [r for r, _ in rules]
    rnd = random.Random(seed)
    alone, fused = AlertBook(), AlertBook()
    fired = 0
    for n, b in enumerate(batches):
        b = _spoil(b, rnd)
        metrics = frozenset(r.metric for r, _ in rules)
        want = []
        for r, f in rules:
            want += eval_threshold(r, f, MetricIndex(b), alone, n, "telemetry.raw")
        got_by_rule = eval_plain_thresholds(
            rules, MetricIndex(b, metrics), fused, n, "telemetry.raw"
        )
        got = [a for r, _ in rules for a in got_by_rule.get(r.name, [])]
        assert [a.model_dump() for a in got] == [a.model_dump() for a in want]
        assert _states(fused) == _states(alone)
        fired += len(want)
    assert fired > 0  # the rules did fire: the comparison covered alerts, not only silence


def test_rules_sharing_a_metric_or_filtering_rows_are_left_to_the_one_by_one_walk() -> None:
    def rule(name: str, **kw: object) -> ThresholdRule:
        spec = {"name": name, "kind": "threshold", "metric": "gpu.temp", "above": 80, **kw}
        return ThresholdRule.model_validate(spec)

    one, two = rule("a"), rule("b", above=90)
    where, regex = (
        rule("c", metric="gpu.power", where={"device": "gpu0"}),
        rule("d", metric="gpu.util", device_regex="gpu[01]"),
    )
    alone = rule("e", metric="nic.rx_bytes")
    assert plain([one, two, where, regex, alone]) == [alone]
