"""MIG on mock hardware: GPU-instance profiles, placements and instance create/destroy, as NVML answers them.

``FakeMig`` is mixed into ``FakeNvml``.  Profiles come from the GPU's facts
(``GpuFacts.migProfiles``, answered only while MIG mode is on).  Instances are
hardware state: like on a real GPU they outlive the process that created them,
so with ``mig_state_file`` they are kept in a JSON file that every process of
the node (a plugin, its restart after kill -9, a test) reads and changes under
a file lock.  Without a file they live in this object.

Error semantics follow the NVML reference: MIG off -> NotSupported; unknown
profile or a placement the profile does not offer -> InvalidArgument; a
placement overlapping an existing instance, or not enough compute slices left
-> InsufficientResources; destroying a GPU instance that still has compute
instances -> InUse; an instance that does not exist -> NotFound.
"""

from __future__ import annotations

import fcntl
import threading
import uuid as uuidlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml
from pydantic import BaseModel, ConfigDict, Field

from topodra.atomicfile import write_atomic
from topodra.hardware.facts import GpuFacts, MigProfileFacts

MIG_UUID_NAMESPACE = uuidlib.UUID("1b0f6c52-93a4-4a57-8d0e-5e2f4f1d7c21")
# NVML_COMPUTE_INSTANCE_PROFILE_<n>_SLICE index -> compute slices.
CI_PROFILE_SLICES: dict[int, int] = {0: 1, 1: 2, 2: 3, 3: 4, 4: 7, 5: 8, 6: 6}
# nvml.h: a compute-instance profileId is the id nvmlGpuInstanceGetComputeInstanceProfileInfo returns for an
# NVML_COMPUTE_INSTANCE_PROFILE_* index, not the index itself. The fake keeps them apart (as the C stand-in
# does) so code that passes the index where NVML wants the id fails here too (issue 19, finding 21).
CI_PROFILE_ID_BASE = 0x20
CI_ID_SLICES: dict[int, int] = {CI_PROFILE_ID_BASE + i: s for i, s in CI_PROFILE_SLICES.items()}


