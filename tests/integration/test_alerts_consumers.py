"""Against a real broker: `alerts tail`, the example consumer's (id, state) dedupe, and webhook
forwarding that loses nothing while the webhook fails."""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer

from schemas.errors import TransientError
from schemas.records import Alert, AlertState, Severity
from services.alerts import cli as alerts_cli
from services.alerts.tail import TailOptions, tail_alerts
from services.alerts.webhook import WebhookForwarder, WebhookSettings
from services.settings import load_settings

pytestmark = pytest.mark.kafka
REPO = Path(__file__).resolve().parents[2]
T0 = 1_700_000_000_000_000_000


def alert(i: int, state: str = "firing", sev: str = "warning", job: str | None = None) -> Alert:
    return Alert(
        id=f"a{i:04d}",
        rule="gpu_temp_high",
        state=AlertState(state),
        severity=Severity(sev),
        entity=f"n{i}/gpu0",
        node=f"n{i}",
        device="gpu0",
        job=job,
        starts_ns=T0 + i,
        ends_ns=T0 + i + 10 if state == "resolved" else None,
        summary=f"n{i} gpu0 hot",
        emitted_ns=T0 + i,
    )


def produce(bootstrap: str, topic: str, alerts: list[Alert]) -> None:
    p = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    for a in alerts:
        p.produce(topic, key=a.entity.encode(), value=a.model_dump_json().encode())
    assert p.flush(30) == 0


ALERTS = [
    alert(1, sev="critical", job="j1"),
    alert(2, job="j2"),
    alert(1, "resolved", sev="critical", job="j1"),
    alert(3, sev="info"),
]


def test_tail_json_reads_to_the_end_and_filters(
    kafka_bootstrap: str, unique_topic: Callable[..., str]
) -> None:
    topic = unique_topic("alerts", partitions=2)
    produce(kafka_bootstrap, topic, ALERTS)
    conf = {"bootstrap.servers": kafka_bootstrap}
    out = io.StringIO()
    n = tail_alerts(conf, TailOptions(topic=topic, as_json=True, from_beginning=True), out)
    recs = [json.loads(x) for x in out.getvalue().splitlines()]
    assert n == 4 and len(recs) == 4
    assert {(r["id"], r["state"]) for r in recs} == {(a.id, a.state.value) for a in ALERTS}
    out = io.StringIO()
    opts = TailOptions(topic=topic, from_beginning=True, severity=Severity.WARNING, job="j1")
    assert tail_alerts(conf, opts, out) == 2
    lines = out.getvalue().splitlines()
    assert all("gpu_temp_high n1/gpu0" in x and "id=a0001" in x for x in lines)
    assert [x.split()[1] for x in lines] == ["FIRING", "RESOLVED"]


