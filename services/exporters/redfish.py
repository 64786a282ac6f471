"""Redfish BMC reader: chassis sensors, fans, PSUs, the BMC clock and SEL entries →
SAMPLES_SCHEMA / EVENTS_SCHEMA rows and a ``ClockBlock``, read through
:class:`~services.exporters.redfish_client.RedfishClient`.

What is read, per chassis of ``/redfish/v1/Chassis``:

1. ``Sensors`` (preferred): each member's ``Reading`` by ``ReadingType``/``ReadingUnits``:
   Temperature/``Cel`` → ``bmc.temperature`` (°C), Power/``W`` → ``bmc.power`` (W),
   ``RPM`` → ``bmc.fan_speed``, fan ``%`` → ``bmc.fan_percent``, Voltage/``V`` →
   ``bmc.voltage``, Current/``A`` → ``bmc.current``, Frequency/``Hz`` → ``bmc.frequency``,
   EnergykWh/``kW.h`` → ``bmc.energy`` in kWh as read (EnergyJoules/``J`` converted to kWh; the
   catalog keeps it a gauge, so ``raw`` stays NULL). Device ``<chassis>/<URI leaf>`` (the URI
   leaf, not ``Id``: BMCs copy-paste Ids). A sensor with ``State: Absent`` or no ``Reading`` is
   skipped and counted, never emitted as zero.
2. ``ThermalSubsystem/Fans`` and ``PowerSubsystem/PowerSupplies/*/Metrics``: a reading whose
   ``DataSourceUri`` names a member of the Sensors collection is not emitted twice; when it
   differs from that sensor (or cites an absent one) the disagreement is reported. Others
   (fan ``SpeedRPM``, PSU rails) are emitted under ``<chassis>/fan/<leaf>`` /
   ``<chassis>/psu/<leaf>``.
3. Deprecated ``Thermal``/``Power``: used for readings only when the chassis has no Sensors;
   otherwise compared (``ThermalMetrics`` too) and disagreements reported, e.g. the DMTF
   public-tower mockup's CPU1 temperature 41 (Thermal) vs 37 (Sensors) vs 39 (ThermalMetrics).

Clock: the first Manager's ``DateTime`` → ``ClockBlock(source="bmc", offset_ns = bmc time -
local receive time)``, error bound = round trip + 1 s (DateTime has whole seconds).
SEL: every ``LogServices/*/Entries`` of every System and Manager → events ``sel`` (``EntryType``
SEL) or ``bmc_log``; ``code`` = ``MessageId`` when hex; entries already seen are not repeated
on later polls. ``@odata.nextLink`` is followed only while fewer members than
``Members@odata.count`` were read (some BMCs send a next link past the end).

A missing resource (404) is counted in :attr:`RedfishReading.missing`, not fatal; a failure to
reach the service root raises :class:`~services.exporters.redfish_client.RedfishError`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import pyarrow as pa

from schemas.wire import EVENTS_SCHEMA, SAMPLES_SCHEMA, ClockBlock, SyncState
from services.exporters.redfish_client import NotFound, RedfishClient

J_TO_KWH = 1 / 3.6e6
MAX_PAGES = 100


@dataclass
class RedfishReading:
    """One poll's output and its accounting."""

    samples: pa.Table
    events: pa.Table
    clock: ClockBlock | None = None
    absent: list[str] = field(default_factory=list)  # sensors skipped: Absent / no Reading
    unmapped: list[str] = field(default_factory=list)  # readings with no metric for their unit
    disagreements: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # linked resources that answered 404


def _leaf(odata_id: str) -> str:
    return odata_id.rstrip("/").split("#")[0].rsplit("/", 1)[-1]


def _num(v: object) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v)


