"""The chart's real-GPU branch (plugin.hardware=nvml) as issue 19 findings 1, 12 and 13 want it, rendered by
the real helm: no LD_LIBRARY_PATH, NVML found under the driver root, NVIDIA_VISIBLE_DEVICES=void, the driver
root mounted with HostToContainer propagation, and an optional runtimeClassName.
"""

from __future__ import annotations

import subprocess
from typing import Any

import gen_manifests
import pytest
from testkit.paths import REPO

CHART = REPO / "deploy" / "helm" / "topodra"
Obj = dict[str, Any]


def pod_spec(*values: str) -> Obj:
    objs = [o for o, _ in gen_manifests.split(gen_manifests.render(list(values)))]
    (ds,) = [o for o in objs if o["kind"] == "DaemonSet"]
    return dict(ds["spec"]["template"]["spec"])


def plugin(spec: Obj) -> Obj:
    (c,) = spec["containers"]
    return dict(c)


def env(c: Obj) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in c.get("env", [])}


def test_nvml_branch_loads_nvml_from_the_driver_root_not_the_library_path() -> None:
    spec = pod_spec("plugin.nvidiaDriverRoot=/run/nvidia/driver")
    c = plugin(spec)
    e = env(c)
    assert not [k for k in e if k.startswith("LD_")], "the host's libdir on the search path means the host's libc"
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "driver-root"]
    assert e["TOPODRA_NVIDIA_DRIVER_ROOT"] == mount["mountPath"] == "/driver-root"
    assert e["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert "NVIDIA_DRIVER_CAPABILITIES" not in e
    assert mount["readOnly"] is True and mount["mountPropagation"] == "HostToContainer"
    (vol,) = [v for v in spec["volumes"] if v["name"] == "driver-root"]
    assert vol["hostPath"]["path"] == "/run/nvidia/driver"


def test_the_default_manifest_is_the_real_gpu_branch() -> None:
    """deploy/plugin/daemonset.yaml (hack/gen-manifests, default values) carries the same settings."""
    import yaml

    ds = yaml.safe_load((REPO / "deploy/plugin/daemonset.yaml").read_text())
    c = ds["spec"]["template"]["spec"]["containers"][0]
    e = env(c)
    assert e["NVIDIA_VISIBLE_DEVICES"] == "void" and e["TOPODRA_NVIDIA_DRIVER_ROOT"] == "/driver-root"
    assert "LD_LIBRARY_PATH" not in e
    assert "runtimeClassName" not in ds["spec"]["template"]["spec"]


def test_mock_branch_has_no_driver_settings() -> None:
    e = env(plugin(pod_spec("plugin.hardware=mock:dgx-h100")))
    assert not {"TOPODRA_NVIDIA_DRIVER_ROOT", "NVIDIA_VISIBLE_DEVICES", "LD_LIBRARY_PATH"} & e.keys()


@pytest.mark.parametrize("hardware", ["nvml", "mock:dgx-h100"])
def test_runtime_class_is_empty_by_default_and_set_when_given(hardware: str) -> None:
    assert "runtimeClassName" not in pod_spec(f"plugin.hardware={hardware}")
    assert pod_spec(f"plugin.hardware={hardware}", "plugin.runtimeClassName=nvidia")["runtimeClassName"] == "nvidia"


@pytest.mark.parametrize("bad", ["Nvidia", "nvidia_runc", "-nvidia", "a" * 254])
def test_bad_runtime_class_fails_with_a_clear_message(bad: str) -> None:
    r = subprocess.run([str(gen_manifests.helm()), "template", "t", str(CHART), "--set",
                        f"plugin.runtimeClassName={bad}"], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode != 0
    assert "values don't meet the specifications of the schema" in r.stderr
    assert "/plugin/runtimeClassName" in r.stderr, r.stderr
