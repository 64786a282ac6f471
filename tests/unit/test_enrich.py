"""Topology and job enrichment, vectorized per batch, versioned in time."""

from __future__ import annotations

import pyarrow as pa

from pipelines.refine.enrich import ENRICH_SCHEMA, TopologyIndex, classify_device
from schemas.records import EntityKind, JobPlacement, RankPlacement, TopologyEntity

T = 1_000_000


def ent(id_: str, kind: EntityKind, **kw: object) -> TopologyEntity:
    return TopologyEntity(id=id_, kind=kind, **kw)  # type: ignore[arg-type]


ENTS = [
    ent("node:n1", EntityKind.NODE, node="n1", rack="r1", pod="p1"),
    ent("n1:mlx5_0", EntityKind.NIC, node="n1", device="mlx5_0", rail=0, numa=0, gpu="gpu0"),
    ent("n1:mlx5_1", EntityKind.NIC, node="n1", device="mlx5_1", rail=1, numa=1, gpu="gpu1"),
    ent("n1:gpu0", EntityKind.GPU, node="n1", device="gpu0", nic="mlx5_0", numa=0,
        nvlink_domain="nvl-a"),
    ent("n1:gpu1", EntityKind.GPU, node="n1", device="gpu1", nic="mlx5_1", numa=1,
        nvlink_domain="nvl-a"),
    # the link of mlx5_0 moves from leaf1 port 7 to leaf2 port 3 at t = 2T
    ent("n1:mlx5_0/1", EntityKind.LINK, node="n1", device="mlx5_0/1", switch="leaf1",
        switch_port="7", valid_to=2 * T),
    ent("n1:mlx5_0/1", EntityKind.LINK, node="n1", device="mlx5_0/1", switch="leaf2",
        switch_port="3", valid_from=2 * T),
    ent("n1:mlx5_1/1", EntityKind.LINK, node="n1", device="mlx5_1/1", switch="leaf1",
        switch_port="8"),
    ent("leaf1", EntityKind.SWITCH, device="leaf1", role="leaf", peer="spine1"),
    ent("leaf2-up", EntityKind.LINK, switch="leaf2", peer="spine9"),
    ent("leaf2-up2", EntityKind.LINK, switch="leaf2", peer="spine4"),
    ent("node:n2", EntityKind.NODE, node="n2", rack="r2", valid_from=5 * T),
]  # fmt: skip
JOBS = [
    JobPlacement(job="j1", start_ns=0, end_ns=3 * T, nodes=["n1"],
                 ranks=[RankPlacement(rank=4, node="n1", gpu="gpu0")]),
]  # fmt: skip


def enrich(node: str, devices: list[str], ts: list[int]) -> list[dict[str, object]]:
    idx = TopologyIndex(ENTS, JOBS)
    out = idx.enrich(node, pa.array(devices, pa.string()), pa.array(ts, pa.int64()))
    assert out.schema == ENRICH_SCHEMA and out.num_rows == len(devices)
    rows: list[dict[str, object]] = out.to_pylist()
    return rows


def test_classify_device() -> None:
    assert classify_device("gpu3") == ("gpu", "gpu3", None)
    assert classify_device("mlx5_0/1/prio3") == ("nic", "mlx5_0", "1")
    assert classify_device("mlx5_0") == ("nic", "mlx5_0", None)
    assert classify_device("cpu12") == ("other", "cpu12", None)


