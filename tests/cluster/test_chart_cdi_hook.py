"""The chart's nvidia-cdi-hook value (plugin.nvidiaCDIHookPath), rendered by the real helm: the host path goes
to the plugin as TOPODRA_NVIDIA_CDI_HOOK_PATH, the file's directory is mounted read-only where the plugin checks
it, empty turns the hooks off without a mount, and mock hardware gets none of it."""

from __future__ import annotations

import subprocess
from typing import Any

import gen_manifests
import pytest
from test_chart_real_gpu import CHART, env, plugin, pod_spec

from topodra.plugin import config

Obj = dict[str, Any]


def hook_mount(spec: Obj) -> tuple[list[Obj], list[Obj]]:
    c = plugin(spec)
    return ([m for m in c["volumeMounts"] if m["name"] == "nvidia-cdi-hook"],
            [v for v in spec["volumes"] if v["name"] == "nvidia-cdi-hook"])


def test_default_is_the_toolkits_package_path_checked_through_a_mount() -> None:
    spec = pod_spec()
    e = env(plugin(spec))
    assert e["TOPODRA_NVIDIA_CDI_HOOK_PATH"] == config.DEFAULT_CDI_HOOK_PATH == "/usr/bin/nvidia-cdi-hook"
    assert e["TOPODRA_NVIDIA_CDI_HOOK_LOCAL_PATH"] == "/nvidia-cdi-hook/nvidia-cdi-hook"
    (mount,), (vol,) = hook_mount(spec)
    assert mount["mountPath"] == "/nvidia-cdi-hook" and mount["readOnly"] is True
    assert mount["mountPropagation"] == "HostToContainer"
    assert vol["hostPath"] == {"path": "/usr/bin", "type": "DirectoryOrCreate"}


def test_the_gpu_operators_toolkit_path() -> None:
    spec = pod_spec("plugin.nvidiaCDIHookPath=/usr/local/nvidia/toolkit/nvidia-cdi-hook")
    e = env(plugin(spec))
    assert e["TOPODRA_NVIDIA_CDI_HOOK_PATH"] == "/usr/local/nvidia/toolkit/nvidia-cdi-hook"
    assert e["TOPODRA_NVIDIA_CDI_HOOK_LOCAL_PATH"] == "/nvidia-cdi-hook/nvidia-cdi-hook"
    _, (vol,) = hook_mount(spec)
    assert vol["hostPath"]["path"] == "/usr/local/nvidia/toolkit"


def test_empty_turns_the_hooks_off_and_mock_has_none() -> None:
    spec = pod_spec("plugin.nvidiaCDIHookPath=")
    e = env(plugin(spec))
    assert e["TOPODRA_NVIDIA_CDI_HOOK_PATH"] == "none" and "TOPODRA_NVIDIA_CDI_HOOK_LOCAL_PATH" not in e
    assert hook_mount(spec) == ([], [])
    mock = pod_spec("plugin.hardware=mock:dgx-h100")
    assert not [k for k in env(plugin(mock)) if "CDI_HOOK" in k] and hook_mount(mock) == ([], [])


@pytest.mark.parametrize("bad", ["usr/bin/nvidia-cdi-hook", "/usr/bin/"])
def test_a_relative_or_directory_path_fails_the_schema(bad: str) -> None:
    r = subprocess.run([str(gen_manifests.helm()), "template", "t", str(CHART), "--set",
                        f"plugin.nvidiaCDIHookPath={bad}"], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode != 0
    assert "/plugin/nvidiaCDIHookPath" in r.stderr, r.stderr
