"""Topology and job importers on the real fixtures (tests/fixtures/real-data/topology)."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import pytest

from schemas.errors import ConfigError
from schemas.records import EntityKind, TopologyEntity
from services.settings import RefinerySettings
from services.topology import cli
from services.topology.ibnetdiscover import (
    import_ibnetdiscover,
    load_node_map,
    norm_guid,
    parse_ibnetdiscover,
    switch_name,
)
from services.topology.jobs import jobs_from_document, load_jobs, parse_scontrol
from services.topology.nccl_topo import import_nccl_topo
from services.topology.slurm import expand_hostlist, import_topology_conf, parse_topology_conf
from services.topology.topofile import (
    dump_document,
    entities_from_document,
    parse_time_ns,
    parse_topofile,
)

TOPO = Path("tests/fixtures/real-data/topology")
NDR = TOPO / "topograph-ibnetdiscover-example.out"


@pytest.fixture(scope="module")
def ndr() -> list[TopologyEntity]:
    result = import_ibnetdiscover(NDR)
    assert result.problems == []
    return result.entities


def _by_id(entities: list[TopologyEntity]) -> dict[str, TopologyEntity]:
    out = {e.id: e for e in entities}
    assert len(out) == len(entities), "entity ids must be unique"
    return out


# --- ibnetdiscover ------------------------------------------------------------------------


def test_ndr_fabric_counts(ndr: list[TopologyEntity]) -> None:
    kinds = Counter(e.kind for e in ndr)
    assert kinds[EntityKind.SWITCH] == 40
    assert kinds[EntityKind.NIC] == 582
    host_links = [e for e in ndr if e.kind is EntityKind.LINK and e.peer is None]
    switch_links = [e for e in ndr if e.kind is EntityKind.LINK and e.peer is not None]
    assert len(host_links) == 582
    assert len(switch_links) == 532
    roles = Counter(e.role for e in ndr if e.kind is EntityKind.SWITCH)
    assert roles == {"leaf": 31, "spine": 9}
    # the names agree with the levels the graph gives
    for e in ndr:
        if e.kind is EntityKind.SWITCH:
            assert ("IBLEAF" in (e.device or "")) == (e.role == "leaf")
    agg = [e for e in ndr if e.kind is EntityKind.NIC and e.attrs.get("kind") == "aggregation_node"]
    assert len(agg) == 40
    _by_id(ndr)


def test_every_host_adapter_tied_to_its_leaf_and_port(ndr: list[TopologyEntity]) -> None:
    switches = {e.device: e for e in ndr if e.kind is EntityKind.SWITCH}
    nics = [e for e in ndr if e.kind is EntityKind.NIC]
    links = {e.guid: e for e in ndr if e.kind is EntityKind.LINK and e.peer is None}
    for nic in nics:
        assert nic.switch in switches and nic.switch_port is not None
        link = links[nic.guid]
        assert (link.switch, link.switch_port) == (nic.switch, nic.switch_port)
        if nic.attrs.get("kind") != "aggregation_node":
            assert switches[nic.switch].role == "leaf"
    # no (switch, port) is claimed twice
    ports = Counter((e.switch, e.switch_port) for e in links.values())
    assert max(ports.values()) == 1
    named = [n for n in nics if n.node is not None]
    assert len(named) == 473  # the 69 "MT4129 ConnectX7" CAs and 40 SHARP nodes have no host


def test_ndr_link_spot_check(ndr: list[TopologyEntity]) -> None:
    # By hand from the file: 'Ca 1 "H-e09d7303007a5a68" # "a08-p1-dgx-04-c17 mlx5_5"' whose
    # port 1 goes to "S-2c5eab0300b87b40"[17] = MF0;A09-P1-IBLEAF-04-04, 4xNDR.
    link = _by_id(ndr)["link:a08-p1-dgx-04-c17/mlx5_5/1"]
    assert link.node == "a08-p1-dgx-04-c17"
    assert link.device == "mlx5_5/1"
    assert link.switch == "A09-P1-IBLEAF-04-04"
    assert link.switch_port == "17"
    assert link.guid == "0xe09d7303007a5a68"
    assert link.attrs["speed"] == "4xNDR"
    assert link.attrs["switch_guid"] == "0x2c5eab0300b87b40"
    leaf = _by_id(ndr)["switch:A09-P1-IBLEAF-04-04"]
    assert (leaf.role, leaf.guid, leaf.attrs["lid"]) == ("leaf", "0x2c5eab0300b87b40", 73)
    # the leaf's port 35 goes to IBSPINE-02 port 32
    up = _by_id(ndr)["link:A09-P1-IBLEAF-04-04/35~A10-P1-IBSPINE-02/32"]
    assert up.peer == "A10-P1-IBSPINE-02" or up.switch == "A10-P1-IBSPINE-02"


def test_bad_input_is_a_partial_result_with_a_reason() -> None:
    result = import_ibnetdiscover(TOPO / "topograph-ibnetdiscover-example-bad.out")
    assert len(result.problems) == 1
    assert "no port lines" in result.problems[0]
    assert "0xb8e92403009ca838" in result.problems[0]
    (nic,) = result.entities
    assert (nic.node, nic.device, nic.switch) == ("dgx-gb200-n01-c1", "HCA-1", None)
    assert parse_ibnetdiscover("hello\n").problems[-1].startswith("no Switch or Ca")


def test_faked_hdr_director_switch_names() -> None:
    result = import_ibnetdiscover(TOPO / "superbench-ibnetdiscover-FAKED.txt")
    names = {e.device for e in result.entities if e.kind is EntityKind.SWITCH}
    assert "rmd70-0101-0908-01ib1-A/S01" in names
    assert "rmd70-0101-0908-01ib1-A/L01" in names
    assert switch_name("MF0;A09-P1-IBLEAF-04-04:MQM9701/U1", "g") == "A09-P1-IBLEAF-04-04"
    assert norm_guid("0xff08c43213b3f30") == norm_guid("0ff08c43213b3f30")


def test_node_map_names_hostless_adapters(tmp_path: Path) -> None:
    m = tmp_path / "map.yaml"
    # an adapter described only as "MT4129 ConnectX7   Mellanox Technologies" in the file
    m.write_text('"0xe09d730300858d88": a06-p1-dgx-02-c05/mlx5_5\n')
    result = import_ibnetdiscover(NDR, load_node_map(m))
    link = _by_id(result.entities)["link:a06-p1-dgx-02-c05/mlx5_5/1"]
    assert (link.switch, link.switch_port) == ("A09-P1-IBLEAF-04-02", "6")
    ibstat = load_node_map(TOPO / "superbench-ibstat-guids.txt")
    assert ibstat[norm_guid("0ff08c4321664e96")] == ("vma414bbc00005I", None)
    assert len(ibstat) == 10


# --- NCCL topology XML --------------------------------------------------------------------


def test_ndv4_gpu_nic_affinity_and_numa() -> None:
    result = import_nccl_topo(TOPO / "azhpc-nccl-ndv4-topo.xml", ["nd1"])
    assert result.problems == []
    gpus = {e.device: e for e in result.entities if e.kind is EntityKind.GPU}
    # bus-id order: 0001,0002 (NUMA 1), 0003,0004 (NUMA 0), 000b,000c (3), 000d,000e (2)
    assert [gpus[f"gpu{i}"].attrs["pci"] for i in range(8)] == [
        "0001:00:00.0", "0002:00:00.0", "0003:00:00.0", "0004:00:00.0",
        "000b:00:00.0", "000c:00:00.0", "000d:00:00.0", "000e:00:00.0",
    ]  # fmt: skip
    assert [gpus[f"gpu{i}"].numa for i in range(8)] == [1, 1, 0, 0, 3, 3, 2, 2]
    nics = {e.device: e for e in result.entities if e.kind is EntityKind.NIC}
    assert gpus["gpu0"].nic == "nic0" and nics["nic0"].attrs["pci"] == "0101:00:00.0"
    assert gpus["gpu6"].nic == "nic6" and nics["nic6"].attrs["pci"] == "0107:00:00.0"
    assert all(nics[g.nic or ""].gpu == name for name, g in gpus.items())
    assert all(g.attrs["nic_affinity"] == "switch" for g in gpus.values())


def test_ndv5_and_named_nics() -> None:
    names = [f"mlx5_{i}" for i in range(8)]
    result = import_nccl_topo(TOPO / "azhpc-nccl-ndv5-topo.xml", ["h1", "h2"], 5, names)
    gpus = [e for e in result.entities if e.kind is EntityKind.GPU]
    assert len(gpus) == 16 and {e.node for e in gpus} == {"h1", "h2"}
    g3 = next(e for e in gpus if e.id == "gpu:h2/gpu3")
    assert (g3.attrs["pci"], g3.numa, g3.nic, g3.valid_from) == ("0008:00:00.0", 0, "mlx5_3", 5)
    g4 = next(e for e in gpus if e.id == "gpu:h1/gpu4")
    assert (g4.numa, g4.nic) == (1, "mlx5_4")
    with pytest.raises(ConfigError, match="--node"):
        import_nccl_topo(TOPO / "azhpc-nccl-ndv5-topo.xml", [])


def test_ndv2_remote_nic_is_marked() -> None:
    result = import_nccl_topo(TOPO / "azhpc-nccl-ndv2-topo.xml", ["n"])
    gpus = {e.device: e for e in result.entities if e.kind is EntityKind.GPU}
    assert gpus["gpu0"].attrs["nic_affinity"] == "numa"
    assert gpus["gpu7"].attrs["nic_affinity"] == "remote" and gpus["gpu7"].numa == 1


# --- Slurm --------------------------------------------------------------------------------


def test_slurm_tree() -> None:
    result = import_topology_conf(TOPO / "topograph-expected-slurm-tree.conf")
    by = _by_id(result.entities)
    roles = Counter(e.role for e in result.entities if e.kind is EntityKind.SWITCH)
    assert roles == {"leaf": 12, "spine": 6, "core": 1}
    nodes = [e for e in result.entities if e.kind is EntityKind.NODE]
    assert len(nodes) == 96
    assert by["node:srv3205"].switch == "switch.1.6"
    assert by["switch:switch.2.3"].attrs["alias"] == "spine-3"
    assert by["switch:switch.3.1"].attrs["level"] == 3


def test_slurm_block() -> None:
    result = import_topology_conf(TOPO / "topograph-expected-slurm-block.conf")
    by = _by_id(result.entities)
    assert len(by) == 96
    n = by["node:srv4203"]
    assert (n.nvlink_domain, n.attrs["block_alias"], n.attrs["block_sizes"]) == (
        "rack42",
        "nvl-4-2",
        [8, 16, 32],
    )


def test_hostlists_and_errors() -> None:
    assert expand_hostlist("tux[0-2,5],login1") == ["tux0", "tux1", "tux2", "tux5", "login1"]
    assert expand_hostlist("gpu[08-10]") == ["gpu08", "gpu09", "gpu10"]
    with pytest.raises(ConfigError, match="unbalanced"):
        expand_hostlist("tux[0-3")
    with pytest.raises(ConfigError, match="line 1"):
        parse_topology_conf("SwitchName=s0 Nodes=a[3-1]\n")


# --- own file format and jobs -------------------------------------------------------------


def test_topofile_round_trip(tmp_path: Path) -> None:
    doc = {
        "version": 1,
        "valid_from": "2025-03-01T00:00:00Z",
        "switches": [{"name": "leaf-1", "role": "leaf"}],
        "nodes": [
            {
                "name": "n01",
                "rack": "r1",
                "gpus": [{"device": "gpu0", "numa": 0, "nic": "mlx5_0"}],
                "nics": [{"device": "mlx5_0", "rail": 0, "switch": "leaf-1", "switch_port": 7}],
            }
        ],
    }
    ents = entities_from_document(doc)
    by = _by_id(ents)
    assert by["link:n01/mlx5_0/1"].switch_port == "7"
    assert by["gpu:n01/gpu0"].valid_from == parse_time_ns("2025-03-01T00:00:00Z")
    assert by["gpu:n01/gpu0"].valid_from == 1_740_787_200_000_000_000
    f = tmp_path / "t.json"
    f.write_text(json.dumps(dump_document(ents)))
    assert parse_topofile(f) == ents
    with pytest.raises(ConfigError, match=r"nodes\[0\] has no name"):
        entities_from_document({"nodes": [{"rack": "x"}]})


SCONTROL = """JobId=4242 JobName=llm-train
   UserId=alice(1000) GroupId=alice(1000) MCS_label=N/A
   JobState=COMPLETED Reason=None Dependency=(null)
   StartTime=2025-02-23T16:00:00 EndTime=2025-02-23T18:30:00 Deadline=N/A
   NodeList=gpu[01-02] BatchHost=gpu01
   Nodes=gpu[01-02] CPU_IDs=0-63 Mem=0 GRES=gpu:h100:4(IDX:0-3)

