"""The node exporter against the real fixture trees and against this machine's /proc and /sys.

Trees (unpacked once per session into a temporary directory, never committed):
- prometheus/procfs ``fixtures.ttar``: /proc and /sys (hfi1_0, mlx4_0, mlx5_0, thermal, RAPL)
- prometheus/node_exporter ``sys.ttar``: /sys (i40iw0 "N/A (no PMA)", saturated mlx4_0, hwmon, AER)
- leptonai/gpud H100 tree: 8 ConnectX-7 IB HCAs + the mlx5_bond_0 RoCE bond, as class/infiniband
"""

from __future__ import annotations

import argparse
import json
import shutil
import tarfile
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from lab.ttar import extract
from schemas.catalog import Catalog, default_catalog
from schemas.codec import JSON, decode, encode
from schemas.durations import parse_duration_s
from schemas.wire import SAMPLES_SCHEMA, SourceId
from services.exporters.chrony import parse_tracking
from services.exporters.node import NodeCollector, bench_scrape, collect_node, node_source
from services.exporters.node_cli import add_parser
from services.exporters.nvml import NvmlCollector
from services.exporters.procfs import SampleBuffer
from services.settings import RefinerySettings

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
SYSFS_PROCFS = FIXTURES / "real-data" / "sysfs-procfs"
H100_HCAS = {f"mlx5_{i}" for i in (0, 1, 4, 5, 6, 7, 8, 9)}


def _ttar_extract(archive: Path, dest: Path) -> None:
    extract(archive, dest)


