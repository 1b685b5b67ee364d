"""One GPU's telemetry through NVML: a reading per sample, every failed read named.

Works on whatever ``pynvml``-shaped object discovery uses (the real binding, with the driver's library or the C
stand-in; ``FakeNvml`` for mock profiles). A read that fails leaves its field ``None`` (a missing series, never a
made-up number) and is reported in ``GpuReading.errors`` as ``(call, error)``; NOT_SUPPORTED (the GPU lacks the
sensor, NVLink or GPM) and a binding without the call are capabilities, reported in ``unsupported`` instead, so
that the error counter only counts real failures. GPU_IS_LOST ends the sample at once (every other call would
answer the same).

Units are converted at this edge: ratios 0-1, bytes, watts, hertz, bytes/s (nvml.h: power in milliwatts, PCIe
throughput in KB/s, NVLink data counters in KiB, clocks in MHz, GPM metrics in percent).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

# nvml.h constants (the same numbers in every binding; FakeNvml may lack the names).
PCIE_TX, PCIE_RX = 0, 1  # nvmlPcieUtilCounter_t
TEMPERATURE_GPU = 0  # nvmlTemperatureSensors_t
CLOCK_SM = 1  # nvmlClockType_t
ECC_CORRECTED, ECC_UNCORRECTED = 0, 1  # nvmlMemoryErrorType_t
VOLATILE_ECC = 0  # nvmlEccCounterType_t: "reset each time the driver loads"
FI_NVLINK_DATA_TX, FI_NVLINK_DATA_RX = 138, 139  # "NVLink TX/RX Data throughput in KiB"
ALL_LINKS = 0xFFFFFFFF  # scopeId: "aggregate value summed up across all links"
GPM_GRAPHICS_UTIL, GPM_SM_UTIL, GPM_ANY_TENSOR_UTIL = 1, 2, 5  # nvmlGpmMetricId_t, percent 0.0-100.0
MEMORY_V2 = 0x02000028  # nvmlMemory_v2 = NVML_STRUCT_VERSION(Memory, 2)


@dataclass
class GpuReading:
    """One sample of one GPU; ``None``: not read (see ``errors`` / ``unsupported``)."""

    util_gpu: float | None = None  # ratio of time a kernel ran (nvmlUtilization_t.gpu / 100)
    util_memory: float | None = None  # ratio of time memory was read or written
    memory_used: int | None = None  # bytes
    memory_total: int | None = None  # bytes
    power_watts: float | None = None
    temperature_celsius: float | None = None
    sm_clock_hertz: float | None = None
    pcie_tx_bytes_per_second: float | None = None
    pcie_rx_bytes_per_second: float | None = None
    nvlink_tx_bytes: int | None = None  # counter (all links)
    nvlink_rx_bytes: int | None = None
    ecc_corrected: int | None = None  # volatile counter
    ecc_uncorrected: int | None = None
    graphics_active: float | None = None  # GPM ratios over the interval since the previous sample
    sm_active: float | None = None
    tensor_active: float | None = None
    lost: bool = False
    errors: list[tuple[str, str]] = field(default_factory=list)
    unsupported: list[str] = field(default_factory=list)

    @property
    def activity(self) -> float | None:
        """Compute activity for the idle rule: GPM SM activity where the GPU has GPM, else NVML utilisation."""
        return self.sm_active if self.sm_active is not None else self.util_gpu

    @property
    def memory_ratio(self) -> float | None:
        if self.memory_used is None or not self.memory_total:
            return None
        return self.memory_used / self.memory_total


class _Lost(Exception):
    pass


class GpuReader:
    """Reads one GPU; ``open`` once (in the sampler's thread, after ``nvmlInit``), ``read`` per sample."""

    def __init__(self, nvml: Any, uuid: str) -> None:
        self.nvml = nvml
        self.uuid = uuid
        self.handle: Any = None
        self.index: int | None = None
        self._gpm: bool | None = None  # None: not asked yet
        self._samples: list[Any] = []  # two GPM sample buffers: [previous, next]
        self._have_previous = False

    def _error_name(self, e: BaseException) -> str:
        return type(e).__name__.removeprefix("NVMLError_") if isinstance(e, self.nvml.NVMLError) else type(e).__name__

    def _call(self, r: GpuReading, call: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, or None with the failure recorded; raises ``_Lost`` on GPU_IS_LOST."""
        try:
            return fn()
        except AttributeError:  # the binding (or FakeNvml) has no such call
            r.unsupported.append(call)
            return None
        except self.nvml.NVMLError as e:
            name = self._error_name(e)
            if name in ("NotSupported", "FunctionNotFound"):
                r.unsupported.append(call)
                return None
            r.errors.append((call, name))
            if name == "GpuIsLost":
                raise _Lost from None
            return None

    def _resolve(self, r: GpuReading) -> bool:
        if self.handle is not None:
            return True
        h = self._call(r, "nvmlDeviceGetHandleByUUID", lambda: self.nvml.nvmlDeviceGetHandleByUUID(self.uuid))
        if h is None:
            return False
        self.handle = h
        with contextlib.suppress(Exception):
            self.index = int(self.nvml.nvmlDeviceGetIndex(h))
        return True

    def read(self) -> GpuReading:
        r = GpuReading()
        try:
            if self._resolve(r):
                self._read(r)
        except _Lost:
            r = GpuReading(lost=True, errors=r.errors, unsupported=r.unsupported)
            self._have_previous = False
        return r

    def _read(self, r: GpuReading) -> None:
        nv, h = self.nvml, self.handle
        u = self._call(r, "nvmlDeviceGetUtilizationRates", lambda: nv.nvmlDeviceGetUtilizationRates(h))
        if u is not None:
            r.util_gpu, r.util_memory = _ratio(u.gpu), _ratio(u.memory)
        m = self._call(r, "nvmlDeviceGetMemoryInfo_v2", lambda: nv.nvmlDeviceGetMemoryInfo(h, version=MEMORY_V2))
        if m is not None:
            r.memory_used, r.memory_total = int(m.used), int(m.total)
        mw = self._call(r, "nvmlDeviceGetPowerUsage", lambda: nv.nvmlDeviceGetPowerUsage(h))
        r.power_watts = None if mw is None else int(mw) / 1000.0
        t = self._call(r, "nvmlDeviceGetTemperature", lambda: nv.nvmlDeviceGetTemperature(h, TEMPERATURE_GPU))
        r.temperature_celsius = None if t is None else float(t)
        c = self._call(r, "nvmlDeviceGetClockInfo", lambda: nv.nvmlDeviceGetClockInfo(h, CLOCK_SM))
        r.sm_clock_hertz = None if c is None else int(c) * 1e6
        tx = self._call(r, "nvmlDeviceGetPcieThroughput", lambda: nv.nvmlDeviceGetPcieThroughput(h, PCIE_TX))
        rx = None if tx is None else self._call(r, "nvmlDeviceGetPcieThroughput",
                                                lambda: nv.nvmlDeviceGetPcieThroughput(h, PCIE_RX))
        if tx is not None and rx is not None:  # KB/s (nvml.h "1KB granularity")
            r.pcie_tx_bytes_per_second, r.pcie_rx_bytes_per_second = int(tx) * 1000.0, int(rx) * 1000.0
        self._nvlink(r)
        ce = self._call(r, "nvmlDeviceGetTotalEccErrors",
                        lambda: nv.nvmlDeviceGetTotalEccErrors(h, ECC_CORRECTED, VOLATILE_ECC))
        ue = None if ce is None else self._call(r, "nvmlDeviceGetTotalEccErrors",
                                                lambda: nv.nvmlDeviceGetTotalEccErrors(h, ECC_UNCORRECTED,
                                                                                       VOLATILE_ECC))
        if ce is not None and ue is not None:
            r.ecc_corrected, r.ecc_uncorrected = int(ce), int(ue)
        self._gpm_read(r)

    def _nvlink(self, r: GpuReading) -> None:
        vals = self._call(r, "nvmlDeviceGetFieldValues", lambda: self.nvml.nvmlDeviceGetFieldValues(
            self.handle, [(FI_NVLINK_DATA_TX, ALL_LINKS), (FI_NVLINK_DATA_RX, ALL_LINKS)]))
        if vals is None:
            return
        out = []
        for v in vals:
            ret = int(v.nvmlReturn)
            if ret == 0:
                out.append(int(v.value.ullVal) * 1024)
                continue
            try:
                raise self.nvml.NVMLError(ret)
            except self.nvml.NVMLError as e:
                name = self._error_name(e)
            if name == "GpuIsLost":
                r.errors.append(("nvmlDeviceGetFieldValues", name))
                raise _Lost
            if name == "NotSupported":
                r.unsupported.append("nvlink")
            else:
                r.errors.append(("nvmlDeviceGetFieldValues", name))
            return
        r.nvlink_tx_bytes, r.nvlink_rx_bytes = out

    def _gpm_read(self, r: GpuReading) -> None:
        """GPM metrics over the interval since the previous sample (nvml.h: "Calculate GPM metrics from two
        samples"); the first sample after start or a loss gives none."""
        nv = self.nvml
        if self._gpm is None:
            s = self._call(r, "nvmlGpmQueryDeviceSupport", lambda: nv.nvmlGpmQueryDeviceSupport(self._gpm_device))
            if s is None:
                if "nvmlGpmQueryDeviceSupport" in r.unsupported:
                    self._gpm = False
                return
            self._gpm = bool(s.isSupportedDevice)
            if self._gpm:
                bufs = [self._call(r, "nvmlGpmSampleAlloc", nv.nvmlGpmSampleAlloc) for _ in range(2)]
                if any(b is None for b in bufs):
                    self._free(bufs)
                    self._gpm = None  # asked again next time
                    return
                self._samples = bufs
        if not self._gpm:
            r.unsupported.append("gpm")
            return
        previous, nxt = self._samples
        got = self._gpm_sample(r, nxt)
        if got is None:
            self._have_previous = False
            return
        if self._have_previous:
            mg = nv.c_nvmlGpmMetricsGet_t()
            mg.version = int(getattr(nv, "NVML_GPM_METRICS_GET_VERSION", 1))
            mg.numMetrics = 3
            mg.sample1, mg.sample2 = previous, nxt
            for k, mid in enumerate((GPM_GRAPHICS_UTIL, GPM_SM_UTIL, GPM_ANY_TENSOR_UTIL)):
                mg.metrics[k].metricId = mid
            out = self._call(r, "nvmlGpmMetricsGet", lambda: nv.nvmlGpmMetricsGet(mg))
            if out is not None:
                vals = [float(out.metrics[k].value) / 100.0 if int(out.metrics[k].nvmlReturn) == 0 else None
                        for k in range(3)]
                for k in range(3):
                    if vals[k] is None:
                        r.errors.append(("nvmlGpmMetricsGet", f"metric{(1, 2, 5)[k]}-{int(out.metrics[k].nvmlReturn)}"))
                r.graphics_active, r.sm_active, r.tensor_active = (_clamp(v) for v in vals)
        self._samples = [nxt, previous]
        self._have_previous = True

    @property
    def _gpm_device(self) -> Any:
        return self.handle

    def _gpm_sample(self, r: GpuReading, buf: Any) -> Any:
        return self._call(r, "nvmlGpmSampleGet", lambda: self.nvml.nvmlGpmSampleGet(self.handle, buf))

    def _free(self, bufs: list[Any]) -> None:
        for b in bufs:
            if b is not None:
                with contextlib.suppress(Exception):
                    self.nvml.nvmlGpmSampleFree(b)

    def close(self) -> None:
        self._free(self._samples)
        self._samples = []
        self._have_previous = False


class MigReader(GpuReader):
    """Reads one MIG device: only what NVML gives per instance (docs/telemetry.md, *MIG*).

    - memory: ``nvmlDeviceGetMemoryInfo_v2`` on the MIG device handle (nvml.h: "Per-instance information can be
      queried by using specific MIG device handles"); its total is the instance's;
    - GPM activity of its GPU instance: ``nvmlGpmMigSampleGet(parent, GPU instance id)`` (Hopper and later).

    Utilisation is not read (nvml.h: "On MIG-enabled GPUs, querying device utilization rates is not currently
    supported"); power, temperature, clocks, PCIe, NVLink and ECC are the parent GPU's and stay on its series.
    ``index`` is the parent's NVML index (what dcgm-exporter's ``gpu`` label says on MIG series)."""

    def __init__(self, nvml: Any, uuid: str, parent_uuid: str, gpu_instance: int) -> None:
        super().__init__(nvml, uuid)
        self.parent_uuid = parent_uuid
        self.gpu_instance = gpu_instance
        self.parent: Any = None

    def _resolve(self, r: GpuReading) -> bool:
        if self.handle is not None:
            return True
        p = self._call(r, "nvmlDeviceGetHandleByUUID", lambda: self.nvml.nvmlDeviceGetHandleByUUID(self.parent_uuid))
        h = None if p is None else self._call(r, "nvmlDeviceGetHandleByUUID",
                                               lambda: self.nvml.nvmlDeviceGetHandleByUUID(self.uuid))
        if h is None:
            return False
        self.parent, self.handle = p, h
        with contextlib.suppress(Exception):
            self.index = int(self.nvml.nvmlDeviceGetIndex(p))
        return True

    def _read(self, r: GpuReading) -> None:
        nv, h = self.nvml, self.handle
        m = self._call(r, "nvmlDeviceGetMemoryInfo_v2", lambda: nv.nvmlDeviceGetMemoryInfo(h, version=MEMORY_V2))
        if m is not None:
            r.memory_used, r.memory_total = int(m.used), int(m.total)
        self._gpm_read(r)

    @property
    def _gpm_device(self) -> Any:
        return self.parent

    def _gpm_sample(self, r: GpuReading, buf: Any) -> Any:
        return self._call(r, "nvmlGpmMigSampleGet",
                          lambda: self.nvml.nvmlGpmMigSampleGet(self.parent, self.gpu_instance, buf))


def _ratio(pct: Any) -> float:
    return max(0.0, min(100.0, float(pct))) / 100.0


def _clamp(v: float | None) -> float | None:
    return None if v is None else max(0.0, min(1.0, v))


EVENT_XID = 0x8  # nvmlEventTypeXidCriticalError


class XidEvents:
    """XID events since the last drain, from NVML event sets of the sampler's own (the health monitor keeps its
    own: NVML delivers each event to every set registered for it). One set per GPU: while a registered GPU is
    lost, a set's wait answers GPU_IS_LOST at every call and delivers nothing, so one lost GPU must not hide the
    XIDs of the others."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml
        self._sets: list[tuple[str, Any]] = []

    def open(self, handles: dict[str, Any]) -> None:
        """``handles``: device name → NVML handle of the GPUs to watch; a binding without events leaves it off."""
        for name, h in handles.items():
            try:
                es = self.nvml.nvmlEventSetCreate()
            except (self.nvml.NVMLError, AttributeError) as e:
                log.info("telemetry: no NVML event set (%s); XID counts are not sampled", e)
                return
            try:
                self.nvml.nvmlDeviceRegisterEvents(h, EVENT_XID, es)
            except (self.nvml.NVMLError, AttributeError) as e:
                log.info("telemetry: %s: XID events not available (%s)", name, e)
                with contextlib.suppress(Exception):
                    self.nvml.nvmlEventSetFree(es)
                continue
            self._sets.append((name, es))

    def drain(self, limit: int = 1024) -> list[tuple[str, int]]:
        """(device name, XID code) of the events queued now; never waits."""
        out: list[tuple[str, int]] = []
        for name, es in self._sets:
            while len(out) < limit:
                try:
                    ev = self.nvml.nvmlEventSetWait_v2(es, 0)
                except self.nvml.NVMLError:
                    break  # TIMEOUT: nothing queued (GPU_IS_LOST: the reads report the loss)
                if int(ev.eventType) & EVENT_XID:
                    out.append((name, int(ev.eventData)))
        return out

    def close(self) -> None:
        for _name, es in self._sets:
            with contextlib.suppress(Exception):
                self.nvml.nvmlEventSetFree(es)
        self._sets = []
