"""The refining's clock flags and settings, shared by ``refinery worker`` and ``refinery worker
grow`` (:mod:`services.worker.cli`, :mod:`services.worker.grow_cli`), and the argparse number
type their flags use."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipelines.refine.clock_model import DeclaredTiming
    from pipelines.refine.types import RefineSettings


def number_arg(unit: str, short: str, lo: float, hi: float) -> Callable[[str], float]:
    """An argparse type: a number of ``unit`` from ``lo`` to ``hi``, else one line saying so."""

    def parse(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of {unit}") from None
        if not lo <= x <= hi:
            raise argparse.ArgumentTypeError(f"{text} {short}: expected {lo:g} to {hi:g}")
        return x

    return parse


_drift_ppm = number_arg("ppm", "ppm", 1.0, 10_000.0)


def add_clock_flags(p: Any) -> None:
    """The clock flags of the refining (``refinery worker`` and ``refinery worker grow``)."""
    p.add_argument(
        "--clock-min-delay-ms",
        type=float,
        default=1.1,
        help="assumed minimum producer→broker delay (default 1.1 ms, a datacenter)",
    )
    p.add_argument(
        "--clock-delay-uncertainty-ms",
        type=float,
        default=0.9,
        help="± range of that assumption; part of every error bound (default 0.9)",
    )
    p.add_argument(
        "--clock-plausible-drift-ppm",
        type=_drift_ppm,
        default=200.0,
        help="the largest drift a source's oscillator may have (default 200 ppm): a steeper "
        "fitted slope is read as growing delays and widens the error bounds",
    )


# The most a row of a foreign format's usual producer waits between its stamp and its
# append, when its topic declares none (deploy/topics.yaml ``send_delay``; docs/clock.md):
# the Collector's batch processor holds rows up to 200 ms; Telegraf stamps at collection and
# sends at its flush (flush_interval 10 s by default, plus flush_jitter); collectd's
# write_kafka and a pushed exposition send as they read, once connected: a producer's first
# records wait for its connection to the broker, seconds on a loaded host.
SEND_DELAY_S = {
    "otlp": 5.0,
    "otlp_proto": 5.0,
    "otlp_json": 5.0,
    "influx": 15.0,
    "prometheus": 5.0,
    "collectd": 5.0,
    "collectd_counters": 5.0,
}


def declared_timing(
    ingest: tuple[tuple[str, str], ...], prefix: str = ""
) -> dict[str, DeclaredTiming]:
    """Per ingest topic, what its spec declares of its producer's timing: ``send_delay``
    (else its format's usual, :data:`SEND_DELAY_S`) and ``clock_error``."""
    from pipelines.refine.clock_model import DeclaredTiming
    from services.topics import load_topic_specs

    specs = {s.name: s for s in load_topic_specs(prefix=prefix)}
    out = {}
    for topic, fmt in ingest:
        spec = specs.get(topic)
        delay = spec.send_delay if spec is not None else None
        if delay is None:
            delay = int(SEND_DELAY_S.get(fmt, 5.0) * 1e9)
        out[topic] = DeclaredTiming(delay, spec.clock_error if spec is not None else None)
    return out


def refine_settings(
    args: argparse.Namespace, ingest: tuple[tuple[str, str], ...], prefix: str
) -> RefineSettings:
    """The refining settings of ``refinery worker``'s flags (:func:`add_clock_flags`)."""
    from pipelines.refine.clock import ClockSettings
    from pipelines.refine.types import RefineSettings

    return RefineSettings(
        seq_window=512,
        clock=ClockSettings(
            assumed_min_delay_ns=int(args.clock_min_delay_ms * 1e6),
            delay_uncertainty_ns=int(args.clock_delay_uncertainty_ms * 1e6),
            plausible_drift_ppm=args.clock_plausible_drift_ppm,
        ),
        declared=declared_timing(ingest, prefix),
    )