JobId=4243 JobName=queued
   UserId=bob(1001) JobState=PENDING StartTime=Unknown EndTime=Unknown NodeList=(null)
"""


def test_scontrol_jobs() -> None:
    jobs, problems = parse_scontrol(SCONTROL)
    (job,) = jobs
    assert (job.job, job.user, job.name, job.nodes) == (
        "4242",
        "alice",
        "llm-train",
        ["gpu01", "gpu02"],
    )
    assert job.start_ns == parse_time_ns("2025-02-23T16:00:00Z")
    assert job.end_ns == job.start_ns + 9000 * 10**9
    assert [(r.rank, r.node, r.gpu) for r in job.ranks][3:5] == [
        (3, "gpu01", "gpu3"),
        (4, "gpu02", "gpu0"),
    ]
    assert problems == ["job 4243: not started (PENDING), skipped"]


def test_jobs_yaml(tmp_path: Path) -> None:
    (job,) = jobs_from_document(
        {"jobs": [{"job": 7, "start": "2025-01-01T00:00:00Z", "nodes": "n[1-2]"}]}
    )
    assert (job.job, job.nodes, job.end_ns) == ("7", ["n1", "n2"], None)
    f = tmp_path / "j.txt"
    f.write_text(SCONTROL)
    assert load_jobs(f)[0][0].job == "4242"


# --- CLI ----------------------------------------------------------------------------------


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    cli.add_parser(sub)
    args = parser.parse_args(argv)
    rc = args.handler(args, RefinerySettings())
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_import_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _run(["topology", "import", "--ibnetdiscover", str(NDR), "--stdout"], capsys)
    assert rc == 0 and err == ""
    lines = out.splitlines()
    assert len(lines) == 40 + 582 + 582 + 532
    first = TopologyEntity.model_validate_json(lines[0])
    assert first.kind is EntityKind.SWITCH and first.source == "ibnetdiscover"
    bad = TOPO / "topograph-ibnetdiscover-example-bad.out"
    rc, out, err = _run(["topology", "import", "--ibnetdiscover", str(bad), "--stdout"], capsys)
    assert rc == 1 and err.count("\n") == 1 and "no port lines" in err


def test_cli_json_document_reimports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    conf = TOPO / "topograph-expected-slurm-tree.conf"
    argv = ["topology", "import", "--slurm", str(conf), "--valid-from", "1000", "--stdout"]
    rc, out, _ = _run([*argv, "--json"], capsys)
    assert rc == 0
    f = tmp_path / "t.json"
    f.write_text(out)
    rc, out2, _ = _run(["topology", "import", "--file", str(f), "--stdout"], capsys)
    ents = [TopologyEntity.model_validate_json(x) for x in out2.splitlines()]
    assert len(ents) == 96 + 19 + 18 and all(e.valid_from == 1000 for e in ents)
    j = tmp_path / "jobs.txt"
    j.write_text(SCONTROL)
    rc, out, err = _run(["jobs", "publish", str(j), "--stdout"], capsys)
    assert rc == 1 and json.loads(out)["job"] == "4242" and "4243" in err
