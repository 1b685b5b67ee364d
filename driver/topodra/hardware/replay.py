"""Replay fixtures: NVML answers + sysfs files captured from one machine, served again by FakeNvml.

Format (YAML, see tests/fixtures/hardware/README.md)::

    synthetic: true            # false only for real captures
    description: ...
    node: <node name the capture was taken on>
    nvml: <NvmlFacts>          # per-GPU answers or {error: NotSupported}
    sysfs: <SysfsTree>         # files/links below the sysfs root

``capture()`` records a fixture from any ``pynvml``-compatible module and sysfs
root (the real ones on a GPU host: ``topodra discover --capture out.yaml``).
"""

from __future__ import annotations

import ctypes
import os
import uuid as uuidlib
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict

from topodra.hardware.base import DiscoveryConfig
from topodra.hardware.facts import (
    YAML_LOADER,
    FabricFacts,
    GpuFacts,
    LinkFacts,
    MigProfileFacts,
    NvmlErr,
    NvmlFacts,
    PciFacts,
    SysfsTree,
    shared_root,
)
from topodra.hardware.mock import FakeNvml
from topodra.hardware.nvml import NvmlBackend
from topodra.hardware.sysfs import BDF, Sysfs


class ReplayFixture(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    synthetic: bool
    description: str
    node: str
    nvml: NvmlFacts
    sysfs: SysfsTree


def load_fixture(path: str) -> ReplayFixture:
    with open(path, encoding="utf-8") as f:
        data = yaml.load(f, Loader=YAML_LOADER)  # a safe loader: CSafeLoader or SafeLoader
    if not isinstance(data, dict):
        raise ValueError(f"replay fixture {path}: expected a mapping")
    return ReplayFixture.model_validate(data)


def replay_backend(
    fx: ReplayFixture, node_name: str, *, config: DiscoveryConfig, sysfs_root: str | None = None
) -> NvmlBackend:
    """The real backend serving a capture's NVML answers and sysfs files as ``node_name``'s hardware.

    The tree goes to ``sysfs_root`` if given, else to a shared read-only copy.  The
    captured machine's ``/dev`` nodes are not on this host, so the devices carry none.
    """
    if sysfs_root is None:
        root = shared_root(fx.sysfs)
    else:
        fx.sysfs.materialize(sysfs_root)
        root = sysfs_root
    return NvmlBackend(node_name, nvml=FakeNvml(fx.nvml), sysfs=Sysfs(root), config=config, host_device_nodes=False)


def dump_fixture(fx: ReplayFixture) -> str:
    return yaml.safe_dump(fx.model_dump(mode="json"), sort_keys=False, width=118, default_flow_style=None)


def _ask(nvml: Any, fn_name: str, *args: Any) -> Any:
    """Call and return the answer, or NvmlErr with the pynvml error class name."""
    fn = getattr(nvml, fn_name, None)
    if fn is None:
        return NvmlErr(error="FunctionNotFound")
    try:
        return fn(*args)
    except nvml.NVMLError as e:
        return NvmlErr(error=type(e).__name__.removeprefix("NVMLError_") or "Unknown")


def _pci_facts(p: Any) -> PciFacts:
    return PciFacts(busId=str(p.busId), pciDeviceId=int(p.pciDeviceId), pciSubSystemId=int(p.pciSubSystemId))


def _conv(v: Any, f: Any) -> Any:
    return v if isinstance(v, NvmlErr) else f(v)


def _fabric(nvml: Any, h: Any) -> FabricFacts | NvmlErr:
    for api, struct_name, fn_name in (
        (3, "c_nvmlGpuFabricInfo_v3_t", "nvmlDeviceGetGpuFabricInfoV"),
        (2, "c_nvmlGpuFabricInfo_v2_t", "nvmlDeviceGetGpuFabricInfoV"),
        (1, "c_nvmlGpuFabricInfo_t", "nvmlDeviceGetGpuFabricInfo"),
    ):
        cls = getattr(nvml, struct_name, None)
        if cls is None:
            continue
        s = cls()
        r = _ask(nvml, fn_name, h, ctypes.byref(s))
        if isinstance(r, NvmlErr):
            if r.error in ("ArgumentVersionMismatch", "FunctionNotFound"):
                continue
            return r
        return FabricFacts(
            clusterUuid=str(uuidlib.UUID(bytes=bytes(s.clusterUuid))),
            cliqueId=int(s.cliqueId),
            state=int(s.state),
            status=int(s.status),
            healthMask=int(getattr(s, "healthMask", 0)),
            api=api,
        )
    return NvmlErr(error="FunctionNotFound")


def _links(nvml: Any, h: Any) -> list[LinkFacts] | NvmlErr:
    links: list[LinkFacts] = []
    for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))):
        state = _ask(nvml, "nvmlDeviceGetNvLinkState", h, link)
        if isinstance(state, NvmlErr):
            if state.error == "InvalidArgument":
                break
            if link == 0:
                return state
        pci = _ask(nvml, "nvmlDeviceGetNvLinkRemotePciInfo", h, link)
        links.append(
            LinkFacts(
                state=_conv(state, int),
                remoteBusId=_conv(pci, lambda p: str(p.busId)),
                remoteType=_conv(_ask(nvml, "nvmlDeviceGetNvLinkRemoteDeviceType", h, link), int),
                version=_conv(_ask(nvml, "nvmlDeviceGetNvLinkVersion", h, link), int),
            )
        )
    return links


