"""NIC identity end to end: the node exporter's netdev ↔ RDMA device ↔ port facts, read from
the real H100 ``/sys/class/infiniband`` tree with the ``/sys/class/net`` links a host has built
around it, make ``ethtool -S`` rows (``eth3/prio3``, real counter names) join the NIC, rail and
RoCE switch port (from the topology file) of ``mlx5_5/1``; a PFC storm on them gives a straggler
alert naming that switch port."""

from __future__ import annotations

import json
import os
import shutil
import tarfile
from pathlib import Path

import pyarrow as pa
import pytest

from pipelines.refine.batch import RefineState, refine_batch
from pipelines.refine.enrich import TopologyIndex
from schemas.catalog import default_catalog
from schemas.records import EntityKind, TopologyEntity
from schemas.wire import Batch, Envelope, SourceId
from services.detect.detector import Detector, Emitted
from services.exporters.ethtool import parse_ethtool_stats
from services.exporters.netdev import (
    Neighbour,
    NetdevLink,
    boot_time_ns,
    discover_netdevs,
    netdev_entities,
    parse_lldpctl,
)
from services.topology.topofile import entities_from_document
from tests.unit.derived_helpers import T0, S
from tests.unit.test_stragglers import PLACEMENT, collectives

REAL = Path(__file__).resolve().parents[1] / "fixtures" / "real-data" / "sysfs-procfs"
# the host's interfaces: not in index order, as on a real H100 node (mlx5_2/3 are absent)
NETDEVS = {
    "eth0": "mlx5_0",
    "eth1": "mlx5_1",
    "eth2": "mlx5_4",
    "eth3": "mlx5_5",
    "eth4": "mlx5_6",
    "eth5": "mlx5_7",
    "eth6": "mlx5_8",
    "eth7": "mlx5_9",
}


@pytest.fixture(scope="module")
def sysfs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_sysfs(tmp_path_factory.mktemp("h100") / "sys")


def build_sysfs(root: Path) -> Path:
    """The real tree as /sys/class/infiniband, each HCA's PCI function holding it and its
    netdev (/sys/devices/.../<pci>/{infiniband,net}), /sys/class/net/<netdev> links to those,
    and the bond's RoCE GID naming ``bond0`` (gid_attrs/ndevs), as the kernel lays them out."""
    raw = root.parent / "raw"
    with tarfile.open(REAL / "gpud-sys-class-infiniband-h100.tar.gz") as tf:
        tf.extractall(raw, filter="data")
    ib = root / "class" / "infiniband"
    ib.parent.mkdir(parents=True)
    shutil.move(raw / "sys-class-infiniband-h100", ib)
    (root / "class" / "net").mkdir()
    for i, (netdev, hca) in enumerate(NETDEVS.items()):
        pci = root / "devices" / "pci0000:00" / f"0000:{0x1A + i:02x}:00.0"
        (pci / "infiniband").mkdir(parents=True)
        os.symlink(ib / hca, pci / "infiniband" / hca)
        (pci / "net" / netdev).mkdir(parents=True)
        (pci / "net" / netdev / "dev_port").write_text("0\n")
        os.symlink(pci, pci / "net" / netdev / "device")
        os.symlink(pci / "net" / netdev, root / "class" / "net" / netdev)
    ndevs = ib / "mlx5_bond_0" / "ports" / "1" / "gid_attrs" / "ndevs"
    ndevs.mkdir(parents=True)
    (ndevs / "0").write_text("bond0\n")
    (root / "class" / "net" / "lo").mkdir()  # no device: no RDMA link
    return root


def test_discovery_links_every_netdev_to_its_rdma_device_and_port(sysfs: Path) -> None:
    links = discover_netdevs(sysfs)
    assert {lk.netdev: lk.rdma for lk in links} == {**NETDEVS, "bond0": "mlx5_bond_0"}
    assert {lk.port for lk in links} == {1}
    layers = {lk.netdev: lk.link_layer for lk in links}  # read from the real tree
    assert layers["bond0"] == "Ethernet" and layers["eth3"] == "InfiniBand"


