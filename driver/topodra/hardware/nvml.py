"""The real discovery backend: NVML (nvidia-ml-py) for GPU facts, sysfs for locality and NICs.

Mock hardware and replayed captures construct this same class with a fake
``pynvml`` module object and a generated sysfs tree, so tests exercise this
code, not a copy.

Error policy: NVML initialisation and the GPU count are mandatory for the node
(``DiscoveryError``).  The handle, UUID, name, memory and PCI info are
mandatory for one GPU: a GPU failing one of them (GPU_IS_LOST after XID 79, a
PCI domain the Kubernetes format cannot hold) never fails the node; it is
logged and published as a ``lost`` device when it can still be named (the
previous discovery, or the driver's procfs), else left out.  Every other call
is optional — NotSupported and FunctionNotFound (older driver) mean "absent",
anything else means "absent" plus a warning naming the GPU.
"""

from __future__ import annotations

import ctypes
import logging
import re
import uuid as uuidlib
from dataclasses import dataclass
from typing import Any

from topodra.devices import Device
from topodra.hardware.attributes import GpuInfo, GpuTopology, SystemInfo, gpu_device, lost_gpu_device, nic_device
from topodra.hardware.base import DiscoveryConfig, DiscoveryError
from topodra.hardware.nvlink import LinkPeer, fabric_domain_id, local_domain_id, local_groups
from topodra.hardware.pairing import assign_rails, pair_gpus, select_compute_nics
from topodra.hardware.sysfs import BDF, Sysfs
from topodra.sharing.memory import shared
from topodra.sharing.mig import MigProfile, partition

log = logging.getLogger(__name__)

_NVML_BUS_ID = re.compile(r"^([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")


class _Absent(Exception):
    """An optional NVML fact is not available."""


# nvmlDeviceGetNvLinkVersion answers an nvmlNvlinkVersion_t enum, not the generation (nvml.h,
# NVML_NVLINK_VERSION_*): 1_0=1, 2_0=2, 2_2=3, 3_0=4, 3_1=5, 4_0=6, 5_0=7, 6_0=8.  An A100 answers 5
# (NVLink 3.1), an H100 6 (4.0), a B200 7 (5.0).  ``nvlinkVersion`` publishes the generation (major).
NVLINK_GENERATION: dict[int, int] = {1: 1, 2: 2, 3: 2, 4: 3, 5: 3, 6: 4, 7: 5, 8: 6}


# The far end of active NVLinks whose remote PCI info NVML cannot give: an NVSwitch hidden from this OS.
HIDDEN_SWITCH = "hidden-nvswitch"
_ZERO_BDF = "0000:00:00.0"


def nvlink_generation(enum_value: int) -> int | None:
    """NVLink generation of an nvmlNvlinkVersion_t value; None for INVALID (0) or a value newer than the table."""
    return NVLINK_GENERATION.get(int(enum_value))


def normalize_bus_id(bus_id: str | bytes) -> str:
    """NVML busId ("00000000:1B:00.0") -> Kubernetes pciBusID ("0000:1b:00.0"); ValueError if malformed."""
    text = bus_id.decode() if isinstance(bus_id, bytes) else bus_id
    m = _NVML_BUS_ID.match(text.strip())
    if not m:
        raise ValueError(f"malformed PCI bus id {text!r}")
    domain = int(m.group(1), 16)
    if domain > 0xFFFF:
        raise ValueError(f"PCI domain of {text!r} does not fit the 4-digit Kubernetes format")
    out = f"{domain:04x}:{m.group(2)}:{m.group(3)}.{m.group(4)}".lower()
    assert BDF.match(out)
    return out


@dataclass(frozen=True)
class _Fabric:
    cluster_uuid: str
    clique_id: int


@dataclass(frozen=True)
class _Failed:
    """A GPU whose mandatory facts could not be read."""

    index: int
    bdf: str | None  # known when the PCI info was readable
    reason: str


class _GpuFailed(Exception):
    def __init__(self, bdf: str | None, reason: str) -> None:
        super().__init__(reason)
        self.bdf = bdf