class FakeComputeInstance(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: int
    profileId: int
    slices: int


class FakeGpuInstance(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: int
    profileId: int
    start: int
    size: int
    slices: int
    multiprocessors: int
    computeInstances: list[FakeComputeInstance] = Field(default_factory=list)


class MigState(BaseModel):
    """Every GPU's instances, by GPU UUID: what ``mig_state_file`` holds."""

    model_config = ConfigDict(extra="forbid")
    gpus: dict[str, list[FakeGpuInstance]] = Field(default_factory=dict)
    # Time-slice level per GPU UUID (``nvidia-smi compute-policy --set-timeslice``); absent means 0 (Default).
    timeslices: dict[str, int] = Field(default_factory=dict)
    # nvmlComputeMode_t per GPU UUID (``nvidia-smi -c``; MPS sets EXCLUSIVE_PROCESS, 3); absent means 0 (DEFAULT).
    computeModes: dict[str, int] = Field(default_factory=dict)


@dataclass(frozen=True)
class FakeGpuInstanceHandle:
    index: int
    gi: int


@dataclass(frozen=True)
class FakeComputeInstanceHandle:
    index: int
    gi: int
    ci: int


@dataclass(frozen=True)
class FakeMigDeviceHandle:
    """The device handle of one MIG device (a compute instance), as nvmlDeviceGetMigDeviceHandleByIndex gives."""

    index: int
    gi: int
    ci: int


@dataclass(frozen=True)
class FakeGpuInstanceInfo:
    """Shaped like c_nvmlGpuInstanceInfo_t."""

    device: Any
    id: int
    profileId: int
    placement: Any


@dataclass(frozen=True)
class FakeComputeInstanceInfo:
    """Shaped like c_nvmlComputeInstanceInfo_t."""

    device: Any
    gpuInstance: FakeGpuInstanceHandle
    id: int
    profileId: int


def mig_uuid(gpu_uuid: str, gi: int, ci: int) -> str:
    """The MIG device UUID of compute instance ``ci`` in GPU instance ``gi`` (stable per parent and ids)."""
    return "MIG-" + str(uuidlib.uuid5(MIG_UUID_NAMESPACE, f"{gpu_uuid}/{gi}/{ci}"))


def _err(name: str) -> pynvml.NVMLError:
    from topodra.hardware.mock import nvml_error

    return nvml_error(name)


def _fake_handle(index: int) -> Any:
    from topodra.hardware.mock import FakeHandle

    return FakeHandle(index)


def _deref(ref: Any) -> Any:
    """The object behind ``ctypes.byref(x)``, or ``x`` itself."""
    return getattr(ref, "_obj", ref)


class FakeMig:
    """NVML's MIG calls over ``self.facts`` (mixed into FakeNvml, which provides ``_gpu`` and ``facts``)."""

    mig_state_file: str | None = None
    _mig_mem: MigState
    _mig_lock: threading.Lock

    def _gpu(self, h: Any) -> GpuFacts:  # provided by FakeNvml
        raise NotImplementedError

    def _mig_init(self, state_file: str | None) -> None:
        self.mig_state_file = state_file
        self._mig_mem = MigState()
        self._mig_lock = threading.Lock()

    # -- state ------------------------------------------------------------------------------------

    @contextmanager
    def _mig_state(self, write: bool) -> Iterator[MigState]:
        """The instances, read (and written back if ``write``) under a lock shared by all processes of the node."""
        with self._mig_lock:
            if self.mig_state_file is None:
                yield self._mig_mem
                return
            path = Path(self.mig_state_file)
            with open(path.with_name(path.name + ".lock"), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                try:
                    state = MigState.model_validate_json(path.read_bytes()) if path.exists() else MigState()
                    yield state
                    if write:
                        write_atomic(path, state.model_dump_json(indent=1).encode(), sync="none")
                finally:
                    fcntl.flock(lock, fcntl.LOCK_UN)

    def mig_instances(self) -> dict[str, list[FakeGpuInstance]]:
        """Every GPU's instances now (for tests and the CLI), by GPU UUID."""
        with self._mig_state(write=False) as st:
            return {k: list(v) for k, v in st.gpus.items() if v}

    # -- time slicing (what ``nvidia-smi compute-policy`` sets on a real GPU; topodra.sharing.timeslice) -----

    def _gpu_by_uuid(self, uuid: str) -> GpuFacts:
        """A tool outside the plugin's NVML session (nvidia-smi) opens its own."""
        nvml: Any = self
        nvml.nvmlInit()
        try:
            return self._gpu(nvml.nvmlDeviceGetHandleByUUID(uuid))
        finally:
            nvml.nvmlShutdown()

    def set_timeslice(self, uuid: str, level: int) -> None:
        """Record the GPU's time-slice level; NotFound for an unknown GPU, InvalidArgument outside 0..3."""
        g = self._gpu_by_uuid(uuid)
        if level not in range(4):
            raise _err("InvalidArgument")
        with self._mig_state(write=True) as st:
            if level == 0:
                st.timeslices.pop(str(g.uuid), None)
            else:
                st.timeslices[str(g.uuid)] = level

    def get_timeslice(self, uuid: str) -> int | None:
        g = self._gpu_by_uuid(uuid)
        with self._mig_state(write=False) as st:
            return st.timeslices.get(str(g.uuid), 0)

    # -- compute mode (``nvidia-smi -i <uuid> -c MODE``; topodra.sharing.computemode) ----------------

    def set_compute_mode(self, uuid: str, mode: str) -> None:
        """Record the GPU's compute mode by name (DEFAULT, EXCLUSIVE_PROCESS, PROHIBITED)."""
        g = self._gpu_by_uuid(uuid)
        value = {"DEFAULT": 0, "PROHIBITED": 2, "EXCLUSIVE_PROCESS": 3}.get(mode)
        if value is None:
            raise _err("InvalidArgument")
        with self._mig_state(write=True) as st:
            if value == 0:
                st.computeModes.pop(str(g.uuid), None)
            else:
                st.computeModes[str(g.uuid)] = value

    def nvmlDeviceGetComputeMode(self, h: Any) -> int:
        g = self._gpu(h)
        with self._mig_state(write=False) as st:
            return st.computeModes.get(str(g.uuid), 0)

    def _mig_gpu(self, h: Any) -> tuple[GpuFacts, str]:
        g = self._gpu(h)
        mode = g.migMode
        if not isinstance(mode, tuple) or mode[0] != 1:
            raise _err("NotSupported")
        return g, str(g.uuid)

    @staticmethod
    def _profile(g: GpuFacts, *, index: int | None = None, pid: int | None = None) -> MigProfileFacts:
        for p in g.migProfiles:
            if (index is not None and p.index == index) or (pid is not None and p.id == pid):
                return p
        raise _err("NotSupported" if index is not None else "InvalidArgument")

    @staticmethod
    def _find_gi(gis: list[FakeGpuInstance], gi: int) -> FakeGpuInstance:
        for x in gis:
            if x.id == gi:
                return x
        raise _err("NotFound")

    # -- GPU instances ----------------------------------------------------------------------------

    def nvmlDeviceGetGpuInstanceProfileInfo(self, h: Any, profile: int, version: int = 2) -> Any:
        g, _ = self._mig_gpu(h)
        p = self._profile(g, index=int(profile))
        info = pynvml.c_nvmlGpuInstanceProfileInfo_v2_t() if version == 2 else pynvml.c_nvmlGpuInstanceProfileInfo_t()
        info.id, info.isP2pSupported, info.sliceCount = p.id, 0, p.sliceCount
        info.instanceCount, info.multiprocessorCount, info.memorySizeMB = p.instanceCount, p.multiprocessorCount, \
            p.memorySizeMB  # fmt: skip
        info.copyEngineCount, info.decoderCount, info.encoderCount = p.copyEngineCount, p.decoderCount, p.encoderCount
        info.jpegCount, info.ofaCount = p.jpegCount, p.ofaCount
        if version == 2:
            info.name = f"MIG {p.name}".encode()
        return info

    nvmlDeviceGetGpuInstanceProfileInfoV = nvmlDeviceGetGpuInstanceProfileInfo

    def nvmlDeviceGetGpuInstancePossiblePlacements(
        self, h: Any, profile_id: int, placements: Any, count_ref: Any
    ) -> int:
        """nvml.h: "all the possible placements for the given profile regardless of whether MIG is enabled or
        not"; NotSupported only for a GPU without MIG."""
        g = self._gpu(h)
        if not isinstance(g.migMode, tuple):
            raise _err("NotSupported")
        p = self._profile(g, pid=int(profile_id))
        count = _deref(count_ref)
        if placements is None:
            count.value = len(p.placements)
            return int(pynvml.NVML_SUCCESS)
        if count.value < len(p.placements):
            count.value = len(p.placements)
            raise _err("InsufficientSize")
        for i, (start, size) in enumerate(p.placements):
            placements[i].start, placements[i].size = start, size
        count.value = len(p.placements)
        return int(pynvml.NVML_SUCCESS)

    def _max_compute_slices(self, g: GpuFacts) -> int:
        return max(p.sliceCount for p in g.migProfiles)

    def nvmlDeviceGetGpuInstanceRemainingCapacity(self, h: Any, profile_id: int) -> int:
        g, uuid = self._mig_gpu(h)
        p = self._profile(g, pid=int(profile_id))
        with self._mig_state(write=False) as st:
            gis = list(st.gpus.get(uuid, []))
        free = 0
        used_compute = sum(x.slices for x in gis)
        for start, size in p.placements:
            if not any(start < x.start + x.size and x.start < start + size for x in gis):
                free += 1
        return min(free, (self._max_compute_slices(g) - used_compute) // p.sliceCount)

    def nvmlDeviceCreateGpuInstanceWithPlacement(self, h: Any, profile_id: int, placement: Any) -> Any:
        g, uuid = self._mig_gpu(h)
        p = self._profile(g, pid=int(profile_id))
        pl = _deref(placement)
        start, size = int(pl.start), int(pl.size)
        if (start, size) not in p.placements:
            raise _err("InvalidArgument")
        with self._mig_state(write=True) as st:
            gis = st.gpus.setdefault(uuid, [])
            if any(start < x.start + x.size and x.start < start + size for x in gis):
                raise _err("InsufficientResources")
            if sum(x.slices for x in gis) + p.sliceCount > self._max_compute_slices(g):
                raise _err("InsufficientResources")
            ids = {x.id for x in gis}
            gi = next(i for i in range(1, 64) if i not in ids)
            gis.append(FakeGpuInstance(id=gi, profileId=p.id, start=start, size=size, slices=p.sliceCount,
                                       multiprocessors=p.multiprocessorCount))  # fmt: skip
            gis.sort(key=lambda x: x.id)
        return FakeGpuInstanceHandle(h.index, gi)

    def nvmlDeviceGetGpuInstances(self, h: Any, profile_id: int, out: Any, count_ref: Any) -> int:
        _, uuid = self._mig_gpu(h)
        with self._mig_state(write=False) as st:
            found = [x.id for x in st.gpus.get(uuid, []) if x.profileId == int(profile_id)]
        count = _deref(count_ref)  # output only (nvml.h); the buffer holds the profile's instanceCount
        for i, gi in enumerate(found):
            out[i] = FakeGpuInstanceHandle(h.index, gi)
        count.value = len(found)
        return int(pynvml.NVML_SUCCESS)

    def nvmlDeviceGetGpuInstanceById(self, h: Any, gi: int) -> FakeGpuInstanceHandle:
        _, uuid = self._mig_gpu(h)
        with self._mig_state(write=False) as st:
            self._find_gi(st.gpus.get(uuid, []), int(gi))
        return FakeGpuInstanceHandle(h.index, int(gi))

    def _gi_of(self, gi: Any) -> tuple[GpuFacts, str, FakeGpuInstanceHandle]:
        from topodra.hardware.mock import FakeHandle

        if not isinstance(gi, FakeGpuInstanceHandle):
            raise _err("InvalidArgument")
        g, uuid = self._mig_gpu(FakeHandle(gi.index))
        return g, uuid, gi

    def nvmlGpuInstanceGetInfo(self, gi: Any) -> FakeGpuInstanceInfo:
        from topodra.hardware.mock import FakeHandle

        _, uuid, handle = self._gi_of(gi)
        with self._mig_state(write=False) as st:
            x = self._find_gi(st.gpus.get(uuid, []), handle.gi)
        return FakeGpuInstanceInfo(FakeHandle(handle.index), x.id, x.profileId,
                                   pynvml.c_nvmlGpuInstancePlacement_t(x.start, x.size))  # fmt: skip

    def nvmlGpuInstanceDestroy(self, gi: Any) -> int:
        _, uuid, handle = self._gi_of(gi)
        with self._mig_state(write=True) as st:
            gis = st.gpus.get(uuid, [])
            x = self._find_gi(gis, handle.gi)
            if x.computeInstances:
                raise _err("InUse")
            gis.remove(x)
        return int(pynvml.NVML_SUCCESS)

    # -- compute instances ------------------------------------------------------------------------

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(self, gi: Any, profile: int, eng_profile: int,
                                                     version: int = 2) -> Any:  # fmt: skip
        _, uuid, handle = self._gi_of(gi)
        slices = CI_PROFILE_SLICES.get(int(profile))
        with self._mig_state(write=False) as st:
            x = self._find_gi(st.gpus.get(uuid, []), handle.gi)
        if slices is None or slices > x.slices:
            raise _err("NotSupported")
        info = pynvml.c_nvmlComputeInstanceProfileInfo_v2_t() if version == 2 \
            else pynvml.c_nvmlComputeInstanceProfileInfo_t()  # fmt: skip
        info.id, info.sliceCount = CI_PROFILE_ID_BASE + int(profile), slices
        info.instanceCount = x.slices // slices
        info.multiprocessorCount = x.multiprocessors * slices // x.slices
        return info

    nvmlGpuInstanceGetComputeInstanceProfileInfoV = nvmlGpuInstanceGetComputeInstanceProfileInfo

    def nvmlGpuInstanceCreateComputeInstance(self, gi: Any, profile_id: int) -> FakeComputeInstanceHandle:
        _, uuid, handle = self._gi_of(gi)
        slices = CI_ID_SLICES.get(int(profile_id))
        with self._mig_state(write=True) as st:
            x = self._find_gi(st.gpus.get(uuid, []), handle.gi)
            if slices is None or slices > x.slices:
                raise _err("NotSupported")
            if sum(c.slices for c in x.computeInstances) + slices > x.slices:
                raise _err("InsufficientResources")
            ids = {c.id for c in x.computeInstances}
            ci = next(i for i in range(0, 64) if i not in ids)
            x.computeInstances.append(FakeComputeInstance(id=ci, profileId=int(profile_id), slices=slices))
        return FakeComputeInstanceHandle(handle.index, handle.gi, ci)

    def nvmlGpuInstanceGetComputeInstances(self, gi: Any, profile_id: int, out: Any, count_ref: Any) -> int:
        _, uuid, handle = self._gi_of(gi)
        with self._mig_state(write=False) as st:
            x = self._find_gi(st.gpus.get(uuid, []), handle.gi)
            found = [c.id for c in x.computeInstances if c.profileId == int(profile_id)]
        count = _deref(count_ref)  # output only (nvml.h); the buffer holds the profile's instanceCount
        for i, ci in enumerate(found):
            out[i] = FakeComputeInstanceHandle(handle.index, handle.gi, ci)
        count.value = len(found)
        return int(pynvml.NVML_SUCCESS)

    def nvmlGpuInstanceGetComputeInstanceById(self, gi: Any, ci: int) -> FakeComputeInstanceHandle:
        _, uuid, handle = self._gi_of(gi)
        with self._mig_state(write=False) as st:
            x = self._find_gi(st.gpus.get(uuid, []), handle.gi)
            if not any(c.id == int(ci) for c in x.computeInstances):
                raise _err("NotFound")
        return FakeComputeInstanceHandle(handle.index, handle.gi, int(ci))

    def _ci_of(self, ci: Any) -> tuple[str, FakeComputeInstanceHandle]:
        if not isinstance(ci, FakeComputeInstanceHandle):
            raise _err("InvalidArgument")
        _, uuid, _ = self._gi_of(FakeGpuInstanceHandle(ci.index, ci.gi))
        return uuid, ci

    def nvmlComputeInstanceGetInfo(self, ci: Any) -> FakeComputeInstanceInfo:
        from topodra.hardware.mock import FakeHandle

        uuid, handle = self._ci_of(ci)
        with self._mig_state(write=False) as st:
            x = self._find_gi(st.gpus.get(uuid, []), handle.gi)
            c = next((c for c in x.computeInstances if c.id == handle.ci), None)
        if c is None:
            raise _err("NotFound")
        return FakeComputeInstanceInfo(FakeHandle(handle.index), FakeGpuInstanceHandle(handle.index, handle.gi),
                                       c.id, c.profileId)  # fmt: skip

    nvmlComputeInstanceGetInfo_v2 = nvmlComputeInstanceGetInfo

    def nvmlComputeInstanceDestroy(self, ci: Any) -> int:
        uuid, handle = self._ci_of(ci)
        with self._mig_state(write=True) as st:
            x = self._find_gi(st.gpus.get(uuid, []), handle.gi)
            c = next((c for c in x.computeInstances if c.id == handle.ci), None)
            if c is None:
                raise _err("NotFound")
            x.computeInstances.remove(c)
        return int(pynvml.NVML_SUCCESS)

    # -- MIG devices ------------------------------------------------------------------------------

    def nvmlDeviceGetMaxMigDeviceCount(self, h: Any) -> int:
        g = self._gpu(h)
        mode = g.migMode
        if not isinstance(mode, tuple) or mode[0] != 1:
            return 0
        return self._max_compute_slices(g)

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: Any, index: int) -> FakeMigDeviceHandle:
        _, uuid = self._mig_gpu(h)
        with self._mig_state(write=False) as st:
            pairs = [(x.id, c.id) for x in st.gpus.get(uuid, [])
                     for c in sorted(x.computeInstances, key=lambda c: c.id)]  # fmt: skip
        if not 0 <= int(index) < len(pairs):
            raise _err("NotFound")
        gi, ci = pairs[int(index)]
        return FakeMigDeviceHandle(h.index, gi, ci)

    def nvmlDeviceIsMigDeviceHandle(self, h: Any) -> bool:
        return isinstance(h, FakeMigDeviceHandle)

    def nvmlDeviceGetGpuInstanceId(self, h: Any) -> int:
        if not isinstance(h, FakeMigDeviceHandle):
            raise _err("InvalidArgument")
        return h.gi

    def nvmlDeviceGetComputeInstanceId(self, h: Any) -> int:
        if not isinstance(h, FakeMigDeviceHandle):
            raise _err("InvalidArgument")
        return h.ci

    def mig_instance(self, h: FakeMigDeviceHandle) -> tuple[GpuFacts, FakeGpuInstance]:
        """The parent's facts and the GPU instance of a MIG device handle; NotFound once it is gone."""
        from topodra.hardware.mock import FakeHandle

        g, uuid = self._mig_gpu(FakeHandle(h.index))
        with self._mig_state(write=False) as st:
            return g, self._find_gi(st.gpus.get(uuid, []), h.gi)

    def gpu_instances_of(self, uuid: str) -> list[FakeGpuInstance]:
        with self._mig_state(write=False) as st:
            return list(st.gpus.get(uuid, []))

    def mig_handle_by_uuid(self, index: int, uuid: str) -> FakeMigDeviceHandle | None:
        """The MIG device of GPU ``index`` whose UUID is ``uuid`` (nvmlDeviceGetHandleByUUID takes MIG UUIDs)."""
        parent = str(self._gpu(_fake_handle(index)).uuid)
        for gi in self.gpu_instances_of(parent):
            for ci in gi.computeInstances:
                if mig_uuid(parent, gi.id, ci.id) == uuid:
                    return FakeMigDeviceHandle(index, gi.id, ci.id)
        return None

    def mig_device_uuid(self, h: FakeMigDeviceHandle) -> str:
        """nvmlDeviceGetUUID of a MIG device handle (FakeNvml.nvmlDeviceGetUUID delegates here)."""
        from topodra.hardware.mock import FakeHandle

        _, uuid = self._mig_gpu(FakeHandle(h.index))
        with self._mig_state(write=False) as st:
            x = self._find_gi(st.gpus.get(uuid, []), h.gi)
            if not any(c.id == h.ci for c in x.computeInstances):
                raise _err("NotFound")
        return mig_uuid(uuid, h.gi, h.ci)
