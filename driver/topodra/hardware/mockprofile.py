"""Mock hardware profiles: declared data (profiles/*.yaml) turned into NVML answers and a sysfs tree.

A profile describes one server model as it really is: the NVML product name,
memory, capabilities, which NVML calls answer NotSupported, the NVLink wiring,
the PCIe tree (host bridge + bridge chain per device), NUMA/CPU layout and the
RDMA NICs.  Per node, GPU UUIDs are derived from the node name, so the same
node always gets the same identities.

Node-specific facts live in the NVML answers only.  The sysfs tree depends on
the profile (and the hidden GPU slots) alone, so every node of a profile can
read one shared tree: a 50-node cluster writes 3 trees, not 50.  NIC GUIDs are
therefore the same on every node of a profile; they name a NIC within its node
(the device's private UUID), which is all discovery and prepare use them for.
"""

from __future__ import annotations

import hashlib
import os
import threading
import uuid as uuidlib
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

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
)
from topodra.hardware.sysfs import BDF, parse_cpulist

PROFILE_DIR = os.path.join(os.path.dirname(__file__), "profiles")
UUID_NAMESPACE = uuidlib.UUID("6f1d5c3e-2b7a-4d1e-9c59-7a8e0c4b2f10")
NOT_SUPPORTED = NvmlErr(error="NotSupported")


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class NumaNode(_Model):
    node: int = Field(ge=0)
    socket: int = Field(ge=0)
    cpus: str

    @field_validator("cpus")
    @classmethod
    def _cpulist(cls, v: str) -> str:
        parse_cpulist(v)
        return v


class PciPlacement(_Model):
    bdf: str
    root: str  # host bridge, e.g. pci0000:15
    bridges: list[str] = Field(default_factory=list)  # BDFs from the root port down
    numa: int = -1  # sysfs numa_node (-1 = firmware gave none)

    @field_validator("bdf")
    @classmethod
    def _bdf(cls, v: str) -> str:
        if not BDF.match(v):
            raise ValueError(f"{v!r} is not a PCI address like 0000:1b:00.0")
        return v


class NvlinkSpec(_Model):
    topology: Literal["switch", "bridge"]
    links: int = Field(ge=1, le=36)
    version: int = Field(ge=1, le=6)  # the NVLink generation (H100: 4); NVML answers its enum (NVLINK_ENUM)
    switches: list[str] = Field(default_factory=list)  # NVSwitch BDFs (topology=switch)
    groups: list[list[int]] = Field(default_factory=list)  # GPU slots per bridge island (topology=bridge)


class GpuModel(_Model):
    """NVML facts shared by every GPU of the profile."""

    name: str
    brand: int
    architecture: int
    computeCapability: tuple[int, int]
    memoryMiB: int
    pciDeviceId: int = 0
    mig: bool
    migEnabled: bool = False  # MIG mode on (admins set it; the driver never toggles it)
    migProfiles: list[MigProfileFacts] = Field(default_factory=list)  # GPU-instance profiles of a MIG GPU
    nvlink: NvlinkSpec | None = None
    fabric: Literal["notSupported", "stateNotSupported", "singleNode", "multiNode"] = "notSupported"


class Nic(PciPlacement):
    name: str
    rate: str = "400 Gb/sec (4X NDR)"
    linkLayer: str = "InfiniBand"
    netdev: str | None = None
    card: str  # adapters with several RDMA functions share a card id (-> same sys_image_guid)


class Fabric(_Model):
    clusterUUID: str = "00000000-0000-0000-0000-000000000000"
    cliqueId: int = 0

    @field_validator("clusterUUID")
    @classmethod
    def _uuid(cls, v: str) -> str:
        return str(uuidlib.UUID(v))


class Profile(_Model):
    name: str
    description: str
    driverVersion: str
    cudaDriverVersion: int
    numa: list[NumaNode]
    gpu: GpuModel
    gpus: list[PciPlacement]
    nics: list[Nic] = Field(default_factory=list)
    fabric: Fabric = Fabric()
    discovery: dict[str, Any] = Field(default_factory=dict)  # DiscoveryConfig defaults for this profile
    # The server's system memory as a Kubernetes quantity (vendor datasheet); simulated nodes report it,
    # with the logical CPUs of ``numa``, as their allocatable (``host_allocatable``).
    hostMemory: str | None = None

    @model_validator(mode="after")
    def _consistent(self) -> Profile:
        bdfs = [g.bdf for g in self.gpus] + [n.bdf for n in self.nics]
        if len(set(bdfs)) != len(bdfs):
            raise ValueError(f"profile {self.name}: duplicate PCI addresses")
        nodes = {n.node for n in self.numa}
        for p in [*self.gpus, *self.nics]:
            if p.numa != -1 and p.numa not in nodes:
                raise ValueError(f"profile {self.name}: {p.bdf} is on unknown NUMA node {p.numa}")
        if self.gpu.migEnabled and not (self.gpu.mig and self.gpu.migProfiles):
            raise ValueError(f"profile {self.name}: migEnabled needs mig: true and migProfiles")
        nv = self.gpu.nvlink
        if nv is not None and nv.topology == "bridge":
            flat = sorted(i for g in nv.groups for i in g)
            if flat != list(range(len(self.gpus))):
                raise ValueError(f"profile {self.name}: bridge groups must cover every GPU slot once")
        if nv is not None and nv.topology == "switch" and not nv.switches:
            raise ValueError(f"profile {self.name}: switch NVLink needs switch addresses")
        return self