def test_facts_are_netdev_entities_with_lldp_neighbours(tmp_path: Path) -> None:
    links = [NetdevLink("eth3", "mlx5_5", 1, "Ethernet")]
    ents = netdev_entities("n2", links, {"eth3": Neighbour("leaf-r3", "swp12")}, valid_from=7)
    (e,) = ents
    assert e.id == "netdev:n2/eth3" and e.kind is EntityKind.NETDEV and e.valid_from == 7
    assert (e.device, e.nic, e.attrs["port"], e.switch, e.switch_port) == (
        "eth3",
        "mlx5_5",
        1,
        "leaf-r3",
        "swp12",
    )
    assert TopologyEntity.model_validate_json(e.model_dump_json()) == e  # the topic's form
    (tmp_path / "stat").write_text("cpu  1 2 3\nbtime 1700000000\n")
    assert boot_time_ns(tmp_path) == 1_700_000_000 * S
    assert boot_time_ns(tmp_path / "absent") == 0


# lldpctl output in both of lldpd's JSON forms (json0: every value a list of {"value": ...})
JSON0 = {
    "lldp": [
        {
            "interface": [
                {
                    "name": "eth3",
                    "via": "LLDP",
                    "chassis": [
                        {
                            "id": [{"type": "mac", "value": "1c:34:da:00:00:01"}],
                            "name": [{"value": "leaf-r3"}],
                        }
                    ],
                    "port": [
                        {
                            "id": [{"type": "ifname", "value": "swp12"}],
                            "descr": [{"value": "to n2"}],
                        }
                    ],
                },
                {
                    "name": "eth0",
                    "chassis": [{"id": [{"type": "mac", "value": "1c:34:da:00:00:02"}]}],
                    "port": [
                        {
                            "id": [{"type": "mac", "value": "1c:34:da:00:00:99"}],
                            "descr": [{"value": "Ethernet1/9"}],
                        }
                    ],
                },
            ]
        }
    ]
}
JSON = {
    "lldp": {
        "interface": {
            "eth3": {
                "chassis": {"leaf-r3": {"id": {"type": "mac", "value": "1c:34:da:00:00:01"}}},
                "port": {"id": {"type": "ifname", "value": "swp12"}},
            }
        }
    }
}


def test_lldpctl_neighbours_from_json0_and_json() -> None:
    assert parse_lldpctl(json.dumps(JSON0)) == {
        "eth3": Neighbour("leaf-r3", "swp12"),
        "eth0": Neighbour("1c:34:da:00:00:02", "Ethernet1/9"),
    }
    assert parse_lldpctl(json.dumps(JSON)) == {"eth3": Neighbour("leaf-r3", "swp12")}
    assert parse_lldpctl("lldpd not running") == {}
    assert parse_lldpctl("{}") == {}


# --- the fabric: four nodes, four RoCE rails, switch ports from the topology file ------------

RAILS = ["mlx5_0", "mlx5_1", "mlx5_4", "mlx5_5"]  # rail k: gpu<k>'s NIC, behind leaf-r<k>


def topofile() -> dict[str, object]:
    nodes = [
        {
            "name": f"n{i}",
            "rack": "r1",
            "gpus": [{"device": f"gpu{k}", "nic": nic} for k, nic in enumerate(RAILS)],
            "nics": [
                {"device": nic, "rail": k, "gpu": f"gpu{k}", "switch": f"leaf-r{k}",
                 "switch_port": 10 + i}
                for k, nic in enumerate(RAILS)
            ],
        }
        for i in range(4)
    ]  # fmt: skip
    return {"version": 1, "nodes": nodes}


def index(sysfs: Path) -> TopologyIndex:
    ents = entities_from_document(topofile())
    links = discover_netdevs(sysfs)
    for i in range(4):
        ents += netdev_entities(f"n{i}", links)
    return TopologyIndex(ents, [PLACEMENT])


