"""The node the sharing tests prepare on: mock hardware whose GPU state (MIG instances, time-slice levels)
lives in a file and so outlives a process, a DeviceState over it, claims, and a child process to kill."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from topodra import effects
from topodra.claims import AllocatedClaim, AllocatedDevice, ClaimRef
from topodra.devices import Device
from topodra.effects import MpsEffect
from topodra.hardware import load_backend
from topodra.hardware.mock import FakeNvml
from topodra.inventory import Inventory
from topodra.sharing.config import Sharing
from topodra.sharing.instances import MigInstances
from topodra.sharing.mps import MpsDaemons
from topodra.sharing.timeslice import control_for
from topodra.state import DeviceState

DRIVER = "gpu.topodra.io"
NODE = "sharing-node"


def hardware(tmp_path: Path, profile: str = "mock:dgx-a100-80gb") -> tuple[list[Device], FakeNvml]:
    """Devices and fake NVML; the plain A100 profile shares GPU memory, the MIG ones publish slices."""
    backend = load_backend(profile, NODE, overrides={"migStateFile": str(tmp_path / "gpu-state.json"),
                                                      "shareGpuMemory": profile == "mock:dgx-a100-80gb"})
    return backend.discover(), backend.nvml


def state(tmp_path: Path, devices: list[Device], nvml: FakeNvml, *, timeslice: bool = True,
          mps_binary: str | None = None) -> DeviceState:
    """The plugin's state (re)started on this node; ``mps_binary`` None: no MPS on the node."""
    boot = tmp_path / "boot_id"
    if not boot.exists():
        boot.write_text("boot-1\n")
    return DeviceState(DRIVER, NODE, Inventory(devices), tmp_path / "cdi", tmp_path / "state", boot_id_path=str(boot),
                       nvidia_spec_dirs=[], gpu_effects=effects.standard(
                           tmp_path / "state", mig=MigInstances(nvml),
                           timeslice=control_for(nvml) if timeslice else None,
                           mps=MpsDaemons(tmp_path / "state", binary=mps_binary, compute_mode=nvml)
                           if mps_binary else None))


def daemons(st: DeviceState) -> MpsDaemons:
    """The MPS daemons of ``st``'s MPS effect."""
    return next(e.daemons for e in st.effects if isinstance(e, MpsEffect))


def claim(uid: str, device: str, sharing: Sharing | None, share: str | None = None) -> AllocatedClaim:
    return AllocatedClaim(ref=ClaimRef(namespace="ns", uid=uid, name=f"c-{uid}"), devices=(AllocatedDevice(
        request="gpus", device=device, share_id=share, access="shared" if share else "exclusive",
        consumed=(("memory", "20Gi"),) if share else (), sharing=sharing),))


def ref(uid: str) -> ClaimRef:
    return ClaimRef("ns", uid, f"c-{uid}")


def run_child(code: str, crash_point: str | None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter, made to die at ``crash_point`` (TOPODRA_CRASH_POINT) when given.

    ``python -c`` imports from its working directory first: ``cwd`` (a test's own folder) lets the
    child use that test module's helpers by name."""
    env = {"PATH": "/usr/bin:/bin", **({"TOPODRA_CRASH_POINT": crash_point} if crash_point else {})}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60,
                          cwd=cwd)
