"""The clock estimator's incremental forms give exactly what the algorithms they replaced
give: the declared bound's intersection (the walk over the last points), the gap statistics
(taken over the whole window each record) and the hull (rebuilt from the points). A
reference estimator runs the old algorithms; every estimate, the estimator's state and, for
ingest records through the refiner, every outcome (refined rows with their clock offsets
and bounds, dead letters, accounting) are compared."""

from __future__ import annotations

import itertools
import json
import math
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from pipelines.refine.clock import _DECLARED_POINTS, ClockEstimate, ClockEstimator
from pipelines.refine.clock_bounds import MS, STEP_TOL_NS, drift_rate
from pipelines.refine.clock_hull import gap_stats, upper_hull
from pipelines.refine.clock_model import UNKNOWN, ClockSettings, DeclaredTiming
from pipelines.refine.enrich import TopologyIndex
from pipelines.refine.types import RefineSettings
from schemas.catalog import default_catalog
from schemas.ingest import IngestDecoder
from schemas.topics import TOPICS
from services.worker.refiner import Outcome, RawRecord, Refiner

S = 1_000_000_000
T0 = 1_700_000_000 * S


class _Reference(ClockEstimator):
    """The estimator as it was: the declared walk over every one of the last points, the
    gap statistics over the whole window, the hull rebuilt from the points."""

    def _declared(self, x: int, declared: DeclaredTiming) -> ClockEstimate:
        delay_max_ns = declared.send_delay_max_ns
        rate = drift_rate(self.settings.exchange_drift_ppm)
        runs: list[tuple[int, int]] = []
        lo, hi = -(2**62), 2**62
        for px, py in itertools.islice(reversed(self.points), _DECLARED_POINTS):
            w = STEP_TOL_NS + math.ceil(rate * abs(x - px))
            a, b = py - MS - w, py + delay_max_ns + w
            if a > hi or b < lo:
                runs.append((lo, hi))
                if len(runs) == 2:
                    break
                lo, hi = a, b
            else:
                lo, hi = max(lo, a), min(hi, b)
        runs.append((lo, hi))
        lo, hi = min(r[0] for r in runs[:2]), max(r[1] for r in runs[:2])
        widened = None
        e = declared.clock_error_ns
        if e is not None:
            if max(lo, -e) <= min(hi, e):
                lo, hi = max(lo, -e), min(hi, e)
            else:
                widened = "clock_error"
        model = self.last.offset_at(x) if self.last is not UNKNOWN else (lo + hi) // 2
        offset = min(max(model, lo), hi)
        from dataclasses import replace

        return replace(self.last, offset_ns=offset, anchor_ns=x, drift_ppm=0.0,
                       error_ns=max(offset - lo, hi - offset) + 1, widened=widened,
                       basis="declared", error_rate=rate)  # fmt: skip

    def _gap_stats(self, a: float, b: float, xa: int) -> tuple[float, float, float]:
        return gap_stats(self.points, a, b, xa, self._xy())

    def _hull_now(self) -> list[tuple[int, int]]:
        return upper_hull(self.points)


def _pair(settings_: ClockSettings | None = None) -> tuple[ClockEstimator, _Reference]:
    s = settings_ or ClockSettings()
    return ClockEstimator(s), _Reference(s)


def _same(new: ClockEstimator, ref: ClockEstimator) -> None:
    assert new.to_dict() == ref.to_dict()
    assert new.last == ref.last
    assert new._fit == ref._fit
    if new._hull is not None:  # the very tuples the chain over all the points keeps
        assert [id(p) for p in new._hull] == [id(p) for p in upper_hull(new.points)]


# one step of a source: (seconds since the last send time, records at it, their append
# jitter in ms, a clock step in ms)
_steps = st.lists(
    st.tuples(
        st.sampled_from([0, 0, 1, 1, 1, 2, 10, -1]),
        st.integers(1, 70),
        st.sampled_from([0, 1, 3, 30, 2_000]),
        st.sampled_from([0] * 12 + [40, -40, 5_000]),
    ),
    min_size=1,
    max_size=24,
)


@settings(max_examples=60, deadline=None)
@given(
    _steps,
    st.sampled_from([None, 200 * MS, 15 * S]),
    st.sampled_from([None, 50 * MS]),
    st.integers(0, 2**32),
)
def test_every_estimate_and_state_is_the_old_algorithms(
    steps: list[tuple[int, int, int, int]], delay: int | None, error: int | None, seed: int
) -> None:
    """Bursts of one send time (one-metric messages), single records, jittered and
    stepped clocks, a send time that goes back (the points sorted anew), with and without a
    declared delay and clock error: the same estimates and state, record for record."""
    rng = random.Random(seed)
    new, ref = _pair(ClockSettings(window=96))
    declared = DeclaredTiming(delay, error) if delay is not None else None
    x, offset = T0, 0
    for dt, burst, jitter_ms, step_ms in steps:
        x += dt * S
        offset += step_ms * MS
        for _ in range(burst):
            arrival = (x - offset + 2 * MS + rng.randrange(jitter_ms * MS + 1)) // MS * MS
            assert new.observe(x, arrival, None, 0, declared) == ref.observe(
                x, arrival, None, 0, declared
            )
        _same(new, ref)