class NvmlBackend:
    """Discover GPUs via a ``pynvml``-compatible module and NICs/locality via sysfs.

    Everything the backend reads comes in through the constructor: ``nvml`` (the
    ``pynvml`` module, or ``FakeNvml``), ``sysfs`` (``/`` on a real host, a
    generated tree for mock hardware) and ``config``.  ``host_device_nodes`` is
    False for hardware that is not this host's (mock profiles, replays): its
    ``/dev/nvidiaN`` and ``/dev/infiniband/uverbsN`` do not exist here, so the
    devices carry none and CDI specs never name them.
    """

    def __init__(
        self,
        node_name: str,
        *,
        nvml: Any,
        sysfs: Sysfs,
        config: DiscoveryConfig | None = None,
        host_device_nodes: bool = True,
    ) -> None:
        self.node_name = node_name
        self.nvml: Any = nvml
        self.sysfs = sysfs
        self.config = config or DiscoveryConfig()
        self.host_device_nodes = host_device_nodes
        self._last_gpus: dict[str, Device] = {}  # BDF -> the GPU's device at the last discovery that read it

    # -- NVML call wrappers -------------------------------------------------------------------------

    def _call(self, fn_name: str, *args: Any) -> Any:
        fn = getattr(self.nvml, fn_name, None)
        if fn is None:  # the installed binding predates the function
            raise _Absent(f"{fn_name} not in this pynvml binding")
        return fn(*args)

    def _is(self, err: BaseException, *names: str) -> bool:
        classes = (getattr(self.nvml, "NVMLError_" + n, None) for n in names)
        return any(isinstance(err, c) for c in classes if c is not None)

    def _must(self, what: str, fn_name: str, *args: Any) -> Any:
        try:
            return self._call(fn_name, *args)
        except (self.nvml.NVMLError, _Absent) as e:
            raise DiscoveryError(f"node {self.node_name}: cannot read {what} ({fn_name}): {e}") from e

    def _opt(self, what: str, gpu: str, fn_name: str, *args: Any) -> Any:
        """Result of an optional call, or None (debug log if unsupported, warning otherwise)."""
        try:
            return self._call(fn_name, *args)
        except _Absent as e:
            log.debug("node %s %s: %s absent: %s", self.node_name, gpu, what, e)
        except self.nvml.NVMLError as e:
            if self._is(e, "NotSupported", "FunctionNotFound"):
                log.debug("node %s %s: %s not supported: %s", self.node_name, gpu, what, e)
            else:
                log.warning("node %s %s: %s unavailable (omitted): %s", self.node_name, gpu, what, e)
        return None

    # -- NVML reading ---------------------------------------------------------------------------

    def _mig_capable(self, h: Any, label: str) -> bool | None:
        try:
            self._call("nvmlDeviceGetMigMode", h)
            return True
        except _Absent:
            return None
        except self.nvml.NVMLError as e:
            if self._is(e, "NotSupported"):
                return False
            if not self._is(e, "FunctionNotFound"):
                log.warning("node %s %s: MIG mode unavailable: %s", self.node_name, label, e)
            return None

    def _mig_profiles(self, h: Any, label: str) -> list[MigProfile]:
        """GPU-instance profiles and placements of a GPU whose MIG mode is on now; [] when it is off.

        The driver never toggles MIG mode; a mode change pending a GPU reset is not acted on.
        Media-extension variants ("+me") are left out: they need engines no counter models.
        """
        mode = self._opt("MIG mode", label, "nvmlDeviceGetMigMode", h)
        if mode is None or int(mode[0]) != int(getattr(self.nvml, "NVML_DEVICE_MIG_ENABLE", 1)):
            return []
        out: list[MigProfile] = []
        for index in range(int(getattr(self.nvml, "NVML_GPU_INSTANCE_PROFILE_COUNT", 0x12))):
            try:
                info = self._call("nvmlDeviceGetGpuInstanceProfileInfo", h, index)
            except _Absent:
                return []
            except self.nvml.NVMLError as e:
                if not self._is(e, "NotSupported", "InvalidArgument"):
                    log.warning("node %s %s: MIG profile %d unreadable: %s", self.node_name, label, index, e)
                continue
            raw = info.name.decode() if isinstance(info.name, bytes) else str(info.name)
            name = raw.removeprefix("MIG ").strip()
            if "+" in name or not re.fullmatch(r"[0-9]+g\.[0-9]+gb", name):
                continue
            arr = (self.nvml.c_nvmlGpuInstancePlacement_t * 16)()
            count = ctypes.c_uint(16)
            placements = self._opt(f"MIG {name} placements", label, "nvmlDeviceGetGpuInstancePossiblePlacements",
                                   h, info.id, arr, ctypes.byref(count))  # fmt: skip
            if placements is None:
                continue
            out.append(MigProfile(
                name=name, profile_id=int(info.id), compute_slices=int(info.sliceCount),
                memory_mib=int(info.memorySizeMB), multiprocessors=int(info.multiprocessorCount),
                placements=tuple((int(arr[i].start), int(arr[i].size)) for i in range(count.value)),
            ))  # fmt: skip
        if not out:
            log.warning("node %s %s: MIG mode is on but no GPU-instance profile is readable; published whole",
                        self.node_name, label)  # fmt: skip
        return out

    def _links(self, h: Any, label: str) -> tuple[list[tuple[str, int | None]], int | None]:
        """Active links as (remote BDF, remote device type or None) and the NVLink version."""
        peers: list[tuple[str, int | None]] = []
        version: int | None = None
        version_read = False
        enabled = int(getattr(self.nvml, "NVML_FEATURE_ENABLED", 1))
        for link in range(int(getattr(self.nvml, "NVML_NVLINK_MAX_LINKS", 18))):
            try:
                state = self._call("nvmlDeviceGetNvLinkState", h, link)
            except _Absent:
                break
            except self.nvml.NVMLError as e:
                if self._is(e, "InvalidArgument"):
                    break  # past the GPU's last link
                if self._is(e, "NotSupported", "FunctionNotFound"):
                    if link == 0:
                        return [], None  # no NVLink on this GPU
                    continue
                log.warning("node %s %s: NVLink %d state unreadable: %s", self.node_name, label, link, e)
                continue
            if state != enabled:
                continue
            rtype = self._opt(f"NVLink {link} remote type", label, "nvmlDeviceGetNvLinkRemoteDeviceType", h, link)
            pci = self._opt(f"NVLink {link} remote PCI info", label, "nvmlDeviceGetNvLinkRemotePciInfo", h, link)
            remote: str | None = None
            if pci is not None:
                try:
                    remote = normalize_bus_id(pci.busId)
                except ValueError as e:
                    log.warning("node %s %s: NVLink %d: %s", self.node_name, label, link, e)
            unknown = int(getattr(self.nvml, "NVML_NVLINK_DEVICE_TYPE_UNKNOWN", 0xFF))
            if remote is None or remote == _ZERO_BDF or (rtype is not None and int(rtype) == unknown):
                # An active link whose far end NVML cannot name: an NVSwitch hidden from this OS (VMs with
                # NVSwitch passthrough; NCCL assumes the same).  All such links meet at one switch.
                peers.append((HIDDEN_SWITCH, self._switch_type()))
            else:
                peers.append((remote, None if rtype is None else int(rtype)))
            if not version_read:
                version_read = True
                v = self._opt(f"NVLink {link} version", label, "nvmlDeviceGetNvLinkVersion", h, link)
                version = None if v is None else nvlink_generation(int(v))
                if v is not None and version is None:
                    log.warning("node %s %s: unknown NVLink version enum %d; nvlinkVersion omitted",
                                self.node_name, label, int(v))  # fmt: skip
        return peers, version

    def _switch_type(self) -> int:
        return int(getattr(self.nvml, "NVML_NVLINK_DEVICE_TYPE_SWITCH", 2))

    def _fabric(self, h: Any, label: str) -> _Fabric | None:
        """Multi-node NVLink membership (clusterUUID, cliqueID), None for single-node or no fabric."""
        n = self.nvml
        info: Any = None
        for struct_name, fn_name in (
            ("c_nvmlGpuFabricInfo_v3_t", "nvmlDeviceGetGpuFabricInfoV"),
            ("c_nvmlGpuFabricInfo_v2_t", "nvmlDeviceGetGpuFabricInfoV"),
            ("c_nvmlGpuFabricInfo_t", "nvmlDeviceGetGpuFabricInfo"),
        ):
            cls = getattr(n, struct_name, None)
            if cls is None:
                continue
            candidate = cls()
            try:
                self._call(fn_name, h, ctypes.byref(candidate))
            except _Absent:
                continue
            except n.NVMLError as e:
                if self._is(e, "ArgumentVersionMismatch", "FunctionNotFound"):
                    continue  # older driver: try the previous struct / function
                if not self._is(e, "NotSupported"):
                    log.warning("node %s %s: fabric info unavailable: %s", self.node_name, label, e)
                return None
            info = candidate
            break
        if info is None:
            return None
        state = int(info.state)
        if state == int(getattr(n, "NVML_GPU_FABRIC_STATE_NOT_SUPPORTED", 0)):
            return None
        if state != int(getattr(n, "NVML_GPU_FABRIC_STATE_COMPLETED", 3)):
            log.warning("node %s %s: NVLink fabric registration not completed (state %d); "
                        "multi-node domain not published yet", self.node_name, label, state)  # fmt: skip
            return None
        if int(info.status) != int(getattr(n, "NVML_SUCCESS", 0)):
            log.warning("node %s %s: NVLink fabric registration failed (status %d)", self.node_name, label,
                        int(info.status))  # fmt: skip
            return None
        raw = bytes(info.clusterUuid)
        if not any(raw):
            return None  # NVLink-capable but not multi-node (HGX with Fabric Manager)
        return _Fabric(str(uuidlib.UUID(bytes=raw)), int(info.cliqueId))

    def _gpu_must(self, bdf: str | None, what: str, fn_name: str, *args: Any) -> Any:
        try:
            return self._call(fn_name, *args)
        except (self.nvml.NVMLError, _Absent) as e:
            raise _GpuFailed(bdf, f"cannot read {what} ({fn_name}): {e}") from e

    def _read_nvml(
        self,
    ) -> tuple[SystemInfo, list[GpuInfo], dict[str, list[tuple[str, int | None]]], dict[str, _Fabric],
               dict[str, list[MigProfile]], list[_Failed]]:  # fmt: skip
        n = self.nvml
        try:
            n.nvmlInit()
        except n.NVMLError as e:
            raise DiscoveryError(f"node {self.node_name}: NVML initialisation failed: {e}") from e
        try:
            drv = self._opt("driver version", "system", "nvmlSystemGetDriverVersion")
            sysinfo = SystemInfo(
                driver_version=None if drv is None else str(drv), cuda_driver_version=self._cuda_version()
            )
            count = int(self._must("GPU count", "nvmlDeviceGetCount"))
            gpus: list[GpuInfo] = []
            links: dict[str, list[tuple[str, int | None]]] = {}
            fabrics: dict[str, _Fabric] = {}
            migs: dict[str, list[MigProfile]] = {}
            failed: list[_Failed] = []
            for idx in range(count):
                try:
                    self._read_gpu(idx, gpus, links, fabrics, migs)
                except _GpuFailed as e:
                    log.error("node %s GPU %d%s: %s; the GPU is not usable, the node's other GPUs are published",
                              self.node_name, idx, f" ({e.bdf})" if e.bdf else "", e)  # fmt: skip
                    failed.append(_Failed(idx, e.bdf, str(e)))
            return sysinfo, gpus, links, fabrics, migs, failed
        finally:
            try:
                n.nvmlShutdown()
            except n.NVMLError as e:
                log.warning("node %s: nvmlShutdown failed: %s", self.node_name, e)

    def _read_gpu(self, idx: int, gpus: list[GpuInfo], links: dict[str, list[tuple[str, int | None]]],
                  fabrics: dict[str, _Fabric], migs: dict[str, list[MigProfile]]) -> None:
        """Read one GPU into the four collections; _GpuFailed (and nothing added) if a mandatory fact fails."""
        label = f"GPU {idx}"
        h = self._gpu_must(None, f"handle of {label}", "nvmlDeviceGetHandleByIndex", idx)
        pci = self._gpu_must(None, f"PCI info of {label}", "nvmlDeviceGetPciInfo", h)
        try:
            bdf = normalize_bus_id(pci.busId)
        except ValueError as e:
            raise _GpuFailed(None, str(e)) from e
        label = f"GPU {idx} ({bdf})"
        uuid = str(self._gpu_must(bdf, "UUID", "nvmlDeviceGetUUID", h))
        name = str(self._gpu_must(bdf, "name", "nvmlDeviceGetName", h))
        memory = self._gpu_must(bdf, "memory", "nvmlDeviceGetMemoryInfo", h)
        cc = self._opt("compute capability", label, "nvmlDeviceGetCudaComputeCapability", h)
        minor = self._opt("minor number", label, "nvmlDeviceGetMinorNumber", h)
        brand = self._opt("brand", label, "nvmlDeviceGetBrand", h)
        arch = self._opt("architecture", label, "nvmlDeviceGetArchitecture", h)
        mode = self._opt("addressing mode", label, "nvmlDeviceGetAddressingMode", h)
        peers, version = self._links(h, label)
        info = GpuInfo(
            index=idx,
            uuid=uuid,
            product_name=name,
            memory_bytes=int(memory.total),
            bdf=bdf,
            minor=None if minor is None else int(minor),
            brand=None if brand is None else int(brand),
            architecture=None if arch is None else int(arch),
            compute_capability=None if cc is None else (int(cc[0]), int(cc[1])),
            mig_capable=self._mig_capable(h, label),
            nvlink_version=version,
            nvlink_active_links=len(peers),
            addressing_mode=None if mode is None else int(mode),
        )
        profiles = self._mig_profiles(h, label) if info.mig_capable else []
        fab = self._fabric(h, label)
        gpus.append(info)
        links[bdf] = peers
        if profiles:
            migs[bdf] = profiles
        if fab is not None:
            fabrics[bdf] = fab

    def _lost_devices(self, failed: list[_Failed], healthy: set[str]) -> list[Device]:
        """Devices for GPUs NVML could not read, named as before (this process) or from the driver's procfs.

        A GPU whose BDF is unknown (even its PCI info failed) is one of the NVIDIA GPUs in sysfs that NVML
        did not read; that is used only when it is unambiguous (as many such GPUs as such failures).
        """
        if not failed:
            return []
        by_bdf = {f.bdf: f for f in failed if f.bdf is not None}
        unnamed = [f for f in failed if f.bdf is None]
        rest = [b for b in self.sysfs.nvidia_gpus() if b not in healthy and b not in by_bdf]
        if unnamed and len(rest) == len(unnamed):
            by_bdf.update({b: f for b, f in zip(rest, unnamed, strict=True)})
        elif unnamed:
            log.error("node %s: %d GPU(s) failed before their PCI address was read and sysfs has %d other NVIDIA "
                      "GPU(s); they are not published", self.node_name, len(unnamed), len(rest))  # fmt: skip
        out = []
        for bdf, f in sorted(by_bdf.items()):
            reason = f"GPU {f.index} ({bdf}): {f.reason}"
            last = self._last_gpus.get(bdf)
            if last is not None:
                out.append(last.model_copy(update={"lost": reason}))
                continue
            info = self.sysfs.nvidia_gpu_info(bdf)
            if not info and self.host_device_nodes and self.sysfs.root != "/":
                # The driver's procfs is not namespaced: this container's /proc has it when --sysfs-root
                # points at a host /sys mount only.
                info = Sysfs("/").nvidia_gpu_info(bdf)
            uuid, minor = info.get("GPU UUID", ""), info.get("Device Minor", "")
            if not uuid.startswith("GPU-") or not minor.isdigit():
                log.error("node %s %s: not published: no previous discovery and no driver procfs entry names it",
                          self.node_name, reason)  # fmt: skip
                continue
            out.append(lost_gpu_device(int(minor), uuid, bdf, reason, device_nodes=self.host_device_nodes))
        return out

    def _cuda_version(self) -> int | None:
        for fn_name in ("nvmlSystemGetCudaDriverVersion_v2", "nvmlSystemGetCudaDriverVersion"):
            v = self._opt("CUDA driver version", "system", fn_name)
            if v is not None:
                return int(v)
        return None

    # -- assembly -------------------------------------------------------------------------------

    def discover(self) -> list[Device]:
        """Read NVML and sysfs now and return gpu-* (by minor) then nic-* (rail order).

        May be called again at any time (timer, SIGHUP, a GPU fell off the bus):
        each call re-reads the hardware, and the same hardware gives an equal list.
        """
        system, gpus, links, fabrics, migs, failed = self._read_nvml()
        gpu_bdfs = {g.bdf for g in gpus}
        switch_type = int(getattr(self.nvml, "NVML_NVLINK_DEVICE_TYPE_SWITCH", 2))
        # Without a remote type, a peer that is not one of our GPUs is taken to be a switch.
        peers = {
            bdf: [LinkPeer(r, switch=(t == switch_type) if t is not None else r not in gpu_bdfs) for r, t in lst]
            for bdf, lst in links.items()
        }
        groups = local_groups(peers)
        if len({(f.cluster_uuid, f.clique_id) for f in fabrics.values()}) > 1:
            ids = sorted({fabric_domain_id(f.cluster_uuid, f.clique_id) for f in fabrics.values()})
            log.warning("node %s: GPUs report different NVLink cliques: %s", self.node_name, ids)

        locations = []
        for g in gpus:
            loc = self.sysfs.pci_location(g.bdf)
            if loc is None:
                log.warning("node %s GPU %d (%s): not found in sysfs; PCIe/NUMA attributes omitted",
                            self.node_name, g.index, g.bdf)  # fmt: skip
            locations.append(loc)
        compute = select_compute_nics(self.sysfs.rdma_nics(), self.config)
        rails = assign_rails(compute, self.config.rails)
        pairs = pair_gpus(locations, compute)

        devices: list[Device] = []
        for g, loc, pair in zip(gpus, locations, pairs, strict=True):
            domain: str | None = None
            size: int | None = None
            if g.bdf in fabrics:
                f = fabrics[g.bdf]
                domain, size = fabric_domain_id(f.cluster_uuid, f.clique_id), self.config.nvlink_domain_size
            elif g.bdf in groups:
                domain, size = local_domain_id(self.node_name, groups[g.bdf]), len(groups[g.bdf])
            topo = GpuTopology(
                location=loc,
                nvlink_domain=domain,
                nvlink_domain_size=size,
                nic=pair,
                rail=rails[pair.nic] if pair is not None else None,
            )
            devices.append(gpu_device(g, system, topo, device_nodes=self.host_device_nodes))
        self._last_gpus.update({g.bdf: d for g, d in zip(gpus, devices, strict=True)})
        devices.extend(self._lost_devices(failed, gpu_bdfs))
        devices.sort(key=lambda d: int(d.name.split("-")[1]))
        names = [d.name for d in devices]
        if len(set(names)) != len(names):
            raise DiscoveryError(f"node {self.node_name}: duplicate GPU minor numbers: {names}")
        bdf_of = {g.uuid: g.bdf for g in gpus}
        # MIG-enabled GPUs: the whole GPU consumes a counter set that its placement devices share.
        devices = [x for d in devices
                   for x in (partition(d, migs[bdf_of[d.uuid]]) if bdf_of.get(d.uuid) in migs else [d])]
        if self.config.share_gpu_memory:  # opt-in: whole GPUs shared by memory (consumable capacity)
            devices = [shared(d) if d.kind == "gpu" and not d.consumes_counters else d for d in devices]
        devices.extend(
            nic_device(idx, nic, rails[nic.name], device_nodes=self.host_device_nodes)
            for idx, nic in enumerate(compute)
        )
        for d in devices:
            log.debug("node %s: discovered %s %s", self.node_name, d.name, d.uuid)
        return devices
