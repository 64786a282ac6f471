"""The metric catalog (schemas/catalog/*.yaml) against the real fixtures it must cover.

File-name and DCGM-field lists are derived from the fixtures here, never hard-coded: every
counter file under ports/*/{counters,counters_ext,hw_counters} in the three real sysfs trees and
every DCGM field (commented-out lines included) in dcgm-exporter's CSVs must resolve.
"""

from __future__ import annotations

import re
import tarfile
from pathlib import Path

import pytest

from schemas.catalog import Catalog, Kind, Overflow, load_catalog

REPO = Path(__file__).resolve().parents[2]
REAL = REPO / "tests" / "fixtures" / "real-data"
SYSFS_DIR = REAL / "sysfs-procfs"
GPU_DIR = REAL / "gpu"
_COUNTER_PATH = re.compile(
    r"class/infiniband/[^/]+/ports/\d+/(counters|counters_ext|hw_counters)/([^/\s]+)$"
)


@pytest.fixture(scope="module")
def cat() -> Catalog:
    return load_catalog()


def _ib_files() -> set[tuple[str, str]]:
    """(group, file name) of every IB counter file in the three real trees."""
    found: set[tuple[str, str]] = set()
    for ttar in ("procfs-fixtures.ttar", "node_exporter-sys.ttar"):
        for line in (SYSFS_DIR / ttar).read_text(errors="replace").splitlines():
            if line.startswith("Path: "):
                m = _COUNTER_PATH.search(line[6:])
                if m:
                    found.add((m.group(1), m.group(2)))
    with tarfile.open(SYSFS_DIR / "gpud-sys-class-infiniband-h100.tar.gz") as tf:
        for name in tf.getnames():
            m = re.search(r"/ports/\d+/(counters|counters_ext|hw_counters)/([^/]+)$", name)
            if m:
                found.add((m.group(1), m.group(2)))
    return found


def _dcgm_fields() -> set[str]:
    fields: set[str] = set()
    for csv in ("dcgm-exporter-default-counters.csv", "dcgm-exporter-dcp-metrics-included.csv"):
        for line in (GPU_DIR / csv).read_text().splitlines():
            m = re.match(r"^#?\s*(DCGM_(?:FI|EXP)_[A-Z0-9_]+)\s*,", line)
            if m:
                fields.add(m.group(1))
    return fields


def _metric_for(group: str, name: str) -> str:
    return ("rdma." if group == "hw_counters" else "ib.") + name.lower()


def test_loads_with_unique_names_and_aliases(cat: Catalog) -> None:
    names = [m.name for m in cat]
    assert len(names) == len(set(names)) == len(cat)
    assert len(cat) > 300
    aliases = [a for m in cat for a in m.aliases]
    assert len(aliases) == len(set(aliases))
    assert not set(aliases) & set(names)


def test_every_counter_has_width_and_overflow(cat: Catalog) -> None:
    for m in cat:
        if m.kind is Kind.COUNTER:
            assert m.width in (8, 16, 32, 64), m.name
            assert m.overflow in (Overflow.WRAP, Overflow.SATURATE), m.name
        else:
            assert m.width is None and m.overflow is None, m.name


def test_names_follow_domain_convention(cat: Catalog) -> None:
    domains = {"gpu", "ib", "rdma", "nic", "cpu", "mem", "psi", "net", "pcie", "thermal"}
    domains |= {"hwmon", "nvme", "bmc", "power", "clock"}
    # block devices, file systems, the OS beyond cpu/mem, the exporters' self-telemetry
    domains |= {"disk", "fs", "host", "exporter"}
    for m in cat:
        assert m.name == m.name.lower()
        assert m.name.split(".")[0] in domains, m.name