def test_tail_through_the_cli_handler(
    kafka_bootstrap: str,
    unique_topic: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    topic = unique_topic("alerts")
    produce(kafka_bootstrap, topic, ALERTS)
    monkeypatch.setenv("REFINERY_BOOTSTRAP_SERVERS", kafka_bootstrap)
    p = argparse.ArgumentParser()
    alerts_cli.add_parser(p.add_subparsers(dest="command"))
    args = p.parse_args(["alerts", "tail", "--json", "--topic", topic, "--severity", "critical"])
    assert args.handler(args, load_settings()) == 0
    recs = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [(r["id"], r["state"]) for r in recs] == [("a0001", "firing"), ("a0001", "resolved")]
    # --last 1 without --from-beginning: only the newest record
    args = p.parse_args(["alerts", "tail", "--json", "--topic", topic, "--last", "1"])
    assert args.handler(args, load_settings()) == 0
    assert [json.loads(x)["id"] for x in capsys.readouterr().out.splitlines()] == ["a0003"]


def test_tail_follow_sees_new_alerts(
    kafka_bootstrap: str, unique_topic: Callable[..., str]
) -> None:
    topic = unique_topic("alerts")
    out = io.StringIO()
    done = threading.Event()
    opts = TailOptions(topic=topic, follow=True, as_json=True, poll_s=0.2)
    th = threading.Thread(
        target=tail_alerts,
        args=({"bootstrap.servers": kafka_bootstrap}, opts, out),
        kwargs={"stop": done.is_set},
    )
    th.start()
    time.sleep(2.0)  # assigned at the end of the (empty) partition
    produce(kafka_bootstrap, topic, ALERTS[:2])
    deadline = time.monotonic() + 30
    while out.getvalue().count("\n") < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    done.set()
    th.join(10)
    assert [json.loads(x)["id"] for x in out.getvalue().splitlines()] == ["a0001", "a0002"]


def test_example_consumer_dedupes_on_id_and_state(
    kafka_bootstrap: str, unique_topic: Callable[..., str], unique_group: str
) -> None:
    topic = unique_topic("alerts", partitions=2)
    dup = ALERTS + ALERTS[:3] + [ALERTS[2]]  # replays and retries: 4 duplicates
    produce(kafka_bootstrap, topic, dup)
    cmd = [
        sys.executable,
        str(REPO / "examples" / "alert_consumer.py"),
        "--bootstrap",
        kafka_bootstrap,
        "--topic",
        topic,
        "--group",
        unique_group,
        "--from-beginning",
        "--exit-at-eof",
        "--json",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=90, check=True)
    keys = [(json.loads(x)["id"], json.loads(x)["state"]) for x in r.stdout.splitlines()]
    assert sorted(keys) == sorted({(a.id, a.state.value) for a in ALERTS})
    assert "duplicates skipped: 4" in r.stderr


class _Hook:
    """A webhook on 127.0.0.1 that fails (503) the first ``fail`` requests."""

    def __init__(self, fail: int) -> None:
        self.fail = fail
        self.calls = 0
        self.received: list[dict[str, Any]] = []
        self.keys: list[str] = []
        hook = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                hook.calls += 1
                if hook.calls <= hook.fail:
                    self.send_response(503)
                else:
                    hook.received.append(json.loads(body))
                    hook.keys.append(self.headers["X-Refinery-Alert-Key"])
                    self.send_response(204)
                self.end_headers()

            def log_message(self, *a: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hook_factory() -> Iterator[Callable[[int], _Hook]]:
    made: list[_Hook] = []

    def make(fail: int) -> _Hook:
        h = _Hook(fail)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


def _forwarder(bootstrap: str, topic: str, group: str, url: str, **kw: Any) -> WebhookForwarder:
    ws = WebhookSettings(
        url=url,
        topic=topic,
        group=group,
        backoff_initial_s=0.05,
        backoff_max_s=0.2,
        poll_s=0.2,
        **kw,
    )
    return WebhookForwarder({"bootstrap.servers": bootstrap}, ws)


def test_webhook_forwarding_with_failures_loses_nothing(
    kafka_bootstrap: str,
    unique_topic: Callable[..., str],
    unique_group: str,
    hook_factory: Callable[[int], _Hook],
) -> None:
    topic = unique_topic("alerts")
    produce(kafka_bootstrap, topic, ALERTS)
    hook = hook_factory(5)
    fwd = _forwarder(kafka_bootstrap, topic, unique_group, hook.url)
    try:
        assert fwd.run(max_records=len(ALERTS)) == len(ALERTS)
    finally:
        fwd.close()
    assert [r["id"] for r in hook.received] == [a.id for a in ALERTS]
    assert hook.keys[0] == "a0001:firing"
    assert fwd.stats.failures == 5
    # everything acknowledged was committed: the group has nothing left
    again = _forwarder(kafka_bootstrap, topic, unique_group, hook.url)
    stop_at = time.monotonic() + 5
    try:
        assert again.run(stop=lambda: time.monotonic() > stop_at) == 0
    finally:
        again.close()


def test_webhook_giving_up_commits_nothing(
    kafka_bootstrap: str,
    unique_topic: Callable[..., str],
    unique_group: str,
    hook_factory: Callable[[int], _Hook],
) -> None:
    topic = unique_topic("alerts")
    produce(kafka_bootstrap, topic, ALERTS[:2])
    down = hook_factory(10**6)
    fwd = _forwarder(kafka_bootstrap, topic, unique_group, down.url, max_attempts=3)
    try:
        with pytest.raises(TransientError):
            fwd.run()
    finally:
        fwd.close()
    up = hook_factory(0)
    fwd = _forwarder(kafka_bootstrap, topic, unique_group, up.url)
    try:
        assert fwd.run(max_records=2) == 2
    finally:
        fwd.close()
    assert [r["id"] for r in up.received] == ["a0001", "a0002"]
