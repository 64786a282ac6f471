"""The refiner restarted from its checkpoints goes on exactly as one that never stopped: on
simulator traffic with every fault on (duplicates, resets, clock steps, malformed rows) and a
second exporter per node copying another's readings (overlapping sources), a refiner rebuilt
from the stream and node tables after every third group publishes the same messages, record
for record, and each node's overlap state is written with its series lists stored once."""

from __future__ import annotations

from pipelines.enrich import TopologyIndex
from schemas.codec import encode
from schemas.wire import PayloadKind
from services.simulate.cluster import Cluster
from services.simulate.engine import Simulation, Stream
from services.worker.refiner import Outcome, OutputTopics, RawRecord, Refiner
from tests.unit.test_refine_group import CAT, T0, S


def _records(seed: int) -> tuple[list[RawRecord], TopologyIndex]:
    sim = Simulation(Cluster.build(4, seed=seed), "all", seed=seed, start_ns=T0, duration_ns=30 * S)
    recs: list[RawRecord] = []

    def add(key: bytes | None, ct: str, body: bytes, due_ns: int) -> None:
        headers = [("content-type", ct.encode())]
        recs.append(RawRecord("raw", 0, len(recs), key, body, headers, due_ns // 10**6))

    for t, tick in enumerate(sim.ticks()):
        for m in tick.messages:
            if m.stream is not Stream.RAW:
                continue
            add(m.key, *m.encode(), m.due_ns)
            env = m.envelope
            if (
                t % 2
                and env is not None
                and m.table is not None
                and env.kind is PayloadKind.SAMPLES
            ):
                # a second exporter on the node delivering the same readings (every other
                # tick): an overlapping source, its copies found in the node's overlap state
                src = env.source.model_copy(update={"exporter": "copy"})
                add(m.key, *encode(env.model_copy(update={"source": src}), m.table), m.due_ns)
    return recs, TopologyIndex(sim.cluster.topology(), sim.cluster.jobs(T0))


def _published(outs: list[Outcome]) -> list[tuple[str, bytes, bytes]]:
    return [(m.topic, m.key, bytes(m.value)) for o in outs for m in o.messages]


def test_a_refiner_restored_from_its_tables_goes_on_as_one_that_never_stopped() -> None:
    recs, topo = _records(3)
    now = T0 + 40 * S
    group = 25
    live = Refiner(CAT, OutputTopics(), lambda: topo, lambda _: None, lambda _: None)
    expected = [_published(live.process_group(recs[i : i + group], now))
                for i in range(0, len(recs), group)]  # fmt: skip

    streams: dict[str, bytes] = {}
    nodes: dict[str, bytes] = {}

    def fresh() -> Refiner:
        return Refiner(CAT, OutputTopics(), lambda: topo, streams.get, nodes.get)

    ref = fresh()
    got = []
    overlap_dups = 0
    node_bytes: list[int] = []
    for n, i in enumerate(range(0, len(recs), group)):
        outs = ref.process_group(recs[i : i + group], now)
        overlap_dups += sum(o.duplicate for o in outs if o.stream and "|copy|" in o.stream)
        got.append(_published(outs))
        s, nd = ref.dirty_blobs()
        streams.update(s)
        nodes.update(nd)
        node_bytes.append(sum(len(b) for b in nd.values()))
        if n % 3 == 2:  # a restart: everything comes back from the tables
            ref = fresh()
    assert overlap_dups > 0  # overlapping sources met the restored overlap state
    assert any("|series|" in k for k in nodes)
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert a == b
    # series lists are written when new: later checkpoints are mostly timestamps
    assert sum(node_bytes[-5:]) < sum(node_bytes[:1]) * 5
