"""``refinery export scrape`` and ``refinery catalog unmapped`` against the session broker,
with a real HTTP endpoint serving node_exporter's own exposition."""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import Producer

from schemas.codec import content_type_of, decode
from services.topics import apply_topics, load_topic_specs
from tests.integration.worker_helpers import fresh_topics, read_all

FIX = Path(__file__).resolve().parents[1] / "fixtures"
EXPOSITION = (FIX / "real-data/sysfs-procfs/node_exporter-e2e-output.txt").read_bytes()


@pytest.fixture
def endpoint() -> Iterator[str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.end_headers()
            self.wfile.write(EXPOSITION)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    server.shutdown()


def _refinery(bootstrap: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "REFINERY_BOOTSTRAP_SERVERS": bootstrap}
    return subprocess.run([sys.executable, "-m", "services.cli", *args], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def test_scrape_publishes_native_batches_with_full_identity(
    kafka_bootstrap: str, endpoint: str
) -> None:
    prefix = fresh_topics(kafka_bootstrap)
    raw = prefix + "telemetry.raw"
    args = ["export", "scrape", "--target", endpoint, "--node", "ne1", "--interval", "200ms"]
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", *args, "--topic", raw],
                            env={**os.environ, "REFINERY_BOOTSTRAP_SERVERS": kafka_bootstrap},
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        got = read_all(kafka_bootstrap, raw, until=4, timeout=120)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "not in the catalog, not published" in err  # reported once, named
    # the target's greeting first (no rows), then its scrapes, the first carrying the
    # greeting's exchange with the broker
    hello, *batches = [decode(v, content_type_of(h)) for _, v, h in got[:4]]
    assert hello.table.num_rows == 0 and hello.envelope.seq == 0
    src = {b.envelope.source for b in [hello, *batches]}
    assert len(src) == 1
    s = batches[0].envelope.source
    assert (s.node, s.exporter, s.instance) == ("ne1", "scrape", endpoint.split("/")[2])
    assert sorted(b.envelope.seq for b in batches) == [1, 2, 3]  # seq per source and run
    clock = batches[0].envelope.clock
    assert clock is not None and clock.exchanges
    rows = {(r["metric"], r["device"]): r for r in batches[0].table.to_pylist()}
    assert rows[("cpu.user_seconds", "cpu0")]["raw"] == 44490
    assert rows[("ib.port_rcv_data", "mlx4_0/1")]["raw"] == 18527668 // 4
    from schemas.catalog import default_catalog

    assert all(m in default_catalog() for m in batches[0].table["metric"].to_pylist())


def test_catalog_unmapped_lists_what_a_topic_carries_that_the_catalog_lacks(
    kafka_bootstrap: str,
) -> None:
    prefix = fresh_topics(kafka_bootstrap)
    topic = prefix + "telemetry.ingest.influx"
    apply_topics({"bootstrap.servers": kafka_bootstrap}, load_topic_specs(prefix=prefix))
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    for i in range(3):
        p.produce(topic, f"cpu,cpu=cpu0,host=h usage_user=1,usage_made_up={i} {i}".encode())
    p.produce(topic, b"not line protocol at all")
    assert p.flush(30) == 0
    out = _refinery(kafka_bootstrap, "catalog", "unmapped", "--topic", topic, "--idle", "2")
    assert out.returncode == 0, out.stderr
    assert "(influx): 4 records read, 1 undecodable, 1 names not in the catalog" in out.stdout
    assert "3  cpu.usage_made_up  (e.g. device cpu0)" in out.stdout
    bad = _refinery(kafka_bootstrap, "catalog", "unmapped", "--topic", prefix + "nope")
    assert bad.returncode != 0 and "no such topic" in bad.stderr
