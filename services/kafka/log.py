"""The Kafka clients' own logs through Python logging, and one line when a cluster cannot be used.

- Every confluent-kafka client gets :data:`KAFKA_LOG` (``refinery.kafka``) as its ``logger``
  (:meth:`services.settings.KafkaSettings.librdkafka`): librdkafka's lines (``FAIL``, ``ERROR``
  …) reach Python logging when the client is polled, instead of being written to stderr by
  librdkafka's own thread. aiokafka logs through Python logging already.
- :class:`CollapseRepeats` drops a line that repeats the previous one of its logger (numbers
  ignored: ``after 0ms`` and ``after 1ms`` are the same line) and notes how many were dropped on
  the next one that differs. It sits on ``refinery.kafka`` and on aiokafka's loggers.
- A one-shot command that configures no logging prints none of these lines (a
  :class:`logging.NullHandler` keeps Python's last-resort handler away); it prints the one line
  :func:`describe` makes from the failure instead. A service that configures logging shows
  them, collapsed.
- :func:`describe` names the address and the cause of a failure to use the cluster: the
  client's error, with the last line librdkafka logged about it (``Connection refused``, a TLS
  or SASL failure).
- :func:`cluster_metadata` is the first contact of the CLI's admin commands: metadata within a
  timeout, or :class:`KafkaUnavailable` with that line.
"""

from __future__ import annotations

import logging
import re
from collections import deque
from typing import Any

from schemas.errors import RefineryError

KAFKA_LOG = logging.getLogger("refinery.kafka")
AIOKAFKA_LOGGERS = (
    "aiokafka",
    "aiokafka.conn",
    "aiokafka.client",
    "aiokafka.cluster",
    "aiokafka.consumer.consumer",
    "aiokafka.consumer.fetcher",
    "aiokafka.consumer.group_coordinator",
    "aiokafka.producer.producer",
    "aiokafka.producer.sender",
)
_NUMBERS = re.compile(r"\d+")
_PREFIX = re.compile(r"^\S+ \[[^\]]*\] \[thrd:[^\]]*\]: (?:\S+: )?")  # FAC [client] [thrd:x]: b:
RECENT: deque[str] = deque(maxlen=32)  # librdkafka's latest warnings and errors, for describe


class KafkaUnavailable(RefineryError):
    """The cluster at the configured address cannot be used (unreachable, refused, TLS or SASL
    failure, not authorized); the message is one line naming the address and the cause."""


class CollapseRepeats(logging.Filter):
    """Drop a record that repeats the previous one (same logger, level and text up to numbers);
    the next record that differs says how many were dropped."""

    def __init__(self) -> None:
        super().__init__()
        self._last: dict[str, tuple[int, str]] = {}
        self._dropped: dict[str, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if record.name == KAFKA_LOG.name and record.levelno >= logging.WARNING:
            RECENT.append(text)
        key = (record.levelno, _NUMBERS.sub("#", text))
        if self._last.get(record.name) == key:
            self._dropped[record.name] = self._dropped.get(record.name, 0) + 1
            return False
        self._last[record.name] = key
        dropped = self._dropped.pop(record.name, 0)
        if dropped:
            record.msg, record.args = f"{text} (the previous line repeated {dropped} times)", ()
        return True


_FILTER = CollapseRepeats()


def install() -> None:
    """Put the collapsing filter on the Kafka clients' loggers (idempotent)."""
    for name in (KAFKA_LOG.name, *AIOKAFKA_LOGGERS):
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
    if not any(isinstance(h, logging.NullHandler) for h in KAFKA_LOG.handlers):
        KAFKA_LOG.addHandler(logging.NullHandler())


install()


def _cause_from_logs(bootstrap: str) -> str | None:
    """The latest logged failure about the cluster, without librdkafka's thread prefix."""
    hosts = [h.strip() for h in bootstrap.split(",") if h.strip()]
    for line in reversed(RECENT):
        if any(h in line for h in hosts):  # librdkafka names the broker in every line
            return _PREFIX.sub("", line).strip()
    return None


def describe(error: BaseException, bootstrap: str) -> str:
    """One line: the address and the cause of a failure to use the cluster."""
    err: Any = error.args[0] if error.args else None
    text = err.str() if hasattr(err, "str") else str(error) or type(error).__name__
    cause = _cause_from_logs(bootstrap)
    detail = f"{cause} ({text})" if cause and cause not in text else text
    return f"cannot use Kafka at {bootstrap}: {detail}".replace("\n", " ")


def drain(client: Any) -> None:
    """Serve a client's queued log lines (they reach Python logging only when polled)."""
    try:
        client.poll(0)
    except Exception:  # a log drain must never mask the failure being reported
        return


def cluster_metadata(conf: dict[str, Any], timeout: float = 15.0) -> tuple[Any, Any]:
    """(admin client, cluster metadata) of the cluster at ``conf``; raises
    :class:`KafkaUnavailable` with one line when it does not answer within ``timeout``."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    admin = AdminClient(conf)
    try:
        return admin, admin.list_topics(timeout=timeout)
    except KafkaException as e:
        drain(admin)
        raise KafkaUnavailable(describe(e, str(conf.get("bootstrap.servers")))) from e


def require_cluster(conf: dict[str, Any], timeout: float = 15.0) -> None:
    """First contact: return once the cluster at ``conf`` answers, else raise
    :class:`KafkaUnavailable` (one line) within ``timeout``."""
    admin_conf = {k: v for k, v in conf.items() if not k.startswith(("group.", "enable.auto"))}
    cluster_metadata(admin_conf, timeout)