def test_required_names_exist(cat: Catalog) -> None:
    required_text = """gpu.sm_clock gpu.mem_clock gpu.temp gpu.mem_temp gpu.power gpu.energy
    gpu.util
    gpu.mem_copy_util gpu.fb_used gpu.fb_free gpu.clock_event_reasons gpu.pcie_replay gpu.xid
    gpu.power_violation gpu.thermal_violation gpu.ecc_sbe_volatile gpu.ecc_dbe_volatile
    gpu.nvlink_bandwidth gpu.remapped_rows_correctable gpu.remapped_rows_uncorrectable
    ib.port_rcv_data ib.port_xmit_data ib.port_rcv_packets ib.port_xmit_packets ib.port_xmit_wait
    ib.link_downed ib.symbol_error ib.port_rcv_errors ib.port_xmit_discards ib.link_error_recovery
    rdma.np_cnp_sent rdma.rp_cnp_handled rdma.rp_cnp_ignored rdma.np_ecn_marked_roce_packets
    rdma.out_of_sequence rdma.out_of_buffer cpu.user_seconds cpu.system_seconds cpu.idle_seconds
    cpu.iowait_seconds mem.total_bytes mem.available_bytes clock.offset_ns
    nic.rx_prio_bytes nic.rx_prio_packets nic.tx_prio_bytes nic.tx_prio_packets nic.rx_prio_pause
    nic.rx_prio_pause_duration nic.rx_prio_pause_transition nic.tx_prio_pause
    nic.tx_prio_pause_duration nic.rx_prio_discards nic.rx_prio_buf_discard nic.rx_pause_ctrl_phy
    nic.tx_pause_ctrl_phy nic.rx_discards_phy nic.tx_discards_phy nic.rx_bytes_phy nic.tx_bytes_phy
    nic.tx_pause_storm_warning_events nic.tx_pause_storm_error_events nic.rx_out_of_buffer
    bmc.temperature bmc.power bmc.fan_speed bmc.fan_percent"""
    required = required_text.split()
    missing = [n for n in required if n not in cat or cat[n].name != n]
    assert missing == []
    assert cat["gpu.xid"].kind is Kind.EVENT
    assert cat["gpu.energy"].unit == "mJ" and cat["gpu.energy"].kind is Kind.COUNTER
    assert cat["nic.rx_prio_pause_duration"].unit == "us"


def test_every_real_ib_counter_file_resolves(cat: Catalog) -> None:
    files = _ib_files()
    groups = {g for g, _ in files}
    assert groups == {"counters", "counters_ext", "hw_counters"}
    assert len(files) > 50
    for group, name in sorted(files):
        m = cat[_metric_for(group, name)]
        assert m.origin.sysfs is not None and m.origin.sysfs.endswith(f"/{group}/{name}")
        assert "N/A (no PMA)" in m.sentinel_texts


def test_roce_congestion_counters_are_64_bit(cat: Catalog) -> None:
    for n in ("np_cnp_sent", "rp_cnp_handled", "rp_cnp_ignored", "np_ecn_marked_roce_packets"):
        m = cat[f"rdma.{n}"]
        assert (m.kind, m.width, m.overflow) == (Kind.COUNTER, 64, Overflow.WRAP)
    # mlx5 Q counters are read as be32: 32-bit, wrapping
    for n in ("out_of_sequence", "out_of_buffer", "rx_write_requests", "local_ack_timeout_err"):
        assert (cat[f"rdma.{n}"].width, cat[f"rdma.{n}"].overflow) == (32, Overflow.WRAP)


def test_ib_widths_follow_the_pma(cat: Catalog) -> None:
    m = cat["ib.port_rcv_data"]
    assert (m.unit, m.kind, m.width, m.scale) == ("B", Kind.COUNTER, 64, 4.0)
    assert cat["ib.port_xmit_data_64"].scale == 4.0
    xw = cat["ib.port_xmit_wait"]
    assert (xw.width, xw.overflow, xw.max_raw) == (32, Overflow.SATURATE, 4294967295)
    assert (cat["ib.link_downed"].width, cat["ib.link_downed"].max_raw) == (8, 255)
    assert cat["ib.symbol_error"].width == 16
    for name in (
        "ib.link_downed",
        "ib.symbol_error",
        "ib.port_rcv_errors",
        "ib.port_xmit_discards",
    ):
        assert cat[name].overflow is Overflow.SATURATE


def test_every_dcgm_csv_field_resolves(cat: Catalog) -> None:
    fields = _dcgm_fields()
    assert "DCGM_FI_DEV_POWER_VIOLATION" in fields  # a commented-out line was read
    assert len(fields) >= 60
    for f in sorted(fields):
        m = cat[f]
        assert m.origin.dcgm_field == f or f in m.aliases
        if f.startswith("DCGM_FI_"):
            assert m.origin.dcgm_id is not None, f


