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

import fnmatch
import logging
import os
import posixpath
import re
import stat
from collections.abc import Iterable, Mapping
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
_VERSION = re.compile(r"^[0-9]+(\.[0-9]+)+$")


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
class Library:
    """One driver library as the container gets it (paths as the container runtime sees them)."""

    soname: str  # e.g. libcuda.so.1: the name it is loaded by
    host: str  # the real (versioned) file on the host
    container: str  # where it is mounted: its own name, in its own directory
    soname_path: str | None = None  # the soname in that directory when the file has another name
    links: tuple[str, ...] = ()  # ``target::link`` the toolkit's create-symlinks makes for it


@dataclass(frozen=True)
class HostDriver:
    """The host driver's facts a spec needs (``discover``); mock hardware has none (no HostDriver at all)."""

    majors: Mapping[str, int] = field(default_factory=dict)  # /proc/devices char majors by name
    nodes: Mapping[str, Node] = field(default_factory=dict)  # /dev/nvidia* found under the dev root
    libraries: tuple[Library, ...] = ()  # the compute libraries found, bind-mounted read-only
    version: str = ""  # the driver version from the libraries' file names (libcuda.so.<version>); "" unknown
    host_root: str = ""  # the driver root as the host's container runtime sees it
    # The host path of nvidia-cdi-hook when it was found (``discover``'s ``cdi_hook``): claim specs then carry
    # the toolkit's hooks (topodra.cdihooks) and the sonames are symlinks it creates, not extra mounts.
    cdi_hook: str | None = None

    def control_nodes(self) -> list[dict[str, Any]]:
        """The control nodes present on this host, in NVIDIA's order."""
        return [self.nodes[f"/dev/{n}"].edit() for n in CONTROL_NODES if f"/dev/{n}" in self.nodes]

    def mounts(self) -> list[dict[str, Any]]:
        """Each library's real file at its own name; without a hook binary also at its soname, so it loads by
        soname with no ldcache or symlink hook."""
        pairs: list[tuple[str, str]] = []
        for lib in self.libraries:
            pairs.append((lib.host, lib.container))
            if self.cdi_hook is None and lib.soname_path is not None:
                pairs.append((lib.host, lib.soname_path))
        return [{"hostPath": h, "containerPath": c, "options": list(MOUNT_OPTIONS)} for h, c in pairs]

    def library_dirs(self) -> list[str]:
        """The container directories of the mounted libraries, in mount order, each once (the toolkit's
        ``update-ldcache --folder`` list)."""
        return list(dict.fromkeys(posixpath.dirname(lib.container) for lib in self.libraries))

    def symlinks(self) -> list[str]:
        """``target::link`` for the toolkit's ``create-symlinks`` hook, in its order and without repeats."""
        return list(dict.fromkeys(link for lib in self.libraries for link in lib.links))

    def env(self) -> list[str]:
        """``NVIDIA_CTK_LIBCUDA_DIR``: the directories holding libcuda, as the toolkit's specs set it."""
        dirs = list(dict.fromkeys(posixpath.dirname(lib.container) for lib in self.libraries
                                  if lib.soname == "libcuda.so.1"))
        return [f"NVIDIA_CTK_LIBCUDA_DIR={':'.join(dirs)}"] if dirs else []

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


def _scan_libraries(driver_root: Path, host_root: str) -> list[Library]:
    """Each compute library found under the driver root, sorted by container path (the toolkit's glob order):
    its real file (host path under ``host_root``), its soname's path, and the symlinks the toolkit's
    ``create-symlinks`` would make for it (``_toolkit_links``)."""
    real_root = Path(os.path.realpath(driver_root))
    out: list[Library] = []
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
            container = f"/{rel}"
            out.append(Library(soname=soname, host=str(Path(host_root) / rel), container=container,
                               soname_path=f"/{d}/{soname}" if real.name != soname else None,
                               links=_toolkit_links(real, container, soname)))
            break
    return sorted(out, key=lambda lib: lib.container)


