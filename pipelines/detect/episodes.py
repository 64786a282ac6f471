"""Congestion and throttling episodes collapsed from per-sample rates.

**Congestion**: rates of the PFC/ECN/CNP/XmitWait counters (:data:`CONGESTION_METRICS`)
are grouped by the switch port the NIC sits behind and the PFC priority::

    key = (leaf, leaf_port, priority)        when the leaf is known (enrichment)
        = (node, nic, priority)              otherwise

An episode **opens** when any counter's rate crosses its threshold and **closes** once no
counter has crossed for ``quiet_ns`` of data time. Counters without a priority (RDMA CNP/ECN,
IB XmitWait on ``mlx5_0/1``) join the episodes open on their port; they open a priority-less
episode only when none is. All NICs behind one leaf port within the same time window land
in one episode, with the affected ports, NICs, nodes and jobs listed.

**Throttling**: a GPU whose ``gpu.clock_event_reasons`` has any of :data:`THROTTLE_BITS` set,
keyed by ``node/gpuN``; peak holds the OR of reasons seen, the max temperature and the
lowest SM clock.

Ids are stable: ``sha1(kind, entity, start bucket)``, so a replay or a restart re-emits the
same id. Each episode is emitted as ``firing`` when it opens and ``resolved`` when it closes
(same id). Closed episodes are kept for ``retain_ns`` so :mod:`pipelines.detect.stragglers` can
join recent ones. State: open episodes plus a bounded list of recent ones.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from pipelines._arrow import column
from pipelines.detect.alerts import stable_id
from schemas.records import AlertState, Episode

CONGESTION_THRESHOLDS: dict[str, float] = {
    "nic.rx_prio_pause": 100.0,  # pause frames/s received
    "nic.rx_prio_pause_duration": 10_000.0,  # µs paused per s (1 % of the time)
    "nic.tx_prio_pause": 100.0,
    # ECN marks and CNPs flow at hundreds to a few thousand per second on a busy but healthy
    # RoCE fabric (DCQCN doing its job); an episode needs an order of magnitude more.
    "rdma.np_ecn_marked_roce_packets": 20_000.0,
    "rdma.np_cnp_sent": 5_000.0,
    "rdma.rp_cnp_handled": 5_000.0,
    "ib.port_xmit_wait": 1e6,  # ticks/s without credits
}
CONGESTION_METRICS = tuple(CONGESTION_THRESHOLDS)
THROTTLE_METRIC = "gpu.clock_event_reasons"
GPU_PEAK_METRICS = ["gpu.temp", "gpu.sm_clock", "gpu.power"]  # kept on throttling episodes
THROTTLE_BITS = 0x4 | 0x8 | 0x20 | 0x40 | 0x80  # SW/HW power, HW slowdown, SW/HW thermal
_THERMAL, _POWER = 0x20 | 0x40 | 0x8, 0x4 | 0x80
_SEP = "\x1f"
_COLUMNS = ("leaf", "leaf_port", "device", "node", "nic", "metric", "rate", "ts", "job", "value")


@dataclass(frozen=True)
class EpisodeSettings:
    thresholds: dict[str, float] = field(default_factory=lambda: dict(CONGESTION_THRESHOLDS))
    quiet_ns: int = 30_000_000_000
    bucket_ns: int = 60_000_000_000
    retain_ns: int = 600_000_000_000
    max_recent: int = 4096


@dataclass
class OpenEpisode:
    id: str
    kind: str
    entity: str
    port: str  # port key without priority (leaf/port or node/nic); node/gpu for throttling
    priority: int | None
    start_ns: int
    last_active_ns: int
    end_ns: int | None = None
    peak: dict[str, float] = field(default_factory=dict)
    ports: list[str] = field(default_factory=list)
    nics: list[str] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)
    jobs: list[str] = field(default_factory=list)

    def record(self, state: AlertState, now_ns: int) -> Episode:
        return Episode(
            id=self.id,
            kind=self.kind,
            state=state,
            entity=self.entity,
            start_ns=self.start_ns,
            end_ns=self.end_ns,
            peak=dict(self.peak),
            ports=sorted(self.ports),
            nics=sorted(self.nics),
            nodes=sorted(self.nodes),
            jobs=sorted(self.jobs),
            cause_hint=cause_hint(self),
            emitted_ns=now_ns,
        )

    def overlaps(self, t0: int, t1: int, slack_ns: int = 0) -> bool:
        end = self.end_ns if self.end_ns is not None else 2**62
        return self.start_ns - slack_ns <= t1 and t0 <= end + slack_ns


def cause_hint(e: OpenEpisode) -> str:
    """A one-line description: ``PFC storm on leaf-p0-r3 port 2 (prio 3): rx pause 1.2e+05/s,
    CNP 4e+03/s`` or ``thermal throttling on n1/gpu3 (...)``."""
    if e.kind == "throttling":
        bits = int(e.peak.get(THROTTLE_METRIC, 0))
        what = "thermal" if bits & _THERMAL else "power" if bits & _POWER else "clock"
        parts = [f"reasons 0x{bits:x}"]
        if "gpu.sm_clock_min" in e.peak:
            parts.append(f"sm clock down to {e.peak['gpu.sm_clock_min']:.0f} MHz")
        return f"{what} throttling on {e.entity}: " + ", ".join(parts)
    where_, _, port = e.port.rpartition("/")
    prio = f" (prio {e.priority})" if e.priority is not None else ""
    pause = e.peak.get("nic.rx_prio_pause", 0.0) + e.peak.get("nic.tx_prio_pause", 0.0)
    what = "PFC storm" if pause else "congestion"
    names = {
        "nic.rx_prio_pause": "rx pause",
        "nic.tx_prio_pause": "tx pause",
        "nic.rx_prio_pause_duration": "paused us",
        "rdma.np_cnp_sent": "CNP",
        "rdma.rp_cnp_handled": "CNP handled",
        "rdma.np_ecn_marked_roce_packets": "ECN",
        "ib.port_xmit_wait": "xmit wait",
    }
    vals = [f"{names[m]} {e.peak[m]:.2g}/s" for m in names if e.peak.get(m)]
    return f"{what} on {where_} port {port}{prio}: " + ", ".join(vals)


def _port_keys(t: pa.Table) -> tuple[Any, Any]:
    """(port key, priority) arrays: leaf/leaf_port when the leaf is known, else node/nic."""
    leaf_key = pc.binary_join_element_wise(column(t, "leaf"), column(t, "leaf_port"), "/")
    base = pc.list_element(pc.split_pattern(column(t, "device"), "/"), 0)
    node_key = pc.binary_join_element_wise(
        column(t, "node"), pc.coalesce(column(t, "nic"), base), "/"
    )
    key = pc.if_else(pc.is_valid(leaf_key), leaf_key, node_key)
    m = pc.extract_regex(column(t, "device"), r"prio(?P<p>\d+)")
    prio = pc.cast(pc.struct_field(m, "p"), pa.int32())
    return key, prio


class EpisodeTracker:
    """Opens, extends and closes episodes from refined batches (pure; time passed in)."""

    def __init__(self, settings: EpisodeSettings | None = None) -> None:
        self.settings = settings or EpisodeSettings()
        self.open: dict[str, OpenEpisode] = {}
        self.recent: list[OpenEpisode] = []

    # --- input ---------------------------------------------------------------------------

    def update(self, refined: pa.Table, now_ns: int, until_ns: int | None = None) -> list[Episode]:
        """Fold one refined batch in; returns the episodes opened or closed by it. Episodes
        quiet at ``until_ns`` close: pass the time every input has reached (the caller's low
        watermark) when batches of several partitions interleave — a batch's own newest
        ``ts`` (the default) is only safe for one time-ordered stream. Firing records carry
        the batch's peaks and members."""
        opened: list[OpenEpisode] = []
        if refined.num_rows:
            if refined.column(0).num_chunks > 1:  # each column read joined once, not per read
                refined = refined.combine_chunks()
            by = _Metrics(refined)
            self._congestion(refined, opened, by)
            self._throttling(refined, opened, by)
        out = [e.record(AlertState.FIRING, now_ns) for e in opened]
        if until_ns is None and refined.num_rows:
            until_ns = int(pc.max(column(refined, "ts")).as_py())
        if until_ns is not None:
            out += self._close_quiet(until_ns, now_ns)
        return out

    @property
    def metrics(self) -> list[str]:
        """Every metric :meth:`update` reads: a table holding only their rows does the same."""
        return [*self.settings.thresholds, THROTTLE_METRIC, *GPU_PEAK_METRICS]

    @property
    def columns(self) -> list[str]:
        """Every column :meth:`update` reads: a table of only these does the same."""
        return list(_COLUMNS)

    def tick(self, now_ns: int) -> list[Episode]:
        """Close episodes quiet at ``now_ns`` (also when their ports stopped reporting)."""
        return self._close_quiet(now_ns, now_ns)

    def _congestion(
        self, refined: pa.Table, opened: list[OpenEpisode], by: _Metrics | None = None
    ) -> None:
        t = self._congestion_rows(refined, by)
        if t is None:
            return
        hot_rows: list[dict[str, Any]] = []
        if pc.any(t["hot"]).as_py():
            h = t.filter(t["hot"]).group_by(["port", "prio"])
            h = h.aggregate([("ts", "min"), ("ts", "max")])
            hot_rows = sorted(h.to_pylist(), key=lambda r: (r["prio"] is None, r["port"]))
        for r in hot_rows:
            port, p = r["port"], r["prio"]
            targets = [e for e in self.open.values() if e.port == port and e.kind == "congestion"]
            if p is not None or not targets:
                ent = f"{port}/prio{p}" if p is not None else port
                e = self.open.get(ent)
                if e is None:
                    e = self._open("congestion", ent, port, p, int(r["ts_min"]))
                    opened.append(e)
                targets = [e]
            for e in targets:
                e.last_active_ns = max(e.last_active_ns, int(r["ts_max"]))
        episodes = [e for e in self.open.values() if e.kind == "congestion"]
        if not episodes:
            return
        g = t.group_by(["port", "prio", "metric"]).aggregate([("rate", "max")])
        who = t.group_by(["port"]).aggregate(
            [("nic", "distinct"), ("node", "distinct"), ("job", "distinct")]
        )
        members = {r["port"]: r for r in who.to_pylist()}
        peaks: dict[tuple[str, int | None], dict[str, float]] = {}
        for r in g.to_pylist():
            peaks.setdefault((r["port"], r["prio"]), {})[r["metric"]] = float(r["rate_max"])
        for e in episodes:
            for (port, p), pk in peaks.items():
                if port == e.port and (p is None or p == e.priority):
                    for m, v in pk.items():
                        e.peak[m] = max(e.peak.get(m, 0.0), v)
            mem = members.get(e.port)
            if mem is not None:
                _add(e.ports, [e.port])
                _add(e.nics, mem["nic_distinct"])
                _add(e.nodes, mem["node_distinct"])
                _add(e.jobs, mem["job_distinct"])

    def _congestion_rows(self, refined: pa.Table, by: _Metrics | None = None) -> pa.Table | None:
        """The congestion rows an update reads — rates over their threshold, and any rate of
        a port with an episode open — as ``port, prio, metric, rate, ts, hot, nic, node,
        job``, in table order; None when there is none. ``by``: ``refined``'s metrics, when
        the caller has them.

        Most rows are neither (no port congested): they are dropped on the metric, the rate
        and the leaf and node names before any port key is built. A row is kept there when
        its leaf or node starts an open port's key (:func:`_port_heads`) and the names its
        own key is made of may make one (:func:`_port_splits`: a superset of the rows on
        open ports), then held to the exact port."""
        if refined.num_rows == 0:
            return None
        th = self.settings.thresholds
        by = by or _Metrics(refined)
        rate = column(refined, "rate")
        hot = rate.to_numpy(zero_copy_only=False) > by.lookup(th)  # NaN (NULL, no limit): False
        keep = hot
        ports = self._open_ports()
        if len(ports):
            names = ports.to_pylist()
            heads = _port_heads(names)
            leaf, node = column(refined, "leaf"), column(refined, "node")
            leaf_in = _mask(pc.is_in(leaf, value_set=heads))
            node_in = _mask(pc.is_in(node, value_set=heads))
            near = (leaf_in | node_in) & by.of(th)
            if rate.null_count:
                near &= _mask(pc.is_valid(rate))
            if near.any():
                every, tails = _port_splits(names)
                if len(every) != len(heads):
                    leaf_in = _mask(pc.is_in(leaf, value_set=every))
                    node_in = _mask(pc.is_in(node, value_set=every))
                leaf_port = column(refined, "leaf_port")
                on_leaf = _mask(pc.and_(pc.is_valid(leaf), pc.is_valid(leaf_port)))
                port_in = _mask(pc.is_in(leaf_port, value_set=tails))
                near &= np.where(on_leaf, leaf_in & port_in, node_in)
            keep = hot | near
        if not keep.any():
            return None
        hot = pa.array(hot[keep])
        cols = ["leaf", "leaf_port", "device", "node", "nic", "metric", "rate", "ts", "job"]
        t = refined.select(cols).filter(pa.array(keep))
        key, prio = _port_keys(t)
        t = pa.table(
            {
                "port": key,
                "prio": prio,
                "metric": column(t, "metric"),
                "rate": column(t, "rate"),
                "ts": column(t, "ts"),
                "hot": hot,
                "nic": pc.binary_join_element_wise(
                    column(t, "node"), pc.coalesce(column(t, "nic"), column(t, "device")), "/"
                ),
                "node": column(t, "node"),
                "job": column(t, "job"),
            }
        )
        t = t.filter(pc.or_(hot, pc.is_in(t["port"], value_set=ports)))
        return t if t.num_rows else None

    def _throttling(
        self, refined: pa.Table, opened: list[OpenEpisode], by: _Metrics | None = None
    ) -> None:
        by = by or _Metrics(refined)
        rows = by.of([THROTTLE_METRIC])
        value = column(refined, "value")
        if value.null_count:
            rows &= _mask(pc.is_valid(value))
        if not rows.any():
            return
        if not _quiet(value.to_numpy(zero_copy_only=False)[rows]):
            self._throttled(refined.filter(pa.array(rows)), opened)
        self._gpu_peaks(refined, by)

    def _throttled(self, t: pa.Table, opened: list[OpenEpisode]) -> None:
        """Open or extend the throttling episodes of the GPUs of ``t`` (throttle reason rows,
        each with a value) with a reason bit set."""
        bits = pc.bit_wise_and(pc.cast(column(t, "value"), pa.int64(), safe=False), THROTTLE_BITS)
        hot_bits = pc.not_equal(bits, 0)
        if not pc.any(hot_bits).as_py():
            return
        key = pc.binary_join_element_wise(column(t, "node"), column(t, "device"), "/")
        cols = {"key": key, "bits": bits, "ts": column(t, "ts"), "job": column(t, "job")}
        hot = pa.table(cols).filter(hot_bits)
        agg = hot.group_by(["key"]).aggregate(
            [("ts", "min"), ("ts", "max"), ("bits", "distinct"), ("job", "distinct")]
        )
        for r in agg.to_pylist():
            ent = r["key"]
            e = self.open.get(ent)
            if e is None:
                e = self._open("throttling", ent, ent, None, int(r["ts_min"]))
                e.nodes = [ent.split("/")[0]]
                opened.append(e)
            e.last_active_ns = max(e.last_active_ns, int(r["ts_max"]))
            b = int(e.peak.get(THROTTLE_METRIC, 0))
            for x in r["bits_distinct"]:
                b |= int(x)
            e.peak[THROTTLE_METRIC] = float(b)
            _add(e.jobs, r["job_distinct"])

    def _gpu_peaks(self, refined: pa.Table, by: _Metrics | None = None) -> None:
        """Peaks of the open throttling episodes' GPUs: rows of :data:`GPU_PEAK_METRICS`
        whose node starts an open key, then of the exact keys."""
        keys = [k for k, e in self.open.items() if e.kind == "throttling"]
        if not keys:
            return
        rows = (by or _Metrics(refined)).of(GPU_PEAK_METRICS)
        if not rows.any():
            return
        rows &= _mask(pc.is_in(column(refined, "node"), value_set=_key_heads(keys)))
        if not rows.any():
            return
        t = refined.filter(pa.array(rows))
        key = pc.binary_join_element_wise(column(t, "node"), column(t, "device"), "/")
        tt = pa.table({"key": key, "metric": column(t, "metric"), "value": column(t, "value")})
        tt = tt.filter(pc.is_in(tt["key"], value_set=pa.array(keys)))
        if tt.num_rows == 0:
            return
        g = tt.group_by(["key", "metric"]).aggregate([("value", "min"), ("value", "max")])
        for r in g.to_pylist():
            e = self.open[r["key"]]
            if r["metric"] == "gpu.sm_clock" and r["value_min"] is not None:
                old = e.peak.get("gpu.sm_clock_min", float("inf"))
                e.peak["gpu.sm_clock_min"] = min(old, float(r["value_min"]))
            elif r["value_max"] is not None:
                e.peak[r["metric"]] = max(e.peak.get(r["metric"], 0.0), float(r["value_max"]))

    def _open(self, kind: str, ent: str, port: str, prio: int | None, start: int) -> OpenEpisode:
        eid = stable_id("episode", kind, ent, start // self.settings.bucket_ns)
        if any(r.id == eid for r in self.recent):
            # a second episode of the entity in one bucket: its own id, still a function of
            # the data (a replay rebuilds the same recent episodes)
            eid = stable_id("episode", kind, ent, "at", start)
        e = OpenEpisode(eid, kind, ent, port, prio, start, start)
        self.open[ent] = e
        return e

    def _open_ports(self) -> Any:
        return pa.array(sorted({e.port for e in self.open.values()}), pa.string())

    def _close_quiet(self, at_ns: int, now_ns: int) -> list[Episode]:
        out = []
        for ent, e in list(self.open.items()):
            if at_ns - e.last_active_ns > self.settings.quiet_ns:
                e.end_ns = e.last_active_ns
                del self.open[ent]
                self.recent.append(e)
                out.append(e.record(AlertState.RESOLVED, now_ns))
        lo = at_ns - self.settings.retain_ns
        self.recent = [e for e in self.recent if (e.end_ns or 0) >= lo][-self.settings.max_recent :]
        return out

    # --- queries (for stragglers) ----------------------------------------------------------

    def all_episodes(self) -> list[OpenEpisode]:
        return [*self.recent, *self.open.values()]

    # --- state -----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "open": [asdict(e) for e in self.open.values()],
            "recent": [asdict(e) for e in self.recent],
        }

    @classmethod
    def from_dict(
        cls, d: dict[str, Any], settings: EpisodeSettings | None = None
    ) -> EpisodeTracker:
        t = cls(settings)
        for x in d.get("open", []):
            e = OpenEpisode(**x)
            t.open[e.entity] = e
        t.recent = [OpenEpisode(**x) for x in d.get("recent", [])]
        return t


