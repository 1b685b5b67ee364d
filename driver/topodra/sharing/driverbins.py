"""The driver's own tools (``nvidia-smi``, the MPS control daemon), found under the driver root and run from there.

The chart's plugin pod sets ``NVIDIA_VISIBLE_DEVICES=void``, so the nvidia runtime injects no driver binary into
it: the host's tools are reached through the driver root (``--nvidia-driver-root``, ``/driver-root`` in the pod).
A host binary in the plugin's Debian image finds its libraries by soname in the image's loader path, where they
are not.  NVIDIA's DRA driver solves that per child process: ``LD_PRELOAD`` of the driver root's
``libnvidia-ml.so.1`` for ``nvidia-smi``.  We do the same, and for the MPS binaries (the servers load libcuda)
preload ``libcuda.so.1`` too; the preload is inherited by the servers the control daemon spawns.  The plugin's
own environment never gets ``LD_LIBRARY_PATH`` or ``LD_PRELOAD`` (the image's libc must stay in charge of it).

Pure lookups and environments here; the callers (``sharing.timeslice``, ``sharing.mps``) run the processes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from topodra.hardware.nvmllib import LIBRARY, LIBRARY_DIRS

# Where driver installs and NVIDIA's driver containers put the tools, in search order (then PATH).
BIN_DIRS = ("usr/bin", "bin", "usr/sbin")
CUDA_LIBRARY = "libcuda.so.1"
NVIDIA_SMI = "nvidia-smi"
MPS_CONTROL = "nvidia-cuda-mps-control"
_PATH_LISTS = ("LD_PRELOAD", "PATH")  # the tool's entries go before the caller's


class DriverToolMissing(RuntimeError):
    """A driver tool or the library it needs is not where it was looked for; the message names every path."""


@dataclass(frozen=True)
class DriverTool:
    """One tool to run: its absolute path and the variables its child process gets on top of ours."""

    path: Path
    env: Mapping[str, str] = field(default_factory=dict)

    def environ(self, base: Mapping[str, str], extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The child's whole environment: ``base`` (the plugin's), ``extra``, then the tool's own variables."""
        out = {**base, **(extra or {})}
        for key, value in self.env.items():
            if key in _PATH_LISTS and out.get(key):
                value = f"{value}{os.pathsep}{out[key]}"  # ours first, as DRA's prependPathListEnvvar
            out[key] = value
        return out


def find_binary(name: str, driver_root: str | os.PathLike[str] | None,
                path_env: str | None) -> Path:  # fmt: skip
    """``name`` under the driver root's BIN_DIRS, else in ``path_env`` (PATH); DriverToolMissing names all."""
    tried: list[Path] = []
    if driver_root is not None:
        tried += [Path(driver_root) / d / name for d in BIN_DIRS]
    tried += [Path(d) / name for d in (path_env or "").split(os.pathsep) if d]
    for p in tried:
        if p.is_file() and os.access(p, os.X_OK):
            return p
    where = ", ".join(str(p) for p in tried) or "nowhere (no driver root and PATH is empty)"
    raise DriverToolMissing(f"{name} not found; looked in: {where}")


def find_driver_library(name: str, driver_root: str | os.PathLike[str]) -> Path:
    """``name`` under the driver root's library dirs (the ones NVML is loaded from), as an absolute path."""
    tried = [Path(driver_root) / d / name for d in LIBRARY_DIRS]
    for p in tried:
        if p.exists():
            return Path(os.path.realpath(p))
    raise DriverToolMissing(f"{name} not found under NVIDIA driver root {str(driver_root)!r}; looked in: "
                            + ", ".join(str(p) for p in tried))


def tool(name: str, driver_root: str | os.PathLike[str] | None, libraries: Sequence[str],
         path_env: str | None, binary: str | os.PathLike[str] | None = None) -> DriverTool:  # fmt: skip
    """The tool ``name`` (at ``binary`` when given, else looked up) and the driver libraries its child
    preloads (none without a driver root: a dev box or mock hardware)."""
    found = Path(binary) if binary else find_binary(name, driver_root, path_env)
    if driver_root is None:
        return DriverTool(found)
    preload = [str(find_driver_library(lib, driver_root)) for lib in libraries]
    return DriverTool(found, {"LD_PRELOAD": ":".join(preload)})


def nvidia_smi(driver_root: str | os.PathLike[str] | None, path_env: str | None,
               binary: str | os.PathLike[str] | None = None) -> DriverTool:  # fmt: skip
    """``nvidia-smi`` with the driver root's NVML preloaded (DRA's ``setTimeSlice``)."""
    return tool(NVIDIA_SMI, driver_root, (LIBRARY,), path_env, binary)


def mps_control(driver_root: str | os.PathLike[str] | None, path_env: str | None,
                binary: str | os.PathLike[str] | None = None) -> DriverTool:  # fmt: skip
    """``nvidia-cuda-mps-control`` with the driver root's CUDA and NVML preloaded (its servers need both),
    and its own directory first in PATH so the ``nvidia-cuda-mps-server`` it starts is the same driver's."""
    t = tool(MPS_CONTROL, driver_root, (CUDA_LIBRARY, LIBRARY), path_env, binary)
    return t if driver_root is None else DriverTool(t.path, {**t.env, "PATH": str(t.path.parent)})
