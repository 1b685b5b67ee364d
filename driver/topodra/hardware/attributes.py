"""Turn discovered facts into published ``Device`` attributes (the public schema).

docs/attributes.md documents every name here; changing a name or type is an API
break.  Unqualified names belong to the driver's domain; ``resource.kubernetes.io/*``
names are the Kubernetes standard ones that other drivers (e.g. dranet) also
publish, so cross-driver ``matchAttribute`` works.  Facts that are unknown are
omitted, never guessed.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from topodra.devices import AttributeValue, Device, bool_attr, int_attr, string_attr, version_attr
from topodra.hardware.pairing import NicPairing
from topodra.hardware.sysfs import PciLocation, RdmaNic

log = logging.getLogger(__name__)

STD = "resource.kubernetes.io/"

BRANDS: dict[int, str] = {
    0: "Unknown", 1: "Quadro", 2: "Tesla", 3: "NVS", 4: "Grid", 5: "GeForce", 6: "Titan",
    7: "NvidiaVApps", 8: "NvidiaVPC", 9: "NvidiaVCS", 10: "NvidiaVWS", 11: "NvidiaCloudGaming",
    12: "QuadroRTX", 13: "NvidiaRTX", 14: "Nvidia", 15: "GeForceRTX", 16: "TitanRTX",
}  # fmt: skip
# ``nvmlDeviceArchitecture_t`` values, spelled as NVIDIA's DRA driver publishes them (go-nvlib's
# ``GetArchitectureAsString``), so its claims (``architecture == 'Hopper'``) match unchanged.
ARCHITECTURES: dict[int, str] = {
    2: "Kepler", 3: "Maxwell", 4: "Pascal", 5: "Volta", 6: "Turing", 7: "Ampere", 8: "Ada Lovelace", 9: "Hopper",
    10: "Blackwell", 13: "Rubin",
}  # fmt: skip
# ``nvmlDeviceAddressingModeType_t`` (nvml.h: NVML_DEVICE_ADDRESSING_MODE_NONE/HMM/ATS), as NVIDIA's driver names them.
ADDRESSING_MODES: dict[int, str] = {0: "None", 1: "HMM", 2: "ATS"}

# (pattern on the NVML product name, model stem, append marketing memory size?)
_MODELS: tuple[tuple[re.Pattern[str], str, bool], ...] = tuple(
    (re.compile(p, re.IGNORECASE), stem, sized)
    for p, stem, sized in (
        (r"\bGB300\b", "GB300", False),
        (r"\bGB200\b", "GB200", False),
        (r"\bGH200\b", "GH200", False),
        (r"\bB300\b", "B300-SXM6", True),
        (r"\bB200\b", "B200-SXM6", True),
        (r"\bH200\b.*\bNVL\b", "H200-NVL", True),
        (r"\bH200\b", "H200-SXM5", True),
        (r"\bH100\b.*\bNVL\b", "H100-NVL", True),
        (r"\bH100\b.*\bPCIe\b", "H100-PCIE", True),
        (r"\bH100\b", "H100-SXM5", True),
        (r"\bA100\b.*\bPCIe\b", "A100-PCIE", True),
        (r"\bA100\b", "A100-SXM4", True),
        (r"\bL40S\b", "L40S", False),
        (r"\bL40\b", "L40", False),
        (r"\bL4\b", "L4", False),
        (r"\bA10\b", "A10", False),
        (r"\bA30\b", "A30", False),
        (r"\bT4\b", "T4", False),
    )
)
# Marketing sizes (GB) that NVML totals (MiB, minus reserved memory) round to.
_MARKETING_GB = (16, 24, 32, 40, 48, 80, 94, 96, 141, 144, 180, 186, 192, 256, 288)


def marketing_memory_gb(product_name: str, memory_bytes: int | None) -> int | None:
    """Size in the product's own naming: from the name if it says ("80GB"), else nearest known size."""
    m = re.search(r"(\d+)\s*GB", product_name, re.IGNORECASE)
    if m:
        return int(m.group(1))
    if not memory_bytes:
        return None
    gib = memory_bytes / 2**30
    return min(_MARKETING_GB, key=lambda g: abs(g - gib))