def _quiet(values: npt.NDArray[np.float64]) -> bool:
    """Whether no throttle reason value has a :data:`THROTTLE_BITS` bit set, when that is
    certain without Arrow: every value finite and in int64 range, truncated as Arrow's
    unsafe cast truncates it."""
    if not (np.isfinite(values).all() and (np.abs(values) < 2.0**63).all()):
        return False
    return not (values.astype(np.int64) & THROTTLE_BITS).any()


def _port_heads(ports: list[str]) -> Any:
    """What a row's leaf or node is when its port key is one of ``ports`` (``leaf/leaf_port``
    or ``node/nic``): the text before the first and before the last ``/`` of each (either
    name may hold a ``/``, not both)."""
    heads = {p.partition("/")[0] for p in ports} | {p.rpartition("/")[0] for p in ports}
    return pa.array(sorted(heads), pa.string())


def _port_splits(ports: list[str]) -> tuple[Any, Any]:
    """The texts before and after each ``/`` of each of ``ports``: a row whose port key is
    one of them has its leaf and leaf port, or its node, among these (whichever name holds
    a ``/``)."""
    heads = {p[:i] for p in ports for i, c in enumerate(p) if c == "/"}
    tails = {p[i + 1 :] for p in ports for i, c in enumerate(p) if c == "/"}
    return pa.array(sorted(heads), pa.string()), pa.array(sorted(tails), pa.string())