def host_allocatable(profile: Profile) -> tuple[str, str | None]:
    """(logical CPUs, system memory) of the profile's server: the CPUs its NUMA nodes list, the memory
    its ``hostMemory`` names (None when the profile does not say)."""
    cpus: set[int] = set()
    for n in profile.numa:
        cpus |= parse_cpulist(n.cpus)
    return str(len(cpus)), profile.hostMemory


def profile_names() -> list[str]:
    return sorted(f[: -len(".yaml")] for f in os.listdir(PROFILE_DIR) if f.endswith(".yaml"))


_profiles: dict[tuple[str, int, int], Profile] = {}
_profiles_lock = threading.Lock()


def load_profile(name_or_path: str) -> Profile:
    """A bundled profile by name (``dgx-h100``) or a profile YAML file by path.

    Parsed once per file version (path, mtime, size): a simulated cluster loads
    the same few profiles for every node, and an edited file is read again.
    """
    path = name_or_path if os.sep in name_or_path or name_or_path.endswith(".yaml") else None
    if path is None:
        if name_or_path not in profile_names():
            raise ValueError(f"unknown mock profile {name_or_path!r}; bundled: {', '.join(profile_names())}")
        path = os.path.join(PROFILE_DIR, name_or_path + ".yaml")
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_mtime_ns, st.st_size)
    with _profiles_lock:
        cached = _profiles.get(key)
    if cached is not None:
        return cached
    with open(path, encoding="utf-8") as f:
        data = yaml.load(f, Loader=YAML_LOADER)  # a safe loader: CSafeLoader or SafeLoader
    if not isinstance(data, dict):
        raise ValueError(f"profile {path}: expected a mapping")
    profile = Profile.model_validate(data)
    with _profiles_lock:
        _profiles[key] = profile
    return profile


def gpu_uuid(node: str, slot: int) -> str:
    """Deterministic NVML-style UUID for GPU ``slot`` of ``node``."""
    return "GPU-" + str(uuidlib.uuid5(UUID_NAMESPACE, f"{node}/gpu/{slot}"))


def _guid(profile: str, what: str) -> str:
    h = hashlib.sha256(f"{profile}/{what}".encode()).hexdigest()[:16]
    return ":".join(h[i : i + 4] for i in range(0, 16, 4))


def _nvml_bus_id(bdf: str) -> str:
    domain, rest = bdf.split(":", 1)
    return f"{int(domain, 16):08X}:{rest.upper()}"


# The nvmlNvlinkVersion_t value a GPU of each NVLink generation answers (nvml.h NVML_NVLINK_VERSION_*):
# V100 2_0, A100 3_1 (5), H100/H200 4_0 (6), B200/GB200 5_0 (7).
NVLINK_ENUM: dict[int, int] = {1: 1, 2: 2, 3: 5, 4: 6, 5: 7, 6: 8}


