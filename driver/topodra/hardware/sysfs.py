"""Read PCIe placement, NUMA/CPU locality and RDMA NICs from sysfs.

Everything is read below a configurable root (default ``/``) so tests and mock
hardware can point at a generated tree.  Missing or malformed files never raise:
the fact is reported as unknown (``None``) and, when the file exists but is
garbage, a warning names the file.  ``numa_node == -1`` (firmware gave no
affinity) is "unknown", as the Kubernetes standard ``numaNode`` attribute wants.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

log = logging.getLogger(__name__)

BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_ROOT = re.compile(r"^pci[0-9a-f]{4}:[0-9a-f]{2}$")
_RATE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*Gb/sec")


@dataclass(frozen=True)
class PciLocation:
    """Where one PCI function sits: host bridge, bridge chain, NUMA node, CPUs."""

    bdf: str
    root: str | None  # host bridge, e.g. "pci0000:15" (the k8s pcieRoot value)
    bridges: tuple[str, ...]  # BDFs of the bridges/switch ports from the root port down, device excluded
    numa_node: int | None
    local_cpus: frozenset[int]
    cpu_socket: int | None

    @property
    def switch(self) -> str | None:
        """Top switch port below the root port: devices sharing it share a PCIe switch tree."""
        return self.bridges[1] if len(self.bridges) >= 2 else None


@dataclass(frozen=True)
class RdmaNic:
    """One RDMA device (``/sys/class/infiniband/<name>``) and its port-1 facts."""

    name: str
    bdf: str
    location: PciLocation
    rate_gbps: int | None
    link_layer: str | None
    state: str | None
    netdevs: tuple[str, ...]
    sys_image_guid: str | None
    node_guid: str | None
    uverbs: str | None  # e.g. "uverbs0" -> /dev/infiniband/uverbs0
    virtual_function: bool = False  # an SR-IOV VF (``device/physfn`` exists): it reports its PF's sys_image_guid

    @property
    def port_active(self) -> bool | None:
        """Port 1 is ACTIVE (its ``rate`` is the negotiated speed); None when the state is unknown."""
        if self.state is None:
            return None
        return self.state.partition(":")[2].strip().upper() in ("ACTIVE", "ACTIVE_DEFER")


def parse_cpulist(text: str) -> frozenset[int]:
    """Parse a kernel cpulist ("0-55,112-167"); raise ValueError if malformed."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            a, z = int(lo), int(hi)
            if z < a:
                raise ValueError(f"bad cpu range {part!r}")
            cpus.update(range(a, z + 1))
        else:
            cpus.add(int(part))
    return frozenset(cpus)


def parse_rate_gbps(text: str) -> int | None:
    """ "400 Gb/sec (4X NDR)" -> 400; None if the format is unknown."""
    m = _RATE.match(text)
    return round(float(m.group(1))) if m else None