def normalize_model(product_name: str, memory_bytes: int | None) -> str:
    """Short model name, e.g. "NVIDIA H100 80GB HBM3" -> "H100-SXM5-80GB"; unknown names are sanitised."""
    for pattern, stem, sized in _MODELS:
        if pattern.search(product_name):
            gb = marketing_memory_gb(product_name, memory_bytes) if sized else None
            return f"{stem}-{gb}GB" if gb else stem
    name = re.sub(r"^NVIDIA\s+", "", product_name.strip(), flags=re.IGNORECASE)
    clean = re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-")
    return clean[:64] or "unknown"


def semver(text: str) -> str | None:
    """Driver version to semver: "535.161.08" -> "535.161.8", "550.54" -> "550.54.0"; None if not numeric."""
    parts = text.strip().split(".")
    if not parts or not all(p.isdigit() for p in parts):
        return None
    nums = [int(p) for p in parts[:3]] + [0] * (3 - min(3, len(parts)))
    return ".".join(str(n) for n in nums)


def cuda_version(v: int) -> str:
    """NVML's CUDA driver version int (13000) -> "13.0.0"."""
    return f"{v // 1000}.{(v % 1000) // 10}.0"


def architecture_name(arch: int | None, cc: tuple[int, int] | None) -> str | None:
    """Architecture as NVIDIA's driver spells it; falls back to the compute-capability family when NVML does not say."""
    if arch is not None and arch in ARCHITECTURES:
        return ARCHITECTURES[arch]
    if cc is None:
        return None
    major, minor = cc
    if major == 8:
        return "Ada Lovelace" if minor >= 9 else "Ampere"
    return {7: "Volta", 9: "Hopper", 10: "Blackwell", 12: "Blackwell"}.get(major)


