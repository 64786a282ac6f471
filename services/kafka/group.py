"""Running a Faust app of this project: its group's progress for ``/health``, Faust's groups
whose acks only the caller gives (each service's checkpoint: :mod:`services.worker.checkpoint`,
:mod:`services.detect.checkpoint`), credentials, and the process runner that ends a crashed
app non-zero. Shared by the worker and detect."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import faust

from services.kafka import hooks, internals
from services.settings import KafkaSettings

log = logging.getLogger(__name__)


class Progress:
    """What /health reports: whether groups keep completing while input waits, and whether
    the group's committed offsets move while the broker holds input for this worker."""

    def __init__(self) -> None:
        self.last_group_done = time.monotonic()
        self.last_group_started = 0.0
        self.groups = 0
        self.records = 0
        self.commit_stalled_s = 0.0  # input waiting while committed offsets stood still

    def healthy(self, stall_after_s: float) -> bool:
        busy = self.last_group_started > self.last_group_done
        if busy and time.monotonic() - self.last_group_started > stall_after_s:
            return False
        return self.commit_stalled_s <= stall_after_s


@contextlib.asynccontextmanager
async def manual_acks(stream: Any, take_max: int, within_s: float) -> AsyncIterator[Any]:
    """Faust's ``noack_take`` groups, whose events only the caller acks, also after the
    groups end. ``noack_take`` turns the stream's own acks off while it runs and back on when
    it closes, and the stream's background reader goes on reading and acking every event it
    passes: after a failed group (the agent crashing) that acked records no agent refined,
    and the shutdown commit committed them (seen: a worker whose outputs the broker refused
    committed two unrefined records of a partition). On the way out, a crash included, the
    groups are closed here at once and the stream's acks stay off."""
    groups = stream.noack_take(take_max, within=within_s)
    try:
        yield groups
    finally:
        await groups.aclose()  # noack_take's cleanup turns the stream's acks back on ...
        stream.enable_acks = False  # ... and nothing this process did not refine is acked


def credentials(kafka: KafkaSettings) -> Any:
    if kafka.security_protocol == "PLAINTEXT":
        return None
    import ssl

    ctx = None
    if kafka.security_protocol.endswith("SSL"):
        ctx = ssl.create_default_context(
            cafile=str(kafka.ssl_ca_location) if kafka.ssl_ca_location else None
        )
        if kafka.ssl_cert_location and kafka.ssl_key_location:
            ctx.load_cert_chain(
                str(kafka.ssl_cert_location),
                str(kafka.ssl_key_location),
                kafka.ssl_key_password.get_secret_value() if kafka.ssl_key_password else None,
            )
    if kafka.security_protocol.startswith("SASL"):
        return faust.SASLCredentials(
            username=kafka.sasl_username or "",
            password=kafka.sasl_password.get_secret_value() if kafka.sasl_password else "",
            mechanism=kafka.sasl_mechanism,
            ssl_context=ctx,
        )
    return faust.SSLCredentials(ctx)


def run_worker(app: faust.App, loglevel: str = "warning", stop_timeout_s: float = 30.0) -> int:
    """Run until SIGTERM/SIGINT (clean shutdown, exit 0) or a crash (non-zero exit).

    A graceful stop that has not finished after ``stop_timeout_s`` (Faust can wait on a
    rebalance that never completes) ends the process with exit code 3 and a log line. That
    loses nothing: every group's outputs and state were flushed before its offsets could be
    committed, so the next owner of the partitions replays at most the unfinished group."""
    import os
    import threading

    def watchdog() -> None:
        log.error("graceful stop took more than %.0fs; exiting now", stop_timeout_s)
        logging.shutdown()
        os._exit(3)

    async def arm_watchdog() -> None:
        timer = threading.Timer(stop_timeout_s, watchdog)
        timer.daemon = True
        timer.start()

    hooks.on_stopping(app, arm_watchdog)

    worker = internals.without_spinner(faust.Worker(app, loglevel=loglevel, quiet=True))
    code = 0
    try:
        worker.execute_from_commandline()
    except SystemExit as e:
        code = int(e.code or 0)
    except Exception as e:  # an agent crashed: Faust re-raises it after closing its loop
        log.error("worker crashed: %s: %s", type(e).__name__, e)
        code = 1
    if code:
        # Threads that outlive the loop (the consumer's, the topology feed's, executors)
        # would keep the interpreter from exiting: a crashed worker must end, non-zero.
        logging.shutdown()
        os._exit(code)
    return code
