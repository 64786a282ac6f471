"""The node exporter records its node's netdev ↔ RDMA device ↔ port links on the topology
topic, as the worker's topology feed reads them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from schemas.records import EntityKind, TopologyEntity
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
    for f in admin.create_topics([NewTopic(pre + t, 1, 1) for t in ("raw", "topology")]).values():
        f.result(30)
    sysfs = build_sysfs(tmp_path / "sys")
    env = {k: v for k, v in os.environ.items() if not k.startswith("REFINERY_")}
    env["REFINERY_BOOTSTRAP_SERVERS"] = kafka_bootstrap
    run = subprocess.run(
        [sys.executable, "-m", "services.cli", "export", "node", "--once", "--no-gpu",
         "--no-clock", "--node", "n7", "--sysfs", str(sysfs), "--topic", pre + "raw",
         "--topology-topic", pre + "topology"],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    facts = _read_all(kafka_bootstrap, pre + "topology")
    assert {k: e.nic for k, e in facts.items()} == {
        f"netdev:n7/{nd}": hca for nd, hca in {**NETDEVS, "bond0": "mlx5_bond_0"}.items()
    }
    eth2 = facts["netdev:n7/eth2"]
    assert eth2.kind is EntityKind.NETDEV and eth2.node == "n7" and eth2.attrs["port"] == 1
    assert eth2.valid_from > 0  # the node's boot time: the links hold since then
    assert json.loads(eth2.model_dump_json())["source"] == "sysfs"
