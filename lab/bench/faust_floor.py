"""The floor under the worker's CPU per record: Faust's own path, with nothing refined.

    REFINERY_BOOTSTRAP_SERVERS=host:port python -m lab.bench.faust_floor [RECORDS]

A process runs a Faust app built as the worker builds its own (``services.kafka.faust_app.App``,
the worker's fetch, buffer and commit settings) with one agent that takes its records in the
worker's groups (``noack_take`` of 600 within 50 ms, through
:func:`services.kafka.group.manual_acks`) and acks each one, as the worker's checkpoint does,
and does nothing else. Its CPU seconds per record, from its first group on, over a backlog of
``RECORDS`` one-line messages (Telegraf's shape) is the least any worker built on Faust's
stream spends on a record before refining it: with a record of ``k`` samples, the worker cannot
refine more than ``k`` over that many samples per CPU-second.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Floor:
    records: int
    cpu_s: float

    @property
    def us_per_record(self) -> float:
        return self.cpu_s / self.records * 1e6 if self.records else float("nan")


def floor(bootstrap: str, topic: str, n: int) -> Floor:
    """The floor measured over the ``n`` records of ``topic``'s backlog (the process's CPU
    from the end of its first group to its last record)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "floor.json")
        cmd = [sys.executable, "-m", "lab.bench.faust_floor", "--child", bootstrap, topic,
               str(n), out, tmp]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, timeout=600)
        if not os.path.exists(out):
            tail = proc.stderr.decode(errors="replace")[-2000:]
            raise RuntimeError(
                f"faust_floor: the child wrote nothing (exit {proc.returncode}) {tail}"
            )
        with open(out) as f:
            got = json.load(f)
    return Floor(int(got["records"]), float(got["cpu_s"]))


def reader_app(name: str, bootstrap: str, topic: str, data_dir: str, buffer: int) -> Any:
    """A Faust app built as the worker builds its own (``services.kafka.faust_app.App``, its
    fetch, commit and stream-buffer settings; ``buffer`` records buffered a stream) and its
    topic ``topic`` of raw bytes: ``(app, topic)``."""
    from services.kafka.faust_app import App

    app = App(
        name,
        broker=f"kafka://{bootstrap}",
        autodiscover=False,
        datadir=data_dir,
        store="memory://",
        key_serializer="raw",
        value_serializer="raw",
        broker_commit_interval=1.0,
        consumer_auto_offset_reset="earliest",
        consumer_max_fetch_size=32 * 1024 * 1024,
        stream_wait_empty=False,
        stream_buffer_maxsize=buffer,
        web_enabled=False,
    )
    source = app.topic(topic, key_type=bytes, value_type=bytes, key_serializer="raw",
                       value_serializer="raw")  # fmt: skip
    return app, source


def _child(bootstrap: str, topic: str, n: int, out: str, data_dir: str) -> None:
    import asyncio

    from services.kafka.group import manual_acks

    app, source = reader_app(f"{topic}-floor", bootstrap, topic, data_dir, 8192)
    state: dict[str, Any] = {"seen": 0, "first": 0, "cpu0": None}

    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    async def agent(stream: Any) -> None:
        async with manual_acks(stream, 600, 0.05) as groups:
            async for events in groups:
                for ev in events:
                    await stream.ack(ev)
                state["seen"] += len(events)
                if state["cpu0"] is None:
                    state["cpu0"], state["first"] = cpu(), state["seen"]
                if state["seen"] >= n:
                    with open(out, "w") as f:
                        json.dump({"records": state["seen"] - state["first"],
                                   "cpu_s": cpu() - state["cpu0"]}, f)  # fmt: skip
                    os._exit(0)
                await asyncio.sleep(0)

    app.agent(source)(agent)
    from services.kafka.group import run_worker

    run_worker(app)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--child"]:
        _child(argv[1], argv[2], int(argv[3]), argv[4], argv[5])
        return 0
    bootstrap = os.environ.get("REFINERY_BOOTSTRAP_SERVERS")
    if not bootstrap:
        print("faust_floor: set REFINERY_BOOTSTRAP_SERVERS", file=sys.stderr)
        return 2
    from lab.bench.ingest_worker import one_line_backlog

    n = int(argv[0]) if argv else 60_000
    f = floor(bootstrap, one_line_backlog(bootstrap, n), n)
    print(json.dumps({**asdict(f), "us_per_record": f.us_per_record}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