def _key_heads(keys: list[str]) -> Any:
    """Every node a ``node/device`` key of ``keys`` may be of: its text before each ``/``."""
    heads = {k[:i] for k in keys for i, c in enumerate(k) if c == "/"}
    return pa.array(sorted(heads), pa.string())


def _mask(a: Any) -> npt.NDArray[np.bool_]:
    """A boolean Arrow array as numpy, NULL read as False."""
    if a.null_count:
        a = pc.fill_null(a, False)
    return np.asarray(a.to_numpy(zero_copy_only=False), np.bool_)


class _Metrics:
    """The metric of each row of a table as a small integer, after one hashing pass over
    the column: the rows of a few metrics, or a value per metric, are then looked up per
    integer instead of comparing every row's string for each."""

    def __init__(self, t: pa.Table) -> None:
        enc = pc.dictionary_encode(column(t, "metric"))
        idx = enc.indices
        # a NULL metric reads the last slot of a lookup table: none
        self._codes = (pc.fill_null(idx, -1) if idx.null_count else idx).to_numpy()
        self._slots = len(enc.dictionary) + 1
        self._index = {n: i for i, n in enumerate(enc.dictionary.to_pylist())}

    def of(self, metrics: Any) -> npt.NDArray[np.bool_]:
        """Whether each row's metric is one of ``metrics``."""
        lut = np.zeros(self._slots, np.bool_)
        lut[[self._index[m] for m in metrics if m in self._index]] = True
        out: npt.NDArray[np.bool_] = lut.take(self._codes)
        return out

    def lookup(self, values: dict[str, float]) -> npt.NDArray[np.float64]:
        """``values`` of each row's metric; NaN where it has none."""
        lut = np.full(self._slots, np.nan)
        for m, v in values.items():
            i = self._index.get(m)
            if i is not None:
                lut[i] = v
        out: npt.NDArray[np.float64] = lut.take(self._codes)
        return out


def _add(target: list[str], items: list[Any]) -> None:
    for x in items:
        if x is not None and x not in target:
            target.append(str(x))
