"""Discrete events of incidents (telemetry.events): XIDs, link down/up, throttle onsets/ends.

:func:`events_between` lists the events whose true time falls in ``[t0, t1)``, grouped by node
index; the engine turns each group into one EVENTS batch in that node's clock.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from lab.simulate.faults import FaultKind, Incident
from schemas.wire import EVENTS_SCHEMA

XID_TEXT = {
    79: ("critical", "GPU has fallen off the bus."),
    48: ("critical", "An uncorrectable double bit error (DBE) has been detected on GPU."),
    119: ("critical", "Timeout after 6s of waiting for RPC response from GPU System Processor."),
    94: ("warning", "Contained ECC error."),
    63: ("warning", "ECC page retirement or row remapping recording event."),
    31: ("warning", "GPU memory page fault."),
}


@dataclass(frozen=True)
class SimEvent:
    true_ns: int
    event: str
    device: str
    code: int | None
    severity: str
    message: str
    attrs: str
    incident: str


def events_between(incidents: list[Incident], t0: int, t1: int) -> dict[int, list[SimEvent]]:
    """Events in ``[t0, t1)`` by node index, in time order."""
    out: dict[int, list[SimEvent]] = {}

    def add(i: int, ev: SimEvent) -> None:
        out.setdefault(i, []).append(ev)

    for inc in incidents:
        if not inc.node_idx or inc.device is None:
            continue
        i = inc.node_idx[0]
        pci = f"0000:{0x18 + 0x10 * max(inc.unit, 0):02x}:00.0"
        if inc.kind is FaultKind.XID and t0 <= inc.start_ns < t1:
            code = int(inc.detail["code"])
            sev, text = XID_TEXT.get(code, ("warning", "Unknown Xid."))
            msg = f"NVRM: Xid (PCI:{pci}): {code}, pid=4182, name=python3, {text}"
            attrs = json.dumps({"pci_bus_id": pci, "pid": 4182})
            add(i, SimEvent(inc.start_ns, "xid", inc.device, code, sev, msg, attrs, inc.id))
        elif inc.kind is FaultKind.LINK_FLAP:
            for at, ev in ((inc.start_ns, "link_down"), (inc.end_ns, "link_up")):
                if t0 <= at < t1:
                    state = "Down" if ev == "link_down" else "Active"
                    msg = f"mlx5_core {pci}: {inc.device.split('/')[0]}: Link {state}"
                    sev = "warning" if ev == "link_down" else "info"
                    add(i, SimEvent(at, ev, inc.device, None, sev, msg, "{}", inc.id))
        elif inc.kind is FaultKind.THROTTLE:
            bits = int(inc.detail["bits"])
            for at, code in ((inc.start_ns, bits), (inc.end_ns, 0)):
                if t0 <= at < t1:
                    msg = f"clocks_event_reasons changed to 0x{code:x}"
                    sev = "warning" if code else "info"
                    attrs = json.dumps({"cause": inc.detail["cause"]})
                    add(i, SimEvent(at, "throttle", inc.device, code, sev, msg, attrs, inc.id))
    for evs in out.values():
        evs.sort(key=lambda e: e.true_ns)
    return out


def events_table(evs: list[SimEvent], offset_ns: int) -> pa.Table:
    """An EVENTS_SCHEMA table of ``evs`` stamped in a clock ``offset_ns`` ahead of true time."""
    return pa.table(
        {
            "ts_ns": pa.array(np.array([e.true_ns for e in evs], np.int64) + offset_ns),
            "event": [e.event for e in evs],
            "device": [e.device for e in evs],
            "code": pa.array([e.code for e in evs], pa.int64()),
            "severity": [e.severity for e in evs],
            "message": [e.message for e in evs],
            "attrs": [e.attrs for e in evs],
        },
        schema=EVENTS_SCHEMA,
    )
