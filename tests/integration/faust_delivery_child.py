"""A Faust app built as the worker's (``services.kafka.faust_app.App``) that reads a topic
in the worker's groups and acks each record, and writes what it was handed: per partition
the offsets in order, and how many deliveries ran straight through or took Faust's race.

    python -m tests.integration.faust_delivery_child BOOTSTRAP TOPIC RECORDS BUFFER OUT DIR
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def main(bootstrap: str, topic: str, n: int, buffer: int, out: str, data_dir: str) -> None:
    import services.kafka.internals as internals
    from lab.bench.faust_floor import reader_app
    from services.kafka.group import manual_acks, run_worker

    paths = {"inline": 0, "raced": 0}
    at_once = internals._delivers_at_once

    def counted(consumer: Any) -> bool:  # calls through: the path taken, counted
        got = at_once(consumer)
        paths["inline" if got else "raced"] += 1
        return got

    internals._delivers_at_once = counted
    app, source = reader_app(f"{topic}-reader", bootstrap, topic, data_dir, buffer)
    offsets: dict[int, list[int]] = {}

    async def agent(stream: Any) -> None:
        seen = 0
        async with manual_acks(stream, 600, 0.05) as groups:
            async for events in groups:
                for ev in events:
                    offsets.setdefault(ev.message.partition, []).append(ev.message.offset)
                    await stream.ack(ev)
                seen += len(events)
                if seen >= n:
                    with open(out, "w") as f:
                        json.dump({"offsets": offsets, "paths": paths}, f)
                    os._exit(0)

    app.agent(source)(agent)
    run_worker(app)


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], a[1], int(a[2]), int(a[3]), a[4], a[5])
