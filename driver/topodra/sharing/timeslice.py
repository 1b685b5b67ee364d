"""Time slicing: the GPU's compute time-slice level, set for the claims that ask for it.

A ``TimeSlicing`` GpuConfig changes how long each process on the GPU runs
before the next one gets it (Default, Short, Medium, Long).  That is a
property of the whole GPU, so every prepared claim on one GPU must agree on it
(prepare refuses a claim that asks for another non-default level), and the GPU
returns to Default once no prepared claim asks for more.

NVML's public API (and ``pynvml``) offers no setter for it outside vGPU; the
driver's tool does: ``nvidia-smi compute-policy -i <uuid> --set-timeslice <n>``.
``NvidiaSmiTimeSlice`` runs it on real hosts, from the driver root (``driverbins``); mock hardware (``FakeNvml``) has
the same two methods and records the level as GPU state.  ``desired_levels`` is
the pure rule both prepare/unprepare and crash recovery use.
"""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Iterable
from typing import Protocol, runtime_checkable

from topodra.sharing import driverbins
from topodra.sharing.config import TIMESLICE_LEVEL, Sharing

log = logging.getLogger(__name__)

DEFAULT_LEVEL = TIMESLICE_LEVEL["Default"]
NVIDIA_SMI = driverbins.NVIDIA_SMI
_TIMEOUT_S = 30.0


class TimeSliceError(RuntimeError):
    """The level could not be set; the message names the GPU and the cause."""


@runtime_checkable
class TimeSliceControl(Protocol):
    """Sets and reads a GPU's time-slice level (0 Default .. 3 Long); ``None`` from get: cannot be read."""

    def set_timeslice(self, uuid: str, level: int) -> None: ...

    def get_timeslice(self, uuid: str) -> int | None: ...


class NvidiaSmiTimeSlice:
    """The time-slice level through the host's ``nvidia-smi``, run as NVIDIA's DRA driver runs it.

    Found under ``driver_root`` (``<root>/usr/bin``, ``bin``, ``usr/sbin``), then in PATH, unless ``path``
    is given; with a driver root its child preloads the root's ``libnvidia-ml.so.1`` (``driverbins``).
    """

    def __init__(self, path: str | None = None, driver_root: str | os.PathLike[str] | None = None) -> None:
        self.path = path
        self.driver_root = driver_root

    def _tool(self) -> driverbins.DriverTool:
        try:
            return driverbins.nvidia_smi(self.driver_root, os.environ.get("PATH"), self.path)
        except driverbins.DriverToolMissing as e:
            raise TimeSliceError(f"time slicing needs {NVIDIA_SMI}: {e}") from e

    def command(self, uuid: str, level: int) -> tuple[list[str], dict[str, str]]:
        """The argv and environment that set ``uuid``'s level (the two-argument form DRA runs)."""
        t = self._tool()
        return [str(t.path), "compute-policy", "-i", uuid, "--set-timeslice", str(level)], t.environ(os.environ)

    def set_timeslice(self, uuid: str, level: int) -> None:
        cmd, env = self.command(uuid, level)
        try:
            subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=_TIMEOUT_S, env=env)
        except subprocess.CalledProcessError as e:
            raise TimeSliceError(f"GPU {uuid}: {' '.join(cmd)} failed: {(e.stderr or e.stdout).strip()}") from e
        except (OSError, subprocess.TimeoutExpired) as e:
            raise TimeSliceError(f"GPU {uuid}: {' '.join(cmd)}: {e}") from e

    def get_timeslice(self, uuid: str) -> int | None:
        return None  # nvidia-smi prints no machine-readable level; callers set the level they want


def control_for(nvml: object, nvidia_smi: str | None = None,
                driver_root: str | os.PathLike[str] | None = None) -> TimeSliceControl:  # fmt: skip
    """Mock hardware answers itself (its ``FakeNvml`` records the level); a real host uses nvidia-smi."""
    return nvml if isinstance(nvml, TimeSliceControl) else NvidiaSmiTimeSlice(nvidia_smi, driver_root)


def level_of(sharing: Sharing | None) -> int:
    """The level a claim's sharing config asks for (Default when it asks nothing about time slicing)."""
    if sharing is None or sharing.strategy != "TimeSlicing":
        return DEFAULT_LEVEL
    return TIMESLICE_LEVEL[sharing.interval]


def desired_levels(uses: Iterable[tuple[str, int]], gpus: Iterable[str]) -> dict[str, int]:
    """GPU UUID -> the level it must have, given the (GPU UUID, level) of every prepared device (pure).

    GPUs that no claim asks a level of get Default.  Callers never let two different non-default
    levels meet on one GPU (prepare refuses the second); if they do anyway, the larger wins.
    """
    out = dict.fromkeys(gpus, DEFAULT_LEVEL)
    for uuid, level in uses:
        out[uuid] = max(out.get(uuid, DEFAULT_LEVEL), level)
    return out


def conflict(uses: Iterable[tuple[str, int]], uuid: str, level: int) -> int | None:
    """The other non-default level already in force on ``uuid``, if ``level`` would clash with it (pure)."""
    if level == DEFAULT_LEVEL:
        return None
    for u, held in uses:
        if u == uuid and held not in (DEFAULT_LEVEL, level):
            return held
    return None


def apply(control: TimeSliceControl, levels: dict[str, int], *, unknown_default: bool = True) -> list[str]:
    """Set each GPU to its level where it differs; returns the UUIDs changed. TimeSliceError on failure.

    A GPU whose level cannot be read is set anyway, unless it should be Default and not
    ``unknown_default`` (start-up recovery: no need to run a tool on every GPU of the node).
    """
    changed = []
    for uuid, level in sorted(levels.items()):
        try:
            now = control.get_timeslice(uuid)
            if now == level or (now is None and level == DEFAULT_LEVEL and not unknown_default):
                continue
            control.set_timeslice(uuid, level)
        except TimeSliceError:
            raise
        except Exception as e:  # the hardware's own error (an NVMLError on mock hardware)
            raise TimeSliceError(f"GPU {uuid}: cannot set time-slice level {level}: {e}") from e
        changed.append(uuid)
        log.info("GPU %s: time-slice level set to %d", uuid, level)
    return changed


def sharing_env(env_fragment: str, sharing: Sharing | None) -> tuple[str, ...]:
    """Container variables saying which sharing config is in force on the device (pure)."""
    if sharing is None:
        return ()
    out = [f"TOPODRA_DEVICE_{env_fragment}_SHARING={sharing.strategy}"]
    if sharing.strategy == "TimeSlicing":
        out.append(f"TOPODRA_DEVICE_{env_fragment}_TIMESLICE_INTERVAL={sharing.interval}")
    return tuple(out)
