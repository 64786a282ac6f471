"""Firmware exporter: ethtool -S, Redfish (real DMTF mockup over local HTTPS), kernel-log XIDs."""

from __future__ import annotations

import argparse
import base64
import json
import shutil
import ssl
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from schemas.durations import parse_duration_s
from schemas.wire import EVENTS_SCHEMA, SAMPLES_SCHEMA
from services.exporters import firmware_cli
from services.exporters.ethtool import EthtoolError, EthtoolSource, parse_ethtool_stats
from services.exporters.firmware import FirmwareExporter, FirmwareSource, KernelLogSource
from services.exporters.kmsg import (
    boot_time_ns,
    load_gpu_map,
    normalize_pci,
    parse_dmesg,
    parse_kmsg,
)
from services.exporters.redfish import RedfishSource
from services.exporters.redfish_client import RedfishClient, RedfishError
from services.settings import RefinerySettings

REAL = Path("tests/fixtures/real-data")
ETH0 = REAL / "ethtool/node_exporter-fixtures/eth0/statistics"
BOND0 = REAL / "ethtool/node_exporter-fixtures/bond0/statistics"
MLX5 = Path("tests/fixtures/synthetic/mlx5-ethtool-S-synthetic.txt")
MOCKUP = REAL / "redfish/public-tower"
DMESG = REAL / "logs/gpud-dmesg-with-xid-119.log"
KMSG = REAL / "logs/gpud-kmsg.1.log"


# --- ethtool ------------------------------------------------------------------------------


def test_mlx5_per_priority_counters() -> None:
    stats = parse_ethtool_stats(MLX5.read_text(), "ens1f0np0", 7)
    assert stats.table.schema == SAMPLES_SCHEMA
    rows = {(r["metric"], r["device"]): r for r in stats.table.to_pylist()}
    p3 = rows[("nic.rx_prio_pause", "ens1f0np0/prio3")]
    assert (p3["raw"], p3["value"], p3["ts_ns"]) == (120456, 120456.0, 7)
    assert rows[("nic.rx_prio_pause_duration", "ens1f0np0/prio3")]["raw"] == 98123456
    assert rows[("nic.tx_prio_pause_duration", "ens1f0np0/prio3")]["raw"] == 27001234
    assert rows[("nic.rx_prio_bytes", "ens1f0np0/prio3")]["raw"] == 2199133533323
    assert rows[("nic.rx_prio_buf_discard", "ens1f0np0/prio3")]["raw"] == 1
    assert rows[("nic.rx_out_of_buffer", "ens1f0np0")]["raw"] == 17
    assert rows[("nic.tx_pause_storm_warning_events", "ens1f0np0")]["raw"] == 2
    assert len(rows) == 24
    # per-queue and generic counters are not in the catalog passed in: skipped and counted
    assert "rx0_packets" in stats.skipped and len(stats.skipped) == 8
    with_catalog = parse_ethtool_stats(MLX5.read_text(), "ens1f0np0", 7, {"nic.rx_packets"})
    assert with_catalog.table.num_rows == 25


def test_node_exporter_traps() -> None:
    stats = parse_ethtool_stats(ETH0.read_text(), "eth0", 1, {"nic.port_rx_dropped"})
    (row,) = stats.table.to_pylist()  # dotted name sanitised, the rest not in the catalog
    assert (row["metric"], row["device"], row["raw"]) == ("nic.port_rx_dropped", "eth0", 12028)
    assert stats.collisions == ["duplicate_metric"]  # "duplicate metric: 1" came first
    assert "duplicate_metric" in stats.skipped
    with pytest.raises(EthtoolError, match=r"errno 1 \(EPERM\)"):
        parse_ethtool_stats(BOND0.read_text(), "bond0", 1)
    # the settings file's stray "netlink error" line is not a counter
    junk = (REAL / "ethtool/node_exporter-fixtures/eth0/settings").read_text()
    assert parse_ethtool_stats(junk, "eth0", 1).table.num_rows == 0


def test_roce_congestion_names_map_to_rdma() -> None:
    text = "NIC statistics:\n     np_cnp_sent: 5\n     rp_cnp_handled: 4\n"
    rows = parse_ethtool_stats(text, "ib0", 1).table.to_pylist()
    assert [(r["metric"], r["raw"]) for r in rows] == [
        ("rdma.np_cnp_sent", 5),
        ("rdma.rp_cnp_handled", 4),
    ]


# --- kernel log ---------------------------------------------------------------------------


