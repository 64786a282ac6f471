"""Typed registration of a Faust app's public hooks: tasks, timers, the partition signals and
the stop signal. Faust's decorators and ``mode`` signals are untyped for mypy (a decorated
function loses its type, a signal takes ``(sender, *args, signal=..., **kwargs)``); these take
plain coroutine functions instead."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, cast

import faust
from faust.types import TP
from mode.types.signals import SignalHandlerT

Handler = Callable[[], Awaitable[None]]
PartitionsHandler = Callable[[set[TP]], Awaitable[None]]


def _handler(receive: Callable[..., Awaitable[None]]) -> SignalHandlerT[Any]:
    """``receive`` takes what a signal passes, ``(sender, *args, signal=..., **kwargs)``; mypy
    matches no ``async def`` against mode's declared handler type (a union of callables with
    the keyword argument ``signal`` typed by a string reference), so it is cast to it."""
    return cast("SignalHandlerT[Any]", receive)


def add_task(app: faust.App, fn: Handler) -> None:
    """Run ``fn`` once the app has started."""
    app.task(fn)


def add_timer(app: faust.App, interval_s: float, fn: Handler) -> None:
    """Run ``fn`` every ``interval_s`` while the app runs (a failure crashes the app)."""
    app.timer(interval=interval_s)(fn)


def on_assigned(app: faust.App, handler: PartitionsHandler) -> None:
    """Call ``handler`` with the partitions assigned after each rebalance."""

    async def receive(sender: Any, *args: Any, signal: Any = None, **kwargs: Any) -> None:
        await handler(set(args[0]))

    app.on_partitions_assigned.connect(_handler(receive))


def on_revoked(app: faust.App, handler: PartitionsHandler) -> None:
    """Call ``handler`` with the partitions revoked at each rebalance."""

    async def receive(sender: Any, *args: Any, signal: Any = None, **kwargs: Any) -> None:
        await handler(set(args[0]))

    app.on_partitions_revoked.connect(_handler(receive))


def on_stopping(app: faust.App, handler: Handler) -> None:
    """Call ``handler`` when the app begins to stop (before its agents and consumer stop)."""

    async def receive(sender: Any, *args: Any, signal: Any = None, **kwargs: Any) -> None:
        await handler()

    app.on_before_shutdown.connect(_handler(receive))
