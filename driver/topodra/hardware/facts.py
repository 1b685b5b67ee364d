"""Serializable NVML answers and sysfs trees: the data behind mock hardware and replays.

A ``NvmlFacts`` holds, per GPU, what each NVML query answers — a value or an
NVML error name (``{"error": "NotSupported"}``).  ``FakeNvml`` (mock.py) serves
these answers through a ``pynvml``-shaped object; a replay fixture is exactly a
``NvmlFacts`` plus a ``SysfsTree`` captured from (or written to look like) a
real machine.  Field names follow the NVML call they answer.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import tempfile
import threading
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator

# libyaml's parser when PyYAML was built with it: ~10x faster than the pure-Python one, same safe subset.
YAML_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class NvmlErr(BaseModel):
    """An NVML error answer, named as in pynvml's class ``NVMLError_<error>``."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    error: str


class PciFacts(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    busId: str  # NVML format, e.g. "00000000:1B:00.0"
    pciDeviceId: int = 0
    pciSubSystemId: int = 0


class LinkFacts(BaseModel):
    """One NVLink: nvmlDeviceGetNvLinkState / RemotePciInfo / RemoteDeviceType / Version."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    state: int | NvmlErr = 1
    remoteBusId: str | NvmlErr = NvmlErr(error="NotSupported")
    remoteType: int | NvmlErr = NvmlErr(error="NotSupported")
    version: int | NvmlErr = NvmlErr(error="NotSupported")


class FabricFacts(BaseModel):
    """nvmlDeviceGetGpuFabricInfo(V) result; ``api`` = newest struct version the driver accepts."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    clusterUuid: str = "00000000-0000-0000-0000-000000000000"
    cliqueId: int = 0
    state: int = 3  # NVML_GPU_FABRIC_STATE_COMPLETED
    status: int = 0  # NVML_SUCCESS
    healthMask: int = 0
    api: int = Field(default=3, ge=1, le=3)


class MigProfileFacts(BaseModel):
    """One GPU-instance profile: nvmlDeviceGetGpuInstanceProfileInfo(V) at ``index`` + its possible placements."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    index: int = Field(ge=0)  # NVML_GPU_INSTANCE_PROFILE_* (the argument of GetGpuInstanceProfileInfo)
    id: int = Field(ge=0)  # the profile id used by every other call
    name: str  # e.g. "1g.10gb" (NVML answers "MIG 1g.10gb")
    sliceCount: int = Field(ge=1)  # compute slices
    instanceCount: int = Field(ge=1)
    multiprocessorCount: int = Field(ge=1)
    memorySizeMB: int = Field(ge=1)
    copyEngineCount: int = 1
    decoderCount: int = 0
    encoderCount: int = 0
    jpegCount: int = 0
    ofaCount: int = 0
    placements: list[tuple[int, int]]  # (start, size) in memory slices


class GpuFacts(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    uuid: str | NvmlErr
    name: str | NvmlErr
    memoryTotal: int | NvmlErr  # bytes
    pci: PciFacts | NvmlErr
    minor: int | NvmlErr
    brand: int | NvmlErr = NvmlErr(error="NotSupported")
    architecture: int | NvmlErr = NvmlErr(error="NotSupported")
    computeCapability: tuple[int, int] | NvmlErr = NvmlErr(error="NotSupported")
    migMode: tuple[int, int] | NvmlErr = NvmlErr(error="NotSupported")
    numaNodeId: int | NvmlErr = NvmlErr(error="NotSupported")
    nvlinks: list[LinkFacts] | NvmlErr = NvmlErr(error="NotSupported")
    fabric: FabricFacts | NvmlErr = NvmlErr(error="NotSupported")
    # A MIG GPU's profiles: their info is answered while MIG mode is enabled, their placements whatever the mode.
    migProfiles: list[MigProfileFacts] = Field(default_factory=list)


class NvmlFacts(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    init: NvmlErr | None = None  # set: nvmlInit fails with this error
    driverVersion: str | NvmlErr
    cudaDriverVersion: int | NvmlErr
    gpus: list[GpuFacts]


class SysfsTree(BaseModel):
    """Files and symlinks below a sysfs root; link targets are root-relative paths (made relative on disk)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    files: dict[str, str] = Field(default_factory=dict)
    links: dict[str, str] = Field(default_factory=dict)
    dirs: list[str] = Field(default_factory=list)

    @field_validator("files", "links")
    @classmethod
    def _relative(cls, v: dict[str, str]) -> dict[str, str]:
        for p in v:
            if p.startswith("/") or ".." in p.split("/"):
                raise ValueError(f"sysfs tree path {p!r} must be relative and stay below the root")
        return v

    def materialize(self, root: str) -> None:
        """Write the tree below ``root`` (created if needed; existing ``root/sys`` is replaced)."""
        sys_dir = os.path.join(root, "sys")
        if os.path.lexists(sys_dir):
            shutil.rmtree(sys_dir)
        for d in self.dirs:
            os.makedirs(os.path.join(root, d), exist_ok=True)
        for rel, content in self.files.items():
            p = os.path.join(root, rel)
            os.makedirs(os.path.dirname(p), exist_ok=True)
            with open(p, "w", encoding="utf-8") as f:
                f.write(content if content.endswith("\n") else content + "\n")
        for rel, target in self.links.items():
            p = os.path.join(root, rel)
            os.makedirs(os.path.dirname(p), exist_ok=True)
            os.symlink(os.path.relpath(os.path.join(root, target), os.path.dirname(p)), p)


TREE_PREFIX = "topodra-sysfs-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_dead_trees(parent: str) -> list[str]:
    """Remove the shared trees of processes that are gone; returns the names removed.

    ``atexit`` never runs for a process killed with SIGKILL (the crash tests do that to plugins), so without
    this their trees stayed in /dev/shm for good: 554 of them on one test machine. A tree is named
    ``topodra-sysfs-<pid>-<random>``; one whose pid answers (alive, or another user's) is left alone, and so
    is every name of another shape.
    """
    removed: list[str] = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        parts = name[len(TREE_PREFIX):].split("-") if name.startswith(TREE_PREFIX) else []
        if len(parts) != 2 or not parts[0].isdigit() or int(parts[0]) == os.getpid():
            continue
        if not _pid_alive(int(parts[0])):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
            removed.append(name)
    return removed


class _SharedTrees:
    """Trees written once per process and content, below one temporary folder removed at exit.

    Mock nodes of one profile have identical sysfs trees; writing each once
    (about 250 files) instead of once per node is most of what makes a
    50-node simulated cluster quick to discover.  Readers must not change them.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._base: str | None = None
        self._roots: dict[str, str] = {}

    def root(self, tree: SysfsTree) -> str:
        key = hashlib.sha256(tree.model_dump_json().encode()).hexdigest()[:20]
        with self._lock:
            if key not in self._roots:
                if self._base is None:
                    # In memory where possible, like the real sysfs: on a busy disk, writing the
                    # trees of a 3-profile cluster took 1.4-2 s on ext4 and 0.02-0.06 s on tmpfs.
                    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
                    self._base = tempfile.mkdtemp(prefix=f"{TREE_PREFIX}{os.getpid()}-", dir=shm)
                    atexit.register(shutil.rmtree, self._base, True)
                    sweep_dead_trees(os.path.dirname(self._base))
                root = os.path.join(self._base, key)
                tree.materialize(root)
                self._roots[key] = root
            return self._roots[key]


_shared = _SharedTrees()


def shared_root(tree: SysfsTree) -> str:
    """A root holding ``tree``, shared by every caller with the same tree in this process; read-only."""
    return _shared.root(tree)
