"""Mock hardware: a fake ``pynvml`` module object and a generated sysfs tree.

``FakeNvml`` answers NVML queries from ``NvmlFacts`` using pynvml's own
constants, error classes and ctypes structs, so ``NvmlBackend`` cannot tell it
from the real module.  ``MockHardware`` ties a profile to a node name and a
sysfs tree and can change the hardware later (e.g. hide a GPU) to exercise
rediscovery.  ``mock_backend`` builds the real ``NvmlBackend`` on it.  Tests
may replace any ``nvml*`` function on a ``FakeNvml`` instance, or ``remove``
one to mimic an older binding.

Faults are injected at run time through a JSON file (``MockFaults``, the mock
hardware-config key ``faultsFile``) that ``FakeNvml`` re-reads when it changes:
lost GPUs, NVLink links down, clock-event reasons, and XID/ECC events delivered
once through NVML event sets.  NIC port faults are plain writes to the sysfs
tree (``.../ports/1/state``, ``phys_state``), which a tree under ``sysfs_root``
keeps until the mock hardware itself changes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
import uuid as uuidlib
from dataclasses import dataclass, field
from typing import Any, Literal

import pynvml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from topodra.hardware.base import DiscoveryConfig
from topodra.hardware.facts import FabricFacts, GpuFacts, LinkFacts, NvmlErr, NvmlFacts, PciFacts, shared_root
from topodra.hardware.mockmig import FakeMig, FakeMigDeviceHandle
from topodra.hardware.mockprofile import Fabric, Profile, build_facts, build_tree
from topodra.hardware.mocktelemetry import (
    ALL_LINKS,
    GPM_METRICS,
    HOPPER,
    NVLINK_RX,
    NVLINK_TX,
    GpuTelemetry,
    TelemetryState,
)
from topodra.hardware.nvml import NvmlBackend
from topodra.hardware.sysfs import Sysfs

log = logging.getLogger(__name__)
_ERROR_CODES: dict[str, int] = {
    cls.__name__.removeprefix("NVMLError_"): code
    for code, cls in pynvml.NVMLError._valClassMapping.items()  # the binding's own name table
}
_SHARED_PREFIXES = ("NVML_", "NVMLError", "c_nvml", "nvmlPciInfo", "nvmlMemory", "nvmlFriendlyObject")
# pynvml's constants, error classes and structs, collected once (not per FakeNvml: there is one per mock node).
_SHARED: dict[str, Any] = {name: getattr(pynvml, name) for name in dir(pynvml) if name.startswith(_SHARED_PREFIXES)}


def nvml_error(name: str) -> pynvml.NVMLError:
    """The pynvml exception for an error name such as "NotSupported" or "Unknown"."""
    if name not in _ERROR_CODES:
        raise ValueError(f"unknown NVML error name {name!r}; known: {', '.join(sorted(_ERROR_CODES))}")
    return pynvml.NVMLError(_ERROR_CODES[name])


@dataclass(frozen=True)
class FakeHandle:
    index: int


GpuRef = int | str  # NVML index, or the GPU's UUID


class GpuFaults(BaseModel):
    """Faults of one GPU that last while they are in the file (level state)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    lost: bool = False  # every per-GPU call fails with NVML_ERROR_GPU_IS_LOST
    nvlinksDown: tuple[int, ...] = ()  # nvmlDeviceGetNvLinkState answers DISABLED for these links
    clocksEventReasons: int = Field(default=0, ge=0)  # nvmlDeviceGetCurrentClocksEventReasons bitmask
    # nvmlGpuRecoveryAction_t answered for field NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (0 NONE, 1 GPU_RESET, ...).
    recoveryAction: int = Field(default=0, ge=0)
    # The telemetry scenario (mocktelemetry.GpuTelemetry; the C stand-in reads the same key).
    telemetry: GpuTelemetry | None = None


