"""``NvmlBackend.discover()`` through the real pynvml and the C stand-in equals the mock path, per profile.

Both paths serve the same profile facts; the stand-in answers at the C ABI, the mock through FakeNvml.
The one difference is where the mock is wrong against NVIDIA: FakeNvml answers the NVLink generation
(3/4/5) from ``nvmlDeviceGetNvLinkVersion``, real NVML the ``nvmlNvlinkVersion_t`` enum (5/6/7), so the
``nvlinkVersion`` attribute differs by exactly that mapping until topodra translates the enum (issue 19,
finding 6).  Device nodes differ by design: a driver root's GPUs are this host's, mock GPUs are not.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from testkit.standin import driver_tree, run_py

from topodra.hardware.base import DiscoveryConfig
from topodra.hardware.mock import mock_backend
from topodra.hardware.mockprofile import build_tree, load_profile, profile_names

NODE = "standin-node"


def _mock_devices(profile: str) -> list[dict[str, Any]]:
    p = load_profile(profile)
    devices = mock_backend(p, NODE, config=DiscoveryConfig.model_validate(p.discovery)).discover()
    return [json.loads(d.model_dump_json()) for d in devices]


@pytest.mark.parametrize("profile", profile_names())
def test_discovery_through_the_stand_in_matches_the_mock_path(tmp_path: Path, profile: str) -> None:
    tree = driver_tree(tmp_path / "root", profile, node=NODE)
    sysfs = tmp_path / "sysfs"
    build_tree(load_profile(profile), frozenset()).materialize(str(sysfs))
    overrides = load_profile(profile).discovery
    got = run_py(tree, f"""
        from topodra.hardware import load_backend
        b = load_backend("nvml", {NODE!r}, sysfs_root={str(sysfs)!r}, overrides={overrides!r},
                         nvidia_driver_root=TREE)
        assert b.nvml is pynvml
        out([json.loads(d.model_dump_json()) for d in b.discover()])
    """)
    want = _mock_devices(profile)
    assert [d["name"] for d in got] == [d["name"] for d in want]
    assert [d["uuid"] for d in got] == [d["uuid"] for d in want]
    for g, w in zip(got, want, strict=True):
        if g["kind"] == "gpu":
            assert any(n.startswith("/dev/nvidia") for n in g["device_nodes"]), g["device_nodes"]
        assert w["device_nodes"] == []
        g_attrs, w_attrs = dict(g.pop("attributes")), dict(w.pop("attributes"))
        g.pop("device_nodes"), w.pop("device_nodes")
        assert g_attrs == w_attrs, g["name"]
        assert g == w, g["name"]