def test_gpu_nic_port_prio_and_node_rows() -> None:
    devs = ["gpu0", "mlx5_0/1", "mlx5_0/1/prio3", "mlx5_0", "mlx5_1/1", "cpu3", "gpu7"]
    r = enrich("n1", devs, [T] * len(devs))
    gpu0, port, prio, bare, nic1, cpu, gpu7 = r
    assert gpu0 | {} == {
        "rack": "r1", "pod": "p1", "leaf": "leaf1", "leaf_port": "7", "spine": "spine1",
        "rail": 0, "nic": "mlx5_0", "gpu": "gpu0", "numa": 0, "nvlink_domain": "nvl-a",
        "job": "j1", "rank": 4, "enrich_reason": None,
    }  # fmt: skip
    assert port == prio == bare  # all map to NIC mlx5_0, port 1
    assert port["nic"] == "mlx5_0" and port["gpu"] == "gpu0" and port["rank"] == 4
    assert nic1["leaf_port"] == "8" and nic1["gpu"] == "gpu1"
    # gpu1 has no rank in j1 but j1 holds the node
    assert nic1["job"] == "j1" and nic1["rank"] is None
    assert cpu["enrich_reason"] == "not_a_fabric_device" and cpu["job"] == "j1"
    assert cpu["rack"] == "r1" and cpu["rail"] is None
    assert gpu7["enrich_reason"] == "no_device_mapping" and gpu7["rack"] == "r1"


def test_missing_joins_have_reasons() -> None:
    assert enrich("nX", ["gpu0"], [T])[0]["enrich_reason"] == "no_topology_for_node"
    assert enrich("n2", ["cpu0"], [T])[0]["enrich_reason"] == "no_topology_at_time"
    r = enrich("n2", ["cpu0"], [6 * T])[0]
    assert r["rack"] == "r2" and r["enrich_reason"] == "not_a_fabric_device"
    late = enrich("n1", ["gpu0"], [4 * T])[0]  # job over
    assert late["job"] is None and late["enrich_reason"] == "no_job"


def test_batch_straddling_a_version_change_is_exact_per_row() -> None:
    ts = [2 * T - 2, 2 * T - 1, 2 * T, 2 * T + 1]
    r = enrich("n1", ["mlx5_0/1"] * 4, ts)
    assert [x["leaf"] for x in r] == ["leaf1", "leaf1", "leaf2", "leaf2"]
    assert [x["leaf_port"] for x in r] == ["7", "7", "3", "3"]
    assert [x["spine"] for x in r] == ["spine1", "spine1", "spine4", "spine4"]


def test_resolution_is_cached_per_distinct_device() -> None:
    idx = TopologyIndex(ENTS, JOBS)
    devs = pa.array(["gpu0", "gpu1", "mlx5_0/1"] * 500)
    for k in range(5):
        out = idx.enrich("n1", devs, pa.array([T + k] * 1500, pa.int64()))
        assert out.num_rows == 1500
    assert idx.resolutions == 3


def test_batch_rows_equal_each_device_resolved_alone() -> None:
    # the batch join resolves a node's non-fabric devices once and shares that row: every row
    # must still be what resolving its own device gives, across versions, jobs and nodes
    devs = ["cpu0", "gpu0", "nvme0", "mlx5_0/1", "cpu1", "gpu7", "mlx5_1/1/prio3", "mem"]
    for node, t in (("n1", T), ("n1", 2 * T), ("n1", 4 * T), ("n2", 6 * T), ("nX", T)):
        got = enrich(node, devs * 3, [t] * (3 * len(devs)))
        alone = TopologyIndex(ENTS, JOBS)
        want = [alone.resolve(node, d, t) for d in devs] * 3
        assert got == want, (node, t)


def test_a_batch_across_several_versions_gives_each_row_its_own() -> None:
    # rows in no order of time, across every boundary of n1 (links, jobs), many devices: each
    # row is what resolving its own device at its own ts gives
    devs = ["cpu0", "gpu0", "mlx5_0/1", "mlx5_0/1/prio3", "gpu7", "mlx5_1/1", "nvme0"]
    ts = [7 * T - 1, T, 2 * T, 4 * T + 3, 2 * T - 1, 3 * T, 5 * T, 6 * T + 5, T + 1]
    rows = [(d, t) for d in devs for t in ts]
    got = enrich("n1", [d for d, _ in rows], [t for _, t in rows])
    alone = TopologyIndex(ENTS, JOBS)
    assert got == [alone.resolve("n1", d, t) for d, t in rows]


