"""nvidia-cdi-hook hooks in topodra's claim specs (issue 19, finding 2's rest), built from a driver tree of
hack/driver-tree (no root: no char nodes needed for hooks).

The expected hooks are what ``nvidia-ctk cdi generate`` v1.20.2 emitted for the same tree (measured; the node
test tests/node/test_ctk_spec.py compares against the real toolkit's output): create-symlinks,
enable-cuda-compat, update-ldcache, disable-device-node-modification and update-application-profile at spec
level, apply-cuda-memory-limits per whole GPU.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from testkit.standin import LIBDIR, driver_tree

from topodra import cdi, cdihooks, hostdriver
from topodra.devices import Device
from topodra.plugin import config
from topodra.plugin.main import host_driver

DRIVER = "gpu.topodra.io"
UID = "af1c2a9e-1b7d-4c8e-9a51-3e2d4b6f7a80"
ENV = ["NVIDIA_CTK_DEBUG=false"]


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return driver_tree(tmp_path_factory.mktemp("hooktree") / "root", "dgx-h100")


@pytest.fixture
def hook_bin(tmp_path: Path) -> Path:
    b = tmp_path / "bin/nvidia-cdi-hook"
    b.parent.mkdir()
    b.write_text("#!/bin/sh\nexit 0\n")
    b.chmod(0o755)
    return b


def gpu(n: int) -> Device:
    return Device(name=f"gpu-{n}", kind="gpu", uuid=f"GPU-0000000{n}-aaaa-bbbb-cccc-dddddddddddd",
                  device_nodes=(f"/dev/nvidia{n}",))


def version_of(tree: Path) -> str:
    return os.path.realpath(tree / LIBDIR / "libcuda.so.1").rsplit("libcuda.so.", 1)[1]


def hooks_of(edits: dict[str, Any]) -> list[tuple[str, list[str]]]:
    return [(h["hookName"], h["args"]) for h in edits.get("hooks", [])]


def test_gpu_claim_gets_the_toolkits_hooks_for_its_libraries(tree: Path, hook_bin: Path) -> None:
    host = hostdriver.discover(tree, proc_root=tree / "proc", host_driver_root="/run/nvidia/driver",
                               cdi_hook=str(hook_bin))
    spec = cdi.valid_spec(DRIVER, UID, [cdi.SpecDevice(gpu(0)), cdi.SpecDevice(gpu(1))], host=host)
    top = spec["containerEdits"]
    ver = version_of(tree)
    lib = f"/{LIBDIR}"
    assert hooks_of(top) == [
        ("createContainer", ["nvidia-cdi-hook", "create-symlinks",
                             "--link", f"libcuda.so.1::{lib}/libcuda.so",
                             "--link", f"libcuda.so.{ver}::{lib}/libcuda.so.1",
                             "--link", f"libnvidia-ml.so.{ver}::{lib}/libnvidia-ml.so.1"]),
        ("createContainer", ["nvidia-cdi-hook", "enable-cuda-compat", f"--host-driver-version={ver}"]),
        ("createContainer", ["nvidia-cdi-hook", "update-ldcache", "--folder", lib]),
        ("createContainer", ["nvidia-cdi-hook", "disable-device-node-modification"]),
        ("createContainer", ["nvidia-cdi-hook", "update-application-profile"])]
    assert all(h["path"] == str(hook_bin) and h["env"] == ENV for h in top["hooks"])
    # The sonames are the hook's symlinks now: only the real files are mounted, as the toolkit mounts them.
    assert [m["containerPath"] for m in top["mounts"]] == [f"{lib}/libcuda.so.{ver}", f"{lib}/libnvidia-ml.so.{ver}"]
    assert f"NVIDIA_CTK_LIBCUDA_DIR={lib}" in top["env"]
    # Each whole GPU: the toolkit's per-device createRuntime hook, with the host's driver root and its UUID.
    for n, dev in enumerate(spec["devices"]):
        assert hooks_of(dev["containerEdits"]) == [
            ("createRuntime", ["nvidia-cdi-hook", "apply-cuda-memory-limits", "--driver-root", "/run/nvidia/driver",
                               "--gpu-id", gpu(n).uuid])]
    assert spec["cdiVersion"] == "0.3.0"  # hooks are in CDI 0.3.0


def test_without_a_hook_binary_the_spec_has_no_hooks_and_mounts_the_sonames(
        tree: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="topodra.hostdriver"):
        host = hostdriver.discover(tree, proc_root=tree / "proc", cdi_hook=str(tmp_path / "nope/nvidia-cdi-hook"))
    assert host.cdi_hook is None
    assert any("no executable nvidia-cdi-hook" in r.getMessage() and "no hooks" in r.getMessage()
               for r in caplog.records), caplog.text
    spec = cdi.valid_spec(DRIVER, UID, [cdi.SpecDevice(gpu(0))], host=host)
    assert "hooks" not in spec["containerEdits"] and "hooks" not in spec["devices"][0]["containerEdits"]
    paths = {m["containerPath"] for m in spec["containerEdits"]["mounts"]}
    assert {f"/{LIBDIR}/libcuda.so.1", f"/{LIBDIR}/libnvidia-ml.so.1"} <= paths
    # A file that is not executable is no hook either; "" (the plugin's "none") turns hooks off.
    plain = tmp_path / "nvidia-cdi-hook"
    plain.write_text("")
    assert hostdriver.find_cdi_hook(str(plain)) is None
    assert hostdriver.find_cdi_hook("") is None


def test_the_hook_is_checked_where_the_plugin_sees_it_and_a_symlink_counts(tree: Path, tmp_path: Path,
                                                                           hook_bin: Path) -> None:
    """The spec names the host path; the check looks at the local one (the chart's /nvidia-cdi-hook mount).
    A symlink that resolves only on the host (absolute, into a directory this process lacks) counts."""
    host = hostdriver.discover(tree, proc_root=tree / "proc", cdi_hook="/usr/local/nvidia/toolkit/nvidia-cdi-hook",
                               cdi_hook_local=hook_bin)
    assert host.cdi_hook == "/usr/local/nvidia/toolkit/nvidia-cdi-hook"
    spec = cdi.valid_spec(DRIVER, UID, [cdi.SpecDevice(gpu(0))], host=host)
    assert {h["path"] for h in spec["containerEdits"]["hooks"]} == {"/usr/local/nvidia/toolkit/nvidia-cdi-hook"}
    link = tmp_path / "link-hook"
    os.symlink("/nonexistent-on-this-side/nvidia-cdi-hook", link)
    assert hostdriver.find_cdi_hook("/usr/bin/nvidia-cdi-hook", link) == "/usr/bin/nvidia-cdi-hook"


def test_links_follow_the_hosts_symlinks_and_a_tree_without_versions(tmp_path: Path, tree: Path) -> None:
    """The toolkit links a soname's ``.so`` name only where the host has it as a symlink; a library whose file
    is its soname gets no soname link, and with no version in any name enable-cuda-compat has no flag."""
    root = tmp_path / "copy"
    shutil.copytree(tree, root, symlinks=True)
    d = root / LIBDIR
    ver = version_of(tree)
    os.symlink("libnvidia-ml.so.1", d / "libnvidia-ml.so")  # a -dev package's link
    (d / "libcuda.so").write_text("")  # not a symlink: not linked
    host = hostdriver.discover(root, proc_root=root / "proc", cdi_hook="/h/nvidia-cdi-hook",
                               cdi_hook_local=hook_of(tmp_path))
    lib = f"/{LIBDIR}"
    assert host.symlinks() == [f"libcuda.so.1::{lib}/libcuda.so", f"libcuda.so.{ver}::{lib}/libcuda.so.1",
                               f"libnvidia-ml.so.{ver}::{lib}/libnvidia-ml.so.1",
                               f"libnvidia-ml.so.1::{lib}/libnvidia-ml.so"]
    bare = tmp_path / "bare"
    (bare / LIBDIR).mkdir(parents=True)
    shutil.copy(os.path.realpath(d / "libcuda.so.1"), bare / LIBDIR / "libcuda.so.1")  # the soname is the file
    host = hostdriver.discover(bare, proc_root=bare, cdi_hook="/h/nvidia-cdi-hook", cdi_hook_local=hook_of(tmp_path))
    assert host.version == "" and host.symlinks() == []
    hooks = cdihooks.spec_hooks(host)
    assert [h["args"] for h in hooks] == [
        ["nvidia-cdi-hook", "enable-cuda-compat"], ["nvidia-cdi-hook", "update-ldcache", "--folder", lib],
        ["nvidia-cdi-hook", "disable-device-node-modification"], ["nvidia-cdi-hook", "update-application-profile"]]
    assert [m["containerPath"] for m in host.mounts()] == [f"{lib}/libcuda.so.1"]  # mounted once


def hook_of(tmp_path: Path) -> Path:
    b = tmp_path / "hook-bin"
    b.write_text("#!/bin/sh\n")
    b.chmod(0o755)
    return b


def test_nvidia_ctk_as_the_hook_program_takes_the_hook_subcommand() -> None:
    h = cdihooks.hook("/usr/bin/nvidia-ctk", "update-ldcache", "--folder", "/usr/lib64")
    assert h["args"] == ["nvidia-ctk", "hook", "update-ldcache", "--folder", "/usr/lib64"]


def test_mock_mig_and_nic_claims_get_no_hooks(tree: Path, hook_bin: Path) -> None:
    """Mock hardware has no HostDriver: no hooks, the spec's shape as before.  On a real host a MIG device
    gets the spec-level hooks but no memory-limit hook (the toolkit gives that to full GPUs only), and a
    NIC-only claim gets no driver at all."""
    mock = cdi.valid_spec(DRIVER, UID, [cdi.SpecDevice(Device(name="gpu-0", kind="gpu", uuid="GPU-x"))])
    assert set(mock["containerEdits"]) == {"env"} and set(mock["devices"][0]["containerEdits"]) == {"env"}
    host = hostdriver.discover(tree, proc_root=tree / "proc", cdi_hook=str(hook_bin))
    mig = Device(name="gpu-0-mig-1g-10gb-0", kind="mig", uuid="MIG-y", device_nodes=("/dev/nvidia0",))
    spec = cdi.valid_spec(DRIVER, UID, [cdi.SpecDevice(mig)], host=host)
    assert len(spec["containerEdits"]["hooks"]) == 5 and "hooks" not in spec["devices"][0]["containerEdits"]
    nic = Device(name="nic-0", kind="nic", uuid="mlx5_0", device_nodes=("/dev/infiniband/uverbs0",))
    nic_only = cdi.valid_spec(DRIVER, UID, [cdi.SpecDevice(nic)], host=host)
    assert set(nic_only["containerEdits"]) == {"env"} and "hooks" not in nic_only["devices"][0]["containerEdits"]


@pytest.mark.parametrize(("bad", "message"), [
    ({"hookName": "createContainer", "path": "nvidia-cdi-hook"}, "must be an absolute path"),
    ({"hookName": "beforeEverything", "path": "/h"}, "hookName 'beforeEverything' is not one of"),
    ({"hookName": "createContainer", "path": "/h", "args": ["a", 1]}, "hook args must be a list of strings"),
    ({"hookName": "createContainer", "path": "/h", "env": ["NOEQUALS"]}, "hook env entries must be KEY=VALUE"),
    ({"hookName": "createContainer", "path": "/h", "timeout": 0}, "timeout 0 must be a positive integer"),
    ({"hookName": "createContainer", "path": "/h", "when": "now"}, "hook has unknown fields ['when']"),
])
def test_a_bad_hook_refuses_the_spec(tmp_path: Path, bad: dict[str, Any], message: str) -> None:
    spec = cdi.build_spec(DRIVER, UID, [cdi.SpecDevice(gpu(0))])
    spec["containerEdits"]["hooks"] = [bad]
    with pytest.raises(cdi.CDISpecInvalid, match=re.escape(message)):
        cdi.validate_spec(spec)
    good = {"hookName": "createContainer", "path": "/h", "args": ["h", "x"], "env": ["A=1"], "timeout": 5}
    spec["containerEdits"]["hooks"] = [good]
    cdi.validate_spec(spec)


def _cfg(*argv: str) -> config.PluginConfig:
    parser = argparse.ArgumentParser()
    config.configure(parser)
    return config.from_args(parser.parse_args(["--node-name", "n", *argv]), {})


def test_plugin_flags_default_validate_and_reach_the_host_driver(tree: Path, hook_bin: Path) -> None:
    assert _cfg().nvidia_cdi_hook_path == "/usr/bin/nvidia-cdi-hook"
    assert _cfg("--nvidia-cdi-hook-path", "none").nvidia_cdi_hook_path == ""
    with pytest.raises(config.ConfigError, match=r"--nvidia-cdi-hook-path .*absolute host path"):
        _cfg("--nvidia-cdi-hook-path", "bin/nvidia-cdi-hook")
    base = ("--hardware", "nvml", "--nvidia-driver-root", str(tree), "--nvidia-proc-root", str(tree / "proc"))
    host = host_driver(_cfg(*base, "--nvidia-cdi-hook-path", "/usr/bin/nvidia-cdi-hook",
                            "--nvidia-cdi-hook-local-path", str(hook_bin)))
    assert host is not None and host.cdi_hook == "/usr/bin/nvidia-cdi-hook"
    off = host_driver(_cfg(*base, "--nvidia-cdi-hook-path", "none", "--nvidia-cdi-hook-local-path", str(hook_bin)))
    assert off is not None and off.cdi_hook is None