def format_quantity(n_bytes: int) -> str:
    """Exact Kubernetes quantity in the largest binary unit that divides the byte count."""
    for unit, factor in (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if n_bytes % factor == 0 and n_bytes >= factor:
            return f"{n_bytes // factor}{unit}"
    return str(n_bytes)


@dataclass(frozen=True)
class GpuInfo:
    """What NVML said about one GPU (None = not supported / unknown)."""

    index: int
    uuid: str
    product_name: str
    memory_bytes: int
    bdf: str
    minor: int | None
    brand: int | None
    architecture: int | None
    compute_capability: tuple[int, int] | None
    mig_capable: bool | None
    nvlink_version: int | None
    nvlink_active_links: int
    addressing_mode: int | None = None  # nvmlDeviceGetAddressingMode; None: unsupported / not in the library


@dataclass(frozen=True)
class SystemInfo:
    driver_version: str | None
    cuda_driver_version: int | None


@dataclass(frozen=True)
class GpuTopology:
    """Where a GPU sits, as derived from sysfs, NVLink and the NIC pairing."""

    location: PciLocation | None
    nvlink_domain: str | None
    nvlink_domain_size: int | None
    nic: NicPairing | None
    rail: int | None


def _locality(attrs: dict[str, AttributeValue], loc: PciLocation | None) -> None:
    if loc is None:
        return
    if loc.root is not None:
        attrs[STD + "pcieRoot"] = string_attr(loc.root)
    if loc.numa_node is not None:
        attrs[STD + "numaNode"] = int_attr(loc.numa_node)
        attrs["numaNode"] = int_attr(loc.numa_node)
    if loc.switch is not None:
        attrs["pcieSwitch"] = string_attr(loc.switch)
    if loc.cpu_socket is not None:
        attrs["cpuSocket"] = int_attr(loc.cpu_socket)


def gpu_device(gpu: GpuInfo, system: SystemInfo, topo: GpuTopology, *, device_nodes: bool) -> Device:
    """The published GPU device (name ``gpu-<minor>``; NVML index if the minor is unknown).

    ``index`` (the NVML index) and ``addressingMode`` are published as NVIDIA's DRA driver publishes (or
    published) them, so its claims select the same GPUs (docs/user-guide.md "Coming from NVIDIA's DRA driver").

    ``device_nodes``: whether the GPU's ``/dev/nvidiaN`` exists on this host (not for mock hardware).
    """
    attrs: dict[str, AttributeValue] = {
        "type": string_attr("gpu"),
        "uuid": string_attr(gpu.uuid),
        "productName": string_attr(gpu.product_name[:64]),
        "model": string_attr(normalize_model(gpu.product_name, gpu.memory_bytes)),
        STD + "pciBusID": string_attr(gpu.bdf),
    }
    if gpu.brand is not None:
        attrs["brand"] = string_attr(BRANDS.get(gpu.brand, "Unknown"))
    arch = architecture_name(gpu.architecture, gpu.compute_capability)
    if arch:
        attrs["architecture"] = string_attr(arch)
    if gpu.compute_capability is not None:
        attrs["cudaComputeCapability"] = version_attr(f"{gpu.compute_capability[0]}.{gpu.compute_capability[1]}.0")
    if system.driver_version is not None:
        dv = semver(system.driver_version)
        if dv:
            attrs["driverVersion"] = version_attr(dv)
        else:
            log.warning("driver version %r is not numeric; driverVersion omitted", system.driver_version)
    if system.cuda_driver_version is not None:
        attrs["cudaDriverVersion"] = version_attr(cuda_version(system.cuda_driver_version))
    if gpu.minor is not None:
        attrs["minor"] = int_attr(gpu.minor)
    attrs["index"] = int_attr(gpu.index)
    if gpu.addressing_mode is not None:
        if gpu.addressing_mode in ADDRESSING_MODES:
            attrs["addressingMode"] = string_attr(ADDRESSING_MODES[gpu.addressing_mode])
        else:
            log.warning("GPU %s: addressing mode %d is not in nvml.h's list; addressingMode omitted",
                        gpu.index, gpu.addressing_mode)
    if gpu.mig_capable is not None:
        attrs["migCapable"] = bool_attr(gpu.mig_capable)
    _locality(attrs, topo.location)
    if topo.nvlink_domain is not None:
        attrs["nvlinkDomain"] = string_attr(topo.nvlink_domain)
        if topo.nvlink_domain_size is not None:
            attrs["nvlinkDomainSize"] = int_attr(topo.nvlink_domain_size)
        if gpu.nvlink_version is not None:
            attrs["nvlinkVersion"] = int_attr(gpu.nvlink_version)
        attrs["nvlinkLinks"] = int_attr(gpu.nvlink_active_links)
    if topo.nic is not None:
        attrs["nicName"] = string_attr(topo.nic.nic)
        attrs["nicDistance"] = string_attr(topo.nic.distance)
    if topo.rail is not None:
        attrs["rail"] = int_attr(topo.rail)
    number = gpu.minor if gpu.minor is not None else gpu.index
    return Device(
        name=f"gpu-{number}",
        kind="gpu",
        attributes=attrs,
        capacity={"memory": format_quantity(gpu.memory_bytes)},
        uuid=gpu.uuid,
        device_nodes=(f"/dev/nvidia{number}",) if device_nodes else (),
    )


def lost_gpu_device(minor: int, uuid: str, bdf: str, reason: str, *, device_nodes: bool) -> Device:
    """A GPU that NVML cannot read, known only by what the kernel driver says: published so it can be tainted.

    It carries no model or memory, so no class that selects by them can match it, and the monitor taints it
    ``gpu-lost`` before the first publish (``Device.lost``).
    """
    return Device(
        name=f"gpu-{minor}",
        kind="gpu",
        attributes={"type": string_attr("gpu"), "uuid": string_attr(uuid), "minor": int_attr(minor),
                    STD + "pciBusID": string_attr(bdf)},
        uuid=uuid,
        device_nodes=(f"/dev/nvidia{minor}",) if device_nodes else (),
        lost=reason,
    )


def nic_device(index: int, nic: RdmaNic, rail: int, *, device_nodes: bool) -> Device:
    """The published compute NIC device (name ``nic-<index in compute-NIC order>``).

    ``device_nodes``: whether the NIC's ``/dev/infiniband/uverbsN`` exists on this host (not for mock hardware).
    """
    attrs: dict[str, AttributeValue] = {
        "type": string_attr("nic"),
        "rail": int_attr(rail),
        "rdmaDevice": string_attr(nic.name),
        STD + "pciBusID": string_attr(nic.bdf),
    }
    if nic.netdevs:
        attrs["netdev"] = string_attr(nic.netdevs[0])
    if nic.rate_gbps is not None:
        attrs["linkRate"] = int_attr(nic.rate_gbps)
    if nic.link_layer:
        attrs["linkLayer"] = string_attr(nic.link_layer[:64])
    _locality(attrs, nic.location)
    nodes = (f"/dev/infiniband/{nic.uverbs}",) if nic.uverbs and device_nodes else ()
    return Device(
        name=f"nic-{index}",
        kind="nic",
        attributes=attrs,
        uuid=f"NIC-{nic.node_guid}" if nic.node_guid else f"NIC-{nic.bdf}",
        device_nodes=nodes,
    )