class FaultEvent(BaseModel):
    """One NVML event; each is delivered once to every event set registered for it (append, never reorder)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    gpu: GpuRef
    type: Literal["xid", "sbe", "dbe"]
    data: int = 0  # the XID code for "xid"
    # The MIG instance the event is about (nvmlEventData_t); absent: the whole GPU (NVML sends 0xFFFFFFFF).
    gi: int | None = Field(default=None, ge=0)
    ci: int | None = Field(default=None, ge=0)


class MockFaults(BaseModel):
    """The fault-injection file: ``{"gpus": {"<index or uuid>": {...}}, "events": [...]}``."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    gpus: dict[str, GpuFaults] = Field(default_factory=dict)
    events: list[FaultEvent] = Field(default_factory=list)


_EVENT_BITS = {"sbe": 0x1, "dbe": 0x2, "xid": 0x8}  # nvmlEventType* values
WHOLE_GPU = 0xFFFFFFFF  # nvmlEventData_t gpuInstanceId/computeInstanceId of an event about the whole GPU
FI_GPU_RECOVERY_ACTION = int(getattr(pynvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", 230))


@dataclass
class FakeEventSet:
    cursor: int
    registered: dict[int, int] = field(default_factory=dict)  # GPU index -> event type mask


@dataclass(frozen=True)
class FakeEventData:
    """Shaped like pynvml's c_nvmlEventData_t."""

    device: FakeHandle
    eventType: int
    eventData: int
    gpuInstanceId: int = WHOLE_GPU
    computeInstanceId: int = WHOLE_GPU


class FakeNvml(FakeMig):
    """A ``pynvml``-compatible object serving ``NvmlFacts`` (plus injected faults, if a file is given).

    MIG instances (``FakeMig``) are kept in ``mig_state_file`` when given, so they outlive the process.
    """

    def __init__(self, facts: NvmlFacts, faults_file: str | None = None, mig_state_file: str | None = None) -> None:
        self.__dict__.update(_SHARED)
        self._mig_init(mig_state_file)
        self.facts = facts
        self.init_count = 0
        self.hardware: MockHardware | None = None
        self.faults_file = faults_file
        self._faults = MockFaults()
        self._faults_stamp: tuple[int, int] | None = None
        self._faults_lock = threading.Lock()
        self._telemetry = TelemetryState()

    # -- injected faults --------------------------------------------------------------------------

    def faults(self) -> MockFaults:
        """The fault file's content, re-read when it changed; a bad file is logged and the last good kept."""
        if self.faults_file is None:
            return self._faults
        with self._faults_lock:
            try:
                st = os.stat(self.faults_file)
            except FileNotFoundError:
                self._faults, self._faults_stamp = MockFaults(), None
                return self._faults
            stamp = (st.st_mtime_ns, st.st_size)
            if stamp != self._faults_stamp:
                try:
                    with open(self.faults_file, encoding="utf-8") as f:
                        self._faults = MockFaults.model_validate(json.load(f))
                except (OSError, ValueError, ValidationError) as e:
                    log.error("mock faults file %s is unusable, keeping the previous faults: %s", self.faults_file, e)
                self._faults_stamp = stamp
            return self._faults

    def _gpu_faults(self, index: int) -> GpuFaults:
        gpus = self.faults().gpus
        if not gpus:
            return GpuFaults()
        uuid = self.facts.gpus[index].uuid
        return gpus.get(str(index)) or (gpus.get(uuid) if isinstance(uuid, str) else None) or GpuFaults()

    def _index_of(self, ref: GpuRef) -> int | None:
        if isinstance(ref, int):
            return ref if 0 <= ref < len(self.facts.gpus) else None
        return next((i for i, g in enumerate(self.facts.gpus) if g.uuid == ref), None)

    def remove(self, fn_name: str) -> None:
        """Make ``fn_name`` disappear from this instance, as in an older nvidia-ml-py.

        The instance moves to a subclass where the name is a property raising
        AttributeError, so ``getattr(nvml, name, None)`` is None and no other
        attribute lookup pays for the feature.
        """

        def gone(_: FakeNvml) -> Any:
            raise AttributeError(fn_name)

        self.__class__ = type(type(self).__name__, (type(self),), {fn_name: property(gone)})

    # -- helpers ----------------------------------------------------------------------------------

    @staticmethod
    def _ans(v: Any) -> Any:
        if isinstance(v, NvmlErr):
            raise nvml_error(v.error)
        return v

    def _gpu(self, h: Any) -> GpuFacts:
        if self.init_count <= 0:
            raise nvml_error("Uninitialized")
        if not isinstance(h, FakeHandle) or not 0 <= h.index < len(self.facts.gpus):
            raise nvml_error("InvalidArgument")
        if self._gpu_faults(h.index).lost:
            raise nvml_error("GpuIsLost")
        return self.facts.gpus[h.index]

    def _link(self, h: Any, link: int) -> LinkFacts:
        links = self._ans(self._gpu(h).nvlinks)
        if not 0 <= link < len(links):
            raise nvml_error("InvalidArgument")
        out: LinkFacts = links[link]
        return out

    @staticmethod
    def _pci_struct(bus_id: str, device_id: int = 0, subsys: int = 0) -> Any:
        s = pynvml.nvmlPciInfo_t()
        domain, bus, rest = bus_id.split(":")
        s.busId = bus_id.encode()
        s.busIdLegacy = bus_id[4:].encode()
        s.domain, s.bus, s.device = int(domain, 16), int(bus, 16), int(rest.split(".")[0], 16)
        s.pciDeviceId, s.pciSubSystemId = device_id, subsys
        return s

    # -- system -----------------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        if self.facts.init is not None:
            raise nvml_error(self.facts.init.error)
        self.init_count += 1

    def nvmlInitWithFlags(self, flags: int) -> None:
        self.nvmlInit()

    def nvmlShutdown(self) -> None:
        if self.init_count <= 0:
            raise nvml_error("Uninitialized")
        self.init_count -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        return str(self._ans(self.facts.driverVersion))

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return int(self._ans(self.facts.cudaDriverVersion))

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        return int(self._ans(self.facts.cudaDriverVersion))

    def nvmlDeviceGetCount(self) -> int:
        if self.init_count <= 0:
            raise nvml_error("Uninitialized")
        return len(self.facts.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        self._gpu(FakeHandle(index))
        return FakeHandle(index)

    # -- per GPU ----------------------------------------------------------------------------------

    def nvmlDeviceGetUUID(self, h: Any) -> str:
        if isinstance(h, FakeMigDeviceHandle):
            return self.mig_device_uuid(h)
        return str(self._ans(self._gpu(h).uuid))

    def nvmlDeviceGetName(self, h: Any) -> str:
        return str(self._ans(self._gpu(h).name))

    def nvmlDeviceGetMemoryInfo(self, h: Any, version: Any = None) -> Any:
        if isinstance(h, FakeMigDeviceHandle):  # the instance's own (nvml.h: "Per-instance information ...")
            g, gi = self.mig_instance(h)
            total = self._profile(g, pid=gi.profileId).memorySizeMB << 20
            used = min(total, self._scenario(h).instance(h.gi).memoryUsed)
        else:
            g = self._gpu(h)
            total = int(self._ans(g.memoryTotal))
            used = min(total, self._scenario(h).memoryUsed)
            if isinstance(g.migMode, tuple) and g.migMode[0] == 1:  # "aggregate information" in MIG mode
                tel = self._scenario(h)
                used = min(total, sum(min(self._profile(g, pid=x.profileId).memorySizeMB << 20,
                                          tel.instance(x.id).memoryUsed)
                                      for x in self.gpu_instances_of(str(g.uuid))))
        if version:
            return pynvml.c_nvmlMemory_v2_t(version=version, total=total, reserved=0, free=total - used, used=used)
        return pynvml.c_nvmlMemory_t(total=total, free=total - used, used=used)

    def nvmlDeviceGetPciInfo(self, h: Any) -> Any:
        p: PciFacts = self._ans(self._gpu(h).pci)
        return self._pci_struct(p.busId, p.pciDeviceId, p.pciSubSystemId)

    def nvmlDeviceGetIndex(self, h: Any) -> int:
        """The NVML index (the telemetry series' ``gpu`` label); a MIG device handle has none (the stand-in's
        NOT_SUPPORTED)."""
        if isinstance(h, FakeMigDeviceHandle):
            raise nvml_error("NotSupported")
        self._gpu(h)
        return int(h.index)

    def nvmlDeviceGetMinorNumber(self, h: Any) -> int:
        return int(self._ans(self._gpu(h).minor))

    def nvmlDeviceGetBrand(self, h: Any) -> int:
        return int(self._ans(self._gpu(h).brand))

    def nvmlDeviceGetArchitecture(self, h: Any) -> int:
        return int(self._ans(self._gpu(h).architecture))

    def nvmlDeviceGetCudaComputeCapability(self, h: Any) -> tuple[int, int]:
        major, minor = self._ans(self._gpu(h).computeCapability)
        return int(major), int(minor)

    def nvmlDeviceGetMigMode(self, h: Any) -> list[int]:
        return list(self._ans(self._gpu(h).migMode))

    def nvmlDeviceGetNumaNodeId(self, h: Any) -> int:
        return int(self._ans(self._gpu(h).numaNodeId))

    def nvmlDeviceGetNvLinkState(self, h: Any, link: int) -> int:
        state = int(self._ans(self._link(h, link).state))
        return 0 if link in self._gpu_faults(h.index).nvlinksDown else state

    def nvmlDeviceGetNvLinkVersion(self, h: Any, link: int) -> int:
        return int(self._ans(self._link(h, link).version))

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h: Any, link: int) -> int:
        return int(self._ans(self._link(h, link).remoteType))

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h: Any, link: int) -> Any:
        return self._pci_struct(str(self._ans(self._link(h, link).remoteBusId)))

    def _fill_fabric(self, h: Any, ref: Any, min_api: int) -> int:
        fab: FabricFacts = self._ans(self._gpu(h).fabric)
        target = ref._obj  # ctypes.byref(struct) -> the struct
        struct_api = {"c_nvmlGpuFabricInfo_t": 1, "c_nvmlGpuFabricInfo_v2_t": 2, "c_nvmlGpuFabricInfo_v3_t": 3}
        api = struct_api.get(type(target).__name__, 0)
        if api < min_api:
            raise nvml_error("InvalidArgument")
        if api > fab.api:
            raise nvml_error("FunctionNotFound" if fab.api == 1 else "ArgumentVersionMismatch")
        target.clusterUuid[:] = list(uuidlib.UUID(fab.clusterUuid).bytes)
        target.status, target.cliqueId, target.state = fab.status, fab.cliqueId, fab.state
        if api >= 2:
            target.healthMask = fab.healthMask
        return int(pynvml.NVML_SUCCESS)

    def nvmlDeviceGetGpuFabricInfoV(self, h: Any, ref: Any) -> int:
        return self._fill_fabric(h, ref, 2)

    def nvmlDeviceGetGpuFabricInfo(self, h: Any, ref: Any) -> int:
        return self._fill_fabric(h, ref, 1)

    # -- health: handles by UUID, clock reasons, events ---------------------------------------------

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> FakeHandle | FakeMigDeviceHandle:
        if self.init_count <= 0:
            raise nvml_error("Uninitialized")
        text = uuid.decode() if isinstance(uuid, bytes) else uuid
        index = self._index_of(text)
        if index is None and text.startswith("MIG-"):  # a MIG device UUID, as the real call takes
            for i, g in enumerate(self.facts.gpus):
                if isinstance(g.migMode, tuple) and g.migMode[0] == 1 and not self._gpu_faults(i).lost:
                    found = self.mig_handle_by_uuid(i, text)
                    if found is not None:
                        return found
        if index is None:
            raise nvml_error("NotFound")
        self._gpu(FakeHandle(index))
        return FakeHandle(index)

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: Any) -> int:
        self._gpu(h)
        return self._gpu_faults(h.index).clocksEventReasons

    def nvmlDeviceGetSupportedEventTypes(self, h: Any) -> int:
        self._gpu(h)
        return sum(_EVENT_BITS.values())

    def nvmlEventSetCreate(self) -> FakeEventSet:
        if self.init_count <= 0:
            raise nvml_error("Uninitialized")
        return FakeEventSet(cursor=len(self.faults().events))  # only events injected from now on

    def nvmlDeviceRegisterEvents(self, h: Any, event_types: int, event_set: FakeEventSet) -> None:
        self._gpu(h)
        event_set.registered[h.index] = event_set.registered.get(h.index, 0) | int(event_types)

    def nvmlEventSetFree(self, event_set: FakeEventSet) -> None:
        event_set.registered.clear()

    def nvmlDeviceGetFieldValues(self, h: Any, field_ids: list[Any]) -> Any:
        """Field values as NVML fills them: a per-field ``nvmlReturn``; only the recovery action is known here."""
        self._gpu(h)
        values = (pynvml.c_nvmlFieldValue_t * len(field_ids))()
        for i, fid in enumerate(field_ids):
            values[i].fieldId = int(fid[0] if isinstance(fid, tuple) else fid)
            if values[i].fieldId == FI_GPU_RECOVERY_ACTION:
                values[i].valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
                values[i].value.uiVal = self._gpu_faults(h.index).recoveryAction
                values[i].nvmlReturn = pynvml.NVML_SUCCESS
            elif values[i].fieldId in (NVLINK_TX, NVLINK_RX):
                self._nvlink_field(h, values[i], int(fid[1]) if isinstance(fid, tuple) else 0)
            else:
                values[i].nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return values

    # -- telemetry (same rules as hack/nvml-standin/telemetry.inc) ------------------------------------

    def _scenario(self, h: Any) -> GpuTelemetry:
        return self._gpu_faults(h.index).telemetry or GpuTelemetry()

    def _tele(self, h: Any, what: str) -> GpuTelemetry:
        self._gpu(h)
        tel = self._scenario(h)
        if what in tel.unsupported:
            raise nvml_error("NotSupported")
        return tel

    def nvmlDeviceGetUtilizationRates(self, h: Any) -> Any:
        tel = self._tele(h, "utilization")
        mig = self._gpu(h).migMode
        if not isinstance(mig, NvmlErr) and mig[0]:
            raise nvml_error("NotSupported")  # nvml.h: not supported on MIG-enabled GPUs
        return pynvml.c_nvmlUtilization_t(gpu=round(tel.utilGpu), memory=round(tel.utilMemory))

    def nvmlDeviceGetPowerUsage(self, h: Any) -> int:
        return self._tele(h, "power").powerMw

    def nvmlDeviceGetTemperature(self, h: Any, sensor: int) -> int:
        tel = self._tele(h, "temperature")
        if int(sensor) != 0:
            raise nvml_error("InvalidArgument")
        return tel.temperatureC

    def nvmlDeviceGetClockInfo(self, h: Any, clock: int) -> int:
        tel = self._tele(h, "clock")
        if int(clock) != 1:  # NVML_CLOCK_SM only
            raise nvml_error("NotSupported")
        return tel.smClockMhz

    def nvmlDeviceGetPcieThroughput(self, h: Any, counter: int) -> int:
        tel = self._tele(h, "pcie")
        if int(counter) not in (0, 1):
            raise nvml_error("InvalidArgument")
        return tel.pcieTxKBps if int(counter) == 0 else tel.pcieRxKBps

    def nvmlDeviceGetTotalEccErrors(self, h: Any, error_type: int, counter_type: int) -> int:
        tel = self._tele(h, "ecc")
        if int(error_type) not in (0, 1) or int(counter_type) not in (0, 1):
            raise nvml_error("InvalidArgument")
        return tel.eccCorrected if int(error_type) == 0 else tel.eccUncorrected

    def _nvlink_field(self, h: Any, v: Any, scope: int) -> None:
        links = self._gpu(h).nvlinks
        active = [] if isinstance(links, NvmlErr) else [i for i, lk in enumerate(links) if lk.state == 1]
        tel = self._scenario(h)
        if not active or "nvlink" in tel.unsupported:
            v.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
            return
        if scope != ALL_LINKS and scope not in active:
            v.nvmlReturn = pynvml.NVML_ERROR_INVALID_ARGUMENT
            return
        _t, sums = self._telemetry.advance(h.index, tel)
        kib = sums.get("nvlinkTxKiBps" if v.fieldId == NVLINK_TX else "nvlinkRxKiBps", 0.0)
        v.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
        v.value.ullVal = int(kib if scope == ALL_LINKS else kib / len(active))
        v.nvmlReturn = pynvml.NVML_SUCCESS

    def _gpm_capable(self, h: Any) -> bool:
        arch = self._gpu(h).architecture
        return isinstance(arch, int) and arch >= HOPPER and "gpm" not in self._scenario(h).unsupported

    def nvmlGpmQueryDeviceSupport(self, h: Any) -> Any:
        return pynvml.c_nvmlGpmSupport_t(version=pynvml.NVML_GPM_SUPPORT_VERSION,
                                          isSupportedDevice=int(self._gpm_capable(h)))

    def nvmlGpmSampleAlloc(self) -> Any:
        return self._telemetry.alloc()

    def nvmlGpmSampleFree(self, sample: Any) -> None:
        if not self._telemetry.free(sample):
            raise nvml_error("InvalidArgument")

    def nvmlGpmSampleGet(self, h: Any, sample: Any) -> Any:
        if isinstance(h, FakeMigDeviceHandle):  # nvml.h: "supports the device handle and MIG device handle"
            return self.nvmlGpmMigSampleGet(FakeHandle(h.index), h.gi, sample)
        self._gpu(h)
        if not self._gpm_capable(h):
            raise nvml_error("NotSupported")
        t, sums = self._telemetry.advance(h.index, self._scenario(h))
        if not self._telemetry.put(sample, {"gpu": h.index, "gi": -1, "t": t, **sums}):
            raise nvml_error("InvalidArgument")
        return sample

    def nvmlGpmMigSampleGet(self, h: Any, gpu_instance: int, sample: Any) -> Any:
        """GPM of one GPU instance (the stand-in's rules: a MIG device handle or MIG off NotSupported, an id no
        instance has NotFound)."""
        if isinstance(h, FakeMigDeviceHandle):
            raise nvml_error("NotSupported")
        g = self._gpu(h)
        if not self._gpm_capable(h) or not (isinstance(g.migMode, tuple) and g.migMode[0] == 1):
            raise nvml_error("NotSupported")
        gi = int(gpu_instance)
        self.mig_instance(FakeMigDeviceHandle(h.index, gi, 0))
        t, sums = self._telemetry.advance((h.index, gi), self._scenario(h).instance(gi))
        if not self._telemetry.put(sample, {"gpu": h.index, "gi": gi, "t": t, **sums}):
            raise nvml_error("InvalidArgument")
        return sample

    def nvmlGpmMetricsGet(self, mg: Any) -> Any:
        if self.init_count <= 0:
            raise nvml_error("Uninitialized")
        if int(mg.version) != pynvml.NVML_GPM_METRICS_GET_VERSION:
            raise nvml_error("ArgumentVersionMismatch")
        a, b = self._telemetry.get(mg.sample1), self._telemetry.get(mg.sample2)
        if a is None or b is None or a["gpu"] != b["gpu"] or a["gi"] != b["gi"] or b["t"] <= a["t"]:
            raise nvml_error("InvalidArgument")
        dt = b["t"] - a["t"]
        for k in range(int(mg.numMetrics)):
            m = mg.metrics[k]
            key = GPM_METRICS.get(int(m.metricId))
            if key is None:
                m.nvmlReturn, m.value = pynvml.NVML_ERROR_NOT_SUPPORTED, 0.0
            else:
                m.nvmlReturn = pynvml.NVML_SUCCESS
                m.value = min(100.0, max(0.0, (b.get(key, 0.0) - a.get(key, 0.0)) / dt))
        return mg

    def nvmlEventSetWait_v2(self, event_set: FakeEventSet, timeout_ms: int) -> FakeEventData:
        """The next injected event for a registered GPU, waiting up to ``timeout_ms`` (else NVMLError_Timeout).

        As nvml.h documents, a registered GPU that is lost makes the wait fail with GPU_IS_LOST, at once.
        """
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            if any(self._gpu_faults(i).lost for i in event_set.registered):
                raise nvml_error("GpuIsLost")
            events = self.faults().events
            event_set.cursor = min(event_set.cursor, len(events))
            while event_set.cursor < len(events):
                ev = events[event_set.cursor]
                event_set.cursor += 1
                index = self._index_of(ev.gpu)
                bit = _EVENT_BITS[ev.type]
                if index is not None and event_set.registered.get(index, 0) & bit:
                    gi = WHOLE_GPU if ev.gi is None else ev.gi
                    ci = WHOLE_GPU if ev.ci is None else ev.ci
                    return FakeEventData(FakeHandle(index), bit, ev.data if ev.type == "xid" else 0, gi, ci)
            left = deadline - time.monotonic()
            if left <= 0:
                raise nvml_error("Timeout")
            time.sleep(min(0.05, left))


