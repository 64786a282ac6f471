"""Batches the cluster refused for good (not authorized, too large): said on stderr once per
distinct reason, so a principal without the right ACL is reported, not silently dropped."""

from __future__ import annotations

import sys
from typing import Any


class Refusals:
    """A :data:`services.kafka.producer.DeliveryCallback` counting refused batches; retriable errors
    (the producer retries or spools them) do not count."""

    def __init__(self, command: str, bootstrap: str) -> None:
        self.command, self.bootstrap = command, bootstrap
        self.count = 0
        self._said: set[tuple[str, str]] = set()

    def for_topic(self, topic: str) -> Any:
        def delivered(_tag: str, err: Any, _partition: int, _offset: int) -> None:
            if err is None or err.retriable():
                return
            self.count += 1
            reason = str(err.str())
            if (topic, reason) not in self._said:
                self._said.add((topic, reason))
                print(
                    f"refinery {self.command}: Kafka at {self.bootstrap} refused a batch for "
                    f"{topic}: {reason}",
                    file=sys.stderr,
                )

        return delivered
