"""What a container needs from the host's NVIDIA driver, read once from the driver root: the CDI edits.

A GPU is useless to CUDA without the driver's control nodes (``/dev/nvidiactl``, ``/dev/nvidia-uvm``,
``/dev/nvidia-uvm-tools``) and user-space libraries (``libcuda.so.1``, ``libnvidia-ml.so.1``, ...).  NVIDIA's
DRA driver generates these edits in process (the toolkit's ``nvcdi``); topodra does the same here rather than
depend on the toolkit's spec being present (MIG devices never have one).  Every device node is emitted with
``type``, ``major``, ``minor`` and ``fileMode``: then the CDI library does not ``stat`` a host path, which
matters for MIG capability nodes (``/dev/nvidia-caps/nvidia-capN``) that usually do not exist on the host
(the driver's ``nvidia-modprobe`` creates them on demand), and for a plugin that sees the host's files under
another root than the container runtime does.

``discover`` is the one filesystem edge (run at plugin start); ``HostDriver`` is plain data and its
methods are pure, so building a claim's spec stays pure.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from topodra.hardware.nvmllib import LIBRARY_DIRS

log = logging.getLogger(__name__)

NVIDIA_MAJOR = 195  # nvidia-frontend: fixed by the kernel driver (GPUs 0..254, nvidiactl 255)
CONTROL_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
# Sonames of the compute libraries, as the toolkit's "compute" capability lists them (those found are mounted).
LIBRARIES = ("libcuda.so.1", "libnvidia-ml.so.1", "libnvidia-ptxjitcompiler.so.1", "libnvidia-nvvm.so.4",
             "libcudadebugger.so.1", "libnvidia-gpucomp.so.1")  # fmt: skip
MOUNT_OPTIONS = ("ro", "nosuid", "nodev", "rbind", "rprivate")  # the toolkit's options for driver files
_GPU_NODE = re.compile(r"^/dev/nvidia([0-9]+)$")
_CAP_NODE = re.compile(r"^/dev/nvidia-caps/nvidia-cap([0-9]+)$")


class HostDriverError(ValueError):
    """A device node's edit cannot be made from what the host driver says (e.g. no nvidia-caps major)."""


@dataclass(frozen=True)
class Node:
    """A char device node as the container gets it: created from its numbers, never stat'ed on the host."""

    path: str
    major: int
    minor: int
    file_mode: int  # permission bits

    def edit(self) -> dict[str, Any]:
        return {"path": self.path, "type": "c", "major": self.major, "minor": self.minor,
                "fileMode": self.file_mode}


@dataclass(frozen=True)
class HostDriver:
    """The host driver's facts a spec needs (``discover``); mock hardware has none (no HostDriver at all)."""

    majors: Mapping[str, int] = field(default_factory=dict)  # /proc/devices char majors by name
    nodes: Mapping[str, Node] = field(default_factory=dict)  # /dev/nvidia* found under the dev root
    libraries: tuple[tuple[str, str], ...] = ()  # (host path, container path), bind-mounted read-only

    def control_nodes(self) -> list[dict[str, Any]]:
        """The control nodes present on this host, in NVIDIA's order."""
        return [self.nodes[f"/dev/{n}"].edit() for n in CONTROL_NODES if f"/dev/{n}" in self.nodes]

    def mounts(self) -> list[dict[str, Any]]:
        return [{"hostPath": h, "containerPath": c, "options": list(MOUNT_OPTIONS)} for h, c in self.libraries]

    def node(self, path: str, file_mode: int | None = None) -> dict[str, Any]:
        """The edit of one device node of a device.  A MIG capability node takes the ``nvidia-caps`` major
        and the mode the driver gives (``file_mode``, from its capability file), as NVIDIA's DRA driver does;
        HostDriverError when the host has no ``nvidia-caps`` major."""
        cap = _CAP_NODE.match(path)
        if cap is not None:
            major = self.majors.get("nvidia-caps")
            if major is None:
                raise HostDriverError(f"{path}: no nvidia-caps line in /proc/devices (is the MIG-capable "
                                      "driver loaded? see --nvidia-proc-root)")
            return Node(path, major, int(cap.group(1)), 0o444 if file_mode is None else file_mode).edit()
        known = self.nodes.get(path)
        if known is not None:
            return known.edit()
        gpu = _GPU_NODE.match(path)
        if gpu is not None:  # not under the dev root (yet): the numbers are fixed by the driver
            return Node(path, NVIDIA_MAJOR, int(gpu.group(1)), 0o666).edit()
        return {"path": path}  # not NVIDIA's (e.g. /dev/infiniband/uverbs0): the runtime stats the host


