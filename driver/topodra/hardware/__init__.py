"""Hardware discovery: GPUs and compute NICs with their topology, as ``Device`` objects.

``load_backend(spec, node_name)`` picks the hardware source:

- ``"nvml"``: this host, via NVML (nvidia-ml-py) and sysfs (``sysfs_root``, default ``/``);
- ``"mock:<profile>"`` or ``"mock:/path/profile.yaml"``: a mock server model (profiles/*.yaml);
- ``"replay:/path/fixture.yaml"``: NVML answers and sysfs captured from a machine.

All three return the same ``NvmlBackend``; mock and replay inject a fake
``pynvml`` object and a generated sysfs tree, so the real discovery code runs.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from typing import Any

from topodra.hardware.base import DiscoveryConfig, DiscoveryError, HardwareBackend
from topodra.hardware.nvml import NvmlBackend

__all__ = ["DiscoveryConfig", "DiscoveryError", "HardwareBackend", "NvmlBackend", "load_backend"]

# Keys of ``overrides`` that change what mock hardware *is*, rather than how discovery reads it.
MOCK_ONLY_KEYS = ("hideGpus", "clusterUUID", "cliqueId")


def _root(backend: NvmlBackend, sysfs_root: str | None, node_name: str) -> str:
    if sysfs_root is not None:
        return sysfs_root
    root = tempfile.mkdtemp(prefix=f"topodra-sysfs-{node_name[:40]}-")
    weakref.finalize(backend, shutil.rmtree, root, True)
    return root


def load_backend(
    spec: str, node_name: str, *, sysfs_root: str | None = None, overrides: dict[str, Any] | None = None
) -> NvmlBackend:
    """Build the backend for ``spec`` on ``node_name``; ValueError on a bad spec or override."""
    if not node_name:
        raise ValueError("node name must not be empty")
    ov = dict(overrides or {})
    mock_keys = {k: ov.pop(k) for k in MOCK_ONLY_KEYS if k in ov}
    if spec == "nvml":
        if mock_keys:
            raise ValueError(f"overrides {sorted(mock_keys)} apply to mock hardware only")
        return NvmlBackend(node_name, sysfs_root=sysfs_root or "/", config=DiscoveryConfig.model_validate(ov))
    if spec.startswith("replay:"):
        from topodra.hardware.mock import FakeNvml
        from topodra.hardware.replay import load_fixture

        if mock_keys:
            raise ValueError(f"overrides {sorted(mock_keys)} apply to mock profiles only, not replays")
        fx = load_fixture(spec.removeprefix("replay:"))
        backend = NvmlBackend(node_name, nvml=FakeNvml(fx.nvml), config=DiscoveryConfig.model_validate(ov))
        root = _root(backend, sysfs_root, node_name)
        fx.sysfs.materialize(root)
        backend.sysfs.root = root
        return backend
    if spec.startswith("mock:"):
        from topodra.hardware.mock import MockHardware
        from topodra.hardware.mockprofile import Fabric, load_profile

        profile = load_profile(spec.removeprefix("mock:"))
        hidden = mock_keys.get("hideGpus", [])
        if not isinstance(hidden, list) or not all(isinstance(x, int) for x in hidden):
            raise ValueError(f"hideGpus must be a list of GPU slot numbers, got {hidden!r}")
        fabric = Fabric(
            clusterUUID=mock_keys.get("clusterUUID", profile.fabric.clusterUUID),
            cliqueId=mock_keys.get("cliqueId", profile.fabric.cliqueId),
        )
        config = DiscoveryConfig.model_validate({**profile.discovery, **ov})
        backend = NvmlBackend(node_name, config=config)
        root = _root(backend, sysfs_root, node_name)
        hw = MockHardware(profile, node_name, root, frozenset(hidden), fabric)
        backend.nvml = hw.nvml
        backend.sysfs.root = root
        return backend
    raise ValueError(f"unknown hardware spec {spec!r}: use 'nvml', 'mock:<profile|path>' or 'replay:<path>'")
