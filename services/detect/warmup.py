"""Detect's warm-up read: the spans of newly assigned partitions, read directly
(confluent-kafka) into the detector without publishing what they produce (see
:mod:`services.detect.agent`)."""

from __future__ import annotations

import time
from typing import Any

from confluent_kafka import Consumer, TopicPartition

from services.detect.core import DetectCore, Span, assigned_spans
from services.detect.detector import Emitted
from services.kafka.internals import LIBRDKAFKA_CONSUMER_BOUNDS

Partition = tuple[str, int]


def warm_up(
    conf: dict[str, Any],
    group: str,
    core: DetectCore,
    parts: list[Partition],
    keep: list[int],
    lookback_s: float,
    stall_s: float,
) -> tuple[list[Span], Emitted]:
    """Read the warm-up spans of ``parts`` into the detector (blocking: run it in a thread
    while no other user of the detector runs). Returns the spans read and the time-driven
    outputs of the warm-up (the watermark's judgements, one tick), which are published."""
    c = Consumer(
        {
            **conf,
            **LIBRDKAFKA_CONSUMER_BOUNDS,  # what a fetch carries and a batch inflates to
            "group.id": group,  # only to read the committed offsets: never joins
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
        }
    )
    out = Emitted()
    try:
        spans = assigned_spans(c, [TopicPartition(t, p) for t, p in parts], int(lookback_s * 1000))
        core.begin(spans, keep=keep)
        refined = core.topics.refined
        highs = {
            p: int(c.get_watermark_offsets(TopicPartition(refined, p), timeout=10)[1])
            for p in core.refined_partitions
        }
        todo = {(s.topic, s.partition): s.resume for s in spans if s.start < s.resume}
        c.assign([TopicPartition(s.topic, s.partition, s.start) for s in spans
                  if s.start < s.resume])  # fmt: skip
        _read(c, core, todo, highs, stall_s, out)
        out.extend(core.detector.tick(time.time_ns()))
    finally:
        c.close()
    return spans, out


def _read(
    c: Consumer,
    core: DetectCore,
    todo: dict[Partition, int],
    highs: dict[int, int],
    stall_s: float,
    out: Emitted,
) -> None:
    """Feed the detector every record before each partition's resume offset in ``todo``."""
    last = time.monotonic()
    while todo:
        msgs: list[Any] = c.consume(500, 0.5)
        now = time.time_ns()
        got: list[tuple[str, int, int, bytes]] = []
        for m in msgs:
            tp = (m.topic(), m.partition())
            if m.error() is not None or m.offset() >= todo.get(tp, -1):
                continue
            got.append((tp[0], tp[1], m.offset(), m.value()))
            if m.offset() >= todo[tp] - 1:
                del todo[tp]
                c.pause([TopicPartition(*tp)])  # read up to its committed offset
        core.route_group(got, now)  # not published
        core.stats["warmup"] += len(got)
        if msgs:
            last = time.monotonic()
        else:
            for tp, end in list(todo.items()):
                if c.position([TopicPartition(*tp)])[0].offset >= end:
                    del todo[tp]
            if time.monotonic() - last > stall_s:
                raise RuntimeError(f"warm-up read nothing for {stall_s}s; "
                                   f"left: {sorted(todo.items())}")  # fmt: skip
        wm = core.watermark(lambda p: highs.get(p, -1))
        if wm is not None:
            out.extend(core.detector.advance(wm, now))
