"""Records reach a Faust agent once each and in order per partition, whether the consumer
delivers them straight through (``services.kafka.internals.delivered_inline``) or, its
stream buffer full, through Faust's race against a suspended flow."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from confluent_kafka import Producer

REPO = Path(__file__).resolve().parent.parent.parent


@pytest.mark.parametrize("buffer", [16, 8192])
def test_every_record_is_delivered_once_in_order_per_partition(
    kafka_bootstrap: str, unique_topic: Callable[..., str], tmp_path: Path, buffer: int
) -> None:
    topic = unique_topic("delivery", partitions=3)
    n = 6000
    p = Producer({"bootstrap.servers": kafka_bootstrap, "linger.ms": 20})
    for i in range(n):
        p.produce(topic, b"cpu,host=h%d usage_idle=%d.5 %d" % (i % 7, i, i), key=b"h%d" % (i % 7))
        if i % 1000 == 0:
            p.poll(0)
    assert p.flush(30) == 0
    out = tmp_path / "got.json"
    cmd = [sys.executable, "-m", "tests.integration.faust_delivery_child", kafka_bootstrap,
           topic, str(n), str(buffer), str(out), str(tmp_path / "data")]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, timeout=180)
    assert out.exists(), proc.stderr.decode(errors="replace")[-3000:]
    got = json.loads(out.read_text())
    offsets = {int(k): v for k, v in got["offsets"].items()}
    assert sum(len(v) for v in offsets.values()) == n
    assert set(offsets) == {0, 1, 2}
    for part, seen in offsets.items():
        assert seen == list(range(len(seen))), f"partition {part}: not each offset once in order"
    paths = got["paths"]
    assert paths["inline"] > n // 2  # most records go straight through
    if buffer == 16:  # a buffer that fills: Faust's race delivers the rest
        assert paths["raced"] > 0