def test_ethtool_rows_join_the_nic_rail_and_switch_port(sysfs: Path) -> None:
    idx = index(sysfs)
    text = "     rx_prio3_pause: 10\n     tx_prio3_pause: 2\n     rx_pause_ctrl_phy: 4\n"
    rows = parse_ethtool_stats(text, "eth3", T0, default_catalog()).table
    assert rows.column("device").to_pylist() == ["eth3/prio3", "eth3/prio3", "eth3"]
    out = idx.enrich("n2", rows.column("device"), rows.column("ts_ns")).to_pylist()
    port = idx.resolve("n2", "mlx5_5/1", T0)
    for r in out:
        assert r == port
    assert (port["nic"], port["rail"], port["leaf"], port["leaf_port"]) == (
        "mlx5_5",
        3,
        "leaf-r3",
        "12",
    )
    assert port["gpu"] == "gpu3" and port["job"] == "j1" and port["rank"] == 11
    assert port["enrich_reason"] is None
    # an interface without an RDMA device stays a node-level device
    assert idx.resolve("n2", "lo", T0)["enrich_reason"] == "not_a_fabric_device"


def test_a_netdev_without_a_topology_file_link_takes_its_lldp_switch_port() -> None:
    ents = [
        TopologyEntity(id="node:n1", kind=EntityKind.NODE, node="n1"),
        TopologyEntity(id="nic:n1/mlx5_5", kind=EntityKind.NIC, node="n1", device="mlx5_5", rail=3),
        *netdev_entities(
            "n1", [NetdevLink("eth3", "mlx5_5", 1)], {"eth3": Neighbour("leaf-x", "swp7")}
        ),
    ]
    idx = TopologyIndex(ents)
    for dev in ("eth3/prio3", "mlx5_5/1"):
        r = idx.resolve("n1", dev, T0)
        assert (r["nic"], r["rail"], r["leaf"], r["leaf_port"]) == ("mlx5_5", 3, "leaf-x", "swp7")


def ethtool_text(pause: int, duration: int) -> str:
    """``ethtool -S eth3`` of a ConnectX port (mlx5 counter names), PFC on priority 3."""
    return (
        "NIC statistics:\n"
        f"     rx_prio3_bytes: {10_000 * pause + 5}\n"
        f"     rx_prio3_pause: {pause}\n"
        f"     rx_prio3_pause_duration: {duration}\n"
        "     tx_prio3_pause: 3\n"
        "     rx_pause_ctrl_phy: 0\n"
    )


def firmware_batches(seconds: int) -> list[Batch]:
    """n2's firmware exporter, one ``ethtool -S eth3`` batch a second, storming from 1 s."""
    cat, out = default_catalog(), []
    pause = duration = 0
    for s in range(seconds):
        ts = T0 + s * S
        table = parse_ethtool_stats(ethtool_text(pause, duration), "eth3", ts, cat).table
        env = Envelope(
            source=SourceId(node="n2", exporter="firmware", instance="0", boot_id="b0"),
            seq=s,
            sent_ns=ts,
        )
        out.append(Batch(envelope=env, table=table))
        pause += 120_000
        duration += 900_000
    return out


def test_a_pfc_storm_on_a_real_named_nic_gives_a_straggler_alert_naming_the_switch_port(
    sysfs: Path,
) -> None:
    idx = index(sysfs)
    det = Detector(default_catalog(), topology=idx)
    det.set_jobs([PLACEMENT])
    state, cat = RefineState(), default_catalog()
    out = Emitted()
    for t in collectives(range(10)):  # rank 11 (n2, gpu3 → mlx5_5 = eth3) arrives late
        out.extend(det.on_collectives(t, T0))
    for i, b in enumerate(firmware_batches(20)):
        ts = b.envelope.sent_ns
        r = refine_batch(b, (0, i), ts + 1_000_000, state, cat, idx, ts)
        refined: pa.Table = r.refined
        if i == 5:
            rows = [x for x in refined.to_pylist() if x["metric"] == "nic.rx_prio_pause"]
            assert rows[0]["device"] == "eth3/prio3"
            assert (rows[0]["leaf"], rows[0]["leaf_port"], rows[0]["nic"]) == (
                "leaf-r3",
                "12",
                "mlx5_5",
            )
        out.extend(det.on_refined(refined, ts))
        out.extend(det.advance(int(refined.column("ts")[0].as_py()), ts))
    strag = [a for a in out.alerts if a.rule == "nccl_straggler"]
    assert strag, [a.rule for a in out.alerts]
    a = strag[0]
    assert a.cause is not None and a.cause.startswith("PFC storm on leaf-r3 port 12 (prio 3)")
    assert a.evidence["port"] == "leaf-r3/12"


