"""The node exporter records its node's netdev ↔ RDMA device ↔ port links on the
``topology.nodes`` topic (it may not write the fabric's ``topology``), and the worker's topology
feed folds them into the same view as the fabric's facts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from schemas.records import EntityKind, TopologyEntity
from schemas.topics import TOPICS
from services.kafka.feed import TopologyFeed, nodes_topic
from tests.unit.test_netdev import NETDEVS, build_sysfs

pytestmark = [pytest.mark.kafka]
REPO = Path(__file__).resolve().parents[2]


def _read_all(bootstrap: str, topic: str) -> dict[str, TopologyEntity]:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "netdev-facts",
                  "enable.partition.eof": True, "log_level": 0})  # fmt: skip
    c.assign([TopicPartition(topic, 0, 0)])
    out: dict[str, TopologyEntity] = {}
    try:
        while True:
            m = c.poll(10)
            assert m is not None, "no end of partition"
            if m.error():
                break
            out[m.key().decode()] = TopologyEntity.model_validate_json(m.value())
    finally:
        c.close()
    return out


def test_the_node_exporter_publishes_its_netdev_facts(kafka_bootstrap: str, tmp_path: Path) -> None:
    pre = f"facts{uuid.uuid4().hex[:6]}."
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    topics = ("raw", "topology", "topology.nodes")
    for f in admin.create_topics([NewTopic(pre + t, 1, 1) for t in topics]).values():
        f.result(30)
    sysfs = build_sysfs(tmp_path / "sys")
    env = {k: v for k, v in os.environ.items() if not k.startswith("REFINERY_")}
    env["REFINERY_BOOTSTRAP_SERVERS"] = kafka_bootstrap
    run = subprocess.run(
        [sys.executable, "-m", "services.cli", "export", "node", "--once", "--no-gpu",
         "--no-clock", "--node", "n7", "--sysfs", str(sysfs), "--topic", pre + "raw",
         "--topology-topic", pre + TOPICS.topology_nodes],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert TOPICS.topology_nodes == nodes_topic("topology") == "topology.nodes"
    assert _read_all(kafka_bootstrap, pre + "topology") == {}  # the fabric's: not the exporter's
    facts = _read_all(kafka_bootstrap, pre + TOPICS.topology_nodes)
    assert {k: e.nic for k, e in facts.items()} == {
        f"netdev:n7/{nd}": hca for nd, hca in {**NETDEVS, "bond0": "mlx5_bond_0"}.items()
    }
    eth2 = facts["netdev:n7/eth2"]
    assert eth2.kind is EntityKind.NETDEV and eth2.node == "n7" and eth2.attrs["port"] == 1
    assert eth2.valid_from > 0  # the node's boot time: the links hold since then
    assert json.loads(eth2.model_dump_json())["source"] == "sysfs"


def _produce(bootstrap: str, topic: str, ents: list[TopologyEntity]) -> None:
    p = Producer({"bootstrap.servers": bootstrap, "log_level": 0})
    for e in ents:
        p.produce(topic, e.model_dump_json().encode(), key=e.id.encode())
    assert p.flush(30) == 0


def test_the_feed_folds_node_facts_into_the_fabric_and_they_cannot_replace_it(
    kafka_bootstrap: str,
) -> None:
    """The feed reads ``topology.nodes`` beside ``topology``: a node's netdev facts join the
    fabric's entities; anything but a netdev entity keyed by its own id is refused there, and
    the fabric's entry for the same interface wins over the node's."""
    pre = f"fold{uuid.uuid4().hex[:6]}."
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    names = ("topology", "topology.nodes", "jobs")
    for f in admin.create_topics([NewTopic(pre + t, 1, 1) for t in names]).values():
        f.result(30)
    nic = TopologyEntity(id="nic:n7/mlx5_2", kind=EntityKind.NIC, node="n7", device="mlx5_2")
    named = TopologyEntity(
        id="netdev:n7/eth3", kind=EntityKind.NETDEV, node="n7", device="eth3", nic="mlx5_3",
        switch="leaf-1", switch_port="17",
    )  # fmt: skip
    _produce(kafka_bootstrap, pre + "topology", [nic, named])
    eth2 = named.model_copy(
        update={"id": "netdev:n7/eth2", "device": "eth2", "nic": "mlx5_2",
                "switch": None, "switch_port": None, "source": "sysfs"}
    )  # fmt: skip
    lldp = named.model_copy(update={"switch": "leaf-9", "switch_port": "1", "source": "lldp"})
    forged_link = TopologyEntity(id="link:leaf-1:17", kind=EntityKind.LINK, switch="leaf-6")
    forged_nic = nic.model_copy(update={"rail": 5})  # the fabric's kind, not a node's
    misfiled = eth2.model_copy(update={"id": "netdev:n8/eth2"})  # another node's key
    _produce(
        kafka_bootstrap, pre + "topology.nodes", [eth2, lldp, forged_link, forged_nic, misfiled]
    )
    feed = TopologyFeed({"bootstrap.servers": kafka_bootstrap}, pre + "topology", pre + "jobs")
    feed.start()
    try:
        assert feed.wait_caught_up(60) and feed.error is None
        _, ents, _ = feed.snapshot()
    finally:
        feed.stop()
    by_id = {e.id: e for e in ents}
    assert set(by_id) == {"nic:n7/mlx5_2", "netdev:n7/eth3", "netdev:n7/eth2"}
    assert by_id["netdev:n7/eth2"] == eth2  # the node's own fact, folded in
    assert by_id["netdev:n7/eth3"].switch == "leaf-1"  # the fabric's entry wins over LLDP
    assert by_id["nic:n7/mlx5_2"].rail is None  # a forged NIC never replaces the fabric's
    assert feed.stats["bad"] == 3  # the link, the NIC and the misfiled netdev