def test_dmesg_xid_119() -> None:
    t = parse_dmesg(DMESG.read_text(), {normalize_pci("00000000:9B:00.0"): "gpu4"})
    assert t.schema == EVENTS_SCHEMA
    rows = t.to_pylist()
    assert len(rows) == 5 and {r["code"] for r in rows} == {119}
    first = rows[0]
    assert (first["event"], first["device"], first["severity"]) == ("xid", "gpu4", "critical")
    assert first["ts_ns"] == 1740327858 * 10**9  # Sun Feb 23 16:24:18 2025, UTC
    assert first["message"].startswith("[Sun Feb 23 16:24:18 2025] NVRM: Xid (PCI:0000:9b:00)")
    attrs = json.loads(first["attrs"])
    assert (attrs["pci"], attrs["pid"], attrs["name"]) == ("0000:9b:00", 2024380, "nvidia-smi")
    assert [json.loads(r["attrs"])["name"] for r in rows] == [
        "nvidia-smi", "nvidia-smi", "nvidia-smi", "cache_mgr_main", "gpud",
    ]  # fmt: skip
    unmapped = parse_dmesg(DMESG.read_text()).to_pylist()[0]
    assert unmapped["device"] == "pci:0000:9b:00"


def test_kmsg_records_and_link_events() -> None:
    boot = boot_time_ns("cpu  1 2 3\nbtime 1740300000\n")
    rows = parse_kmsg(KMSG.read_text(), boot_ns=boot).to_pylist()
    assert len(rows) == 27 and {r["event"] for r in rows} == {"link_up"}
    first = rows[0]  # 6,3973,227986636,-;IPv6: ADDRCONF(NETDEV_CHANGE): eth0: link becomes ready
    assert (first["device"], first["ts_ns"]) == ("eth0", boot + 227986636 * 1000)
    assert sum(r["device"] == "eth0" for r in rows) == 11
    gpus = load_gpu_map("0, 00000000:9B:00.0\n1, 00000000:1B:00.0\n")
    assert gpus == {"0000:9b:00": "gpu0", "0000:1b:00": "gpu1"}
    rec = "3,9001,5000000,-;NVRM: Xid (PCI:0000:1b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."  # noqa: E501
    (xid,) = parse_kmsg(rec, gpus, boot_ns=0).to_pylist()
    assert (xid["device"], xid["code"], xid["ts_ns"]) == ("gpu1", 79, 5_000_000_000)
    assert json.loads(xid["attrs"])["pid"] is None


# --- Redfish over HTTPS -------------------------------------------------------------------


class _Mockup(BaseHTTPRequestHandler):
    """Serves the DSP2043 mockup tree: ``<path>/index.json``; basic auth u:p required."""

    def do_GET(self) -> None:
        if self.headers.get("Authorization") != "Basic " + base64.b64encode(b"u:p").decode():
            self.send_response(401)
            self.end_headers()
            return
        rel = self.path.split("?", 1)[0].strip("/")
        f = MOCKUP / rel / "index.json"
        if ".." in rel or not f.is_file():
            self.send_response(404)
            self.end_headers()
            return
        body = f.read_bytes()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def bmc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a self-signed certificate")
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
         "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Mockup)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"https://127.0.0.1:{srv.server_address[1]}", str(cert)
    srv.shutdown()
    srv.server_close()


def test_redfish_sensors_prefer_and_absent(bmc: tuple[str, str]) -> None:
    url, ca = bmc
    src = RedfishSource(RedfishClient(url, "u", "p", ca_file=ca, clock=lambda: 10**18))
    r = src.collect(42)
    rows = {(x["metric"], x["device"]): x for x in r.samples.to_pylist()}
    assert rows[("bmc.temperature", "Tower/CPU1Temp")]["value"] == 37.0  # Sensors, not 41
    assert rows[("bmc.power", "Tower/TotalPower")]["value"] == 374.0  # not Power's 926
    assert rows[("bmc.fan_percent", "Tower/CPUFan1")]["value"] == 80.0
    assert rows[("bmc.fan_speed", "Tower/fan/Bay1")]["value"] == 2200.0
    energy = rows[("bmc.energy", "Tower/PS1Energy")]
    assert (energy["value"], energy["raw"]) == (7855.0, None)  # kWh, a gauge in the catalog
    assert rows[("bmc.voltage", "Tower/PS1InputVoltage")]["value"] == 119.27
    # 11 PS2* sensors are "State": "Absent" without a Reading: skipped, none emitted as zero
    assert len(r.absent) == 11 and all("/Sensors/PS2" in a for a in r.absent)
    assert not any(d.startswith("Tower/PS2") for _, d in rows)
    assert {x["ts_ns"] for x in rows.values()} == {42}
    assert len(rows) == r.samples.num_rows  # nothing emitted twice
    dis = "\n".join(r.disagreements)
    assert "Thermal 'CPU1 Temp' reads 41 but /redfish/v1/Chassis/Tower/Sensors/CPU1Temp" in dis
    assert "ThermalMetrics Internal reads 39" in dis
    assert "Power 'System Input Power' reads 926" in dis and "TotalPower reads 374" in dis
    assert "BaseBoard System Fan' reads 2100 RPM" in dis
    assert "PS2InputPower, which is absent" in dis


