"""Kernel log → EVENTS_SCHEMA rows: NVIDIA Xid and NVSwitch SXid errors, network link events.

Two input forms:

- ``dmesg -T`` lines ``[Sun Feb 23 16:24:18 2025] msg`` (wall time as dmesg reconstructed it,
  local time of the node: pass ``tz``), ``dmesg --time-format iso`` lines
  ``2025-01-21T04:41:44,285060+00:00 msg``, and plain ``[  123.456789] msg`` (seconds since
  boot, needs ``boot_ns``);
- raw ``/dev/kmsg`` records ``prio,seq,usec_since_boot,flags;msg`` (continuation lines that
  start with a space are ignored); time = ``boot_ns + usec`` (``boot_ns`` from ``btime`` in
  ``/proc/stat``).

Events:

- ``NVRM: Xid (PCI:0000:9b:00): 119, pid=2024380, name=nvidia-smi, <text>`` → event ``xid``,
  ``code`` 119, device ``gpu<N>`` from the PCI bus id map when given, else ``pci:0000:9b:00``,
  attrs ``{pci, pid, name, detail}``; severity from the NVIDIA Xid catalog's action
  (reset/reboot → critical, restart app → warning, ignore → info; unknown → warning). Xid 74
  (NVLink) and 149 additionally carry ``attrs.nvlink = true``.
- ``nvidia-nvswitchN: SXid (PCI:…): 12028, <text>`` → event ``sxid`` on device ``nvswitchN``.
- ``<iface>: Link is Up|Down`` / ``NIC Link is Up|Down`` and
  ``ADDRCONF(NETDEV_CHANGE): <iface>: link becomes ready`` → ``link_up`` / ``link_down``.

Every event keeps the original line as ``message``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, tzinfo
from typing import Any

import pyarrow as pa

from schemas.wire import EVENTS_SCHEMA

_XID_RE = re.compile(
    r"NVRM: Xid \((?:PCI:)?([0-9A-Fa-f:.]+)\): (\d+)(?:, pid=([^,]*))?(?:, name=([^,]*))?"
    r"(?:, (.*))?$"
)
_SXID_RE = re.compile(r"nvidia-nvswitch(\d+): SXid \((?:PCI:)?([0-9A-Fa-f:.]+)\): (\d+),?\s*(.*)$")
_LINK_RE = re.compile(r"(?:^|\s)([\w.@-]+): (?:NIC )?Link is (Up|Down)\b")
_READY_RE = re.compile(r"ADDRCONF\(NETDEV_CHANGE\): ([\w.@-]+): link becomes ready")
_DMESG_T_RE = re.compile(r"^\[(\w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4})\] ?(.*)$")
_DMESG_ISO_RE = re.compile(
    r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:[,.]\d+)?(?:[+-]\d\d:?\d\d|Z)?) (.*)$"
)
_DMESG_MONO_RE = re.compile(r"^\[\s*(\d+)\.(\d+)\] ?(.*)$")
_KMSG_RE = re.compile(r"^(\d+),(\d+),(\d+),[^;]*;(.*)$")

# Xid → catalog "immediate action" bucket (DATA-NOTES §2.4)
_CRITICAL = frozenset({46, 48, 62, 64, 79, 95, 109, 119, 120, 140})
_WARNING = frozenset({8, 13, 31, 45, 74, 94, 149})
_INFO = frozenset({43, 63, 92, 121, 154})
NVLINK_XIDS = frozenset({74, 149})


def xid_severity(code: int) -> str:
    if code in _CRITICAL:
        return "critical"
    if code in _INFO:
        return "info"
    return "warning"


def normalize_pci(bus: str) -> str:
    """``00000000:9B:00.0``, ``0000:9b:00``, ``9b:00.0`` → ``0000:9b:00`` (domain:bus:device)."""
    parts = bus.lower().split(".")[0].split(":")
    if len(parts) == 2:
        parts = ["0", *parts]
    dom, b, d = parts[-3], parts[-2], parts[-1]
    return f"{int(dom, 16):04x}:{int(b, 16):02x}:{int(d, 16):02x}"


@dataclass(frozen=True)
class LogLine:
    ts_ns: int | None
    message: str
    raw: str


def parse_dmesg_line(line: str, tz: tzinfo = UTC, boot_ns: int | None = None) -> LogLine | None:
    """One ``dmesg`` line in any of the three time formats, or None if it has no prefix."""
    s = line.rstrip("\n")
    if m := _DMESG_T_RE.match(s):
        dt = datetime.strptime(re.sub(r" +", " ", m.group(1)), "%a %b %d %H:%M:%S %Y")
        return LogLine(_ns(dt.replace(tzinfo=tz)), m.group(2), s)
    if m := _DMESG_ISO_RE.match(s):
        dt = datetime.fromisoformat(m.group(1).replace(",", ".").replace("Z", "+00:00"))
        return LogLine(_ns(dt if dt.tzinfo else dt.replace(tzinfo=tz)), m.group(2), s)
    if m := _DMESG_MONO_RE.match(s):
        frac = (m.group(2) + "000000000")[:9]
        mono = int(m.group(1)) * 1_000_000_000 + int(frac)
        return LogLine(None if boot_ns is None else boot_ns + mono, m.group(3), s)
    return None


def parse_kmsg_record(line: str, boot_ns: int | None = None) -> LogLine | None:
    """One ``/dev/kmsg`` record ``prio,seq,usec,flags;msg``; None for continuation lines."""
    m = _KMSG_RE.match(line.rstrip("\n"))
    if m is None:
        return None
    usec = int(m.group(3))
    return LogLine(None if boot_ns is None else boot_ns + usec * 1000, m.group(4), line.rstrip())


def _ns(dt: datetime) -> int:
    return int(dt.timestamp()) * 1_000_000_000 + dt.microsecond * 1000


def event_of(line: LogLine, gpu_by_pci: Mapping[str, str]) -> dict[str, Any] | None:
    """The event row one log line carries, or None."""
    msg = line.message
    ts = line.ts_ns if line.ts_ns is not None else 0
    if m := _XID_RE.search(msg):
        pci = normalize_pci(m.group(1))
        code = int(m.group(2))
        pid_s = (m.group(3) or "").strip()
        attrs: dict[str, Any] = {
            "pci": pci,
            "pid": int(pid_s) if pid_s.isdigit() else None,
            "name": (m.group(4) or "").strip() or None,
            "detail": (m.group(5) or "").strip() or None,
        }
        if code in NVLINK_XIDS:
            attrs["nvlink"] = True
        return _row(
            ts, "xid", gpu_by_pci.get(pci, f"pci:{pci}"), code, xid_severity(code), line, attrs
        )
    if m := _SXID_RE.search(msg):
        pci = normalize_pci(m.group(2))
        attrs = {"pci": pci, "detail": m.group(4).strip() or None}
        return _row(ts, "sxid", f"nvswitch{m.group(1)}", int(m.group(3)), "warning", line, attrs)
    if m := _READY_RE.search(msg):
        return _row(ts, "link_up", m.group(1), None, "info", line, {"reason": "netdev_change"})
    if m := _LINK_RE.search(msg):
        up = m.group(2) == "Up"
        return _row(ts, "link_up" if up else "link_down", m.group(1), None,
                    "info" if up else "warning", line, {})  # fmt: skip
    return None


def _row(
    ts: int,
    event: str,
    device: str,
    code: int | None,
    severity: str,
    line: LogLine,
    attrs: dict[str, Any],
) -> dict[str, Any]:
    if line.ts_ns is None:
        attrs = {**attrs, "ts_unknown": True}
    return {
        "ts_ns": ts,
        "event": event,
        "device": device,
        "code": code,
        "severity": severity,
        "message": line.raw,
        "attrs": json.dumps(attrs, separators=(",", ":"), sort_keys=True),
    }


def events_table(rows: Iterable[dict[str, Any]]) -> pa.Table:
    return pa.Table.from_pylist(list(rows), schema=EVENTS_SCHEMA)


def parse_dmesg(
    text: str,
    gpu_by_pci: Mapping[str, str] | None = None,
    tz: tzinfo = UTC,
    boot_ns: int | None = None,
) -> pa.Table:
    """All events of a ``dmesg`` text; lines without a time prefix are ignored."""
    rows = []
    for raw in text.splitlines():
        ll = parse_dmesg_line(raw, tz, boot_ns)
        if ll is not None and (row := event_of(ll, gpu_by_pci or {})) is not None:
            rows.append(row)
    return events_table(rows)


def parse_kmsg(
    text: str, gpu_by_pci: Mapping[str, str] | None = None, boot_ns: int | None = None
) -> pa.Table:
    """All events of raw ``/dev/kmsg`` records (one a line)."""
    rows = []
    for raw in text.splitlines():
        ll = parse_kmsg_record(raw, boot_ns)
        if ll is not None and (row := event_of(ll, gpu_by_pci or {})) is not None:
            rows.append(row)
    return events_table(rows)


def load_gpu_map(text: str) -> dict[str, str]:
    """``nvidia-smi --query-gpu=index,pci.bus_id --format=csv,noheader`` output (or JSON
    ``{"0000:9b:00.0": "gpu4"}``) → normalised bus id → ``gpu<index>``."""
    s = text.strip()
    if s.startswith("{"):
        doc = json.loads(s)
        return {normalize_pci(k): str(v) for k, v in doc.items()}
    out: dict[str, str] = {}
    for line in s.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 2 and parts[0].isdigit():
            out[normalize_pci(parts[1])] = f"gpu{parts[0]}"
    return out


def boot_time_ns(proc_stat: str) -> int:
    """``btime`` from ``/proc/stat`` text, in ns since the epoch."""
    m = re.search(r"^btime\s+(\d+)", proc_stat, re.MULTILINE)
    if m is None:
        raise ValueError("no btime line in /proc/stat")
    return int(m.group(1)) * 1_000_000_000
