"""A GPU's compute mode while an MPS daemon serves it: ``EXCLUSIVE_PROCESS``, back to ``DEFAULT`` at stop.

In EXCLUSIVE_PROCESS mode the GPU takes one process, the claim's MPS server, so a client that cannot reach
the daemon fails instead of silently running on the GPU without MPS and without its limits (NVIDIA's DRA driver
and device plugin set it for the same reason).  Real hosts run the driver's tool as NVIDIA does,
``nvidia-smi -i <uuid> -c EXCLUSIVE_PROCESS`` from the driver root (``driverbins``); mock hardware's
``FakeNvml`` records the mode in its GPU state file.
"""

from __future__ import annotations

import os
import subprocess
from typing import Literal, Protocol, runtime_checkable

from topodra.sharing import driverbins

ComputeMode = Literal["DEFAULT", "EXCLUSIVE_PROCESS"]
NVML_COMPUTE_MODE = {"DEFAULT": 0, "EXCLUSIVE_PROCESS": 3}  # nvmlComputeMode_t
_TIMEOUT_S = 30.0


class ComputeModeError(RuntimeError):
    """The mode could not be set; the message names the GPU and the cause."""


@runtime_checkable
class ComputeModeControl(Protocol):
    def set_compute_mode(self, uuid: str, mode: ComputeMode) -> None: ...


class NvidiaSmiComputeMode:
    """``nvidia-smi -i <uuid> -c <MODE>`` from the driver root, with its NVML preloaded."""

    def __init__(self, path: str | None = None, driver_root: str | os.PathLike[str] | None = None) -> None:
        self.path = path
        self.driver_root = driver_root

    def command(self, uuid: str, mode: ComputeMode) -> tuple[list[str], dict[str, str]]:
        try:
            t = driverbins.nvidia_smi(self.driver_root, os.environ.get("PATH"), self.path)
        except driverbins.DriverToolMissing as e:
            raise ComputeModeError(f"MPS sets the compute mode with {driverbins.NVIDIA_SMI}: {e}") from e
        return [str(t.path), "-i", uuid, "-c", mode], t.environ(os.environ)

    def set_compute_mode(self, uuid: str, mode: ComputeMode) -> None:
        cmd, env = self.command(uuid, mode)
        try:
            subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=_TIMEOUT_S, env=env,
                           stdin=subprocess.DEVNULL)
        except subprocess.CalledProcessError as e:
            raise ComputeModeError(f"GPU {uuid}: {' '.join(cmd)} failed: {(e.stderr or e.stdout).strip()}") from e
        except (OSError, subprocess.TimeoutExpired) as e:
            raise ComputeModeError(f"GPU {uuid}: {' '.join(cmd)}: {e}") from e


def control_for(nvml: object, driver_root: str | os.PathLike[str] | None = None) -> ComputeModeControl:
    """Mock hardware answers itself (its ``FakeNvml``); a real host uses nvidia-smi."""
    return nvml if isinstance(nvml, ComputeModeControl) else NvidiaSmiComputeMode(driver_root=driver_root)
