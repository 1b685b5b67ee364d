"""Discovery findings of issue 19 that only real NVML semantics show, run through the C stand-in.

Each failed on the code before its fix (a5b4678); they assert what any fix must give, not how it is done.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from testkit.standin import driver_tree, run_py

from topodra.hardware.mockprofile import build_tree, load_profile

NODE = "standin-node"


def _discover(tmp_path: Path, profile: str, faults: dict[str, Any] | None = None) -> Any:
    tree = driver_tree(tmp_path / "root", profile, node=NODE)
    sysfs = tmp_path / "sysfs"
    build_tree(load_profile(profile), frozenset()).materialize(str(sysfs))
    return run_py(tree, f"""
        import os
        from topodra.hardware import load_backend
        from topodra.hardware.base import DiscoveryError
        faults = {faults!r}
        if faults:
            path = TREE + "/usr/lib/x86_64-linux-gnu/nvml-standin-faults.json"
            with open(path, "w") as f:
                json.dump(faults, f)
        try:
            devices = load_backend("nvml", {NODE!r}, sysfs_root={str(sysfs)!r}, nvidia_driver_root=TREE).discover()
        except DiscoveryError as e:
            out({{"error": str(e)}})
        else:
            out({{"devices": [json.loads(d.model_dump_json()) for d in devices]}})
    """)


def test_nvlink_version_attribute_is_the_generation(tmp_path: Path) -> None:
    got = _discover(tmp_path, "dgx-h100")
    v = next(d for d in got["devices"] if d["name"] == "gpu-0")["attributes"]["nvlinkVersion"]
    assert v["int"] == 4 or str(v["string"] or v["version"] or "").startswith("4"), v


def test_a_lost_gpu_does_not_fail_the_node(tmp_path: Path) -> None:
    got = _discover(tmp_path, "dgx-h100", {"gpus": {"2": {"lost": True}}})
    assert "devices" in got, got
    names = {d["name"] for d in got["devices"] if d["kind"] == "gpu"}
    assert {f"gpu-{i}" for i in range(8) if i != 2} <= names


def test_discovery_without_faults_publishes_every_gpu(tmp_path: Path) -> None:
    """The control for the two above: the same node, no fault, discovers all eight GPUs."""
    got = _discover(tmp_path, "dgx-h100")
    assert sorted(d["name"] for d in got["devices"] if d["kind"] == "gpu") == [f"gpu-{i}" for i in range(8)]
