"""The simulation loop: per tick, every node's exporter batches, events, collectives and faults.

:class:`Simulation` yields :class:`Tick` objects. A tick holds the :class:`Message` s whose true
arrival time at the broker (``due_ns``) falls in it, ordered by ``due_ns``; a publisher sends
each one when the wall clock reaches it (see :mod:`lab.simulate.publish`). Per node and
tick there is one batch per exporter — ``node`` (cpu, mem; 1 sample per tick), ``gpu`` and
``nic`` (``substeps`` samples per tick each, default 10: the exporters sample at 10 Hz and
publish once a tick) — plus an ``events`` batch when something happened, and per job one
``nccl`` collectives batch keyed by job. Published (``ticks(greet=True)``), each node's
``node`` and ``events`` exporters and each job's ``nccl`` one first send a batch with no rows
(their first seq) :data:`GREET_LEAD_NS` before the start, as ``BatchProducer.greet`` does:
its exchange with the broker bounds the clock of the first batch with rows.

Time: true time ``t`` runs from ``start_ns`` in steps of ``interval_ns``; every timestamp a
source writes (``ts_ns``, ``sent_ns``) is its node's wall clock at that instant (:mod:`.clocks`:
rows of one batch sit on the settings a slewing or stepping clock had when each was stamped;
``Message.offset_ns`` holds each row's offset). A batch is sent 0.5-3 ms after its last sample
and reaches the broker after the network delay. While a node's VM is paused it samples nothing
and sends nothing: a batch due then is sent when it resumes, late, its boot id unchanged.

Phases: by default every node samples on the same grid (``t``, ``t + interval/substeps``, …),
so all nodes publish within a few ms of each other once a tick (lockstep: what exporters
aligned to the second do, and the burst a pipeline meets then). ``spread=True`` gives each
node a fixed phase in ``[0, interval)`` (whole ms, from the seed): its samples and sends are
that much later in every tick, as exporters started at unrelated moments run (``refinery
export node`` scrapes every interval from its own start). Events, collectives and fault
windows keep the unshifted grid.
Everything is deterministic in ``seed`` and ``start_ns``.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa

from lab.simulate.clocks import NodeClocks
from lab.simulate.cluster import Cluster
from lab.simulate.collectives import CollectiveGen
from lab.simulate.events import events_between, events_table
from lab.simulate.faults import (
    FaultKind,
    FaultSpec,
    Incident,
    S,
    malformed_reasons,
    parse_faults,
    plan_window,
)
from lab.simulate.gen import (
    Effects,
    GpuGen,
    NicGen,
    NodeGen,
    gpu_layout,
    nic_layout,
    node_layout,
)
from lab.simulate.inject import inject_faults, row_offsets
from lab.simulate.layout import TableBuilder
from lab.simulate.messages import Message, SendKind, Stream, Tick
from schemas.wire import PAYLOAD_SCHEMAS, Envelope, PayloadKind, SourceId

WINDOW_MAX_NS = 120 * S
EXPORTERS = ("node", "gpu", "nic")
# how long before the start the exporters greet the broker (``ticks(greet=True)``): their
# reports are back before their first batches with rows are sent
GREET_LEAD_NS = 2 * S
STREAM_KIND = {
    Stream.RAW: PayloadKind.SAMPLES,
    Stream.EVENTS: PayloadKind.EVENTS,
    Stream.COLLECTIVES: PayloadKind.COLLECTIVES,
}


class Simulation:
    """A seeded simulated cluster run. ``duration_ns`` None runs forever; ``spread`` gives
    each node's exporters a phase of their own (module docstring). Not thread-safe."""

    def __init__(
        self,
        cluster: Cluster,
        faults: FaultSpec | str | None = None,
        seed: int = 0,
        interval_ns: int = S,
        start_ns: int | None = None,
        duration_ns: int | None = None,
        substeps: int = 10,
        ops_per_tick: int = 4,
        spread: bool = False,
    ) -> None:
        self.cluster = cluster
        self.faults = faults if isinstance(faults, FaultSpec) else parse_faults(faults)
        self.seed, self.interval_ns, self.start_ns = seed, interval_ns, start_ns
        self.duration_ns, self.substeps, self.ops_per_tick = duration_ns, substeps, ops_per_tick
        self.spread = spread
        self.window_ns = min(duration_ns or WINDOW_MAX_NS, WINDOW_MAX_NS)
        self.window_ns = max(interval_ns, self.window_ns // interval_ns * interval_ns)
        self.incidents: list[Incident] = []
        self._clocks: NodeClocks | None = None

    @property
    def n_ticks(self) -> int | None:
        return None if self.duration_ns is None else self.duration_ns // self.interval_ns

    @property
    def clocks(self) -> NodeClocks:
        if self._clocks is None:
            raise RuntimeError("clocks exist once the simulation has a start time")
        return self._clocks

    def ticks(self, greet: bool = False) -> Iterator[Tick]:
        """Run; ``start_ns`` defaults to the wall clock now. After the last tick, one more
        tick carries the messages still held back (late batches). ``greet``: the first tick
        starts with the exporters' batches without rows (module docstring), as published."""
        if self.start_ns is None:
            import time

            self.start_ns = time.time_ns()
        return _Run(self, self.start_ns).run(greet)


class _Run:
    def __init__(self, sim: Simulation, start_ns: int) -> None:
        c, self.sim, self.start = sim.cluster, sim, start_ns
        self.n, self.iv = c.n_nodes, sim.interval_ns
        n_ticks = sim.n_ticks
        self.windows = (
            10_000 if n_ticks is None else max(1, math.ceil(n_ticks * self.iv / sim.window_ns))
        )
        rng = np.random.default_rng([sim.seed, 1])
        # each node's phase within a tick (ns, whole ms): zero in lockstep
        self.phase = np.zeros(self.n, np.int64)
        if sim.spread:
            ms = np.random.default_rng([sim.seed, 6]).integers(
                0, max(1, self.iv // 1_000_000), self.n
            )
            self.phase = ms.astype(np.int64) * 1_000_000
        job_of = np.asarray(c.job_of_node())
        self.busy = job_of >= 0
        sim._clocks = self.clocks = NodeClocks.build(
            self.n,
            sim.faults,
            sim.seed,
            start_ns,
            sim.window_ns,
            self.windows,
            c.node_names,
            self.iv,
            self.phase,
            ~self.busy,
        )
        busy_gpu = np.repeat(self.busy[:, None], c.gpus, axis=1)
        self.gens = (
            NodeGen(self.n, c.cpus, self.busy, rng),
            GpuGen(self.n, c.gpus, busy_gpu, rng),
            NicGen(self.n, c.nics, self.busy, rng),
        )
        s = sim.substeps
        self.builders = (
            TableBuilder(node_layout(c.cpus)),
            TableBuilder(gpu_layout(c.gpus, s)),
            TableBuilder(nic_layout(c.nics, s)),
        )
        self.rng = rng
        self.colls = [
            CollectiveGen(c, j, np.random.default_rng([sim.seed, 2, k]), sim.ops_per_tick)
            for k, j in enumerate(c.job_list)
        ]
        self.boot_no = np.zeros(self.n, np.int64)
        self.down = np.zeros(self.n, bool)
        self.seq: dict[tuple[int, str], int] = {}
        self.sources: dict[tuple[int, str], SourceId] = {}
        self.planned = 0
        self.held: list[tuple[int, int, Message]] = []
        self.counter = 0
        self.reasons = malformed_reasons(sim.faults)
        self.fault_ticks: dict[int, set[str]] = {}

    # -- identities -------------------------------------------------------------------------

    def boot_id(self, i: int) -> str:
        b = np.random.default_rng([self.sim.seed, 3, i, int(self.boot_no[i])]).bytes(16).hex()
        return f"{b[:8]}-{b[8:12]}-{b[12:16]}-{b[16:20]}-{b[20:]}"

    def source(self, i: int, exporter: str, instance: str = "0") -> SourceId:
        k = (i, exporter + "/" + instance)
        if k not in self.sources:
            self.sources[k] = SourceId.model_construct(
                node=self.sim.cluster.node_name(i),
                exporter=exporter,
                instance=instance,
                boot_id=self.boot_id(i) if exporter != "nccl" else f"{instance}-run1",
            )
        return self.sources[k]

    def next_seq(self, i: int, exporter: str) -> int:
        k = (i, exporter)
        self.seq[k] = v = self.seq.get(k, -1) + 1
        return v

    def envelope(
        self, i: int, exporter: str, kind: PayloadKind, sent_ns: int, off: int, instance: str = "0"
    ) -> Envelope:
        return Envelope.model_construct(
            schema_version=1,
            kind=kind,
            source=self.source(i, exporter, instance),
            seq=self.next_seq(i, exporter + "/" + instance),
            sent_ns=sent_ns,
            interval_ns=self.iv,
            clock=self.clocks.block(i, off),
        )

    # -- planning ---------------------------------------------------------------------------

    def plan(self, upto_ns: int) -> None:
        sim = self.sim
        while self.planned < self.windows and self.start + self.planned * sim.window_ns <= upto_ns:
            w = self.planned
            new = plan_window(
                sim.cluster, sim.faults, sim.seed, w, sim.window_ns, self.start, self.iv
            )
            sim.incidents.extend(new)
            self.clocks.plan_window(w)
            for inc in new:
                if inc.kind is FaultKind.WRAP:
                    self.gens[2].start_wrap(
                        inc.node_idx[0], inc.unit, (inc.start_ns - self.start) / S
                    )
            per_w = max(1, sim.window_ns // self.iv)
            wr = np.random.default_rng([sim.seed, 5, w])
            for name in ("dup", "late", "malformed_record", "malformed_sample"):
                k = w * per_w + int(wr.integers(per_w))
                self.fault_ticks.setdefault(k, set()).add(name)
            self.planned += 1

    def effects(self, t: int, active: list[Incident]) -> Effects:
        c, s = self.sim.cluster, self.sim.substeps
        storm = np.zeros((s, self.n, c.nics))
        link_down = np.zeros((s, self.n, c.nics), bool)
        throttle = np.zeros((s, self.n, c.gpus), np.int64)
        times = t + np.arange(s) * (self.iv // s)
        for inc in active:
            on = (times >= inc.start_ns) & (times < inc.end_ns)
            if not on.any() or not inc.node_idx or inc.unit < 0:
                continue
            sel = np.ix_(np.flatnonzero(on), np.asarray(inc.node_idx), np.asarray([inc.unit]))
            if inc.kind is FaultKind.PFC_STORM:
                storm[sel] = 1.0
            elif inc.kind is FaultKind.LINK_FLAP:
                link_down[sel] = True
            elif inc.kind is FaultKind.THROTTLE:
                throttle[sel] |= int(inc.detail["bits"])
        return Effects(self.iv / s / S, self.busy, storm, link_down, throttle)

    # -- the loop ---------------------------------------------------------------------------

    def run(self, greet: bool) -> Iterator[Tick]:
        for m in self.hellos() if greet else ():
            heapq.heappush(self.held, (m.due_ns, self._next(), m))
        k = 0
        n_ticks = self.sim.n_ticks
        while n_ticks is None or k < n_ticks:
            t = self.start + k * self.iv
            self.plan(t + 2 * self.iv)
            for m in self.tick(k, t):
                heapq.heappush(self.held, (m.due_ns, self._next(), m))
            yield Tick(k, t, self.release(t + self.iv))
            k += 1
        yield Tick(k, self.start + k * self.iv, self.release(None))

    def hellos(self) -> list[Message]:
        """The exporters' first batches, with no rows, sent :data:`GREET_LEAD_NS` before the
        start (module docstring)."""
        t = self.start - GREET_LEAD_NS
        off = self.clocks.offsets(t)
        out = []

        def hello(i: int, stream: Stream, kind: PayloadKind, exporter: str, key: bytes,
                  instance: str = "0") -> Message:  # fmt: skip
            env = self.envelope(i, exporter, kind, t + int(off[i]), int(off[i]), instance)
            table = PAYLOAD_SCHEMAS[kind].empty_table()
            return Message(stream, SendKind.BATCH, key, t, t, env, table, offset_ns=int(off[i]))

        for i in map(int, np.flatnonzero(~self.down)):
            key = self.sim.cluster.node_name(i).encode()
            out.append(hello(i, Stream.RAW, PayloadKind.SAMPLES, EXPORTERS[0], key))
            out.append(hello(i, Stream.EVENTS, PayloadKind.EVENTS, "events", key))
        for gen in self.colls:
            job = gen.job.job
            lead = gen.job.node_idx[0]
            out.append(
                hello(lead, Stream.COLLECTIVES, PayloadKind.COLLECTIVES, "nccl", job.encode(), job)
            )
        return out

    def _next(self) -> int:
        self.counter += 1
        return self.counter

    def release(self, before: int | None) -> list[Message]:
        out = []
        while self.held and (before is None or self.held[0][0] < before):
            out.append(heapq.heappop(self.held)[2])
        return out

    def tick(self, k: int, t: int) -> list[Message]:
        sim, c, iv = self.sim, self.sim.cluster, self.iv
        active = [x for x in sim.incidents if x.start_ns < t + iv and x.end_ns >= t]
        self.reboot(t, active)
        fx = self.effects(t, active)
        frng = np.random.default_rng([sim.seed, 4, k])
        up = np.flatnonzero(~self.down)
        out: list[Message] = []
        nd, gd, kd = (
            self.gens[0].step(fx),
            self.gens[1].step(fx, sim.substeps),
            self.gens[2].step(fx, sim.substeps),
        )
        delay = frng.uniform(0.5e6, 3e6, (self.n, 3)).astype(np.int64)
        net = self.clocks.net_delay_ns(frng, self.n * 3).reshape(self.n, 3)
        for e, (exporter, (val, raw), b) in enumerate(
            zip(EXPORTERS, (nd, gd, kd), self.builders, strict=True)
        ):
            steps = b.layout.substeps
            true_ts = t + np.arange(steps, dtype=np.int64) * (iv // steps)
            at = true_ts[None, :] + self.phase[:, None]  # each node's sampling instants
            off = self.clocks.offsets(at)  # its clock's setting at each of them
            tables = b.tables(at + off, b.merge_values(val, raw), raw)
            for i in map(int, up):
                table, rows = self.unpaused(i, at[i], tables[i], off[i], b.layout.n_entries)
                if table is None:
                    continue
                sent = self.send_time(i, int(at[i, -1] + delay[i, e]), int(delay[i, e]))
                out.append(self.batch(Stream.RAW, i, exporter, sent, int(net[i, e]), table, rows))
        for i, evs in events_between(active, t, t + iv).items():
            if self.down[i]:
                continue
            true = np.asarray([ev.true_ns for ev in evs], np.int64)
            evo = self.clocks.node_offsets(i, true)[0]
            tb = events_table(evs, 0)
            tb = tb.set_column(0, tb.schema.field(0), pa.array(true + evo))
            sent = self.send_time(i, evs[-1].true_ns + 2_000_000, 2_000_000)
            out.append(
                self.batch(Stream.EVENTS, i, "events", sent, int(net[i, 0]), tb, evo, extra=evs)
            )
        for gen in self.colls:
            lead, job = gen.job.node_idx[0], gen.job.job
            ct = gen.tick(t, iv, 0, active)  # on the true clock (the truth's), then the lead's
            table, starts = self.on_clock(lead, ct.table)
            sent = self.send_time(lead, ct.last_end_true + 1_000_000, 1_000_000)
            batch = self.batch(
                Stream.COLLECTIVES, lead, "nccl", sent, int(net[lead, 1]), table, starts,
                job, job.encode(), ct,
            )  # fmt: skip
            out.append(batch)
        return inject_faults(
            sim.faults,
            self.fault_ticks.get(k, set()),
            self.reasons,
            out,
            frng,
            iv,
            c.node_names,
            self.clocks,
            self.custom_envelope,
        )

    def batch(
        self,
        stream: Stream,
        i: int,
        exporter: str,
        sent: int,
        net: int,
        table: pa.Table,
        row_off: np.ndarray,
        instance: str = "0",
        key: bytes | None = None,
        extra: Any = None,
    ) -> Message:
        """Node ``i``'s batch sent at true time ``sent``, its rows stamped ``row_off`` off."""
        off = self.clocks.offset(i, sent)
        env = self.envelope(i, exporter, STREAM_KIND[stream], sent + off, off, instance)
        return Message(
            stream,
            SendKind.BATCH,
            key or env.source.node.encode(),
            sent + net,
            sent,
            env,
            table,
            samples=table.num_rows,
            offset_ns=row_offsets(row_off),
            extra=extra,
        )

    def unpaused(
        self, i: int, at: np.ndarray, table: pa.Table, off: np.ndarray, entries: int
    ) -> tuple[pa.Table | None, np.ndarray]:
        """Node ``i``'s rows sampled at ``at`` (``entries`` per instant) but those sampled
        while its clocks stood still (a VM pause: nothing runs), and each row's offset; None
        when none is left."""
        keep = ~self.clocks.paused(i, at)
        if keep.all():
            return table, np.repeat(off, entries)
        if not keep.any():
            return None, off[:0]
        mask = np.repeat(keep, entries)
        return table.filter(pa.array(mask)), np.repeat(off[keep], entries)

    def send_time(self, i: int, sent: int, delay: int) -> int:
        """``sent``, or ``delay`` after node ``i`` resumes when it falls in a pause: the
        exporter sends the batch it held then, late."""
        back = self.clocks.resumed(i, sent)
        return sent if back == sent else back + delay

    def on_clock(self, i: int, table: pa.Table) -> tuple[pa.Table, np.ndarray]:
        """Collectives ``table`` stamped on the true clock, stamped on node ``i``'s (each
        start and end on the setting it had then), and the offsets of its ``ts_ns``."""
        starts = np.zeros(0, np.int64)
        for name in ("ts_ns", "end_ns"):
            col = table.schema.get_field_index(name)
            true = np.asarray(table.column(col).to_numpy(), np.int64)
            off = self.clocks.node_offsets(i, true)[0]
            table = table.set_column(col, table.schema.field(col), pa.array(true + off))
            starts = off if name == "ts_ns" else starts
        return table, starts

    def custom_envelope(self, i: int, sent_ns: int, off: int) -> Envelope:
        return self.envelope(i, "custom", PayloadKind.SAMPLES, sent_ns, off)

    def reboot(self, t: int, active: list[Incident]) -> None:
        down = np.zeros(self.n, bool)
        for inc in active:
            if inc.kind is FaultKind.RESET and inc.active(t):
                down[list(inc.node_idx)] = True
        back = self.down & ~down
        if back.any():
            for i in np.flatnonzero(back):
                self.boot_no[i] += 1
                for key in [k for k in self.sources if k[0] == i and not k[1].startswith("nccl")]:
                    del self.sources[key]
                for key in [k for k in self.seq if k[0] == i and not k[1].startswith("nccl")]:
                    del self.seq[key]
            uptime = np.full(self.n, 30.0)
            for g in self.gens:
                g.reset(back, uptime)
        self.down = down


__all__ = ["Message", "SendKind", "Simulation", "Stream", "Tick"]