def build_facts(profile: Profile, node: str, hidden: frozenset[int], fabric: Fabric) -> NvmlFacts:
    """NVML answers of ``node`` built from ``profile`` (GPU slots in ``hidden`` are gone from the bus)."""
    g = profile.gpu
    present = [i for i in range(len(profile.gpus)) if i not in hidden]
    gpus: list[GpuFacts] = []
    for slot in present:
        place = profile.gpus[slot]
        nvlinks: list[LinkFacts] | NvmlErr = NOT_SUPPORTED
        if g.nvlink is not None:
            nvlinks = []
            nv = g.nvlink
            enum = NVLINK_ENUM[nv.version]
            if nv.topology == "switch":
                for link in range(nv.links):
                    sw = nv.switches[link % len(nv.switches)]
                    nvlinks.append(LinkFacts(state=1, remoteBusId=_nvml_bus_id(sw), remoteType=2, version=enum))
            else:
                peers = [p for grp in nv.groups if slot in grp for p in grp if p != slot]
                for link in range(nv.links):
                    if not peers:
                        nvlinks.append(LinkFacts(state=0, version=enum))
                        continue
                    peer = peers[link % len(peers)]
                    # A bridge to a GPU that fell off the bus is a dead link.
                    alive = peer not in hidden
                    nvlinks.append(
                        LinkFacts(
                            state=1 if alive else 0,
                            remoteBusId=_nvml_bus_id(profile.gpus[peer].bdf),
                            remoteType=0,
                            version=enum,
                        )
                    )
        fab: FabricFacts | NvmlErr = NOT_SUPPORTED
        if g.fabric == "stateNotSupported":
            fab = FabricFacts(state=0)
        elif g.fabric == "singleNode":
            fab = FabricFacts()
        elif g.fabric == "multiNode":
            fab = FabricFacts(clusterUuid=fabric.clusterUUID, cliqueId=fabric.cliqueId)
        gpus.append(
            GpuFacts(
                uuid=gpu_uuid(node, slot),
                name=g.name,
                memoryTotal=g.memoryMiB * 2**20,
                pci=PciFacts(busId=_nvml_bus_id(place.bdf), pciDeviceId=g.pciDeviceId),
                minor=slot,
                brand=g.brand,
                architecture=g.architecture,
                computeCapability=g.computeCapability,
                migMode=((1, 1) if g.migEnabled else (0, 0)) if g.mig else NOT_SUPPORTED,
                migProfiles=list(g.migProfiles) if g.mig else [],  # placements answer with MIG off too
                numaNodeId=place.numa if g.fabric == "multiNode" else NOT_SUPPORTED,
                nvlinks=nvlinks,
                fabric=fab,
            )
        )
    return NvmlFacts(driverVersion=profile.driverVersion, cudaDriverVersion=profile.cudaDriverVersion, gpus=gpus)


def _pci_device(tree: SysfsTree, p: PciPlacement, cpus: str, vendor: str, pci_class: str) -> str:
    dev = "/".join(["sys/devices", p.root, *p.bridges, p.bdf])
    for bridge_depth in range(len(p.bridges)):
        tree.dirs.append("/".join(["sys/devices", p.root, *p.bridges[: bridge_depth + 1]]))
    tree.files[f"{dev}/numa_node"] = str(p.numa)
    tree.files[f"{dev}/local_cpulist"] = cpus
    tree.files[f"{dev}/vendor"] = vendor
    tree.files[f"{dev}/class"] = pci_class
    tree.links[f"sys/bus/pci/devices/{p.bdf}"] = dev
    return dev


def build_tree(profile: Profile, hidden: frozenset[int]) -> SysfsTree:
    """The sysfs tree of every node of ``profile``: PCI devices, RDMA NICs, CPU/NUMA topology.

    GPU slots in ``hidden`` are gone from the PCI bus.  No fact here depends on the node.
    """
    tree = SysfsTree()
    cpus_of = {n.node: n.cpus for n in profile.numa}
    all_cpus = ",".join(n.cpus for n in profile.numa)
    for n in profile.numa:
        tree.files[f"sys/devices/system/node/node{n.node}/cpulist"] = n.cpus
        # Only the first CPU of each range: discovery reads the lowest CPU of a device's
        # local_cpulist, and skipping the rest keeps a tree at ~250 files instead of ~700.
        for part in n.cpus.split(","):
            first = int(part.split("-")[0])
            tree.files[f"sys/devices/system/cpu/cpu{first}/topology/physical_package_id"] = str(n.socket)
    for slot, gp in enumerate(profile.gpus):
        if slot not in hidden:
            _pci_device(tree, gp, cpus_of.get(gp.numa, all_cpus), "0x10de", "0x030200")
    for idx, nic in enumerate(profile.nics):
        dev = _pci_device(
            tree, nic, cpus_of.get(nic.numa, all_cpus), "0x15b3",
            "0x020700" if nic.linkLayer == "InfiniBand" else "0x020000",
        )  # fmt: skip
        ib = f"{dev}/infiniband/{nic.name}"
        tree.files[f"{ib}/ports/1/rate"] = nic.rate
        tree.files[f"{ib}/ports/1/link_layer"] = nic.linkLayer
        tree.files[f"{ib}/ports/1/state"] = "4: ACTIVE"
        tree.files[f"{ib}/ports/1/phys_state"] = "5: LinkUp"
        tree.files[f"{ib}/node_guid"] = _guid(profile.name, f"nic/{nic.name}")
        tree.files[f"{ib}/sys_image_guid"] = _guid(profile.name, f"card/{nic.card}")
        tree.links[f"{ib}/device"] = dev
        tree.links[f"sys/class/infiniband/{nic.name}"] = ib
        tree.dirs.append(f"{dev}/infiniband_verbs/uverbs{idx}")
        if nic.netdev:
            tree.dirs.append(f"{dev}/net/{nic.netdev}")
    return tree