def test_a_port_and_its_priorities_share_one_resolution() -> None:
    idx = TopologyIndex(ENTS, JOBS)
    devs = pa.array(["mlx5_0/1", "mlx5_0/1/prio3", "mlx5_0/1/prio0", "cpu0", "nvme0", "mem"])
    out = idx.enrich("n1", devs, pa.array([T] * len(devs), pa.int64())).to_pylist()
    assert idx.resolutions == 2  # the port, and the node for every non-fabric device
    assert out[0] == out[1] == out[2] and out[3] == out[4] == out[5]


N3 = [
    ent("node:n3", EntityKind.NODE, node="n3", rack="r3"),
    ent("n3:gpu0", EntityKind.GPU, node="n3", device="gpu0", nvlink_domain="nvl-b"),
]  # fmt: skip
J3 = JobPlacement(job="j3", start_ns=0, nodes=["n3"],
                  ranks=[RankPlacement(rank=0, node="n3", gpu="gpu0")])  # fmt: skip
DEVS = ["gpu0", "mlx5_0/1", "mlx5_1/1", "cpu0"]


def _joins(idx: TopologyIndex, node: str) -> list[dict[str, object]]:
    devs = pa.array(DEVS * 2)
    ts = pa.array([T] * len(DEVS) + [4 * T] * len(DEVS), pa.int64())
    rows: list[dict[str, object]] = idx.enrich(node, devs, ts).to_pylist()
    return rows


def test_a_job_change_re_resolves_only_the_nodes_it_runs_on() -> None:
    # the worker builds a new index whenever the topology or jobs topic changes; a job that
    # starts on n3 must not cost every node its joins, and n3 must see the job
    ents = ENTS + N3
    old = TopologyIndex(ents, JOBS)
    before = {n: _joins(old, n) for n in ("n1", "n3")}
    assert {r["job"] for r in before["n3"]} == {None}
    new = TopologyIndex(ents, [*JOBS, J3], previous=old)
    fresh = TopologyIndex(ents, [*JOBS, J3])
    for n in ("n1", "n3"):
        assert _joins(new, n) == _joins(fresh, n), n
    assert new.carried_nodes == 1  # n1; n3's jobs changed
    assert _joins(new, "n1") == before["n1"]
    assert _joins(new, "n3")[0]["job"] == "j3" and _joins(new, "n3")[0]["rank"] == 0
    # only n3's rows were resolved again: as many as a fresh index needs for n3 alone
    alone = TopologyIndex(ents, [*JOBS, J3])
    _joins(alone, "n3")
    assert new.resolutions == alone.resolutions > 0


def test_a_node_or_fabric_change_re_resolves_what_it_touches() -> None:
    ents = ENTS + N3
    old = TopologyIndex(ents, JOBS)
    for n in ("n1", "n3"):
        _joins(old, n)
    # n3's GPU moves to another NVLink domain: n1 keeps its joins, n3 sees the change
    moved = [*ENTS, N3[0], ent("n3:gpu0", EntityKind.GPU, node="n3", device="gpu0",
                               nvlink_domain="nvl-c")]  # fmt: skip
    new = TopologyIndex(moved, JOBS, previous=old)
    assert new.carried_nodes == 1
    assert _joins(new, "n3")[0]["nvlink_domain"] == "nvl-c"
    assert _joins(new, "n1") == _joins(TopologyIndex(moved, JOBS), "n1")
    # leaf1's uplink changes: every node's spine may change, nothing is carried
    spined = [ent("leaf1", EntityKind.SWITCH, device="leaf1", role="leaf", peer="spine2")
              if e.id == "leaf1" else e for e in ents]  # fmt: skip
    again = TopologyIndex(spined, JOBS, previous=old)
    assert again.carried_nodes == 0
    spines = {r["spine"] for r in _joins(again, "n1")}
    assert "spine2" in spines and "spine1" not in spines
    assert _joins(again, "n1") == _joins(TopologyIndex(spined, JOBS), "n1")