def _mig_profiles(nvml: Any, h: Any, mode: Any) -> list[MigProfileFacts]:
    """GPU-instance profiles and their placements, as NVML answers them while MIG mode is on."""
    if isinstance(mode, NvmlErr) or int(mode[0]) != int(getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1)):
        return []
    out: list[MigProfileFacts] = []
    for index in range(int(getattr(nvml, "NVML_GPU_INSTANCE_PROFILE_COUNT", 0x12))):
        info = _ask(nvml, "nvmlDeviceGetGpuInstanceProfileInfo", h, index)
        if isinstance(info, NvmlErr):
            continue  # NotSupported / InvalidArgument: no such profile on this GPU
        arr = (nvml.c_nvmlGpuInstancePlacement_t * 16)()
        count = ctypes.c_uint(16)
        r = _ask(nvml, "nvmlDeviceGetGpuInstancePossiblePlacements", h, info.id, arr, ctypes.byref(count))
        placements = [] if isinstance(r, NvmlErr) else [(int(arr[i].start), int(arr[i].size))
                                                         for i in range(count.value)]
        raw = info.name.decode() if isinstance(info.name, bytes) else str(info.name)
        out.append(MigProfileFacts(
            index=index, id=int(info.id), name=raw.removeprefix("MIG ").strip(), sliceCount=int(info.sliceCount),
            instanceCount=int(info.instanceCount), multiprocessorCount=int(info.multiprocessorCount),
            memorySizeMB=int(info.memorySizeMB), copyEngineCount=int(info.copyEngineCount),
            decoderCount=int(info.decoderCount), encoderCount=int(info.encoderCount),
            jpegCount=int(info.jpegCount), ofaCount=int(info.ofaCount), placements=placements,
        ))  # fmt: skip
    return out