def metric_for_sensor(doc: dict[str, Any]) -> tuple[str, float] | None:
    """(metric, scale to its unit) for a Sensor resource, or None when nothing fits."""
    rtype = str(doc.get("ReadingType") or "")
    unit = str(doc.get("ReadingUnits") or "")
    ident = f"{doc.get('Id', '')} {doc.get('Name', '')} {doc.get('@odata.id', '')}".lower()
    if rtype == "Temperature" or unit == "Cel":
        return "bmc.temperature", 1.0
    if unit == "RPM" or rtype == "Rotational":
        return "bmc.fan_speed", 1.0
    if (rtype == "Percent" or unit == "%") and "fan" in ident:
        return "bmc.fan_percent", 1.0
    if rtype == "Power" or unit == "W":
        return "bmc.power", 1.0
    if rtype == "Voltage" or unit == "V":
        return "bmc.voltage", 1.0
    if rtype == "Current" or unit == "A":
        return "bmc.current", 1.0
    if rtype == "Frequency" or unit == "Hz":
        return "bmc.frequency", 1.0
    if rtype == "EnergykWh" or unit == "kW.h":
        return "bmc.energy", 1.0
    if rtype == "EnergyJoules" or unit == "J":
        return "bmc.energy", J_TO_KWH
    return None


def _state(doc: dict[str, Any]) -> object:
    status = doc.get("Status")
    return status.get("State") if isinstance(status, dict) else None


def _absent(doc: dict[str, Any]) -> bool:
    return _state(doc) == "Absent" or _num(doc.get("Reading")) is None


def parse_redfish_time(text: str) -> int:
    """ISO-8601 with offset → ns since the epoch (ValueError if malformed or zone-less)."""
    dt = datetime.fromisoformat(text.replace("Z", "+00:00"))
    if dt.tzinfo is None:
        raise ValueError(f"Redfish time without zone: {text!r}")
    return int(dt.timestamp()) * 1_000_000_000 + dt.microsecond * 1000


class _Rows:
    def __init__(self, ts_ns: int) -> None:
        self.ts = ts_ns
        self.rows: list[dict[str, Any]] = []
        self.by_uri: dict[str, float] = {}

    def add(self, metric: str, device: str, value: float, uri: str | None = None) -> None:
        # every BMC metric is a gauge in the catalog: no raw counter value
        self.rows.append(
            {"ts_ns": self.ts, "metric": metric, "device": device, "value": value,
             "raw": None, "text": None}
        )  # fmt: skip
        if uri:
            self.by_uri[uri] = value


