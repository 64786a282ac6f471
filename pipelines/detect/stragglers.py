"""NCCL stragglers and their likely cross-layer cause.

Input: collective records (:data:`schemas.wire.COLLECTIVES_SCHEMA` columns, ``ts_ns``
already aligned to the common clock). A collective instance is ``(job, comm, op, op_seq)``;
its ranks arrive in several batches (one per node), so rows are buffered until all
``nranks`` arrived or ``complete_after_ns`` of data time passed.

Per instance (vectorized with ``group_by`` + ``join``)::

    skew(rank)   = ts_ns(rank) - min over ranks of ts_ns
    straggler    = skew > max(abs_bound_ns, k x median skew)

Stragglers of one job are collapsed into a **straggler episode**: it fires as one
:class:`~schemas.records.Alert` once ``min_collectives`` instances had stragglers, and
resolves after ``quiet_ns`` of data time without any — one alert per (job, episode), not
per collective. A straggle on ranks the open episode never saw, after ``new_ranks_gap_ns``
without any, is another incident (another rank's path, likely another cause): the open
episode resolves where its straggle ended and a new one starts. Its id is
``alert_id("nccl_straggler", "job/<job>", onset)``, stable across replays and restarts.

Cause: each straggler rank maps to ``(node, gpu)`` through :class:`JobPlacement`, then to
its NIC and leaf port through a :class:`PathLookup` (e.g. :class:`pipelines.refine.enrich.
TopologyIndex`) at the collective's time. Open or recent episodes
(:class:`pipelines.detect.episodes.EpisodeTracker`) on that port/NIC (congestion) or GPU
(throttling), overlapping the straggle window, are candidates; the one on the path of the
most straggler ranks wins. ``cause`` names it; otherwise ``cause = "none found"``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import pyarrow as pa
import pyarrow.compute as pc

from pipelines.detect.alerts import Firing, alert_id
from pipelines.detect.episodes import OpenEpisode, cause_hint
from schemas.records import Alert, AlertState, JobPlacement, Lineage
from schemas.wire import COLLECTIVES_SCHEMA

RULE = "nccl_straggler"
NONE_FOUND = "none found"
_KEY = ["job", "comm", "op", "op_seq"]


class PathLookup(Protocol):
    """Topology at time ``t``: a mapping with at least ``nic``, ``leaf``, ``leaf_port``."""

    def resolve(self, node: str, device: str, t: int) -> Mapping[str, Any]: ...


@dataclass(frozen=True)
class StragglerSettings:
    abs_bound_ns: int = 5_000_000
    k: float = 3.0
    min_collectives: int = 3
    quiet_ns: int = 60_000_000_000
    new_ranks_gap_ns: int = 15_000_000_000  # other ranks after this long: a new episode
    complete_after_ns: int = 10_000_000_000
    slack_ns: int = 5_000_000_000  # time join tolerance around episodes


def arrival_skew(coll: pa.Table, settings: StragglerSettings | None = None) -> pa.Table:
    """Per row of ``coll``: ``skew_ns``, ``median_skew_ns`` of its instance and
    ``straggler`` (bool). Rows keep their columns; order is by instance then rank."""
    s = settings or StragglerSettings()
    if coll.num_rows == 0:
        return coll.append_column("skew_ns", pa.array([], pa.int64()))
    first = coll.group_by(_KEY, use_threads=False).aggregate([("ts_ns", "min")])
    t = coll.join(first, _KEY, join_type="inner")
    t = t.append_column("skew_ns", pc.subtract(t["ts_ns"], t["ts_ns_min"]))
    med = t.group_by(_KEY, use_threads=False).aggregate([("skew_ns", "approximate_median")])
    t = t.join(med, _KEY, join_type="inner").drop_columns(["ts_ns_min"])
    t = t.rename_columns(
        [("median_skew_ns" if c == "skew_ns_approximate_median" else c) for c in t.column_names]
    )
    bound = pc.max_element_wise(
        pc.multiply(pc.cast(t["median_skew_ns"], pa.float64()), s.k), float(s.abs_bound_ns)
    )
    t = t.append_column("straggler", pc.greater(pc.cast(t["skew_ns"], pa.float64()), bound))
    return t.sort_by([(c, "ascending") for c in [*_KEY, "rank"]])


@dataclass
class JobStraggle:
    onset_ns: int
    last_ns: int
    collectives: int = 0
    ranks: dict[str, float] = field(default_factory=dict)  # rank -> max skew ns
    windows: list[list[int]] = field(default_factory=list)  # [t0, t1] of straggling ops
    ops: list[str] = field(default_factory=list)
    firing: dict[str, Any] | None = None


class StragglerDetector:
    """Buffers collectives, finds stragglers, explains them, emits alert lifecycle records."""

    def __init__(
        self,
        placements: Iterable[JobPlacement] = (),
        topology: PathLookup | None = None,
        settings: StragglerSettings | None = None,
    ) -> None:
        self.settings = settings or StragglerSettings()
        self.topology = topology
        self.placements: dict[str, JobPlacement] = {}
        for p in placements:
            self.set_placement(p)
        self.buffer: pa.Table | None = None
        self.jobs: dict[str, JobStraggle] = {}
        self.watermark = 0

    def set_placement(self, p: JobPlacement) -> None:
        """Add or replace a job's placement (from the ``jobs`` topic)."""
        self.placements[p.job] = p

    def _place(self, job: str, rank: int) -> tuple[str, str] | None:
        p = self.placements.get(job)
        if p is None:
            return None
        for r in p.ranks:
            if r.rank == rank:
                return r.node, r.gpu
        return None

    def update(
        self,
        coll: pa.Table,
        episodes: list[OpenEpisode],
        now_ns: int,
        lineage: list[Lineage] | None = None,
    ) -> list[Alert]:
        """Fold one collectives batch in; ``episodes``: open + recent episodes (from
        :meth:`EpisodeTracker.all_episodes`). Returns firing/resolved straggler alerts."""
        s = self.settings
        if coll.num_rows:
            coll = coll.select(_BUF.names).cast(_BUF)
            self.buffer = coll if self.buffer is None else pa.concat_tables([self.buffer, coll])
            self.watermark = max(self.watermark, int(pc.max(coll["ts_ns"]).as_py()))
        out: list[Alert] = []
        if self.buffer is not None and self.buffer.num_rows:
            cnt = self.buffer.group_by(_KEY, use_threads=False).aggregate(
                [("rank", "count_distinct"), ("nranks", "max"), ("ts_ns", "max")]
            )
            done = pc.or_(
                pc.greater_equal(cnt["rank_count_distinct"], cnt["nranks_max"]),
                pc.less(cnt["ts_ns_max"], self.watermark - s.complete_after_ns),
            )
            ready = cnt.filter(done).select(_KEY)
            if ready.num_rows:
                whole = self.buffer.join(ready, _KEY, join_type="left semi")
                rest = self.buffer.join(ready, _KEY, join_type="left anti")
                self.buffer = rest.select(_BUF.names).cast(_BUF)
                # instances a backlog releases at once may span several straggle episodes:
                # judged in time order, each quiet gap resolving the one before
                gap = min(s.quiet_ns, s.new_ranks_gap_ns)
                for part, starts in _quiet_parts(arrival_skew(whole, s), gap):
                    out += self._resolve_quiet(starts, now_ns)
                    out += self._judge(part, episodes, now_ns, lineage or [])
        out += self._resolve_quiet(self.watermark, now_ns)
        return out

    def tick(self, now_ns: int) -> list[Alert]:
        """Resolve straggler episodes quiet at ``now_ns`` (common clock)."""
        return self._resolve_quiet(now_ns, now_ns)

    def _judge(
        self, t: pa.Table, episodes: list[OpenEpisode], now_ns: int, lineage: list[Lineage]
    ) -> list[Alert]:
        late = t.filter(t["straggler"])
        if late.num_rows == 0:
            return []
        g = late.group_by(_KEY, use_threads=False).aggregate([("ts_ns", "min"), ("ts_ns", "max")])
        per_job = g.group_by(["job"], use_threads=False).aggregate(
            [("ts_ns_min", "min"), ("op", "count")]
        )
        ranks = late.group_by(["job", "rank"], use_threads=False).aggregate([("skew_ns", "max")])
        out: list[Alert] = self._split_on_new_ranks(g, ranks, now_ns)
        spans = {r["job"]: r for r in per_job.to_pylist()}
        for r in g.sort_by([("ts_ns_min", "ascending")]).to_pylist():
            js = self.jobs.setdefault(r["job"], JobStraggle(r["ts_ns_min"], r["ts_ns_max"]))
            js.last_ns = max(js.last_ns, r["ts_ns_max"])
            js.windows = [*js.windows, [r["ts_ns_min"], r["ts_ns_max"]]][-64:]
            if r["op"] not in js.ops:
                js.ops.append(r["op"])
        for r in ranks.to_pylist():
            js = self.jobs[r["job"]]
            key = str(r["rank"])
            js.ranks[key] = max(js.ranks.get(key, 0.0), float(r["skew_ns_max"]))
        for job, span in spans.items():
            js = self.jobs[job]
            js.collectives += int(span["op_count"])
            if js.firing is None and js.collectives >= self.settings.min_collectives:
                out.append(self._fire(job, js, episodes, now_ns, lineage))
        return out

    def _split_on_new_ranks(self, g: pa.Table, ranks: pa.Table, now_ns: int) -> list[Alert]:
        """Resolve each job's firing episode that this part's straggle does not continue:
        only ranks it never saw, starting ``new_ranks_gap_ns`` or more after its last."""
        first = g.group_by(["job"], use_threads=False).aggregate([("ts_ns_min", "min")])
        onset = {r["job"]: r["ts_ns_min_min"] for r in first.to_pylist()}
        late: dict[str, set[str]] = {}
        for r in ranks.select(["job", "rank"]).to_pylist():
            late.setdefault(r["job"], set()).add(str(r["rank"]))
        out = []
        for job, first in onset.items():
            js = self.jobs.get(job)
            if js is None or js.firing is None or late[job] & set(js.ranks):
                continue
            if first - js.last_ns >= self.settings.new_ranks_gap_ns:
                out += self._resolve(job, js, now_ns)
        return out

    def explain(
        self, job: str, js: JobStraggle, episodes: list[OpenEpisode]
    ) -> tuple[str, dict[str, Any]]:
        """The likely cause of ``js`` and its evidence (port, counters, peaks)."""
        t0 = min(w[0] for w in js.windows)
        t1 = max(w[1] for w in js.windows)
        score: dict[str, list[str]] = {}
        paths: dict[str, dict[str, Any]] = {}
        for rank in sorted(js.ranks, key=int):
            where_ = self._place(job, int(rank))
            if where_ is None:
                continue
            node, gpu = where_
            path: dict[str, Any] = {"node": node, "gpu": gpu}
            if self.topology is not None:
                got = self.topology.resolve(node, gpu, t0)
                path |= {k: got.get(k) for k in ("nic", "leaf", "leaf_port", "rail")}
            paths[rank] = path
            for e in episodes:
                if not e.overlaps(t0, t1, self.settings.slack_ns) or not _on_path(e, path):
                    continue
                score.setdefault(e.id, []).append(rank)
        ev: dict[str, Any] = {
            "ranks": {r: {"max_skew_ms": v / 1e6, **paths.get(r, {})} for r, v in js.ranks.items()},
            "collectives": js.collectives,
            "ops": js.ops,
        }
        if not score:
            return NONE_FOUND, ev
        by_id = {e.id: e for e in episodes}

        def rank_of(eid: str) -> tuple[int, float, int, str]:
            e = by_id[eid]
            return (len(score[eid]), _intensity(e), e.kind == "congestion", eid)

        best = by_id[max(score, key=rank_of)]
        ev |= {
            "episode": best.id,
            "episode_kind": best.kind,
            "port": best.port,
            "priority": best.priority,
            "peak": dict(best.peak),
            "matched_ranks": sorted(score[best.id], key=int),
            "nics": sorted(best.nics),
        }
        return cause_hint(best), ev

    def _fire(
        self,
        job: str,
        js: JobStraggle,
        episodes: list[OpenEpisode],
        now_ns: int,
        lineage: list[Lineage],
    ) -> Alert:
        cause, ev = self.explain(job, js, episodes)
        worst = max(js.ranks.values()) / 1e6
        ranks = ",".join(sorted(js.ranks, key=int))
        summary = (
            f"job {job}: ranks {ranks} arrive up to {worst:.1f} ms late in "
            f"{'/'.join(js.ops)}; likely cause: {cause}"
        )
        f = Firing(
            id=alert_id(RULE, f"job/{job}", js.onset_ns),
            starts_ns=js.onset_ns,
            summary=summary,
            severity="warning",
            job=job,
            evidence=ev | {"cause": cause},
            lineage=[x.model_dump() for x in lineage],
        )
        js.firing = asdict(f)
        return f.alert(RULE, f"job/{job}", AlertState.FIRING, None, now_ns).model_copy(
            update={"cause": cause}
        )

    def _resolve_quiet(self, at_ns: int, now_ns: int) -> list[Alert]:
        out = []
        for job, js in list(self.jobs.items()):
            if at_ns - js.last_ns > self.settings.quiet_ns:
                out += self._resolve(job, js, now_ns)
        return out

    def _resolve(self, job: str, js: JobStraggle, now_ns: int) -> list[Alert]:
        """End ``job``'s episode where its straggle ended; its resolved record if it fired."""
        del self.jobs[job]
        if js.firing is None:
            return []
        f = Firing.from_dict(js.firing)
        a = f.alert(RULE, f"job/{job}", AlertState.RESOLVED, js.last_ns, now_ns)
        return [a.model_copy(update={"cause": f.evidence.get("cause")})]

    # --- trial judgements -------------------------------------------------------------------

    def fork(self) -> StragglerDetector:
        """A copy to judge on without changing this one (:meth:`adopt` takes its state):
        settings, placements and topology shared, episodes per job copied."""
        twin = copy.copy(self)
        twin.jobs = {k: copy.deepcopy(v) for k, v in self.jobs.items()}
        return twin

    def adopt(self, twin: StragglerDetector) -> None:
        """Take the state of ``twin`` (a :meth:`fork` of this one that judged since)."""
        self.buffer, self.jobs, self.watermark = twin.buffer, twin.jobs, twin.watermark

    # --- state -----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Straggler episodes per job and the watermark. The buffer of incomplete
        collectives is not kept (it re-fills from the replayed input)."""
        return {"jobs": {k: asdict(v) for k, v in self.jobs.items()}, "watermark": self.watermark}

    def restore(self, d: dict[str, Any]) -> None:
        self.jobs = {k: JobStraggle(**v) for k, v in d.get("jobs", {}).items()}
        self.watermark = int(d.get("watermark", 0))


_BUF = pa.schema(
    [
        pa.field(f.name, f.type)  # nullable: joins drop NOT NULL, concat needs equal schemas
        for f in COLLECTIVES_SCHEMA
        if f.name in ("ts_ns", "end_ns", "job", "comm", "op", "op_seq", "rank", "nranks")
    ]
)


def _quiet_parts(t: pa.Table, quiet_ns: int) -> list[tuple[pa.Table, int]]:
    """``t`` (``arrival_skew`` rows) cut where its straggling instances leave a gap over
    ``quiet_ns`` (a gap after which an episode may end): (rows, the part's first straggling
    instance's start) in time order, each instance whole in one part; one part when there
    is no such gap."""
    inst = t.group_by(_KEY, use_threads=False).aggregate([("ts_ns", "min")])
    t = t.join(inst, _KEY, join_type="inner")
    late = pc.unique(t.filter(t["straggler"])["ts_ns_min"]).sort().to_numpy()
    if len(late) < 2 or not ((late[1:] - late[:-1]) > quiet_ns).any():
        return [(t.drop_columns(["ts_ns_min"]), int(late[0]) if len(late) else 0)]
    cuts = [int(c) for c in late[1:][(late[1:] - late[:-1]) > quiet_ns]]
    parts = []
    for lo, hi, start in zip([None, *cuts], [*cuts, None], [int(late[0]), *cuts], strict=True):
        m = pa.array([True] * t.num_rows)
        if lo is not None:
            m = pc.and_(m, pc.greater_equal(t["ts_ns_min"], lo))
        if hi is not None:
            m = pc.and_(m, pc.less(t["ts_ns_min"], hi))
        parts.append((t.filter(m).drop_columns(["ts_ns_min"]), start))
    return parts


def _on_path(e: OpenEpisode, path: dict[str, Any]) -> bool:
    node, gpu, nic = path.get("node"), path.get("gpu"), path.get("nic")
    if e.kind == "throttling":
        return e.entity == f"{node}/{gpu}"
    leaf, port = path.get("leaf"), path.get("leaf_port")
    if leaf is not None and port is not None and e.port == f"{leaf}/{port}":
        return True
    return nic is not None and (e.port == f"{node}/{nic}" or f"{node}/{nic}" in e.nics)


def _intensity(e: OpenEpisode) -> float:
    return float(e.peak.get("nic.rx_prio_pause", 0.0) + e.peak.get("rdma.np_cnp_sent", 0.0))