def test_a_long_burst_stream_is_the_old_algorithms() -> None:
    """Hosts flushing 64 one-line messages a second with appends a few ms apart, over more
    than a full window: the incremental path runs for most records, with the same
    results."""
    rng = random.Random(5)
    new, ref = _pair()
    declared = DeclaredTiming(15 * S)
    for second in range(40):
        x = T0 + second * S + rng.randrange(1000)
        for _ in range(64):
            arrival = (x + rng.randrange(1 * MS, 9 * MS)) // MS * MS
            assert new.observe(x, arrival, None, 0, declared) == ref.observe(
                x, arrival, None, 0, declared
            )
    _same(new, ref)


def _line(host: int, cpu: int, i: int, ts: int) -> bytes:
    fields = ",".join(f"time_{m}={1000 + i}.25" for m in ("user", "system", "idle"))
    return f"cpu,cpu=cpu{cpu},host=h{host} {fields} {ts}".encode()


def _value_list(host: int, dev: int, i: int, ts: int) -> bytes:
    vl = {"values": [10**9 + i * 4096, 10**9 + i * 2048], "dstypes": ["derive", "derive"],
          "dsnames": ["rx", "tx"], "time": ts / 1e9, "interval": 1.0, "host": f"h{host}",
          "plugin": "interface", "plugin_instance": f"eth{dev}", "type": "if_octets",
          "type_instance": ""}  # fmt: skip
    return json.dumps([vl]).encode()


def _records() -> list[RawRecord]:
    """Three hosts' bursts on a line-protocol and a collectd topic over 12 seconds, appends
    jittered; host 2's clock steps 3 s ahead at second 7, a record's time goes back, one
    record is not line protocol, one metric is unknown."""
    rng = random.Random(3)
    recs: list[RawRecord] = []
    for second in range(12):
        for host in range(3):
            ahead = 3 * S if host == 2 and second >= 7 else 0
            ts = T0 + second * S + ahead
            for c in range(16):
                body = _line(host, c, second, ts - (S if (second, c) == (5, 3) else 0))
                if (second, host, c) == (4, 1, 7):
                    body = b"not line protocol"
                if (second, host, c) == (6, 0, 2):
                    body = body.replace(b"cpu,", b"cpux,")
                recs.append(RawRecord("lp", host, len(recs), b"h%d" % host, body, [],
                                      (ts - ahead) // MS + rng.randrange(2, 40)))  # fmt: skip
            for d in range(4):
                body = _value_list(host, d, second, ts)
                recs.append(RawRecord("cd", host, len(recs), b"h%d" % host, body, [],
                                      (ts - ahead) // MS + rng.randrange(2, 40)))  # fmt: skip
    return recs


def _refine(recs: list[RawRecord], clocks: dict[str, ClockEstimator] | None) -> list[Outcome]:
    topo = TopologyIndex([], [])
    timing = {"lp": DeclaredTiming(15 * S), "cd": DeclaredTiming(5 * S, 2 * S)}
    refiner = Refiner(default_catalog(), TOPICS, lambda: topo, lambda _: None,
                      lambda _: None, RefineSettings(seq_window=512, declared=timing),
                      IngestDecoder({"lp": "influx", "cd": "collectd_counters"}))  # fmt: skip
    if clocks is not None:
        refiner.state.refine.clocks.update(clocks)
    out: list[Outcome] = []
    for i in range(0, len(recs), 100):
        out += refiner.process_group(recs[i : i + 100], T0 + 60 * S)
    return out


def test_ingest_records_refine_as_with_the_old_algorithms() -> None:
    """Every outcome of the refiner, messages included (refined rows with their clock
    offsets and bounds, dead letters, accounting), is the same with the reference
    estimator in every stream."""
    recs = _records()
    got = _refine(recs, None)
    probe = Refiner(default_catalog(), TOPICS, lambda: TopologyIndex([], []),
                    lambda _: None, lambda _: None, RefineSettings(seq_window=512),
                    IngestDecoder({"lp": "influx", "cd": "collectd_counters"}))  # fmt: skip
    probe.process_group(recs, T0)
    streams = list(probe.state.refine.clocks)
    assert len(streams) == 6
    clocks: dict[str, ClockEstimator] = {s: _Reference(ClockSettings()) for s in streams}
    want = _refine(recs, clocks)
    assert len(got) == len(want) == len(recs)
    assert got == want
    assert any(o.outcome == "deadletter" for o in got)
    assert {o.clock.basis for o in got if o.clock is not None} == {"declared"}
    assert any(o.clock.widened == "clock_error" for o in got if o.clock is not None)
