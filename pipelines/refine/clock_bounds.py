"""Hard bounds on a source's clock offset from its producer's exchanges with the broker.

On a topic with ``message.timestamp.type=LogAppendTime`` the producer's delivery report
carries the broker's append time ``A`` (ms, the partition leader's clock) of the record. The
exporter stamped ``S`` (its clock, just before ``produce()``) and ``R`` (its clock, when the
report arrived). The append happened between the two, so at that moment the source clock
read some ``s`` in ``[S, R]`` while the broker's read some ``b`` in ``[A, A + 1 ms)`` (Kafka
truncates to the millisecond). The offset ``source - broker`` then lies in::

    [S - A - 1 ms, R - A]

whatever the queueing, linger, retries or load: they widen the interval, never falsify it.

Over time the offset moves by what the source's time daemon does to its wall clock (steps,
slews) and by the drift of its oscillator against the broker's clock. The exporter sees the
first exactly: its wall clock against its raw monotonic clock (``CLOCK_MONOTONIC_RAW``, the
oscillator alone) moves by every step and slew, and the exchanges are carried onto the
setting of each batch (:class:`ExchangeLog`). The second is at most ``drift_ppm``
(:data:`DRIFT_PPM`, 500 ppm: the frequency tolerance NTP and the kernel's clock discipline
are built for, ``MAXFREQ``; real oscillators drift by tens): an exchange taken at source time
``S`` bounds the offset at source time ``t`` by its interval widened by ``drift_ppm x |t - S|``
on each side. The intersection of several such intervals is the hard bound at ``t``.

When the intervals still do not intersect (a leader whose clock differs from the previous
one's, a machine paused between them), only the newest exchange is kept. A pause of the
whole machine (a VM stopped: its clocks stand still, the raw one too) moves the offset down
by the pause, unseen by the exporter: the worker's bound takes the batch's own append time
as well, which bounds the offset from below whatever happened (:func:`own_floor`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

MS = 1_000_000
DRIFT_PPM = 500.0
# how many exchanges an exporter carries in a batch's clock block: the newest three and the
# two that bound the offset at the batch tightest from below and from above (see
# :meth:`ExchangeLog.carried`)
CARRIED = 5
# how far one reading of the setting (the wall clock against the raw monotonic one, read a
# few µs apart) may be off: every exchange's interval is widened by as much
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
    :data:`STEP_TOL_NS` for the reading of the setting. Rounded up."""
    ppb = round(drift_ppm * 1000)
    return STEP_TOL_NS - (-abs(dt_ns) * ppb // (1_000_000_000 - ppb))


def drift_allowance(dt_ns: int, drift_ppm: float = DRIFT_PPM) -> int:
    """How far the offset can drift while the source clock advances by ``|dt_ns|``
    (:func:`_widen` without the tolerance of reading the setting). Rounded up."""
    return _widen(dt_ns, drift_ppm) - STEP_TOL_NS


def drift_rate(drift_ppm: float = DRIFT_PPM) -> float:
    """:func:`_widen`'s growth per ns of source time, as a float (for whole columns)."""
    d = drift_ppm * 1e-6
    return d / (1 - d)


def own_floor(sent_ns: int, append_ns: int) -> int:
    """The lowest offset a record sent at source time ``sent_ns`` and appended at
    ``append_ns`` (the broker's, truncated to the ms) allows: the append came after the
    send. It rests on nothing else: no drift, no pause, no step can break it."""
    return sent_ns - append_ns - MS


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
    """An exporter's recent exchanges of the last ``keep_ns``: a batch carries the newest few
    and the tightest, widened to its time (see :meth:`carried`). Pure: the caller hands it its
    wall and raw monotonic readings.

    The wall clock moves against the raw monotonic clock (``CLOCK_MONOTONIC_RAW``: the
    oscillator alone, never stepped nor slewed by a time daemon) by exactly what the daemon
    did to it: every step, every slew (chrony's up to 83,333 ppm, ntpd's 500 ppm), a leap
    smear. The log keeps each exchange's setting ``wall - raw`` at its send and at its ack,
    and carries it onto the setting of the batch (its wall readings moved by what the daemon
    did since), so a batch is bounded as tightly after a step or during a slew as before it,
    even while no new exchange can be had (a broker failover). What is left between the
    source's clock and the broker's is the oscillator's drift (:data:`DRIFT_PPM`).

    The caller reads the pair (:meth:`check`) at each instant it stamps rows and at each
    send: a batch's exchanges are widened over the settings its rows were stamped on
    (:meth:`for_batch`), so two steps between two sends, or a slew while the rows were
    gathered, leave every row inside."""

    keep_ns: int = 60_000_000_000
    newest: int = 3
    # (exchange, setting its send was read on, setting its ack was read on)
    _items: list[tuple[Exchange, int, int]] | None = None
    _skew: int | None = None  # wall - raw at the last check
    _raw: int | None = None  # raw reading of the last check
    # the settings read lately: (number of the read, raw reading, wall - raw)
    _checks: deque[tuple[int, int, int]] = field(default_factory=lambda: deque(maxlen=4096))
    _reads: int = 0  # how many checks so far
    # per source of the batches: the number of the read its last batch was given exchanges
    # on (not its raw reading: a row may be stamped on a reading equal to its send's)
    _batch_at: dict[str, int] = field(default_factory=dict)
    # what the last :meth:`for_batch` widened by: the lowest and highest setting of its rows
    # less the setting of its send (<= 0, >= 0), carried in the clock block as ``stamps_ns``
    last_stamps: tuple[int, int] = (0, 0)

    def add(self, exchange: Exchange, raw_sent_ns: int, raw_ack_ns: int) -> bool:
        """Keep ``exchange`` (its wall readings ``sent_ns``/``ack_ns`` were taken with the
        raw monotonic readings given). An exchange during which the setting moved (a slew,
        a step) is kept too: its raw readings still bracket the append, so it is carried
        exactly (:func:`_on_setting`). Always True."""
        k_sent = exchange.sent_ns - raw_sent_ns
        k_ack = exchange.ack_ns - raw_ack_ns
        horizon = raw_ack_ns - self.keep_ns  # on the raw clock: steps move no age
        items = [it for it in self._items or [] if it[0].ack_ns - it[2] >= horizon]
        items.append((exchange, k_sent, k_ack))
        self._items = items[-256:]
        return True

    def check(self, wall_ns: int, raw_ns: int) -> None:
        """The wall clock's setting now (``wall - raw``): call it at each stamp of rows and
        before each send; :meth:`carried` maps the exchanges onto the last one when given
        no setting of its own."""
        self._skew = wall_ns - raw_ns
        self._raw = raw_ns
        self._reads += 1
        self._checks.append((self._reads, raw_ns, self._skew))

    def stamps_since(self, source: str) -> tuple[int, int, int] | None:
        """The lowest and highest setting read since ``source``'s last batch (its rows
        were stamped on settings among them, or that batch's own) and the raw reading of
        the first read after that batch (its first stamp); None before any check."""
        if not self._checks:
            return None
        since = self._batch_at.get(source)
        seen = []  # newest first, back to that batch's own read
        for n, raw, k in reversed(self._checks):
            if since is not None and n < since:
                break
            seen.append((n, raw, k))
        seen.reverse()
        if not seen:
            seen = [self._checks[-1]]
        ks = [k for _, _, k in seen]
        # the first stamp: the first read after that batch's own (at its send)
        after = [raw for n, raw, _ in seen if since is None or n > since]
        return min(ks), max(ks), after[0] if after else self._checks[-1][1]

    def for_batch(
        self,
        source: str,
        partition: int | None = None,
        skew: int | None = None,
        stamps: tuple[int, int] | None = None,
        first_raw: int | None = None,
    ) -> list[Exchange]:
        """What the next batch of ``source`` carries (:meth:`carried`, on the setting
        ``skew`` of its send), widened over ``stamps``: the lowest and highest setting its
        rows were stamped on (None: those read by :meth:`check` since its last batch). A
        row stamped on setting ``k`` has the offset at the send moved by ``k - skew``, so
        every row of the batch is inside, however the clock was stepped or slewed between
        its stamps.

        Only exchanges acknowledged before its first row was stamped (``first_raw``, the raw
        clock then; None: the first :meth:`check` since its last batch) are carried: a
        machine paused between a row's stamp and its send (its clocks standing still) moved
        the offset by the pause, which an exchange acknowledged after it would carry onto
        the row unseen. Acknowledged before the stamps, an exchange tells the offset the rows
        had, and a pause after it lowers the offset only: the worker's floor covers that
        (:func:`own_floor`)."""
        skew = self._skew if skew is None else skew
        since = self.stamps_since(source) if stamps is None or first_raw is None else None
        if stamps is None and since is not None:
            stamps = since[0], since[1]
        if first_raw is None and since is not None:
            first_raw = since[2]
        out = self.carried(partition, skew, first_raw)
        self.last_stamps = (0, 0)
        if skew is None:
            return out
        if self._raw is not None:
            self._batch_at[source] = self._reads
        lo = min(0, stamps[0] - skew) if stamps is not None else 0
        hi = max(0, stamps[1] - skew) if stamps is not None else 0
        self.last_stamps = (lo, hi)
        if not lo and not hi:
            return out
        # a row's distance from the exchanges, read on its own setting, is off by as much:
        # the drift over that difference too
        far = _widen(hi - lo, DRIFT_PPM) - STEP_TOL_NS
        lo, hi = lo - far, hi + far
        return [Exchange(e.sent_ns + lo, e.append_ms, e.ack_ns + hi, e.partition) for e in out]

    def carried(
        self, partition: int | None = None, skew: int | None = None, acked_by: int | None = None
    ) -> list[Exchange]:
        """What a batch carries: on ``partition`` (None: the newest exchange's), the
        newest ``newest`` exchanges and of all, the one whose upper end and the one whose
        lower end, widened by the drift since, lie tightest (an old exchange with a short
        round trip can beat the newest: its width is its round trip, the drift adds
        500 ppm of its age), at most :data:`CARRIED`,
        each on the setting ``skew`` of the wall clock (``wall - raw`` when the batch was
        sent; None: at the last :meth:`check`, else as taken); with ``acked_by``, only those
        acknowledged by that raw reading."""
        kept = [
            it for it in self._items or [] if acked_by is None or it[0].ack_ns - it[2] <= acked_by
        ]
        if not kept:
            return []
        skew = self._skew if skew is None else skew
        items = [_on_setting(e, k0, k1, skew) for e, k0, k1 in kept]
        part = items[-1].partition if partition is None else partition
        mine = [e for e in items if e.partition == part]
        chosen = mine[-self.newest :]
        if len(mine) > len(chosen):
            # widened to any later time t, an exchange's ends are lo - r(t - S) and
            # hi + r(t - S): which bounds tightest from below and from above is the same
            # for every t, the batch's rows included
            r = drift_rate()
            by_hi = min(mine, key=lambda e: e.hi - r * e.sent_ns)
            by_lo = max(mine, key=lambda e: e.lo + r * e.sent_ns)
            for e in (by_hi, by_lo):
                if len(chosen) < CARRIED and all(e is not c for c in chosen):
                    chosen.append(e)
        return sorted(chosen, key=lambda e: e.sent_ns)


def _on_setting(e: Exchange, k_sent: int, k_ack: int, skew: int | None) -> Exchange:
    """``e``, whose send was read on the setting ``k_sent`` and its ack on ``k_ack``, as its
    interval reads on the setting ``skew`` (None: as is). Exact whatever the wall clock did
    in between: the raw readings ``S - k_sent`` and ``R - k_ack`` bracket the append."""
    if skew is None:
        return e
    return Exchange(e.sent_ns + skew - k_sent, e.append_ms, e.ack_ns + skew - k_ack, e.partition)
