"""NVIDIA Xid codes Refinery names: meaning and how bad it is.

From NVIDIA's "XID Errors" catalogue (docs.nvidia.com/deploy/xid-errors). Unknown codes are
still alerts (every Xid is an event), with meaning "unknown Xid" and severity warning.
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas.records import Severity


@dataclass(frozen=True)
class XidInfo:
    code: int
    meaning: str
    severity: Severity


_C, _W = Severity.CRITICAL, Severity.WARNING
XID_TABLE: dict[int, XidInfo] = {
    c: XidInfo(c, m, s)
    for c, m, s in (
        (13, "graphics engine exception (often an application fault)", _W),
        (31, "GPU memory page fault (MMU fault; application or driver)", _W),
        (43, "GPU stopped processing (reset channel; application fault)", _W),
        (45, "preemptive cleanup after a previous error (robust channel)", _W),
        (48, "double-bit ECC error (DBE): uncorrectable memory error", _C),
        (61, "internal micro-controller breakpoint/warning", _W),
        (62, "internal micro-controller halt", _C),
        (63, "ECC page retirement or row remapping recorded", _W),
        (64, "ECC page retirement or row remapping failure", _C),
        (74, "NVLink error (link training or data errors)", _C),
        (79, "GPU has fallen off the bus", _C),
        (92, "high single-bit ECC error rate", _W),
        (94, "contained ECC error (application affected, GPU healthy)", _W),
        (95, "uncontained ECC error (GPU reset required)", _C),
        (119, "GSP RPC timeout", _C),
        (120, "GSP error", _C),
        (121, "C2C link corrected error", _W),
        (140, "unrecovered ECC error", _C),
    )
}


def xid_info(code: int | None) -> XidInfo:
    """Meaning and severity of Xid ``code`` (a generic entry for unknown codes)."""
    if code is not None and code in XID_TABLE:
        return XID_TABLE[code]
    return XidInfo(code if code is not None else -1, "unknown Xid", _W)
