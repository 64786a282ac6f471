"""Hard bounds on a source's clock offset from its producer's exchanges with the broker.

On a topic with ``message.timestamp.type=LogAppendTime`` the producer's delivery report
carries the broker's append time ``A`` (ms, the partition leader's clock) of the record. The
exporter stamped ``S`` (its clock, just before ``produce()``) and ``R`` (its clock, when the
report arrived). The append happened between the two, so at that moment the source clock
read some ``s`` in ``[S, R]`` while the broker's read some ``b`` in ``[A, A + 1 ms)`` (Kafka
truncates to the millisecond). The offset ``source - broker`` then lies in::

    [S - A - 1 ms, R - A]

whatever the queueing, linger, retries or load: they widen the interval, never falsify it.

Over time the offset moves by the relative drift of the two oscillators, at most
``drift_ppm`` (200 ppm by default): an exchange taken at source time ``S`` bounds the offset
at source time ``t`` by its interval widened by ``drift_ppm x |t - S|`` on each side. The
intersection of several such intervals is the hard bound at ``t``.

A clock step invalidates older exchanges. The exporter sees its own steps (its wall clock
moves against its monotonic clock by more than drift explains) and drops its exchanges then
(:class:`ExchangeLog`). When the intervals still do not intersect (a step not seen, a leader
whose clock differs from the previous one's), only the newest exchange is kept.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

MS = 1_000_000
DRIFT_PPM = 200.0
# how many exchanges an exporter carries in a batch's clock block
CARRIED = 4
# the largest step of the exporter's clock it may miss (its wall clock against its monotonic
# one, read a few µs apart): every exchange's interval is widened by as much
STEP_TOL_NS = 50_000


@dataclass(frozen=True)
class Exchange:
    """One acknowledged record: source send ``sent_ns`` and ack ``ack_ns`` (source clock),
    broker append ``append_ms`` (partition leader's clock), on ``partition``."""

    sent_ns: int
    append_ms: int
    ack_ns: int
    partition: int = -1

    @property
    def lo(self) -> int:
        return self.sent_ns - self.append_ms * MS - MS

    @property
    def hi(self) -> int:
        return self.ack_ns - self.append_ms * MS

    @property
    def width(self) -> int:
        return self.hi - self.lo

    def at(self, t_ns: int, drift_ppm: float = DRIFT_PPM) -> tuple[int, int]:
        """The interval this exchange bounds the offset to at source time ``t_ns``."""
        w = _widen(t_ns - self.sent_ns, drift_ppm)
        return self.lo - w, self.hi + w

    def as_list(self) -> list[int]:
        return [self.sent_ns, self.append_ms, self.ack_ns, self.partition]


def _widen(dt_ns: int, drift_ppm: float) -> int:
    """How far the offset can move while the source clock advances by ``|dt_ns|``:
    ``drift x true elapsed``, the true elapsed being up to ``|dt| / (1 - drift)``, plus
    :data:`STEP_TOL_NS` for a step too small to be seen. Rounded up."""
    ppb = round(drift_ppm * 1000)
    return STEP_TOL_NS - (-abs(dt_ns) * ppb // (1_000_000_000 - ppb))


def drift_rate(drift_ppm: float = DRIFT_PPM) -> float:
    """:func:`_widen`'s growth per ns of source time, as a float (for whole columns)."""
    d = drift_ppm * 1e-6
    return d / (1 - d)


def exchanges_of(raw: Iterable[Sequence[int]]) -> list[Exchange]:
    """The exchanges of a clock block's ``exchanges`` list; ones with ``R < S`` (no exchange
    can be acknowledged before it was sent) are left out."""
    out = []
    for item in raw:
        if len(item) < 3:
            continue
        e = Exchange(
            int(item[0]), int(item[1]), int(item[2]), int(item[3]) if len(item) > 3 else -1
        )
        if e.ack_ns >= e.sent_ns:
            out.append(e)
    return out


def hard_interval(
    exchanges: Sequence[Exchange], t_ns: int, drift_ppm: float = DRIFT_PPM
) -> tuple[int, int, int] | None:
    """``(lo, hi, used)``: the offset's bound at source time ``t_ns`` from the exchanges on
    the newest one's partition (each leader has its own clock), intersected newest first;
    an exchange that does not intersect the ones after it ends the walk (the clock stepped
    between them). None without exchanges."""
    if not exchanges:
        return None
    newest = max(exchanges, key=lambda e: e.sent_ns)
    same = sorted(
        (e for e in exchanges if e.partition == newest.partition),
        key=lambda e: e.sent_ns,
        reverse=True,
    )
    lo, hi = same[0].at(t_ns, drift_ppm)
    used = 1
    for e in same[1:]:
        a, b = e.at(t_ns, drift_ppm)
        if a > hi or b < lo:
            break
        lo, hi = max(lo, a), min(hi, b)
        used += 1
    return lo, hi, used


@dataclass
class ExchangeLog:
    """An exporter's recent exchanges: the newest few and the tightest of the last
    ``keep_ns`` (see :meth:`carried`). Pure: the caller hands it its wall and monotonic
    readings.

    A step of the exporter's wall clock moves every offset by the step's size. The log keeps
    each exchange's ``wall - monotonic`` (both run on the same oscillator, so it moves only
    when the wall clock is stepped, by exactly the step): an exchange whose send and ack
    disagree by more than :data:`STEP_TOL_NS` straddles a step and is not kept; the others
    are carried onto the setting of the batch's stamps (their wall readings moved by the
    step since), so a batch stamped right after a step is bounded as tightly as before it,
    even while no new exchange can be had (a broker failover)."""

    keep_ns: int = 60_000_000_000
    newest: int = 3
    _items: list[tuple[Exchange, int]] | None = None  # (exchange, wall - monotonic at ack)
    _skew: int | None = None  # wall - monotonic at the last check
    # per source of the batches: the setting its last batch was given exchanges on
    _batch_skews: dict[str, int] = field(default_factory=dict)

    def add(self, exchange: Exchange, mono_sent_ns: int, mono_ack_ns: int) -> bool:
        """Keep ``exchange`` (its wall readings ``sent_ns``/``ack_ns`` were taken with the
        monotonic readings given); False when it straddles a step and is left out."""
        skew = exchange.ack_ns - mono_ack_ns
        if abs(skew - (exchange.sent_ns - mono_sent_ns)) > STEP_TOL_NS:
            return False
        horizon = mono_ack_ns - self.keep_ns  # on the monotonic clock: steps move no age
        items = [it for it in self._items or [] if it[0].ack_ns - it[1] >= horizon]
        items.append((exchange, skew))
        self._items = items[-256:]
        return True

    def check(self, wall_ns: int, mono_ns: int) -> None:
        """The wall clock's setting now (``wall - monotonic``): what :meth:`carried` maps
        the exchanges onto when given no setting of its own."""
        self._skew = wall_ns - mono_ns

    def for_batch(
        self, source: str, partition: int | None = None, skew: int | None = None
    ) -> list[Exchange]:
        """What the next batch of ``source`` carries (:meth:`carried`); its first batch
        after a step of the wall clock (its rows stamped on either setting: the step came
        since its batch before) carries them widened over both settings, the new and the
        one before, so every row of it is inside, however wide."""
        skew = self._skew if skew is None else skew
        out = self.carried(partition, skew)
        if skew is None:
            return out
        before = self._batch_skews.get(source)
        self._batch_skews[source] = skew
        if before is None or abs(skew - before) <= STEP_TOL_NS:
            return out
        step = skew - before  # the earlier setting: every exchange moved back by the step
        lo, hi = min(0, -step), max(0, -step)
        return [Exchange(e.sent_ns + lo, e.append_ms, e.ack_ns + hi, e.partition) for e in out]

    def carried(self, partition: int | None = None, skew: int | None = None) -> list[Exchange]:
        """What a batch carries: on ``partition`` (None: the newest exchange's), the
        newest ``newest`` exchanges and the tightest of the rest, at most :data:`CARRIED`,
        each on the setting ``skew`` of the wall clock (``wall - monotonic`` when the
        batch's rows were stamped; None: at the last :meth:`check`, else as taken)."""
        if not self._items:
            return []
        skew = self._skew if skew is None else skew
        items = [_on_setting(e, k, skew) for e, k in self._items]
        part = items[-1].partition if partition is None else partition
        mine = [e for e in items if e.partition == part]
        recent = mine[-self.newest :]
        rest = mine[: -self.newest] if len(mine) > self.newest else []
        extra = sorted(rest, key=lambda e: e.width)[: max(0, CARRIED - len(recent))]
        return sorted(extra + recent, key=lambda e: e.sent_ns)


def _on_setting(e: Exchange, taken: int, skew: int | None) -> Exchange:
    """``e``, taken with the wall clock at ``wall - monotonic = taken``, as its wall
    readings would be on the setting ``skew`` (None or within :data:`STEP_TOL_NS`: as is)."""
    if skew is None or abs(skew - taken) <= STEP_TOL_NS:
        return e
    step = skew - taken
    return Exchange(e.sent_ns + step, e.append_ms, e.ack_ns + step, e.partition)