class MockHardware:
    """A profile instantiated for one node: NVML answers plus the sysfs tree they sit in.

    With ``sysfs_root`` the tree is written there and belongs to the caller (a
    test may then damage it).  Without, the node reads the process-wide tree
    that every node of the profile shares (``facts.shared_root``).
    """

    def __init__(
        self, profile: Profile, node: str, hidden: frozenset[int], fabric: Fabric, sysfs_root: str | None = None,
        faults_file: str | None = None, mig_state_file: str | None = None,
    ) -> None:
        self.profile, self.node, self.fabric = profile, node, fabric
        self._own_root = sysfs_root
        self._check(hidden)
        self.nvml = FakeNvml(build_facts(profile, node, hidden, fabric), faults_file, mig_state_file)
        self.nvml.hardware = self
        self.sysfs = Sysfs(self._place(hidden))

    def _check(self, hidden: frozenset[int]) -> None:
        bad = sorted(s for s in hidden if not 0 <= s < len(self.profile.gpus))
        if bad:
            raise ValueError(f"profile {self.profile.name} has no GPU slot(s) {bad}")

    def _place(self, hidden: frozenset[int]) -> str:
        tree = build_tree(self.profile, hidden)
        if self._own_root is None:
            return shared_root(tree)
        # Re-discovery builds the hardware again: an unchanged tree is left as it is, so faults
        # written into it (a NIC port going down) last until the test undoes them.
        digest = hashlib.sha256(tree.model_dump_json().encode()).hexdigest()
        marker = os.path.join(self._own_root, ".topodra-mock-tree")
        try:
            with open(marker, encoding="utf-8") as f:
                same = f.read() == digest and os.path.isdir(os.path.join(self._own_root, "sys"))
        except OSError:
            same = False
        if not same:
            tree.materialize(self._own_root)
            with open(marker, "w", encoding="utf-8") as f:
                f.write(digest)
        return self._own_root

    def hide_gpus(self, slots: frozenset[int] | set[int] | list[int]) -> None:
        """Make GPU slots vanish from NVML and the PCI bus (or come back, if left out)."""
        hidden = frozenset(slots)
        self._check(hidden)
        self.nvml.facts = build_facts(self.profile, self.node, hidden, self.fabric)
        self.sysfs.root = self._place(hidden)


def mock_backend(
    profile: Profile,
    node_name: str,
    *,
    config: DiscoveryConfig,
    hidden: frozenset[int] = frozenset(),
    fabric: Fabric | None = None,
    sysfs_root: str | None = None,
    faults_file: str | None = None,
    mig_state_file: str | None = None,
) -> NvmlBackend:
    """The real backend reading ``profile`` as ``node_name``'s hardware.

    Mock GPUs and NICs have no ``/dev`` nodes on this host, so the devices carry none.
    """
    hw = MockHardware(profile, node_name, hidden, fabric or profile.fabric, sysfs_root, faults_file, mig_state_file)
    return NvmlBackend(node_name, nvml=hw.nvml, sysfs=hw.sysfs, config=config, host_device_nodes=False)