@pytest.fixture(scope="session")
def trees(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("real-trees")
    _ttar_extract(SYSFS_PROCFS / "procfs-fixtures.ttar", root / "procfs")
    _ttar_extract(SYSFS_PROCFS / "node_exporter-sys.ttar", root / "ne")
    with tarfile.open(SYSFS_PROCFS / "gpud-sys-class-infiniband-h100.tar.gz") as tf:
        tf.extractall(root / "h100-raw", filter="data")
    (root / "h100" / "sys" / "class").mkdir(parents=True)
    shutil.move(
        root / "h100-raw" / "sys-class-infiniband-h100",
        root / "h100" / "sys" / "class" / "infiniband",
    )
    return {
        "proc": root / "procfs" / "fixtures" / "proc",
        "procfs_sys": root / "procfs" / "fixtures" / "sys",
        "ne_sys": root / "ne" / "sys",
        "h100_sys": root / "h100" / "sys",
    }


@pytest.fixture(scope="session")
def cat() -> Catalog:
    return default_catalog()


Rows = dict[tuple[str, str], dict[str, Any]]


def _rows(table: pa.Table) -> Rows:
    return {(r["metric"], r["device"]): r for r in table.to_pylist()}


@pytest.fixture(scope="session")
def h100(trees: dict[str, Path], cat: Catalog) -> Rows:
    return _rows(collect_node(trees["proc"], trees["h100_sys"], now_ns=1, catalog=cat))


@pytest.fixture(scope="session")
def ne(trees: dict[str, Path], cat: Catalog) -> Rows:
    return _rows(collect_node(trees["proc"], trees["ne_sys"], now_ns=1, catalog=cat))


@pytest.fixture(scope="session")
def pf(trees: dict[str, Path], cat: Catalog) -> Rows:
    return _rows(collect_node(trees["proc"], trees["procfs_sys"], now_ns=1, catalog=cat))


def _raw(rows: Rows, metric: str, device: str) -> int:
    r = rows[(metric, device)]
    assert r["value"] == float(r["raw"]) and r["text"] is None
    return int(r["raw"])


# --- H100: 8 IB HCAs + RoCE bond ------------------------------------------------------------


def test_h100_every_hca_and_the_bond(h100: Rows) -> None:
    ib_devices = {d for (m, d) in h100 if m.startswith("ib.")}
    rdma_devices = {d for (m, d) in h100 if m.startswith("rdma.")}
    expected = {f"{h}/1" for h in H100_HCAS} | {"mlx5_bond_0/1"}
    assert ib_devices == expected
    assert rdma_devices == expected
    assert sum(1 for (m, _) in h100 if m.startswith("ib.")) == 9 * (21 + 3)  # + state, rate
    assert sum(1 for (m, _) in h100 if m.startswith("rdma.")) == 9 * 26


def test_h100_exact_raw_values(h100: Rows, trees: dict[str, Path]) -> None:
    path = trees["h100_sys"] / "class/infiniband/mlx5_0/ports/1/counters/port_rcv_data"
    assert not path.read_bytes().endswith(b"\n")  # gpud files have no trailing newline
    assert _raw(h100, "ib.port_rcv_data", "mlx5_0/1") == 230539874932483
    assert _raw(h100, "ib.port_xmit_wait", "mlx5_0/1") == 2489603687
    assert _raw(h100, "ib.link_downed", "mlx5_1/1") == 255
    assert _raw(h100, "rdma.rx_write_requests", "mlx5_bond_0/1") == 3809045607
    assert _raw(h100, "rdma.rx_read_requests", "mlx5_bond_0/1") == 9187392
    assert _raw(h100, "rdma.rx_dct_connect", "mlx5_bond_0/1") == 422237
    assert _raw(h100, "rdma.roce_adp_retrans", "mlx5_bond_0/1") == 3
    assert h100[("ib.port_state", "mlx5_bond_0/1")]["value"] == 4.0  # "4: ACTIVE"
    assert h100[("ib.rate", "mlx5_0/1")]["value"] == 400.0  # "400 Gb/sec (4X NDR)"
    assert h100[("ib.rate", "mlx5_bond_0/1")]["value"] == 200.0
    assert h100[("ib.phys_state", "mlx5_4/1")]["raw"] is None


# --- node_exporter sys tree: traps ----------------------------------------------------------


def test_no_pma_sentinel_is_text_with_null_value(ne: Rows) -> None:
    states = {"ib.port_state", "ib.phys_state", "ib.rate"}
    rows = {m: r for (m, d), r in ne.items() if d == "i40iw0/1" and m not in states}
    assert len(rows) == 17
    for r in rows.values():
        assert (r["value"], r["raw"], r["text"]) == (None, None, "N/A (no PMA)")


def test_saturated_xmit_wait_and_64_bit_packets(ne: Rows) -> None:
    assert _raw(ne, "ib.port_xmit_wait", "mlx4_0/1") == 4294967295
    assert _raw(ne, "ib.port_rcv_data", "mlx4_0/1") == 4631917
    assert _raw(ne, "ib.port_rcv_packets", "mlx4_0/1") == 6825908347  # > 2**32
    assert _raw(ne, "ib.port_xmit_discards", "mlx4_0/1") == 5
    assert _raw(ne, "ib.port_rcv_data_64", "mlx4_0/2") == 4631917
    assert _raw(ne, "ib.port_unicast_xmit_packets", "mlx4_0/1") == 61239


def test_hwmon_thermal_aer_nvme(ne: Rows) -> None:
    assert ne[("hwmon.temp", "hwmon0/temp1")]["value"] == 55000.0  # m°C as read
    assert ne[("hwmon.temp_crit", "hwmon0/temp1")]["value"] == 100000.0
    assert ne[("hwmon.fan_speed", "hwmon3/fan2")]["value"] == 1098.0
    assert ne[("hwmon.voltage", "hwmon3/in0")]["value"] == 792.0
    assert ne[("hwmon.freq", "hwmon4/freq1")]["value"] == 214000000.0
    assert not any(d.startswith("hwmon5/") for (_, d) in ne)  # "bogus" sensors are skipped
    assert ne[("thermal.zone_temp", "thermal_zone0")]["value"] == 12376.0
    assert _raw(ne, "pcie.aer_correctable_total", "0000:45:00.0") == 0
    assert _raw(ne, "pcie.aer_fatal", "0000:45:00.0/PoisonTLPBlocked") == 0
    assert ne[("nvme.state", "nvme0")]["value"] == 2.0  # "live"


# --- procfs fixture tree --------------------------------------------------------------------


def test_procfs_ib_values(pf: Rows) -> None:
    assert _raw(pf, "ib.port_xmit_data", "mlx5_0/1") == 2880761508848
    assert _raw(pf, "ib.port_xmit_packets", "mlx5_0/1") == 10907922116
    assert _raw(pf, "ib.port_rcv_data", "hfi1_0/1") == 345091702026
    assert _raw(pf, "ib.port_xmit_wait", "mlx4_0/1") == 3599
    assert _raw(pf, "rdma.out_of_sequence", "mlx5_0/1") == 1
    assert _raw(pf, "rdma.req_cqe_error", "mlx5_0/1") == 3481
    assert _raw(pf, "rdma.rx_read_requests", "mlx5_0/1") == 175528982
    assert pf[("rdma.lifespan", "mlx5_0/1")]["value"] == 10.0  # a gauge, not a counter
    assert pf[("rdma.lifespan", "mlx5_0/1")]["raw"] is None


def test_procfs_host_values(pf: Rows) -> None:
    assert _raw(pf, "cpu.user_seconds", "all") == 301854
    assert _raw(pf, "cpu.idle_seconds", "all") == 8979004
    assert _raw(pf, "cpu.user_seconds", "cpu0") == 44490
    assert _raw(pf, "cpu.context_switches", "node") == 38014093
    assert _raw(pf, "cpu.forks", "node") == 26442
    assert pf[("cpu.boot_time", "node")]["value"] == 1418183276.0
    assert pf[("cpu.procs_blocked", "node")]["value"] == 1.0
    assert pf[("cpu.load15", "node")]["value"] == 0.05
    assert pf[("mem.total_bytes", "node")]["value"] == 15666184.0  # kB; catalog scale 1024
    assert pf[("mem.hugepages_total", "node")]["value"] == 0.0
    assert pf[("psi.io_some_avg10", "node")]["value"] == 0.10
    assert pf[("psi.io_full_avg300", "node")]["value"] == 4.95
    assert _raw(pf, "psi.io_full_seconds", "node") == 25
    assert _raw(pf, "net.rx_bytes", "lo") == 1664039048
    assert _raw(pf, "net.tx_packets", "eth0") == 732147
    assert _raw(pf, "nvme.reads", "nvme0n1") == 47114
    assert _raw(pf, "nvme.write_bytes", "nvme0n1") == 39451633  # sectors; catalog scale 512
    assert ("nvme.reads", "nvme0n1p1") not in pf  # partitions are already in the namespace


def test_negative_readings_survive(pf: Rows) -> None:
    assert pf[("thermal.zone_temp", "thermal_zone1")]["value"] == -44000.0
    assert pf[("thermal.cooling_state", "cooling_device2")]["value"] == -1.0  # intel_powerclamp
    assert ("thermal.cooling_state", "cooling_device1") not in pf  # TFN1 has no cur_state
    assert _raw(pf, "power.rapl_energy", "intel-rapl:0") == 240422366267
    assert pf[("power.rapl_max_energy", "intel-rapl:0")]["value"] == 262143328850.0


def test_every_row_resolves_in_the_catalog(trees: dict[str, Path], cat: Catalog) -> None:
    for sys in ("procfs_sys", "ne_sys", "h100_sys"):
        t = collect_node(trees["proc"], trees[sys], now_ns=5, catalog=cat)
        assert t.schema.equals(SAMPLES_SCHEMA)
        for name in set(t.column("metric").to_pylist()):
            assert name in cat and cat[name].name == name
        assert set(t.column("ts_ns").to_pylist()) == {5}


# --- this machine ---------------------------------------------------------------------------


def test_this_machine(cat: Catalog) -> None:
    t = collect_node(Path("/proc"), Path("/sys"), now_ns=7, catalog=cat)
    rows = _rows(t)
    assert t.schema.equals(SAMPLES_SCHEMA)
    cpus = {d for (m, d) in rows if m == "cpu.user_seconds"}
    assert "all" in cpus and "cpu0" in cpus
    assert rows[("mem.total_bytes", "node")]["value"] > 0
    assert all(name in cat for name in t.column("metric").to_pylist())
    assert node_source(Path("/proc")).boot_id != "unknown"


def test_collector_tiers_seq_and_json_roundtrip(trees: dict[str, Path], cat: Catalog) -> None:
    c = NodeCollector(trees["proc"], trees["ne_sys"], catalog=cat, slow_every=3)
    first, second = c.scrape(1), c.scrape(2)
    slow = {m for m in first.column("metric").to_pylist()} - set(
        second.column("metric").to_pylist()
    )
    assert "pcie.aer_correctable_total" in slow and "nvme.state" in slow
    src = node_source(trees["proc"], node="n1")
    assert src == SourceId(node="n1", exporter="node", instance="0", boot_id="unknown")
    e0 = c.envelope(src, sent_ns=10)
    e1 = c.envelope(src, sent_ns=11)
    assert e1.seq == e0.seq + 1 and e0.seq > 1_700_000_000_000_000 and e0.clock is None
    ct, body = encode(e1, first, JSON)
    batch = decode(body, ct)
    assert batch.table.equals(first)
    got = _rows(batch.table)[("ib.port_xmit_wait", "mlx4_0/1")]
    assert got["raw"] == 4294967295


def test_cli_once_stdout_prints_one_json_batch(
    trees: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser(prog="refinery")
    add_parser(parser.add_subparsers(dest="command"))
    argv = ["export", "node", "--once", "--stdout", "--no-gpu", "--no-clock", "--node", "h100"]
    args = parser.parse_args(
        [*argv, "--procfs", str(trees["proc"]), "--sysfs", str(trees["h100_sys"])]
    )
    assert args.handler(args, RefinerySettings()) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1
    doc = json.loads(lines[0])
    assert doc["source"]["node"] == "h100" and doc["seq"] > 1_700_000_000_000_000
    batch = decode(lines[0].encode(), JSON)
    rows = _rows(batch.table)
    assert rows[("ib.port_rcv_data", "mlx5_0/1")]["raw"] == 230539874932483
    assert parse_duration_s("1s") == 1.0 and parse_duration_s("250ms") == 0.25


# --- NVML and chrony ------------------------------------------------------------------------


def test_nvml_absent_is_a_clean_empty_result() -> None:
    missing = NvmlCollector(module="no_such_nvml_module")
    assert not missing.available and missing.reason and "not installed" in missing.reason
    buf = SampleBuffer()
    missing.collect(1, buf)
    assert len(buf) == 0
    real = NvmlCollector()  # pynvml may be installed; without a driver it reports why
    if not real.available:
        assert real.reason
        real.collect(1, buf)
        assert len(buf) == 0
    real.close()


CHRONY_TEXT = """Reference ID    : CB00710F (foo.example.net)
Stratum         : 3
Ref time (UTC)  : Fri Jan 27 09:49:17 2017
System time     : 0.000006523 seconds slow of NTP time
Last offset     : -0.000006747 seconds
RMS offset      : 0.000035822 seconds
Frequency       : 3.225 ppm slow
Residual freq   : -0.000 ppm
Skew            : 0.129 ppm
Root delay      : 0.013639022 seconds
Root dispersion : 0.001100737 seconds
Update interval : 64.2 seconds
Leap status     : Normal
"""
CHRONY_CSV = (
    "CB00710F,foo.example.net,3,1485510557.000000000,-0.000006523,-0.000006747,0.000035822,"
    "3.225,-0.000,0.129,0.013639022,0.001100737,64.2,Normal\n"
)


def test_chrony_text_and_csv_agree() -> None:
    a, b = parse_tracking(CHRONY_TEXT), parse_tracking(CHRONY_CSV)
    assert a is not None and a == b
    block = a.clock_block()
    assert block.offset_ns == -6523  # "slow of NTP time": local minus reference is negative
    assert block.stratum == 3 and block.reference == "foo.example.net"
    assert block.state.value == "synced"
    assert block.error_bound_ns == round((0.000006523 + 0.001100737 + 0.013639022 / 2) * 1e9)
    unsynced = parse_tracking(CHRONY_CSV.replace("Normal", "Not synchronised"))
    assert unsynced is not None and unsynced.clock_block().state.value == "unsynced"
    assert parse_tracking("") is None and parse_tracking("garbage") is None
    buf = SampleBuffer(default_catalog())
    a.add_samples(1, buf)
    assert buf.metric[0] == "clock.offset_ns" and buf.value[0] == -6523.0 and not buf.unknown


# --- cost -----------------------------------------------------------------------------------


def test_bench_scrape_h100(trees: dict[str, Path]) -> None:
    r = bench_scrape(trees["proc"], trees["h100_sys"], 20)
    print(f"node exporter, H100 tree: {r['cpu_s_per_scrape'] * 1e3:.2f} ms CPU per scrape")
    assert r["rows_per_scrape"] > 500
    assert 0 < r["cpu_s_per_scrape"] < 0.05


def test_open_files_see_new_readings_and_survive_removal(
    trees: dict[str, Path], cat: Catalog, tmp_path: Path
) -> None:
    src = trees["h100_sys"] / "class/infiniband/mlx5_0"
    hca = tmp_path / "sys/class/infiniband/mlx5_0"
    shutil.copytree(src, hca)
    # 8 held descriptors: the first 8 counter files in name order, port_rcv_data among them
    # (re-read with pread); symbol_error is past the cap and opened per read
    c = NodeCollector(trees["proc"], tmp_path / "sys", catalog=cat, max_open_files=8)
    first = _rows(c.scrape(1))
    assert first[("ib.port_rcv_data", "mlx5_0/1")]["raw"] == 230539874932483
    counters = hca / "ports/1/counters"
    (counters / "port_rcv_data").write_bytes(b"230539874932999")  # same inode, new reading
    (counters / "symbol_error").unlink()  # a file that vanishes between scrapes
    second = _rows(c.scrape(2))
    assert second[("ib.port_rcv_data", "mlx5_0/1")]["raw"] == 230539874932999
    # the rate file is in the slow tier: read on the first scrape only
    assert set(first) - set(second) == {("ib.symbol_error", "mlx5_0/1"), ("ib.rate", "mlx5_0/1")}
    c.close()