def read_majors(proc_root: str | os.PathLike[str]) -> dict[str, int]:
    """Char device majors by driver name from ``<proc_root>/devices``; empty when unreadable."""
    try:
        text = (Path(proc_root) / "devices").read_text()
    except OSError as e:
        log.warning("cannot read %s/devices: %s", proc_root, e)
        return {}
    out: dict[str, int] = {}
    for line in text.split("Block devices:")[0].splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit():
            out[parts[1]] = int(parts[0])
    return out


def default_dev_root(driver_root: str | os.PathLike[str]) -> Path:
    """NVIDIA's rule: the driver root holds the device nodes when it has ``dev/nvidiactl`` (a driver
    container), else they are under ``/``."""
    root = Path(driver_root)
    return root if (root / "dev/nvidiactl").exists() else Path("/")


def _scan_nodes(dev_root: Path) -> dict[str, Node]:
    out: dict[str, Node] = {}
    dev = dev_root / "dev"
    try:
        names = sorted(p.name for p in dev.iterdir() if p.name.startswith("nvidia"))
    except OSError as e:
        log.warning("cannot list %s: %s", dev, e)
        return out
    for name in names:
        try:
            st = os.stat(dev / name)
        except OSError:
            continue
        if stat.S_ISCHR(st.st_mode):
            out[f"/dev/{name}"] = Node(f"/dev/{name}", os.major(st.st_rdev), os.minor(st.st_rdev),
                                       stat.S_IMODE(st.st_mode))
    return out


def _scan_libraries(driver_root: Path, host_root: str) -> list[tuple[str, str]]:
    """(host path, container path): each library's real file at its own name and at its soname, so it
    loads by soname with no ldcache hook."""
    real_root = Path(os.path.realpath(driver_root))
    out: list[tuple[str, str]] = []
    for soname in LIBRARIES:
        for d in LIBRARY_DIRS:
            link = driver_root / d / soname
            if not link.exists():
                continue
            real = Path(os.path.realpath(link))
            try:
                rel = real.relative_to(real_root)
            except ValueError:
                log.warning("%s resolves outside the driver root (%s); not mounted", link, real)
                break
            host = str(Path(host_root) / rel)
            out.append((host, f"/{rel}"))
            if real.name != soname:
                out.append((host, f"/{d}/{soname}"))
            break
    return out


def discover(driver_root: str | os.PathLike[str], *, dev_root: str | os.PathLike[str] | None = None,
             proc_root: str | os.PathLike[str] = "/proc",
             host_driver_root: str | os.PathLike[str] | None = None) -> HostDriver:
    """Read the host driver's facts.  ``driver_root``: where this process sees the driver files;
    ``host_driver_root``: where the container runtime sees them (the chart mounts the host's root at
    ``/driver-root``; default: the same path); ``dev_root``: where ``dev/nvidia*`` is (default
    ``default_dev_root``)."""
    root = Path(driver_root)
    host = str(host_driver_root) if host_driver_root is not None else str(root)
    devs = Path(dev_root) if dev_root is not None else default_dev_root(root)
    found = HostDriver(majors=read_majors(proc_root), nodes=_scan_nodes(devs),
                       libraries=tuple(_scan_libraries(root, host)))
    missing = [n for n in ("nvidiactl", "nvidia-uvm") if f"/dev/{n}" not in found.nodes]
    if missing or not found.libraries:
        log.warning("NVIDIA driver incomplete for containers: missing nodes %s under %s/dev, libraries %s "
                    "under %s", missing or "-", devs, "found" if found.libraries else "none", root)
    log.info("host driver: %d device nodes under %s/dev, %d library mounts from %s (host path %s)",
             len(found.nodes), devs, len(found.libraries), root, host)
    return found
