"""hack/kind_standin.py: which kind nodes get a host driver tree, under which names, mounted where the kind
values point the chart. Pure functions of the committed configs; the trees themselves are built in tests/kind."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
KIND = REPO / "deploy" / "kind"


def _standin() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kind_standin", REPO / "hack" / "kind_standin.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ks = _standin()


def _config(name: str) -> dict[str, Any]:
    cfg: dict[str, Any] = yaml.safe_load((KIND / name).read_text())
    return cfg


def test_node_names_follow_kinds_counter_per_role() -> None:
    cfg = {"nodes": [{"role": "control-plane"}, {"role": "worker"}, {"role": "worker"}, {"role": "worker"}]}
    assert ks.node_names(cfg, "c") == ["c-control-plane", "c-worker", "c-worker2", "c-worker3"]
    assert ks.node_names({}, "c") == ["c-control-plane"]


@pytest.mark.parametrize(("config", "want"), [
    ("kind-config.yaml", {"t-worker": "dgx-h100", "t-worker2": "dgx-a100-80gb", "t-worker3": "dgx-h100-mig"}),
    ("kind-config-single.yaml", {"t-control-plane": "dgx-h100"}),
])
def test_every_plugin_node_gets_its_tree_mounted_where_the_values_point(config: str, want: dict[str, str]) -> None:
    cfg = _config(config)
    assert {name: profile for _, name, profile in ks.plugin_nodes(cfg, "t")} == want
    out = ks.with_mounts(cfg, "t", Path("/base"))
    for node, name in zip(out["nodes"], ks.node_names(cfg, "t"), strict=True):
        mounts = [m for m in node.get("extraMounts") or [] if m["containerPath"] == ks.NODE_DIR]
        if name in want:
            assert mounts == [{"hostPath": f"/base/{name}", "containerPath": ks.NODE_DIR}]
            assert node["labels"]["topodra.io/kubelet-plugin"] == "true"
        else:
            assert not mounts
    assert cfg == _config(config), "with_mounts must not change its input"


def test_kind_values_run_the_real_gpu_branch_on_the_mounted_tree() -> None:
    values = yaml.safe_load((KIND / "values.yaml").read_text())
    p = values["plugin"]
    assert p["hardware"] == "nvml"
    assert p["nvidiaDriverRoot"] == f"{ks.NODE_DIR}/driver" and p["sysfsHostPath"] == f"{ks.NODE_DIR}/sys"
    env = {e["name"]: e["value"] for e in p["extraEnv"]}
    assert env["TOPODRA_NVIDIA_PROC_ROOT"] == "/driver-root/proc"
    # The stand-in writes its state through the plugin's read-write /var/lib/kubelet/plugins mount, into the same
    # tree the plugin reads read-only at /driver-root.
    assert env["TOPODRA_NVML_STANDIN_STATE"].startswith(f"{ks.NODE_DIR}/driver/usr/lib/x86_64-linux-gnu/")
    assert env["TOPODRA_NVML_STANDIN_CAPS"] == f"{ks.NODE_DIR}/driver/proc/driver/nvidia/capabilities"