class Sysfs:
    """Read-only view of a sysfs tree mounted at ``<root>/sys``."""

    def __init__(self, root: str = "/") -> None:
        self.root = os.path.abspath(root)

    def path(self, rel: str) -> str:
        return os.path.join(self.root, rel.lstrip("/"))

    def read(self, rel_or_abs: str) -> str | None:
        """File content stripped, or None if absent/unreadable."""
        p = rel_or_abs if os.path.isabs(rel_or_abs) else self.path(rel_or_abs)
        try:
            with open(p, encoding="utf-8", errors="replace") as f:
                return f.read().strip()
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("sysfs: cannot read %s: %s", p, e)
            return None

    def _read_int(self, p: str, what: str) -> int | None:
        text = self.read(p)
        if text is None:
            return None
        try:
            return int(text, 0)
        except ValueError:
            log.warning("sysfs: %s in %s is not an integer: %r", what, p, text)
            return None

    def cpu_socket(self, cpus: frozenset[int]) -> int | None:
        """Physical package of the lowest CPU in the set."""
        if not cpus:
            return None
        cpu = min(cpus)
        return self._read_int(f"sys/devices/system/cpu/cpu{cpu}/topology/physical_package_id", "socket")

    def nvidia_gpus(self) -> list[str]:
        """BDFs of the NVIDIA display/3D-class PCI functions (vendor 0x10de, class 0x03xxxx), sorted."""
        base = self.path("sys/bus/pci/devices")
        try:
            names = sorted(os.listdir(base))
        except OSError:
            return []
        out = []
        for bdf in names:
            vendor = self.read(os.path.join(base, bdf, "vendor"))
            pci_class = self.read(os.path.join(base, bdf, "class"))
            if BDF.match(bdf) and vendor == "0x10de" and pci_class is not None and pci_class.startswith("0x03"):
                out.append(bdf)
        return out

    def nvidia_gpu_info(self, bdf: str) -> dict[str, str]:
        """The NVIDIA driver's ``/proc/driver/nvidia/gpus/<bdf>/information`` ("GPU UUID", "Device Minor", ...).

        The kernel driver answers it even when NVML calls fail for the GPU; {} when it is absent.
        """
        text = self.read(f"proc/driver/nvidia/gpus/{bdf}/information")
        out: dict[str, str] = {}
        for line in (text or "").splitlines():
            key, sep, value = line.partition(":")
            if sep:
                out[key.strip()] = value.strip()
        return out

    def pci_location(self, bdf: str) -> PciLocation | None:
        """Resolve ``/sys/bus/pci/devices/<bdf>``; None if the device is not there."""
        link = self.path(f"sys/bus/pci/devices/{bdf}")
        if not os.path.lexists(link):
            return None
        real = os.path.realpath(link)
        devices_dir = self.path("sys/devices") + os.sep
        root: str | None = None
        bridges: tuple[str, ...] = ()
        if real.startswith(devices_dir):
            parts = real[len(devices_dir) :].split(os.sep)
            if parts and _ROOT.match(parts[0]) and parts[-1] == bdf:
                root = parts[0]
                bridges = tuple(p for p in parts[1:-1] if BDF.match(p))
            else:
                log.warning("sysfs: %s resolves to %s, which is not below a PCI host bridge", link, real)
        else:
            log.warning("sysfs: %s resolves outside %s: %s", link, devices_dir, real)
        numa = self._read_int(os.path.join(real, "numa_node"), "numa_node")
        if numa is not None and numa < 0:
            numa = None
        cpus: frozenset[int] = frozenset()
        cpulist = self.read(os.path.join(real, "local_cpulist"))
        if cpulist is not None:
            try:
                cpus = parse_cpulist(cpulist)
            except ValueError:
                log.warning("sysfs: malformed local_cpulist for %s: %r", bdf, cpulist)
        socket = self.cpu_socket(cpus)
        return PciLocation(bdf=bdf, root=root, bridges=bridges, numa_node=numa, local_cpus=cpus, cpu_socket=socket)

    def rdma_nics(self) -> list[RdmaNic]:
        """All RDMA devices backed by a PCI function, sorted by PCI address."""
        base = self.path("sys/class/infiniband")
        try:
            names = sorted(os.listdir(base))
        except FileNotFoundError:
            return []
        nics: list[RdmaNic] = []
        for name in names:
            dev = os.path.join(base, name, "device")
            if not os.path.lexists(dev):
                log.warning("sysfs: RDMA device %s has no device link; skipped", name)
                continue
            real = os.path.realpath(dev)
            bdf = os.path.basename(real)
            loc = self.pci_location(bdf) if BDF.match(bdf) else None
            if loc is None:
                log.warning("sysfs: RDMA device %s is not a PCI function (%s); skipped", name, real)
                continue
            port = os.path.join(base, name, "ports", "1")
            rate_text = self.read(os.path.join(port, "rate"))
            rate = parse_rate_gbps(rate_text) if rate_text is not None else None
            if rate_text is not None and rate is None:
                log.warning("sysfs: unknown rate format for %s: %r", name, rate_text)
            try:
                netdevs = tuple(sorted(os.listdir(os.path.join(real, "net"))))
            except OSError:
                netdevs = ()
            try:
                verbs = sorted(os.listdir(os.path.join(real, "infiniband_verbs")))
            except OSError:
                verbs = []
            nics.append(
                RdmaNic(
                    name=name,
                    bdf=bdf,
                    location=loc,
                    rate_gbps=rate,
                    link_layer=self.read(os.path.join(port, "link_layer")),
                    state=self.read(os.path.join(port, "state")),
                    netdevs=netdevs,
                    sys_image_guid=self.read(os.path.join(base, name, "sys_image_guid")),
                    node_guid=self.read(os.path.join(base, name, "node_guid")),
                    uverbs=verbs[0] if verbs else None,
                    virtual_function=os.path.lexists(os.path.join(real, "physfn")),
                )
            )
        return sorted(nics, key=lambda n: (n.bdf, n.name))