class RedfishSource:
    """A firmware source polling one BMC; remembers SEL entries already emitted."""

    def __init__(self, client: RedfishClient, name: str = "redfish") -> None:
        self.client = client
        self.name = name
        self._seen_sel: set[str] = set()

    def _get(self, path: str, out: RedfishReading) -> dict[str, Any] | None:
        try:
            return self.client.get(path).doc
        except NotFound:
            out.missing.append(path)
            return None

    def _members(self, path: str, out: RedfishReading) -> list[dict[str, Any]]:
        """Members of a collection (inline when expanded, else fetched), nextLink-aware."""
        coll = self._get(path, out)
        items: list[dict[str, Any]] = []
        pages = 0
        while coll is not None and pages < MAX_PAGES:
            pages += 1
            for m in coll.get("Members") or []:
                if not isinstance(m, dict):
                    continue
                if set(m) - {"@odata.id"}:
                    items.append(m)
                elif (doc := self._get(str(m.get("@odata.id")), out)) is not None:
                    items.append(doc)
            count = coll.get("Members@odata.count")
            nxt = coll.get("@odata.nextLink")
            if not nxt or (isinstance(count, int) and len(items) >= count):
                break
            coll = self._get(str(nxt), out)
        return items

    def collect(self, now_ns: int) -> RedfishReading:
        out = RedfishReading(
            pa.table({n: [] for n in SAMPLES_SCHEMA.names}, schema=SAMPLES_SCHEMA),
            pa.table({n: [] for n in EVENTS_SCHEMA.names}, schema=EVENTS_SCHEMA),
        )
        root = self.client.get("/redfish/v1/").doc
        rows = _Rows(now_ns)
        if isinstance(root.get("Chassis"), dict):
            for chassis in self._members(root["Chassis"]["@odata.id"], out):
                self._chassis(chassis, rows, out)
        out.clock = self._clock(root, out)
        events: list[dict[str, Any]] = []
        for key in ("Systems", "Managers"):
            if isinstance(root.get(key), dict):
                for member in self._members(root[key]["@odata.id"], out):
                    events.extend(self._logs(member, out))
        out.samples = pa.Table.from_pylist(rows.rows, schema=SAMPLES_SCHEMA)
        out.events = pa.Table.from_pylist(events, schema=EVENTS_SCHEMA)
        return out

    # -- chassis ----------------------------------------------------------------------------

    def _chassis(self, chassis: dict[str, Any], rows: _Rows, out: RedfishReading) -> None:
        cname = _leaf(str(chassis.get("@odata.id", chassis.get("Id", "chassis"))))
        sensors: dict[str, dict[str, Any]] = {}
        if isinstance(chassis.get("Sensors"), dict):
            for s in self._members(chassis["Sensors"]["@odata.id"], out):
                sensors[str(s.get("@odata.id", "")).rstrip("/")] = s
        for uri, s in sensors.items():
            target = metric_for_sensor(s)
            if _absent(s):
                out.absent.append(uri)
            elif target is None:
                out.unmapped.append(uri)
            else:
                value = float(s["Reading"]) * target[1]
                rows.add(target[0], f"{cname}/{_leaf(uri)}", value, uri)
        sub = chassis.get("ThermalSubsystem")
        if isinstance(sub, dict) and (ts := self._get(sub["@odata.id"], out)) is not None:
            if isinstance(ts.get("Fans"), dict):
                for fan in self._members(ts["Fans"]["@odata.id"], out):
                    self._fan(cname, fan, sensors, rows, out)
            if isinstance(ts.get("ThermalMetrics"), dict):
                tm = self._get(ts["ThermalMetrics"]["@odata.id"], out) or {}
                for key, ex in (tm.get("TemperatureSummaryCelsius") or {}).items():
                    if isinstance(ex, dict):
                        self._cited(f"ThermalMetrics {key}", ex, sensors, rows, out)
        sub = chassis.get("PowerSubsystem")
        ps = self._get(sub["@odata.id"], out) if isinstance(sub, dict) else None
        if ps is not None and isinstance(ps.get("PowerSupplies"), dict):
            for psu in self._members(ps["PowerSupplies"]["@odata.id"], out):
                self._psu(cname, psu, sensors, rows, out)
        self._legacy(cname, chassis, sensors, rows, out)

    def _cited(
        self,
        what: str,
        excerpt: dict[str, Any],
        sensors: dict[str, dict[str, Any]],
        rows: _Rows,
        out: RedfishReading,
    ) -> bool:
        """True when ``excerpt`` cites a Sensors member (so it must not be emitted again)."""
        uri = str(excerpt.get("DataSourceUri") or "").rstrip("/")
        if uri not in sensors:
            return False
        value = _num(excerpt.get("Reading"))
        if uri not in rows.by_uri:
            if value is not None:
                out.disagreements.append(f"{what} reads {value:g} citing {uri}, which is absent")
        elif value is not None:
            scale = (metric_for_sensor(sensors[uri]) or ("", 1.0))[1]
            if abs(value * scale - rows.by_uri[uri]) > 1e-9 * max(1.0, abs(value)):
                out.disagreements.append(
                    f"{what} reads {value:g} but {uri} reads {rows.by_uri[uri] / scale:g}"
                )
        return True

    def _fan(
        self,
        cname: str,
        fan: dict[str, Any],
        sensors: dict[str, dict[str, Any]],
        rows: _Rows,
        out: RedfishReading,
    ) -> None:
        fid = str(fan.get("@odata.id", ""))
        sp = fan.get("SpeedPercent") if isinstance(fan.get("SpeedPercent"), dict) else None
        if sp is None or _absent({**sp, "Status": fan.get("Status")}):
            out.absent.append(fid)
            return
        device = f"{cname}/fan/{_leaf(fid)}"
        if not self._cited(f"fan {_leaf(fid)}", sp, sensors, rows, out):
            rows.add("bmc.fan_percent", device, float(sp["Reading"]))
        if (rpm := _num(sp.get("SpeedRPM"))) is not None:
            rows.add("bmc.fan_speed", device, rpm)

    def _psu(
        self,
        cname: str,
        psu: dict[str, Any],
        sensors: dict[str, dict[str, Any]],
        rows: _Rows,
        out: RedfishReading,
    ) -> None:
        pid = str(psu.get("@odata.id", ""))
        if _state(psu) == "Absent":
            out.absent.append(pid)
            return
        if not isinstance(psu.get("Metrics"), dict):
            return
        m = self._get(psu["Metrics"]["@odata.id"], out)
        if m is None:
            return
        device = f"{cname}/psu/{_leaf(pid)}"
        fields = (
            ("InputVoltage", "bmc.voltage", 1.0, "input"),
            ("InputCurrentAmps", "bmc.current", 1.0, "input"),
            ("InputPowerWatts", "bmc.power", 1.0, "input"),
            ("OutputPowerWatts", "bmc.power", 1.0, "output"),
            ("EnergykWh", "bmc.energy", 1.0, ""),
            ("FrequencyHz", "bmc.frequency", 1.0, "input"),
            ("TemperatureCelsius", "bmc.temperature", 1.0, ""),
            ("FanSpeedPercent", "bmc.fan_percent", 1.0, "fan"),
            ("RailVoltage", "bmc.voltage", 1.0, "rail"),
            ("RailCurrentAmps", "bmc.current", 1.0, "rail"),
            ("RailPowerWatts", "bmc.power", 1.0, "rail"),
        )
        for key, metric, scale, part in fields:
            value = m.get(key)
            excerpts = value if isinstance(value, list) else [value]
            for i, ex in enumerate(excerpts):
                if not isinstance(ex, dict) or (reading := _num(ex.get("Reading"))) is None:
                    continue
                if self._cited(f"PSU {_leaf(pid)} {key}", ex, sensors, rows, out):
                    continue
                sub = f"{part}{i}" if part == "rail" else part
                rows.add(metric, f"{device}/{sub}" if sub else device, reading * scale)

    def _legacy(
        self,
        cname: str,
        chassis: dict[str, Any],
        sensors: dict[str, dict[str, Any]],
        rows: _Rows,
        out: RedfishReading,
    ) -> None:
        """Deprecated Thermal/Power: readings when there are no Sensors, else a cross-check."""
        by_name = {re.sub(r"[^a-z0-9]", "", _leaf(u).lower()): u for u in sensors}
        thermal = chassis.get("Thermal")
        th = self._get(thermal["@odata.id"], out) if isinstance(thermal, dict) else None
        power = chassis.get("Power")
        pw = self._get(power["@odata.id"], out) if isinstance(power, dict) else None
        items: list[tuple[str, str, float | None, str]] = []
        for t in (th or {}).get("Temperatures") or []:
            items.append(
                ("bmc.temperature", str(t.get("Name")), _num(t.get("ReadingCelsius")), "Thermal")
            )
        for f in (th or {}).get("Fans") or []:
            unit = f.get("ReadingUnits")
            metric = "bmc.fan_speed" if unit == "RPM" else "bmc.fan_percent"
            items.append((metric, str(f.get("Name")), _num(f.get("Reading")), "Thermal"))
        for v in (pw or {}).get("Voltages") or []:
            items.append(("bmc.voltage", str(v.get("Name")), _num(v.get("ReadingVolts")), "Power"))
        for c in (pw or {}).get("PowerControl") or []:
            items.append(
                ("bmc.power", str(c.get("Name")), _num(c.get("PowerConsumedWatts")), "Power")
            )
        for metric, name, value, res in items:
            key = re.sub(r"[^a-z0-9]", "", name.lower())
            if not sensors:
                if value is None:
                    out.absent.append(f"{res} {name}")
                else:
                    rows.add(metric, f"{cname}/{key}", value)
                continue
            match = next(
                (u for k, u in by_name.items() if key.endswith(k) or k.endswith(key)), None
            )
            if match is None and metric == "bmc.power" and res == "Power":
                match = next((u for k, u in by_name.items() if k == "totalpower"), None)
            fan = metric in ("bmc.fan_speed", "bmc.fan_percent")
            if match is None and fan and value is not None:
                unit = "RPM" if metric == "bmc.fan_speed" else "%"
                out.disagreements.append(
                    f"{res} fan {name!r} reads {value:g} {unit} with no Sensors counterpart"
                )
                continue
            if value is None or match is None or match not in rows.by_uri:
                continue
            if abs(rows.by_uri[match] - value) > 1e-9 * max(1.0, abs(value)):
                out.disagreements.append(
                    f"{res} {name!r} reads {value:g} but {match} reads {rows.by_uri[match]:g}"
                )

    # -- clock and logs ---------------------------------------------------------------------

    def _clock(self, root: dict[str, Any], out: RedfishReading) -> ClockBlock | None:
        if not isinstance(root.get("Managers"), dict):
            return None
        coll = self._get(root["Managers"]["@odata.id"], out) or {}
        for m in coll.get("Members") or []:
            try:
                f = self.client.get(str(m.get("@odata.id")))
            except NotFound:
                continue
            text = f.doc.get("DateTime")
            if not isinstance(text, str):
                continue
            try:
                bmc_ns = parse_redfish_time(text)
            except ValueError:
                continue
            rtt = max(0, f.received_ns - f.sent_ns)
            return ClockBlock(
                source="bmc",
                offset_ns=bmc_ns - f.received_ns,
                error_bound_ns=rtt + 1_000_000_000,
                state=SyncState.UNKNOWN,
                reference=str(f.doc.get("@odata.id", ""))[:128],
            )
        return None

    def _logs(self, owner: dict[str, Any], out: RedfishReading) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        if not isinstance(owner.get("LogServices"), dict):
            return rows
        oname = _leaf(str(owner.get("@odata.id", "")))
        for svc in self._members(owner["LogServices"]["@odata.id"], out):
            if not isinstance(svc.get("Entries"), dict):
                continue
            sname = _leaf(str(svc.get("@odata.id", "")))
            for e in self._members(svc["Entries"]["@odata.id"], out):
                key = f"{e.get('@odata.id')}|{e.get('Created')}"
                if key in self._seen_sel:
                    continue
                self._seen_sel.add(key)
                try:
                    ts = parse_redfish_time(str(e.get("Created")))
                except ValueError:
                    ts = 0
                mid = str(e.get("MessageId") or "")
                code = int(mid, 16) if re.fullmatch(r"0x[0-9A-Fa-f]+", mid) else None
                attrs = {
                    "id": e.get("Id"),
                    "entry_code": e.get("EntryCode"),
                    "sensor_type": e.get("SensorType"),
                    "sensor_number": e.get("SensorNumber"),
                    "message_id": mid or None,
                    "ts_unknown": ts == 0 or None,
                }
                rows.append(
                    {
                        "ts_ns": ts,
                        "event": "sel" if e.get("EntryType") == "SEL" else "bmc_log",
                        "device": f"{oname}/{sname}",
                        "code": code,
                        "severity": str(e.get("Severity") or "").lower() or None,
                        "message": str(e.get("Message") or ""),
                        "attrs": json.dumps(
                            {k: v for k, v in attrs.items() if v is not None}, sort_keys=True
                        ),
                    }
                )
        return rows
