#!/usr/bin/env python3
"""A plain confluent-kafka consumer of Refinery's alert stream, deduplicating on (id, state).

Refinery publishes alert *lifecycle records* to ``telemetry.alerts`` (JSON, one
``schemas.records.Alert`` per message, key = entity). Each alert is born ``firing`` and ends
``resolved`` with the **same ``id``**. Ids are stable across worker restarts and replays, so
the same record may be delivered more than once (at-least-once delivery, a reprocessed
batch after a crash): a consumer keys on ``(id, state)`` and acts once per key.

This program needs nothing from Refinery — only ``confluent-kafka``::

    pip install confluent-kafka
    python examples/alert_consumer.py --bootstrap 127.0.0.1:9092 --group my-pager

What it does, per message:

1. parse the JSON record (fields: id, rule, state, severity, entity, node, device, job,
   starts_ns, ends_ns, summary, cause, evidence, lineage, emitted_ns);
2. skip it if ``(id, state)`` was seen already (a bounded in-memory set here; use a database
   or the receiving system's idempotency key in production);
3. act on it: open an incident on ``firing``, close it on ``resolved`` (here: print);
4. commit the offset after acting (``enable.auto.commit=false``), so a crash re-delivers
   rather than loses — step 2 absorbs the re-delivery.

Options: ``--topic`` (default telemetry.alerts), ``--from-beginning`` (a new group starts at
the oldest record instead of the newest), ``--exit-at-eof`` (stop at the end of the
partitions — for scripts and tests), ``--json`` (print the records as JSON lines).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import OrderedDict
from typing import Any

from confluent_kafka import Consumer, KafkaError


class SeenKeys:
    """The last ``capacity`` (id, state) keys, oldest forgotten first."""

    def __init__(self, capacity: int = 100_000) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[tuple[str, str], None] = OrderedDict()

    def add(self, key: tuple[str, str]) -> bool:
        """True when ``key`` is new (and remember it)."""
        if key in self._keys:
            self._keys.move_to_end(key)
            return False
        self._keys[key] = None
        if len(self._keys) > self.capacity:
            self._keys.popitem(last=False)
        return True


def act(alert: dict[str, Any], as_json: bool) -> None:
    """What a real consumer does: page, open/close a ticket. Here: print one line."""
    if as_json:
        print(json.dumps(alert, sort_keys=True), flush=True)
        return
    verb = "OPEN " if alert["state"] == "firing" else "CLOSE"
    cause = f" (cause: {alert['cause']})" if alert.get("cause") else ""
    print(f"{verb} [{alert['severity']}] {alert['entity']}: {alert['summary']}{cause}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--bootstrap", default="127.0.0.1:9092")
    ap.add_argument("--topic", default="telemetry.alerts")
    ap.add_argument("--group", default="alert-consumer-example")
    ap.add_argument("--from-beginning", action="store_true")
    ap.add_argument("--exit-at-eof", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    consumer = Consumer(
        {
            "bootstrap.servers": args.bootstrap,
            "group.id": args.group,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest" if args.from_beginning else "latest",
            "enable.partition.eof": args.exit_at_eof,
        }
    )
    consumer.subscribe([args.topic])
    seen = SeenKeys()
    at_eof: set[int] = set()
    duplicates = 0
    try:
        while True:
            msg = consumer.poll(1.0)
            if msg is None:
                continue
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    at_eof.add(msg.partition() or 0)
                    assigned = {tp.partition for tp in consumer.assignment()}
                    if args.exit_at_eof and assigned and assigned <= at_eof:
                        break
                    continue
                print(f"consumer error: {err}", file=sys.stderr)
                return 1
            at_eof.discard(msg.partition() or 0)
            try:
                alert = json.loads(msg.value() or b"")
                key = (str(alert["id"]), str(alert["state"]))
            except (ValueError, KeyError, TypeError):
                print(
                    f"skipping a record that is not an alert at offset {msg.offset()}",
                    file=sys.stderr,
                )
            else:
                if seen.add(key):
                    act(alert, args.json)
                else:
                    duplicates += 1
            consumer.commit(message=msg, asynchronous=False)
    except KeyboardInterrupt:
        pass
    finally:
        consumer.close()
    print(f"duplicates skipped: {duplicates}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
