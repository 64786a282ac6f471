"""GPUs through NVML (``nvidia-ml-py``, module ``pynvml``), when it is importable and a driver
is loaded.

:class:`NvmlCollector` opens NVML once; :meth:`NvmlCollector.collect` appends one reading per
supported metric and GPU (device ``gpuN``, the NVML index) and any Xid events seen since the
last call (metric ``gpu.xid``, value = Xid code, kind event). Units follow the catalog (the DCGM
units): power W (NVML reports mW), memory MiB (NVML reports bytes), PCIe throughput B/s (NVML
KB/s), NVLink data bytes (NVML KiB).

Absence is a state, not an error: without the module, the library or a driver, ``available``
is False, ``reason`` says why, and ``collect`` adds nothing. A call a GPU does not support
(``NVMLError_NotSupported``) skips that metric only. Nothing here raises into a scrape.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from services.exporters.procfs import SampleBuffer

_MIB = 1024 * 1024
_NVLINK_MAX_LINKS = 18


class NvmlCollector:
    """NVML session for the life of the exporter. Call :meth:`close` at shutdown."""

    def __init__(self, *, module: str = "pynvml") -> None:
        self.available = False
        self.reason: str | None = None
        self._nv: Any = None
        self._handles: list[Any] = []
        self._events: Any = None
        self._uuids: dict[str, int] = {}
        try:
            nv = importlib.import_module(module)
        except ImportError:
            self.reason = f"{module} is not installed (pip install 'telemetry-refinery[gpu]')"
            return
        try:
            nv.nvmlInit()
            count = nv.nvmlDeviceGetCount()
            self._handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        except Exception as e:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
            self.reason = f"NVML unavailable: {type(e).__name__}: {e}"
            return
        self._nv = nv
        self.available = True
        self._uuids = {
            str(self._try(nv.nvmlDeviceGetUUID, h)): i for i, h in enumerate(self._handles)
        }
        if not self._handles:
            self.reason = "NVML has no GPUs"
        self._events = self._register_xid_events()

    def _register_xid_events(self) -> Any:
        nv = self._nv
        try:
            es = nv.nvmlEventSetCreate()
        except Exception:
            return None
        registered = False
        for h in self._handles:
            try:
                nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, es)
                registered = True
            except Exception:
                continue  # not supported on this GPU (e.g. some vGPU / MIG setups)
        return es if registered else None

    def close(self) -> None:
        if self._nv is None:
            return
        try:
            if self._events is not None:
                self._nv.nvmlEventSetFree(self._events)
            self._nv.nvmlShutdown()
        except Exception:
            pass
        self._nv = None
        self.available = False

    def _try(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception:
            return None

    def collect(self, ts: int, buf: SampleBuffer) -> None:
        """Append one reading per supported metric per GPU, then pending Xid events."""
        if not self.available:
            return
        for i, h in enumerate(self._handles):
            self._collect_gpu(ts, buf, f"gpu{i}", h)
        self._collect_xids(ts, buf)

    def _collect_gpu(self, ts: int, buf: SampleBuffer, dev: str, h: Any) -> None:
        nv, t = self._nv, self._try

        def gauge(metric: str, fn: Callable[[], Any], scale: float = 1.0) -> None:
            v = t(fn)
            if v is not None:
                buf.gauge(ts, metric, dev, float(v) * scale)

        def counter(metric: str, fn: Callable[[], Any]) -> None:
            v = t(fn)
            if v is not None:
                buf.counter(ts, metric, dev, int(v))

        gauge("gpu.sm_clock", lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM))
        gauge("gpu.mem_clock", lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM))
        gauge("gpu.temp", lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
        gauge("gpu.power", lambda: nv.nvmlDeviceGetPowerUsage(h), 1e-3)
        gauge("gpu.power_limit", lambda: nv.nvmlDeviceGetEnforcedPowerLimit(h), 1e-3)
        gauge("gpu.pstate", lambda: nv.nvmlDeviceGetPerformanceState(h))
        counter("gpu.energy", lambda: nv.nvmlDeviceGetTotalEnergyConsumption(h))
        counter("gpu.pcie_replay", lambda: nv.nvmlDeviceGetPcieReplayCounter(h))
        gauge("gpu.pcie_link_gen", lambda: nv.nvmlDeviceGetCurrPcieLinkGeneration(h))
        gauge("gpu.pcie_link_width", lambda: nv.nvmlDeviceGetCurrPcieLinkWidth(h))
        util = t(lambda: nv.nvmlDeviceGetUtilizationRates(h))
        if util is not None:
            buf.gauge(ts, "gpu.util", dev, util.gpu)
            buf.gauge(ts, "gpu.mem_copy_util", dev, util.memory)
        mem = t(lambda: nv.nvmlDeviceGetMemoryInfo(h))
        if mem is not None:
            buf.gauge(ts, "gpu.fb_total", dev, mem.total / _MIB)
            buf.gauge(ts, "gpu.fb_free", dev, mem.free / _MIB)
            buf.gauge(ts, "gpu.fb_used", dev, mem.used / _MIB)
        reasons = t(lambda: nv.nvmlDeviceGetCurrentClocksEventReasons(h))
        if reasons is None:
            reasons = t(lambda: nv.nvmlDeviceGetCurrentClocksThrottleReasons(h))
        if reasons is not None:
            buf.gauge(ts, "gpu.clock_event_reasons", dev, int(reasons))
        for metric, policy in (
            ("gpu.power_violation", "NVML_PERF_POLICY_POWER"),
            ("gpu.thermal_violation", "NVML_PERF_POLICY_THERMAL"),
        ):
            v = t(nv.nvmlDeviceGetViolationStatus, h, getattr(nv, policy, None))
            if v is not None:
                buf.counter(ts, metric, dev, int(v.violationTime))
        for metric, err_type, counter_type in (
            ("gpu.ecc_sbe_volatile", "NVML_MEMORY_ERROR_TYPE_CORRECTED", "NVML_VOLATILE_ECC"),
            ("gpu.ecc_dbe_volatile", "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", "NVML_VOLATILE_ECC"),
            ("gpu.ecc_sbe_aggregate", "NVML_MEMORY_ERROR_TYPE_CORRECTED", "NVML_AGGREGATE_ECC"),
            ("gpu.ecc_dbe_aggregate", "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", "NVML_AGGREGATE_ECC"),
        ):
            n = t(
                nv.nvmlDeviceGetTotalEccErrors,
                h,
                getattr(nv, err_type, None),
                getattr(nv, counter_type, None),
            )
            if n is not None:
                buf.counter(ts, metric, dev, int(n))
        rows = t(lambda: nv.nvmlDeviceGetRemappedRows(h))
        if rows is not None:
            corr, unc, pending, failure = rows
            buf.counter(ts, "gpu.remapped_rows_correctable", dev, int(corr))
            buf.counter(ts, "gpu.remapped_rows_uncorrectable", dev, int(unc))
            buf.gauge(ts, "gpu.row_remap_pending", dev, int(bool(pending)))
            buf.gauge(ts, "gpu.row_remap_failure", dev, int(bool(failure)))
        self._collect_fields(ts, buf, dev, h)

    def _collect_fields(self, ts: int, buf: SampleBuffer, dev: str, h: Any) -> None:
        """Memory temperature, NVLink error totals and NVLink data (one NVML call)."""
        nv = self._nv
        singles = {
            "NVML_FI_DEV_MEMORY_TEMP": ("gpu.mem_temp", False),
            "NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL": ("gpu.nvlink_crc_flit_errors", True),
            "NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL": ("gpu.nvlink_crc_data_errors", True),
            "NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL": ("gpu.nvlink_replay_errors", True),
            "NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL": ("gpu.nvlink_recovery_errors", True),
        }
        ids: list[Any] = [getattr(nv, k) for k in singles if hasattr(nv, k)]
        names = [singles[k] for k in singles if hasattr(nv, k)]
        data_ids = [
            getattr(nv, k)
            for k in (
                "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX",
                "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX",
            )
            if hasattr(nv, k)
        ]
        link_req = [(f, link) for f in data_ids for link in range(_NVLINK_MAX_LINKS)]
        values = self._try(lambda: nv.nvmlDeviceGetFieldValues(h, ids + link_req))
        if values is None:
            return
        for (metric, is_counter), fv in zip(names, values[: len(ids)], strict=True):
            v = _field_value(nv, fv)
            if v is None:
                continue
            if is_counter:
                buf.counter(ts, metric, dev, int(v))
            else:
                buf.gauge(ts, metric, dev, v)
        link_vals = [_field_value(nv, fv) for fv in values[len(ids) :]]
        got = [int(v) for v in link_vals if v is not None]
        if got:
            buf.counter(ts, "gpu.nvlink_bandwidth", dev, sum(got) * 1024)

    def _collect_xids(self, ts: int, buf: SampleBuffer) -> None:
        """Drain pending Xid events without blocking (timeout 0 ms)."""
        if self._events is None:
            return
        nv = self._nv
        for _ in range(64):  # bound the drain; the rest comes next scrape
            try:
                ev = nv.nvmlEventSetWait(self._events, 0)
            except Exception:  # NVMLError_Timeout: nothing pending
                return
            uuid = self._try(nv.nvmlDeviceGetUUID, getattr(ev, "device", None))
            idx = self._uuids.get(str(uuid))
            dev = f"gpu{idx}" if idx is not None else "gpu"
            buf.gauge(ts, "gpu.xid", dev, int(ev.eventData))


def _field_value(nv: Any, fv: Any) -> int | float | None:
    """The number in an ``nvmlFieldValue_t``, or None if NVML returned an error for it."""
    if getattr(fv, "nvmlReturn", 1) != nv.NVML_SUCCESS:
        return None
    vt = fv.valueType
    u = fv.value
    if vt == nv.NVML_VALUE_TYPE_DOUBLE:
        return float(u.dVal)
    if vt == nv.NVML_VALUE_TYPE_UNSIGNED_INT:
        return int(u.uiVal)
    if vt == nv.NVML_VALUE_TYPE_UNSIGNED_LONG:
        return int(u.ulVal)
    if vt == nv.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG:
        return int(u.ullVal)
    if vt == nv.NVML_VALUE_TYPE_SIGNED_LONG_LONG:
        return int(u.sllVal)
    return None