def _toolkit_links(real: Path, container: str, soname: str) -> tuple[str, ...]:
    """The links toolkit v1.20 makes for a mounted driver library (``internal/discover/symlinks.go``, read,
    not copied): ``libcuda.so`` -> ``libcuda.so.1`` always; for a versioned file, its soname and the soname's
    ``.so`` name where the host's library directory has them as symlinks.  The soname is the name the library
    was found by (NVIDIA installs each under its ELF SONAME); the toolkit reads it from the ELF header."""
    cdir, name = posixpath.split(container)
    links: list[str] = []
    if fnmatch.fnmatchcase(name, "libcuda.so.*.*"):
        links.append(f"libcuda.so.1::{cdir}/libcuda.so")
    if fnmatch.fnmatchcase(name, "*.*.*"):
        if soname != name and (real.parent / soname).is_symlink():
            links.append(f"{name}::{cdir}/{soname}")
        dot_so = soname.split(".so", 1)[0] + ".so"
        if dot_so != soname and (real.parent / dot_so).is_symlink():
            links.append(f"{soname}::{cdir}/{dot_so}")
    return tuple(dict.fromkeys(links))


def driver_version(libraries: Iterable[Library]) -> str:
    """The version in the real file name of libcuda (else libnvidia-ml), e.g. ``580.126.20``; "" when neither
    has one.  The toolkit infers it the same way (``internal/lookup/root``)."""
    by_soname = {lib.soname: posixpath.basename(lib.container) for lib in libraries}
    for soname, prefix in (("libcuda.so.1", "libcuda.so."), ("libnvidia-ml.so.1", "libnvidia-ml.so.")):
        name = by_soname.get(soname, "")
        version = name.removeprefix(prefix)
        if name.startswith(prefix) and _VERSION.match(version):
            return version
    return ""


def find_cdi_hook(host_path: str | None, local_path: str | os.PathLike[str] | None = None) -> str | None:
    """``host_path`` (where the host's runtime runs nvidia-cdi-hook) when the file is there, seen by this
    process at ``local_path`` (default: the same path); None, with a log line saying what that costs,
    when it is not.  A symlink counts as found: it may resolve only in the host's namespace."""
    if not host_path:
        log.info("nvidia-cdi-hook disabled (--nvidia-cdi-hook-path is empty): claim specs get no hooks")
        return None
    local = Path(local_path) if local_path else Path(host_path)
    if local.is_symlink() or (local.is_file() and os.access(local, os.X_OK)):
        log.info("nvidia-cdi-hook found at %s (host path %s): claim specs carry the toolkit's hooks", local,
                 host_path)
        return host_path
    log.warning("no executable nvidia-cdi-hook at %s (host path %s; install the NVIDIA Container Toolkit or set "
                "--nvidia-cdi-hook-path): claim specs get no hooks, so no ldcache update, no libcuda.so link and "
                "no CUDA compat; the libraries are mounted at their sonames instead", local, host_path)
    return None


def discover(driver_root: str | os.PathLike[str], *, dev_root: str | os.PathLike[str] | None = None,
             proc_root: str | os.PathLike[str] = "/proc",
             host_driver_root: str | os.PathLike[str] | None = None,
             cdi_hook: str | None = None, cdi_hook_local: str | os.PathLike[str] | None = None) -> HostDriver:
    """Read the host driver's facts.  ``driver_root``: where this process sees the driver files;
    ``host_driver_root``: where the container runtime sees them (the chart mounts the host's root at
    ``/driver-root``; default: the same path); ``dev_root``: where ``dev/nvidia*`` is (default
    ``default_dev_root``); ``cdi_hook``: the host path of nvidia-cdi-hook, looked for at ``cdi_hook_local``
    (``find_cdi_hook``; None: no hooks, and no log line, as for a test's tree)."""
    root = Path(driver_root)
    host = str(host_driver_root) if host_driver_root is not None else str(root)
    devs = Path(dev_root) if dev_root is not None else default_dev_root(root)
    libraries = tuple(_scan_libraries(root, host))
    hook = find_cdi_hook(cdi_hook, cdi_hook_local) if cdi_hook is not None else None
    found = HostDriver(majors=read_majors(proc_root), nodes=_scan_nodes(devs), libraries=libraries,
                       version=driver_version(libraries), host_root=host, cdi_hook=hook)
    missing = [n for n in ("nvidiactl", "nvidia-uvm") if f"/dev/{n}" not in found.nodes]
    if missing or not found.libraries:
        log.warning("NVIDIA driver incomplete for containers: missing nodes %s under %s/dev, libraries %s "
                    "under %s", missing or "-", devs, "found" if found.libraries else "none", root)
    log.info("host driver %s: %d device nodes under %s/dev, %d libraries from %s (host path %s)",
             found.version or "(version unknown)", len(found.nodes), devs, len(found.libraries), root, host)
    return found
