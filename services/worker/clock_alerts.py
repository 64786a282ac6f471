"""The refiner's clock alerts: per stream, whether its clock is flagged as off and since when.

Part of the refiner's one state (:class:`services.worker.refiner_state.RefinerState`), which
loads it with a stream's checkpointed state and writes it back at checkpoints, and takes a
:meth:`ClockAlerts.snapshot` of the streams a group touches to put back
(:meth:`ClockAlerts.restore`) when refining the group raised; the refiner flips it as
estimates come (:meth:`ClockAlerts.observe`).
"""

from __future__ import annotations

import hashlib
from typing import Any

from pipelines.refine.types import RefineResult
from schemas.records import Alert, AlertState, Severity
from services.kafka.outputs import OutMessage
from services.worker.refiner_outputs import RawRecord

_MISSING: Any = object()


class ClockAlerts:
    """Per stream key: flagged (a firing ``clock_offset`` alert) and its onset, the broker
    append time of the record that flipped the flag (the same on a replay of that record, and
    remembered in the stream's state until it resolves). Not thread-safe."""

    def __init__(self, topic: str) -> None:
        self.topic = topic  # the alerts topic
        self._flagged: dict[str, bool] = {}
        self._onsets: dict[str, int] = {}

    def load(self, stream: str, flagged: bool, onset: int | None) -> None:
        """Set a stream's state as its checkpoint holds it."""
        self._flagged[stream] = flagged
        if onset is not None:
            self._onsets[stream] = onset

    def flagged(self, stream: str) -> bool:
        return self._flagged.get(stream, False)

    def onset(self, stream: str) -> int | None:
        return self._onsets.get(stream)

    def clear(self) -> None:
        """Forget every stream (the partitions were revoked; the state reloads)."""
        self._flagged.clear()
        self._onsets.clear()

    def snapshot(self, stream: str) -> tuple[Any, Any]:
        """A stream's state as it is now, for :meth:`restore`."""
        return self._flagged.get(stream, _MISSING), self._onsets.get(stream, _MISSING)

    def restore(self, stream: str, snap: tuple[Any, Any]) -> None:
        """Put a stream's state back as :meth:`snapshot` took it."""
        flagged, onset = snap
        if flagged is _MISSING:
            self._flagged.pop(stream, None)
        else:
            self._flagged[stream] = flagged
        if onset is _MISSING:
            self._onsets.pop(stream, None)
        else:
            self._onsets[stream] = onset

    def observe(
        self, stream: str, node: str, r: RefineResult, now_ns: int, rec: RawRecord
    ) -> list[OutMessage]:
        """The alert message when ``r`` (a record of ``stream`` refined) flips its flag:
        firing when the bound proves the clock off by more than the settings allow, resolved
        when it proves it back; none otherwise."""
        if r.clock is None:
            return []
        was = self._flagged.get(stream, False)
        if r.clock_alert is None or r.clock_alert == was:
            return []
        self._flagged[stream] = r.clock_alert
        at_ns = rec.append_ms * 1_000_000
        if r.clock_alert:
            self._onsets[stream] = at_ns
        onset = self._onsets[stream] if r.clock_alert else self._onsets.pop(stream, at_ns)
        aid = hashlib.sha1(f"clock_offset|{stream}|{onset}".encode()).hexdigest()[:20]
        alert = Alert(
            id=aid,
            rule="clock_offset",
            state=AlertState.FIRING if r.clock_alert else AlertState.RESOLVED,
            severity=Severity.WARNING,
            entity=stream,
            node=node,
            starts_ns=onset,
            ends_ns=None if r.clock_alert else at_ns,
            summary=(
                f"clock of {stream} is off by {r.clock.offset_ns / 1e9:+.3f} s "
                f"(±{r.clock.error_ns / 1e6:.1f} ms)"
            ),
            evidence={
                "offset_ns": r.clock.offset_ns,
                "error_ns": r.clock.error_ns,
                "drift_ppm": r.clock.drift_ppm,
            },
            emitted_ns=now_ns,
        )
        return [OutMessage(self.topic, stream.encode(), alert.model_dump_json().encode())]