def capture_nvml(nvml: Any) -> NvmlFacts:
    """Record every NVML answer the discovery backend asks for."""
    init = _ask(nvml, "nvmlInit")
    if isinstance(init, NvmlErr):
        raise RuntimeError(f"NVML initialisation failed: {init.error}")
    try:
        gpus: list[GpuFacts] = []
        for idx in range(int(nvml.nvmlDeviceGetCount())):
            h = _ask(nvml, "nvmlDeviceGetHandleByIndex", idx)
            if isinstance(h, NvmlErr):  # a lost GPU: recorded as NVML answers it, so a replay fails it alike
                gpus.append(GpuFacts(uuid=h, name=h, memoryTotal=h, pci=h, minor=h))
                continue
            pci = _ask(nvml, "nvmlDeviceGetPciInfo", h)
            mig_mode = _ask(nvml, "nvmlDeviceGetMigMode", h)
            gpus.append(
                GpuFacts(
                    uuid=_conv(_ask(nvml, "nvmlDeviceGetUUID", h), str),
                    name=_conv(_ask(nvml, "nvmlDeviceGetName", h), str),
                    memoryTotal=_conv(_ask(nvml, "nvmlDeviceGetMemoryInfo", h), lambda m: int(m.total)),
                    pci=_conv(pci, _pci_facts),
                    minor=_conv(_ask(nvml, "nvmlDeviceGetMinorNumber", h), int),
                    brand=_conv(_ask(nvml, "nvmlDeviceGetBrand", h), int),
                    architecture=_conv(_ask(nvml, "nvmlDeviceGetArchitecture", h), int),
                    computeCapability=_conv(_ask(nvml, "nvmlDeviceGetCudaComputeCapability", h), tuple),
                    migMode=_conv(mig_mode, tuple),
                    migProfiles=_mig_profiles(nvml, h, mig_mode),
                    numaNodeId=_conv(_ask(nvml, "nvmlDeviceGetNumaNodeId", h), int),
                    nvlinks=_links(nvml, h),
                    fabric=_fabric(nvml, h),
                )
            )
        cuda = _ask(nvml, "nvmlSystemGetCudaDriverVersion_v2")
        return NvmlFacts(
            driverVersion=_conv(_ask(nvml, "nvmlSystemGetDriverVersion"), str),
            cudaDriverVersion=_conv(cuda, int),
            gpus=gpus,
        )
    finally:
        nvml.nvmlShutdown()


def capture_sysfs(root: str, bdfs: list[str]) -> SysfsTree:
    """Copy what discovery reads: the given PCI devices, all RDMA NICs, CPU packages."""
    tree = SysfsTree()
    sys_root = os.path.abspath(root)

    def rel(p: str) -> str:
        return os.path.relpath(p, sys_root)

    def read(p: str) -> str | None:
        try:
            with open(p, encoding="utf-8", errors="replace") as f:
                return f.read().strip()
        except OSError:
            return None

    def add_pci(bdf: str) -> str | None:
        link = os.path.join(sys_root, "sys/bus/pci/devices", bdf)
        if not os.path.lexists(link):
            return None
        real = os.path.realpath(link)
        tree.links[rel(link)] = rel(real)
        for name in ("numa_node", "local_cpulist", "vendor", "device", "class"):
            content = read(os.path.join(real, name))
            if content is not None:
                tree.files[rel(os.path.join(real, name))] = content
        return real

    for bdf in bdfs:
        add_pci(bdf)
    ib = os.path.join(sys_root, "sys/class/infiniband")
    for name in sorted(os.listdir(ib)) if os.path.isdir(ib) else []:
        cls_link = os.path.join(ib, name)
        dev_real = os.path.realpath(os.path.join(cls_link, "device"))
        if not BDF.match(os.path.basename(dev_real)) or add_pci(os.path.basename(dev_real)) is None:
            continue
        ib_real = os.path.realpath(cls_link)
        tree.links[rel(cls_link)] = rel(ib_real)
        tree.links[rel(os.path.join(ib_real, "device"))] = rel(dev_real)
        for f in ("node_guid", "sys_image_guid", "ports/1/rate", "ports/1/link_layer", "ports/1/state"):
            content = read(os.path.join(ib_real, f))
            if content is not None:
                tree.files[rel(os.path.join(ib_real, f))] = content
        for sub in ("net", "infiniband_verbs"):
            d = os.path.join(dev_real, sub)
            for entry in sorted(os.listdir(d)) if os.path.isdir(d) else []:
                tree.dirs.append(rel(os.path.join(d, entry)))
    cpu_dir = os.path.join(sys_root, "sys/devices/system/cpu")
    for entry in sorted(os.listdir(cpu_dir)) if os.path.isdir(cpu_dir) else []:
        p = os.path.join(cpu_dir, entry, "topology/physical_package_id")
        content = read(p) if entry.startswith("cpu") and entry[3:].isdigit() else None
        if content is not None:
            tree.files[rel(p)] = content
    return tree
