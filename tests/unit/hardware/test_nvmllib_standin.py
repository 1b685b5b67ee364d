"""--nvidia-driver-root end to end: the plugin's config, `topodra discover` and the error for a tree without NVML."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
from testkit.standin import clean_env, driver_tree, lib_dir

from topodra.hardware.mockprofile import build_tree, load_profile
from topodra.plugin import config
from topodra.plugin.config import ConfigError
from topodra.plugin.main import Plugin


def _parse(argv: list[str], env: dict[str, str]) -> config.PluginConfig:
    parser = argparse.ArgumentParser()
    config.configure(parser)
    return config.from_args(parser.parse_args(argv), env)


def test_driver_root_flag_env_and_default() -> None:
    assert _parse([], {"NODE_NAME": "n"}).nvidia_driver_root == Path("/")
    assert _parse([], {"NODE_NAME": "n", "TOPODRA_NVIDIA_DRIVER_ROOT": "/driver-root"}).nvidia_driver_root == \
        Path("/driver-root")  # fmt: skip
    cfg = _parse(["--nvidia-driver-root", "/run/nvidia/driver"], {"NODE_NAME": "n", "TOPODRA_NVIDIA_DRIVER_ROOT": "/x"})
    assert cfg.nvidia_driver_root == Path("/run/nvidia/driver")


def test_plugin_without_nvml_under_the_driver_root_says_where_it_looked(tmp_path: Path) -> None:
    cfg = _parse(["--nvidia-driver-root", str(tmp_path)], {"NODE_NAME": "n"})
    with pytest.raises(ConfigError) as e:
        Plugin(cfg).backend()
    msg = str(e.value)
    assert "libnvidia-ml.so.1 not found under NVIDIA driver root" in msg
    assert f"{tmp_path}/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1" in msg and f"{tmp_path}/lib64/" in msg
    # Mock hardware ignores the default root, so a mock plugin starts anywhere.
    mock = _parse(["--hardware", "mock:l4", "--nvidia-driver-root", str(tmp_path)], {"NODE_NAME": "n"})
    assert Plugin(mock).backend().discover()


def test_topodra_discover_loads_nvml_from_the_driver_root(tmp_path: Path) -> None:
    tree = driver_tree(tmp_path / "root", "dgx-h100", node="n1")
    sysfs = tmp_path / "sysfs"
    build_tree(load_profile("dgx-h100"), frozenset()).materialize(str(sysfs))
    topodra = [sys.executable, "-m", "topodra.cli"]
    r = subprocess.run([*topodra, "discover", "--hardware", "nvml", "--nvidia-driver-root", str(tree),
                        "--sysfs-root", str(sysfs), "--node-name", "n1", "--output", "json"],
                       capture_output=True, text=True, env=clean_env(), timeout=120, check=False)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert f"NVML library loaded from {lib_dir(tree) / 'libnvidia-ml.so.580.126.20'}" in r.stderr
    assert r.stdout.count('"name": "gpu-') == 8
    bad = subprocess.run([*topodra, "discover", "--hardware", "mock:l4", "--nvidia-driver-root", str(tree)],
                         capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert bad.returncode == 1 and "an NVIDIA driver root applies to --hardware nvml only" in bad.stderr


def _child(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=clean_env(),
                          timeout=60, check=False)  # fmt: skip


LOADED_FIRST = """
import ctypes, sys
import pynvml
from topodra.hardware import nvmllib
from topodra.hardware.base import DiscoveryError
pynvml.nvmlLib = ctypes.CDLL(sys.argv[1] + "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1")  # someone else's load
try:
    print(nvmllib.load(sys.argv[2], pynvml))
except DiscoveryError as e:
    print("refused:", e)
try:
    print(nvmllib.load(sys.argv[1], pynvml))
except DiscoveryError as e:
    print("refused:", e)
"""


def test_a_library_pynvml_already_holds_is_accepted_only_if_it_is_the_driver_roots(tmp_path: Path) -> None:
    a = driver_tree(tmp_path / "a", "l4")
    b = driver_tree(tmp_path / "b", "l4")
    r = _child(LOADED_FIRST, str(a), str(b))
    assert r.returncode == 0, r.stderr
    first, second = r.stdout.splitlines()
    assert first.startswith("refused: pynvml already holds an NVML library other than ") and str(b) in first
    version = json.loads((lib_dir(a) / "nvml-standin.json").read_text())["driverVersion"]
    assert second == str(lib_dir(a) / f"libnvidia-ml.so.{version}")  # the very file pynvml holds: accepted