def test_redfish_clock_and_sel(bmc: tuple[str, str]) -> None:
    url, ca = bmc
    receive = 1_700_000_000 * 10**9
    src = RedfishSource(RedfishClient(url, "u", "p", ca_file=ca, clock=lambda: receive))
    r = src.collect(0)
    assert r.clock is not None and r.clock.source == "bmc"
    # DateTime "2015-03-13T04:14:33+06:00" = 1426198473 s since the epoch
    assert r.clock.offset_ns == 1426198473 * 10**9 - receive
    assert r.clock.error_bound_ns == 10**9 and r.clock.reference == "/redfish/v1/Managers/BMC"
    sel = r.events.to_pylist()
    assert [(e["event"], e["ts_ns"], e["severity"]) for e in sel] == [
        ("sel", 1331131440 * 10**9, "critical"),  # 2012-03-07T14:44:00Z
        ("sel", 1331131500 * 10**9, "critical"),
    ]
    assert sel[0]["code"] == 0x592A28 and sel[0]["device"] == "437XR1238R2/Log1"
    assert json.loads(sel[1]["attrs"])["sensor_number"] == 2
    assert "/redfish/v1/Managers/BMC/LogServices" in r.missing  # linked, not in the mockup
    assert src.collect(0).events.num_rows == 0  # entries already emitted are not repeated


def test_redfish_tls_and_auth_failures(bmc: tuple[str, str]) -> None:
    url, _ = bmc
    with pytest.raises(RedfishError, match=r"CERTIFICATE_VERIFY_FAILED|certificate"):
        RedfishClient(url, "u", "p").get("/redfish/v1/")
    with pytest.raises(RedfishError, match="401"):
        RedfishClient(url, "u", "wrong", insecure=True).get("/redfish/v1/")


def test_exporter_isolates_a_failing_source(bmc: tuple[str, str], tmp_path: Path) -> None:
    url, ca = bmc
    log = tmp_path / "dmesg.log"
    text = DMESG.read_text()
    cut = text.index("\n", text.index("Xid")) + 50  # one Xid line, then half a line
    log.write_text(text[:cut])
    sources: list[FirmwareSource] = [
        EthtoolSource("bond0", read=lambda _: BOND0.read_text()),
        EthtoolSource("ens1f0np0", read=lambda _: MLX5.read_text()),
        RedfishSource(RedfishClient(url, "u", "p", ca_file=ca)),
        KernelLogSource(log, raw_kmsg=False),
    ]
    exp = FirmwareExporter(sources, clock=lambda: 5)
    poll = exp.poll()
    assert [t.num_rows for t in poll.samples] == [24, 53]
    assert sum(t.num_rows for t in poll.events) == 2 + 1  # SEL entries + one Xid
    bad = exp.health["ethtool:bond0"]
    assert bad.errors == 1
    assert bad.last_error == "EthtoolError: ethtool -S bond0 failed: errno 1 (EPERM)"
    assert exp.health["ethtool:ens1f0np0"].errors == 0
    with log.open("a") as f:
        f.write(text[cut:])
    again = exp.poll()
    assert sum(t.num_rows for t in again.events) == 4  # the other Xids, SEL not repeated
    assert exp.health["ethtool:bond0"].errors == 2


def test_cli_once_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    firmware_cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["export", "firmware", "--dmesg", str(DMESG), "--once", "--stdout"])
    assert args.interval == "1s"
    rc = args.handler(args, RefinerySettings())
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert rc == 0 and len(rows) == 5
    assert {(r["kind"], r["event"], r["code"]) for r in rows} == {("events", "xid", 119)}
    assert parse_duration_s("500ms") == 0.5
