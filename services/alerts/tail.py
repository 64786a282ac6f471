"""``refinery alerts tail``: print alert lifecycle records from ``telemetry.alerts``.

A plain confluent-kafka consumer with **manual assignment** (no consumer group, nothing
committed): it reads every partition of the topic from ``--from-beginning``, or the last
``--last N`` records of each partition by default. Without ``--follow`` it exits once it
reaches the end of every partition (high watermark at start); with ``--follow`` it keeps
going until interrupted. One line per alert, or the JSON record with ``--json``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

from confluent_kafka import Consumer, KafkaError, TopicPartition
from pydantic import ValidationError

from schemas.errors import RefineryError
from schemas.records import Alert, Severity
from schemas.topics import TOPICS
from services.kafka.internals import LIBRDKAFKA_CONSUMER_BOUNDS

_RANK = {Severity.INFO: 0, Severity.WARNING: 1, Severity.CRITICAL: 2}


@dataclass(frozen=True)
class TailOptions:
    topic: str = TOPICS.alerts
    follow: bool = False
    as_json: bool = False
    severity: Severity | None = None  # at least this severe
    job: str | None = None
    from_beginning: bool = False
    last: int = 10
    poll_s: float = 0.5


def selected(a: Alert, opts: TailOptions) -> bool:
    """Does ``a`` pass the ``--severity`` (at least) and ``--job`` filters?"""
    if opts.severity is not None and _RANK[a.severity] < _RANK[opts.severity]:
        return False
    return opts.job is None or a.job == opts.job


def format_line(a: Alert) -> str:
    """``2024-01-01T00:00:00Z FIRING   critical gpu_xid n1/gpu3 <summary> [cause] id=...``."""
    ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(a.starts_ns / 1e9))
    cause = f" cause: {a.cause}" if a.cause else ""
    return (
        f"{ts}Z {a.state.value.upper():<8} {a.severity.value:<8} {a.rule} {a.entity}: "
        f"{a.summary}{cause} id={a.id}"
    )


def _start_offsets(c: Consumer, topic: str, opts: TailOptions) -> tuple[list[Any], dict[int, int]]:
    md = c.list_topics(topic, timeout=10)
    t = md.topics.get(topic)
    if t is None or t.error is not None or not t.partitions:
        raise ValueError(f"topic {topic!r} does not exist, or this principal may not describe it")
    tps, ends = [], {}
    for p in sorted(t.partitions):
        lo, hi = c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
        start = lo if opts.from_beginning else max(lo, hi - max(opts.last, 0))
        tps.append(TopicPartition(topic, p, start))
        if start < hi:
            ends[p] = hi
    return tps, ends


def tail_alerts(
    conf: dict[str, Any],
    opts: TailOptions,
    out: TextIO,
    err: TextIO | None = None,
    stop: Callable[[], bool] = lambda: False,
) -> int:
    """Print the selected alerts to ``out``; returns how many were printed. Blocks until
    the end of every partition (or ``stop()`` with ``follow``). Undecodable records are
    reported on ``err`` and skipped."""
    c = Consumer(
        {
            **conf,
            **LIBRDKAFKA_CONSUMER_BOUNDS,  # what a fetch carries and a batch inflates to
            "group.id": "refinery-alerts-tail",
            "enable.auto.commit": False,
            "enable.partition.eof": False,
        }
    )
    printed = 0
    try:
        tps, ends = _start_offsets(c, opts.topic, opts)
        c.assign(tps)
        while opts.follow or ends:
            if stop():
                break
            m = c.poll(opts.poll_s)
            if m is None:
                continue
            e_ = m.error()
            if e_ is not None:
                if e_.code() != KafkaError._PARTITION_EOF:
                    raise RefineryError(f"alerts tail: {e_}")
                continue
            p, off = m.partition(), m.offset()
            if p in ends and off is not None and off + 1 >= ends[p]:
                del ends[p]
            try:
                a = Alert.model_validate_json(m.value() or b"")
            except ValidationError as e:
                if err is not None:
                    print(
                        f"alerts tail: skipping p{p}@{off}: not an alert: {e.errors()[0]['msg']}",
                        file=err,
                    )
                continue
            if not selected(a, opts):
                continue
            line = (
                json.dumps(a.model_dump(mode="json"), sort_keys=True)
                if opts.as_json
                else (format_line(a))
            )
            out.write(line + "\n")
            out.flush()
            printed += 1
    finally:
        c.close()
    return printed
