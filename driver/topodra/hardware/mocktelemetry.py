"""Telemetry answers of ``FakeNvml`` (mock profiles): the same scenario and nvml.h rules as the C stand-in's
``hack/nvml-standin/telemetry.inc``, so one faults file drives both (``GpuFaults.telemetry``).

Absent keys read as an idle GPU (power 60 W, 30 C, SM clock 1980 MHz, everything else 0); ``unsupported`` names
reads that answer NOT_SUPPORTED; ``mig`` holds per GPU-instance figures (memory on the MIG device handle, GPM of
the GPU instance), as in the stand-in. Counters (NVLink KiB, GPM activity) integrate the scenario's rates over time per
process, as the stand-in does. GPM samples are real ctypes buffers, so pynvml's ``c_nvmlGpmMetricsGet_t`` can
carry them.
"""

from __future__ import annotations

import ctypes
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pynvml
from pydantic import BaseModel, ConfigDict, Field

HOPPER = 9  # NVML_DEVICE_ARCH_HOPPER
NVLINK_TX, NVLINK_RX = 138, 139
ALL_LINKS = 0xFFFFFFFF
GPM_METRICS = {1: "graphicsActivity", 2: "smActivity", 5: "tensorActivity"}


class MigTelemetry(BaseModel):
    """One GPU instance's scenario (MIG on): what NVML gives per instance."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    memoryUsed: int = Field(default=0, ge=0)
    smActivity: float = Field(default=0, ge=0, le=100)
    tensorActivity: float = Field(default=0, ge=0, le=100)
    graphicsActivity: float = Field(default=0, ge=0, le=100)


class GpuTelemetry(BaseModel):
    """One GPU's scenario (units as NVML answers them); ``mig``: per GPU-instance id, with MIG on."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    utilGpu: float = Field(default=0, ge=0, le=100)
    utilMemory: float = Field(default=0, ge=0, le=100)
    memoryUsed: int = Field(default=0, ge=0)
    powerMw: int = Field(default=60000, ge=0)
    temperatureC: int = 30
    smClockMhz: int = Field(default=1980, ge=0)
    pcieTxKBps: int = Field(default=0, ge=0)
    pcieRxKBps: int = Field(default=0, ge=0)
    nvlinkTxKiBps: float = Field(default=0, ge=0)
    nvlinkRxKiBps: float = Field(default=0, ge=0)
    smActivity: float = Field(default=0, ge=0, le=100)
    tensorActivity: float = Field(default=0, ge=0, le=100)
    graphicsActivity: float = Field(default=0, ge=0, le=100)
    eccCorrected: int = Field(default=0, ge=0)
    eccUncorrected: int = Field(default=0, ge=0)
    unsupported: tuple[str, ...] = ()
    mig: dict[str, MigTelemetry] = Field(default_factory=dict)

    def instance(self, gi: int) -> MigTelemetry:
        return self.mig.get(str(gi)) or MigTelemetry()


@dataclass
class _Acc:
    t: float | None = None
    sums: dict[str, float] = field(default_factory=dict)


class TelemetryState:
    """Per-process integrals and GPM sample buffers of one ``FakeNvml``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._acc: dict[int | tuple[int, int], _Acc] = {}  # GPU index, or (GPU index, GPU-instance id)
        self._samples: dict[int, tuple[Any, dict[str, Any] | None]] = {}  # buffer address -> (buffer, sample)

    def advance(self, index: int | tuple[int, int], tel: GpuTelemetry | MigTelemetry) -> tuple[float, dict[str, float]]:
        now = time.monotonic()
        with self._lock:
            a = self._acc.setdefault(index, _Acc())
            if a.t is not None:
                dt = now - a.t
                for key in ("nvlinkTxKiBps", "nvlinkRxKiBps", *GPM_METRICS.values()):
                    a.sums[key] = a.sums.get(key, 0.0) + float(getattr(tel, key, 0.0)) * dt
            a.t = now
            return now, dict(a.sums)

    def alloc(self) -> Any:
        buf = ctypes.create_string_buffer(16)
        with self._lock:
            self._samples[ctypes.addressof(buf)] = (buf, None)
        return ctypes.cast(buf, pynvml.c_nvmlGpmSample_t)

    def _addr(self, sample: Any) -> int | None:
        try:
            return ctypes.cast(sample, ctypes.c_void_p).value
        except (TypeError, ctypes.ArgumentError):
            return None

    def free(self, sample: Any) -> bool:
        with self._lock:
            return self._samples.pop(self._addr(sample) or 0, None) is not None

    def put(self, sample: Any, value: dict[str, Any]) -> bool:
        addr = self._addr(sample)
        with self._lock:
            if addr not in self._samples:
                return False
            self._samples[addr] = (self._samples[addr][0], value)
            return True

    def get(self, sample: Any) -> dict[str, Any] | None:
        with self._lock:
            entry = self._samples.get(self._addr(sample) or 0)
        return None if entry is None else entry[1]