def test_the_topology_file_names_a_nics_interface() -> None:
    doc = {
        "version": 1,
        "nodes": [
            {"name": "n1", "nics": [{"device": "mlx5_5", "netdev": "eth3", "port": 1,
                                     "switch": "leaf-r3", "switch_port": 12}]}
        ],
    }  # fmt: skip
    ents = entities_from_document(doc)
    (nd,) = [e for e in ents if e.kind is EntityKind.NETDEV]
    assert (nd.id, nd.device, nd.nic, nd.attrs) == ("netdev:n1/eth3", "eth3", "mlx5_5", {"port": 1})
    r = TopologyIndex(ents).resolve("n1", "eth3/prio3", T0)
    assert (r["leaf"], r["leaf_port"], r["nic"]) == ("leaf-r3", "12", "mlx5_5")


def test_the_lake_counts_an_interfaces_rows_on_the_rdma_port_behind_it(tmp_path: Path) -> None:
    """top_congested_links: eth5/prio3 (PFC) and mlx5_5/1 (CNP) are one link once the
    netdev facts say eth5 is mlx5_5 port 1, relabelled by the topology of the lake."""
    import numpy as np
    import pyarrow.compute as pc

    from lab.lake import synth
    from services.lake import sqlload
    from services.lake.datasets import TOPOLOGY_SCHEMA
    from services.lake.writer import LakeWriter

    t = synth.refined_samples(1, 10)
    dev = t.column("device").to_numpy(zero_copy_only=False)
    met = t.column("metric").to_numpy(zero_copy_only=False)
    delta = pc.fill_null(t.column("delta"), 0.0).to_numpy(zero_copy_only=False).copy()
    delta[(dev == "eth5/prio3") & (met == "nic.rx_prio_pause")] = 4_000.0
    delta[(dev == "mlx5_5/1") & (met == "rdma.np_cnp_sent")] = 2_500.0
    i = t.schema.get_field_index("delta")
    t = t.set_column(i, t.schema.field(i), pa.array(delta).cast(t.schema.field(i).type))
    w = LakeWriter(tmp_path)
    w.ensure_seeds()
    synth.land_lake(w, t, chunk_rows=50_000)

    def links() -> dict[str, tuple[object, ...]]:
        con = sqlload.connect(tmp_path)
        rows = sqlload.run_query(con, "top_congested_links", {"limit": "100"}).fetchall()
        return {r[4]: r for r in rows if r[3] == "node000"}

    before = links()
    assert before["eth5"][5] > 0 and before["mlx5_5/1"][8] > 0  # two rows for one link
    rows = [
        {"ts": 0, "id": f"netdev:node000/eth{g}", "kind": "netdev", "valid_from": 0,
         "node": "node000", "device": f"eth{g}", "nic": f"mlx5_{g}", "attrs": '{"port": 1}',
         "source": "sysfs", "kafka_partition": 0, "kafka_offset": 100 + g}
        for g in range(8)
    ]  # fmt: skip
    facts = pa.Table.from_pylist(
        [{k: r.get(k) for k in TOPOLOGY_SCHEMA.names} for r in rows], schema=TOPOLOGY_SCHEMA
    )
    w.land("topology", facts, partition=0, first=100, last=107)
    after = links()
    assert "eth5" not in after
    one = after["mlx5_5/1"]
    assert one[5] == before["eth5"][5] and one[8] == before["mlx5_5/1"][8]  # pause and CNP
    assert one[1] == before["mlx5_5/1"][1] and np.isfinite(one[-1])  # its switch, a score
