"""Mock hardware: a fake ``pynvml`` module object and a generated sysfs tree.

``FakeNvml`` answers NVML queries from ``NvmlFacts`` using pynvml's own
constants, error classes and ctypes structs, so ``NvmlBackend`` cannot tell it
from the real module.  ``MockHardware`` ties a profile to a node name and a
sysfs tree and can change the hardware later (e.g. hide a GPU) to exercise
rediscovery.  ``mock_backend`` builds the real ``NvmlBackend`` on it.  Tests
may replace any ``nvml*`` function on a ``FakeNvml`` instance, or ``remove``
one to mimic an older binding.
"""

from __future__ import annotations

import uuid as uuidlib
from dataclasses import dataclass
from typing import Any

import pynvml

from topodra.hardware.base import DiscoveryConfig
from topodra.hardware.facts import FabricFacts, GpuFacts, LinkFacts, NvmlErr, NvmlFacts, PciFacts, shared_root
from topodra.hardware.mockprofile import Fabric, Profile, build_facts, build_tree
from topodra.hardware.nvml import NvmlBackend
from topodra.hardware.sysfs import Sysfs

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


class FakeNvml:
    """A ``pynvml``-compatible object serving ``NvmlFacts``."""

    def __init__(self, facts: NvmlFacts) -> None:
        self.__dict__.update(_SHARED)
        self.facts = facts
        self.init_count = 0
        self.hardware: MockHardware | None = None

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
        return str(self._ans(self._gpu(h).uuid))

    def nvmlDeviceGetName(self, h: Any) -> str:
        return str(self._ans(self._gpu(h).name))

    def nvmlDeviceGetMemoryInfo(self, h: Any, version: Any = None) -> Any:
        total = int(self._ans(self._gpu(h).memoryTotal))
        return pynvml.c_nvmlMemory_t(total=total, free=total, used=0)

    def nvmlDeviceGetPciInfo(self, h: Any) -> Any:
        p: PciFacts = self._ans(self._gpu(h).pci)
        return self._pci_struct(p.busId, p.pciDeviceId, p.pciSubSystemId)

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
        return int(self._ans(self._link(h, link).state))

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


class MockHardware:
    """A profile instantiated for one node: NVML answers plus the sysfs tree they sit in.

    With ``sysfs_root`` the tree is written there and belongs to the caller (a
    test may then damage it).  Without, the node reads the process-wide tree
    that every node of the profile shares (``facts.shared_root``).
    """

    def __init__(
        self, profile: Profile, node: str, hidden: frozenset[int], fabric: Fabric, sysfs_root: str | None = None
    ) -> None:
        self.profile, self.node, self.fabric = profile, node, fabric
        self._own_root = sysfs_root
        self._check(hidden)
        self.nvml = FakeNvml(build_facts(profile, node, hidden, fabric))
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
        tree.materialize(self._own_root)
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
) -> NvmlBackend:
    """The real backend reading ``profile`` as ``node_name``'s hardware.

    Mock GPUs and NICs have no ``/dev`` nodes on this host, so the devices carry none.
    """
    hw = MockHardware(profile, node_name, hidden, fabric or profile.fabric, sysfs_root)
    return NvmlBackend(node_name, nvml=hw.nvml, sysfs=hw.sysfs, config=config, host_device_nodes=False)