def test_dcgm_ids_and_blank_sentinels(cat: Catalog) -> None:
    assert cat["DCGM_FI_DEV_SM_CLOCK"].origin.dcgm_id == 100
    assert cat["DCGM_FI_DEV_GPU_TEMP"].name == "gpu.temp"
    assert cat["gpu.temp"].origin.dcgm_id == 150
    assert cat["DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL"].origin.dcgm_id == 449
    assert cat["DCGM_FI_PROF_PCIE_RX_BYTES"].origin.dcgm_id == 1010
    mem_temp = cat["DCGM_FI_DEV_MEMORY_TEMP"]
    # the README's exposition reads 9223372036854775794 (INT64 NOT_SUPPORTED) for memory temp
    assert float(9223372036854775794) in mem_temp.sentinels
    assert float(2147483632) in mem_temp.sentinels  # DCGM_INT32_BLANK
    assert 140737488355328.0 in mem_temp.sentinels  # DCGM_FP64_BLANK
    assert "<<<NOT_SUPPORTED>>>" in mem_temp.sentinel_texts


def test_clock_event_reasons_bit_table(cat: Catalog) -> None:
    m = cat["DCGM_FI_DEV_CLOCK_THROTTLE_REASONS"]
    assert m.name == "gpu.clock_event_reasons" and m.kind is Kind.BITMASK
    # 0x48 = bit 3 (HW_SLOWDOWN) + bit 6 (HW_THERMAL); SW_THERMAL is 0x20, not in 0x48
    assert m.decode_bits(0x48) == ["HW_SLOWDOWN", "HW_THERMAL"]
    assert m.decode_bits(0x20) == ["SW_THERMAL"]
    assert m.decode_bits(0x1) == ["GPU_IDLE"]
    assert len(m.decode_bits(0x1FF)) == 9  # clocks_event_reasons.supported on H100
    assert m.decode_bits(0) == []


def test_valid_ranges_where_physics_gives_one(cat: Catalog) -> None:
    for name in ("gpu.util", "gpu.mem_copy_util", "gpu.fan_speed", "psi.io_some_avg10"):
        assert (cat[name].valid_min, cat[name].valid_max) == (0, 100), name
    for name in ("gpu.temp", "gpu.mem_temp", "thermal.zone_temp", "hwmon.temp", "bmc.temperature"):
        assert cat[name].valid_min is not None and cat[name].valid_max is not None, name
    assert cat["gpu.sm_clock"].valid_min == 0
    # the procfs fixture's acpitz zone reads -44000 m°C: a plausible-enough reading stays valid
    assert cat["thermal.zone_temp"].valid_min is not None
    assert -44000 * cat["thermal.zone_temp"].scale >= cat["thermal.zone_temp"].valid_min


def test_units_documented_and_scales_positive(cat: Catalog) -> None:
    for m in cat:
        assert m.unit and m.scale > 0, m.name
    assert cat["cpu.user_seconds"].scale == 0.01
    assert cat["mem.total_bytes"].scale == 1024.0
    assert cat["psi.cpu_some_seconds"].scale == 1e-6


def test_catalog_unmapped_names_every_unmapped_metric_and_why_records_were_rejected() -> None:
    """``refinery catalog unmapped`` lists every name a topic carries that maps to nothing,
    however many (node_exporter's own e2e exposition enables collectors that are off by
    default: hundreds of names), and counts records rejected whole by why."""
    from collections import Counter

    from schemas.ingest import Format, IngestDecoder, Position
    from services.catalog_cli import unmapped_names

    body = (SYSFS_DIR / "node_exporter-e2e-output.txt").read_bytes()
    table = (
        IngestDecoder({"t": "prometheus"}).decode("t", body, None, Position(0, 0, 1, b"n")).table
    )
    cat = load_catalog()
    expected = Counter(m for m in table["metric"].to_pylist() if m not in cat)
    assert len(expected) > 100
    lp = b"cpu,cpu=cpu0 usage_user=1 1"  # no host tag and no key: rejected whole
    records = [(body, None, 0, 0, b"n"), (lp, None, 0, 1, None)]
    why: Counter[str] = Counter()
    counts, devices, bad = unmapped_names(records[:1], Format.PROMETHEUS, "t", why)
    assert counts == expected and set(devices) == set(expected) and bad == 0
    counts, _, bad = unmapped_names(records[1:], Format.INFLUX, "t", why)
    assert bad == 1 and not counts
    ((detail, n),) = why.items()
    assert n == 1 and detail.startswith("bad_envelope: no host identity") and "host tag" in detail
