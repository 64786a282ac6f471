"""Forward alert records from Kafka to an HTTP webhook, at least once, losing nothing.

Loop (one message at a time, in partition order)::

    poll → POST the record as JSON → 2xx? → commit that message's offset (synchronously)
                                   ↘ not 2xx / error → retry with exponential backoff

An offset is committed **only after** the webhook answered 2xx, so an acknowledged alert is
never lost; a crash between the answer and the commit re-sends it, which the receiver
deduplicates on ``(id, state)`` — sent as the ``X-Refinery-Alert-Key`` header and the
``Idempotency-Key`` header. With ``max_attempts`` set, a record that still fails raises
:class:`~schemas.errors.TransientError` without committing: the process exits non-zero and
its supervisor restarts it from the last committed offset.

The HTTP call is a seam (``post``): by default :func:`post_json` over ``urllib``.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from confluent_kafka import Consumer, KafkaError

from schemas.errors import TransientError
from schemas.topics import TOPICS
from services.kafka.internals import LIBRDKAFKA_CONSUMER_BOUNDS

log = logging.getLogger(__name__)

Post = Callable[[str, bytes, dict[str, str]], int]


def post_json(url: str, body: bytes, headers: dict[str, str], timeout_s: float = 10.0) -> int:
    """POST ``body``; returns the HTTP status (0 when no answer came back)."""
    req = urllib.request.Request(url, data=body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except (urllib.error.URLError, TimeoutError, ConnectionError, OSError):
        return 0


@dataclass(frozen=True)
class WebhookSettings:
    url: str
    topic: str = TOPICS.alerts
    group: str = "refinery-alerts-webhook"
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    max_attempts: int | None = None  # None: retry forever (the default: never skip an alert)
    poll_s: float = 0.5


@dataclass
class ForwardStats:
    forwarded: int = 0
    attempts: int = 0
    failures: int = 0


class WebhookForwarder:
    """Consumes ``settings.topic`` in group ``settings.group`` and POSTs each record."""

    def __init__(
        self,
        conf: dict[str, Any],
        settings: WebhookSettings,
        post: Post | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.settings = settings
        self.post: Post = post or post_json
        self.sleep = sleep
        self.stats = ForwardStats()
        self.consumer = Consumer(
            {
                **conf,
                **LIBRDKAFKA_CONSUMER_BOUNDS,  # what a fetch carries and a batch inflates to
                "group.id": settings.group,
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                "auto.offset.reset": "earliest",
            }
        )
        self.consumer.subscribe([settings.topic])

    def _deliver(self, body: bytes, headers: dict[str, str]) -> None:
        s = self.settings
        delay, attempt = s.backoff_initial_s, 0
        while True:
            attempt += 1
            self.stats.attempts += 1
            status = self.post(s.url, body, headers)
            if 200 <= status < 300:
                return
            self.stats.failures += 1
            if s.max_attempts is not None and attempt >= s.max_attempts:
                raise TransientError(
                    f"webhook {s.url}: HTTP {status or 'no answer'} after {attempt} attempts"
                )
            log.warning("webhook %s: HTTP %s, retry in %.1fs", s.url, status or "-", delay)
            self.sleep(delay)
            delay = min(delay * 2, s.backoff_max_s)

    def run(self, stop: Callable[[], bool] = lambda: False, max_records: int | None = None) -> int:
        """Forward until ``stop()`` or ``max_records`` forwarded; returns how many were.
        Raises :class:`TransientError` (nothing committed for that record) when
        ``max_attempts`` is exhausted."""
        while not stop() and (max_records is None or self.stats.forwarded < max_records):
            m = self.consumer.poll(self.settings.poll_s)
            if m is None:
                continue
            e_ = m.error()
            if e_ is not None:
                if e_.code() == KafkaError._PARTITION_EOF:
                    continue
                raise TransientError(f"webhook consumer: {e_}")
            body = m.value() or b""
            headers = {"Content-Type": "application/json"}
            try:
                rec = json.loads(body)
                key = f"{rec.get('id')}:{rec.get('state')}"
                headers |= {"X-Refinery-Alert-Key": key, "Idempotency-Key": key}
            except (ValueError, AttributeError):
                pass  # not JSON: forward as is; the receiver decides
            self._deliver(body, headers)
            self.consumer.commit(message=m, asynchronous=False)
            self.stats.forwarded += 1
        return self.stats.forwarded

    def close(self) -> None:
        self.consumer.close()
