"""The source's own clock view from chrony: ``chronyc -c tracking`` (CSV) or ``chronyc tracking``.

:func:`parse_tracking` turns either form into a :class:`Tracking`; :meth:`Tracking.clock_block`
gives the envelope's :class:`~schemas.wire.ClockBlock` and :meth:`Tracking.add_samples` the
``clock.*`` samples. :func:`read_chrony` runs ``chronyc`` only when it is installed, with a
timeout, and returns None on any failure (not installed, daemon down, timeout, odd output):
a missing clock block is a normal state, never an error of the scrape.

Sign convention: ``offset_ns`` is local clock minus reference. chrony's "System time" is
positive when the local clock is fast (text form: "... seconds fast of NTP time").
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

from schemas.wire import ClockBlock, SyncState
from services.exporters.procfs import SampleBuffer

_UNSYNCED_LEAP = "not synchronised"


@dataclass(frozen=True, slots=True)
class Tracking:
    """The fields of ``chronyc tracking`` that Refinery uses (seconds and ppm as printed)."""

    reference: str
    stratum: int
    system_time_s: float  # local minus reference (fast positive)
    frequency_ppm: float  # slow positive, as chrony prints it
    skew_ppm: float
    root_delay_s: float
    root_dispersion_s: float
    leap: str

    @property
    def synced(self) -> bool:
        return self.leap.lower() != _UNSYNCED_LEAP and self.stratum > 0

    @property
    def error_bound_ns(self) -> int:
        """|offset| + root dispersion + root delay / 2, the bound chrony documents."""
        bound = abs(self.system_time_s) + self.root_dispersion_s + self.root_delay_s / 2
        return round(bound * 1e9)

    def clock_block(self) -> ClockBlock:
        return ClockBlock(
            source="chrony",
            offset_ns=round(self.system_time_s * 1e9),
            error_bound_ns=self.error_bound_ns,
            state=SyncState.SYNCED if self.synced else SyncState.UNSYNCED,
            stratum=min(max(self.stratum, 0), 16),
            reference=self.reference[:128] or None,
        )

    def add_samples(self, ts: int, buf: SampleBuffer, device: str = "chrony") -> None:
        buf.gauge(ts, "clock.offset_ns", device, round(self.system_time_s * 1e9))
        buf.gauge(ts, "clock.error_bound_ns", device, self.error_bound_ns)
        buf.gauge(ts, "clock.frequency_ppm", device, self.frequency_ppm)
        buf.gauge(ts, "clock.skew_ppm", device, self.skew_ppm)
        buf.gauge(ts, "clock.stratum", device, self.stratum)
        buf.gauge(ts, "clock.sync_state", device, 1 if self.synced else 2)


def _parse_csv(line: str) -> Tracking | None:
    f = line.strip().split(",")
    if len(f) < 14:
        return None
    try:
        return Tracking(
            reference=f[1] or f[0],
            stratum=int(f[2]),
            system_time_s=float(f[4]),
            frequency_ppm=float(f[7]),
            skew_ppm=float(f[9]),
            root_delay_s=float(f[10]),
            root_dispersion_s=float(f[11]),
            leap=f[13].strip(),
        )
    except ValueError:
        return None


def _signed(value: str, fast_word: str = "fast") -> float:
    parts = value.split()
    x = float(parts[0])
    return x if fast_word in parts else -x


def _parse_text(text: str) -> Tracking | None:
    kv: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, val = line.partition(":")
        if sep:
            kv[key.strip()] = val.strip()
    try:
        ref = kv.get("Reference ID", "")
        name = ref[ref.find("(") + 1 : ref.rfind(")")] if "(" in ref else ref
        return Tracking(
            reference=name,
            stratum=int(kv["Stratum"]),
            system_time_s=_signed(kv["System time"]),
            frequency_ppm=_signed(kv["Frequency"], "slow"),
            skew_ppm=float(kv["Skew"].split()[0]),
            root_delay_s=float(kv["Root delay"].split()[0]),
            root_dispersion_s=float(kv["Root dispersion"].split()[0]),
            leap=kv.get("Leap status", ""),
        )
    except (KeyError, ValueError, IndexError):
        return None


def parse_tracking(output: str) -> Tracking | None:
    """Parse ``chronyc -c tracking`` or ``chronyc tracking`` output; None if it is neither."""
    stripped = output.strip()
    if not stripped:
        return None
    if ":" not in stripped.splitlines()[0]:
        return _parse_csv(stripped.splitlines()[0])
    return _parse_text(stripped)


def read_chrony(chronyc: str = "chronyc", timeout_s: float = 1.0) -> Tracking | None:
    """Run ``chronyc -c tracking`` if installed. May block up to ``timeout_s``; never raises."""
    exe = shutil.which(chronyc)
    if exe is None:
        return None
    try:
        proc = subprocess.run(
            [exe, "-c", "tracking"], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return None
    return parse_tracking(proc.stdout)
