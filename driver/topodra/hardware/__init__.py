"""Hardware discovery: GPUs and compute NICs with their topology, as ``Device`` objects.

``load_backend(spec, node_name)`` picks the hardware source:

- ``"nvml"``: this host, via NVML (nvidia-ml-py) and sysfs (``sysfs_root``, default ``/``); the NVML library
  is loaded by absolute path from ``nvidia_driver_root`` (default ``/``; see ``hardware.nvmllib``);
- ``"mock:<profile>"`` or ``"mock:/path/profile.yaml"``: a mock server model (profiles/*.yaml);
- ``"replay:/path/fixture.yaml"``: NVML answers and sysfs captured from a machine.

All three build the same ``NvmlBackend``, complete at construction: mock and
replay hand it a fake ``pynvml`` object and a generated sysfs tree, so the real
discovery code runs, and their devices carry no ``/dev`` nodes (none exist here).
"""

from __future__ import annotations

from typing import Any

from topodra.hardware.base import DiscoveryConfig, DiscoveryError
from topodra.hardware.nvml import NvmlBackend
from topodra.hardware.sysfs import Sysfs

__all__ = ["DiscoveryConfig", "DiscoveryError", "NvmlBackend", "load_backend"]

# Keys of ``overrides`` that change what mock hardware *is*, rather than how discovery reads it.
MOCK_ONLY_KEYS = ("hideGpus", "clusterUUID", "cliqueId", "faultsFile", "migStateFile")


def load_backend(
    spec: str, node_name: str, *, sysfs_root: str | None = None, overrides: dict[str, Any] | None = None,
    nvidia_driver_root: str | None = None,
) -> NvmlBackend:
    """Build the backend for ``spec`` on ``node_name``; ValueError on a bad spec or override.

    For mock and replay hardware, ``sysfs_root`` is where their tree is written
    (the caller's to change); without it, nodes with the same tree share one copy.
    ``nvidia_driver_root`` applies to ``nvml`` only (DiscoveryError when its library is not there).
    """
    if not node_name:
        raise ValueError("node name must not be empty")
    ov = dict(overrides or {})
    mock_keys = {k: ov.pop(k) for k in MOCK_ONLY_KEYS if k in ov}
    if spec != "nvml" and nvidia_driver_root is not None:
        raise ValueError("an NVIDIA driver root applies to --hardware nvml only")
    if spec == "nvml":
        if mock_keys:
            raise ValueError(f"overrides {sorted(mock_keys)} apply to mock hardware only")
        import pynvml

        from topodra.hardware import nvmllib

        nvmllib.load(nvidia_driver_root or "/", pynvml)
        return NvmlBackend(
            node_name,
            nvml=pynvml,
            sysfs=Sysfs(sysfs_root or "/"),
            config=DiscoveryConfig.model_validate(ov),
        )
    if spec.startswith("replay:"):
        from topodra.hardware.replay import load_fixture, replay_backend

        if mock_keys:
            raise ValueError(f"overrides {sorted(mock_keys)} apply to mock profiles only, not replays")
        fx = load_fixture(spec.removeprefix("replay:"))
        return replay_backend(fx, node_name, config=DiscoveryConfig.model_validate(ov), sysfs_root=sysfs_root)
    if spec.startswith("mock:"):
        from topodra.hardware.mock import mock_backend
        from topodra.hardware.mockprofile import Fabric, load_profile

        profile = load_profile(spec.removeprefix("mock:"))
        hidden = mock_keys.get("hideGpus", [])
        if not isinstance(hidden, list) or not all(isinstance(x, int) for x in hidden):
            raise ValueError(f"hideGpus must be a list of GPU slot numbers, got {hidden!r}")
        fabric = Fabric(
            clusterUUID=mock_keys.get("clusterUUID", profile.fabric.clusterUUID),
            cliqueId=mock_keys.get("cliqueId", profile.fabric.cliqueId),
        )
        faults = mock_keys.get("faultsFile")
        if faults is not None and not isinstance(faults, str):
            raise ValueError(f"faultsFile must be a path, got {faults!r}")
        mig_state = mock_keys.get("migStateFile")
        if mig_state is not None and not isinstance(mig_state, str):
            raise ValueError(f"migStateFile must be a path, got {mig_state!r}")
        config = DiscoveryConfig.model_validate({**profile.discovery, **ov})
        return mock_backend(
            profile, node_name, config=config, hidden=frozenset(hidden), fabric=fabric, sysfs_root=sysfs_root,
            faults_file=faults, mig_state_file=mig_state,
        )
    raise ValueError(f"unknown hardware spec {spec!r}: use 'nvml', 'mock:<profile|path>' or 'replay:<path>'")
