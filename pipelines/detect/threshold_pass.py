"""Every plain threshold rule over one refined batch in one vectorized pass.

A threshold rule per rule costs a dozen Arrow calls (its rows, their values, classes, hot
series, runs) whatever the batch's size; with ten rules that fixed cost outweighed the rows'
own work on the small groups a live detect judges (and on each replica's smaller share when
detect scales out). Here the rows of every *plain* rule (no ``where``, no ``device_regex``,
one rule per metric) are taken at once from the :class:`~pipelines.detect.rule_eval.
MetricIndex` (each rule's rows a slice of its one sort, in (series, ts) order), classified
with each row's own rule's thresholds, kept only for series a rule may step (a HI row, or a
state in the book), cut at run boundaries, and walked rule by rule, in rule order, exactly as
:func:`~pipelines.detect.rule_eval.eval_threshold` walks one rule: the same rows reach the
same hysteresis, so the alerts are the same, in the same order.
"""

from __future__ import annotations

import itertools

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipelines._arrow import column, take
from pipelines.detect.alerts import HI, LO, MID, AlertBook
from pipelines.detect.rule_config import ThresholdRule
from pipelines.detect.rule_eval import (
    _ROW_READ,
    SEP,
    MetricIndex,
    _walk,
    threshold_limits,
    threshold_summary,
)
from schemas.records import Alert


def plain(rules: list[ThresholdRule]) -> list[ThresholdRule]:
    """The rules this pass takes: no ``where``, no ``device_regex``, the only rule of their
    metric (the others are evaluated one by one)."""
    metrics = [r.metric for r in rules]
    return [
        r for r in rules if not r.where and r.device_regex is None and metrics.count(r.metric) == 1
    ]


def eval_plain_thresholds(
    rules: list[tuple[ThresholdRule, str]],
    index: MetricIndex,
    book: AlertBook,
    now_ns: int,
    topic: str,
) -> dict[str, list[Alert]]:
    """Alerts per rule name of ``rules`` (each with the field it reads; all :func:`plain`)
    over one refined batch (``index`` over it)."""
    t = index.table
    have = set(t.column_names)
    parts, owner = [], []
    for i, (rule, field) in enumerate(rules):
        if field not in have:
            continue
        pos = index.positions(rule.metric)
        if len(pos):
            parts.append(pos)
            owner.append(np.full(len(pos), i, np.int64))
    out: dict[str, list[Alert]] = {}
    if not parts:
        return out
    pos = pa.concat_arrays(parts)
    rule_of = np.concatenate(owner)
    fields = sorted({f for _, f in rules})
    values = None
    for f in fields:  # each row's own rule's field
        if f not in have:
            continue
        got = take(column(t, f), pos)
        if values is None:
            values = got
            continue
        mine = np.array([fld == f for _, fld in rules])[rule_of]
        values = pc.if_else(pa.array(mine), got, values)
    assert values is not None
    valid = pc.is_valid(values).to_numpy(zero_copy_only=False)
    if not valid.all():
        pos, rule_of = pos.filter(pa.array(valid)), rule_of[valid]
        values = values.filter(pa.array(valid))
    v = values.to_numpy(zero_copy_only=False).astype(np.float64, copy=False)
    # per rule: fire, resolve, below
    lims = np.array([threshold_limits(r) for r, _ in rules], dtype=np.float64)
    sign = np.where(lims[:, 2] > 0, -1.0, 1.0)[rule_of]  # below: mirrored
    sv = sign * v
    hi = sv > sign * lims[:, 0][rule_of]
    lo = sv <= sign * lims[:, 1][rule_of]
    cls = np.where(hi, HI, np.where(lo, LO, MID)).astype(np.int8)
    series = take(index.series, pos).to_numpy(zero_copy_only=False)
    width = int(series.max()) + 1 if len(series) else 1
    key = rule_of * width + series
    wanted = [np.unique(key[cls == HI])]
    known: dict[str, list[str]] = {}
    for r, e in book.states:
        known.setdefault(r, []).append(e)
    for i, (rule, _) in enumerate(rules):
        codes = index.series_of(known[rule.name]) if rule.name in known else []
        if codes:
            wanted.append(i * width + np.asarray(codes, np.int64))
    hot = np.isin(key, np.concatenate(wanted))
    if not hot.any():
        return out
    key, cls, rule_of = key[hot], cls[hot], rule_of[hot]
    pos = pos.filter(pa.array(hot))
    changed = np.ones(len(key), bool)
    changed[1:] = (key[1:] != key[:-1]) | (cls[1:] != cls[:-1])
    ends = np.ones(len(key), bool)
    ends[:-1] = changed[1:]
    keep = np.flatnonzero(changed | ends)
    cols = [c for c in _ROW_READ if c in have]
    sel = t.select(cols).take(take(pos, pa.array(keep)))
    joined = pc.binary_join_element_wise(column(sel, "node"), column(sel, "device"), SEP)
    sel = sel.append_column("_key", joined).append_column("_cls", pa.array(cls[keep]))
    owners = rule_of[keep]
    cut = [0, *(np.flatnonzero(owners[1:] != owners[:-1]) + 1).tolist(), len(owners)]
    for a, b in itertools.pairwise(cut):
        rule, field = rules[int(owners[a])]
        part = sel.slice(a, b - a)
        make = threshold_summary(rule, field)
        out[rule.name] = _walk(rule.name, rule.for_ns, part, book, now_ns, topic, make)
    return out
