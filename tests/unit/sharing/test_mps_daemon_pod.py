"""``--mps-daemon pod``: the per-claim daemon pod's manifest, the stand-in's ``-f`` (the pod's foreground
process), and the plugin settings.  The pod's life on a real kubelet: tests/node/test_mps_daemon_pod_node.py."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from topodra.hardware import mockmps
from topodra.plugin import config
from topodra.plugin.config import ConfigError
from topodra.sharing import mpspod
from topodra.sharing.mps import BINARY_ENV, MpsDaemons, MpsError
from topodra.sharing.mpspod import MpsPods

STAND_IN = str(Path(mockmps.__file__))
UID = "0b7c2a9e-1111-4222-8333-944455556666"


class _NoApi:
    """Manifests are pure: no API call may happen while one is built."""

    def get(self, path: str) -> dict[str, Any] | None:
        raise AssertionError(f"GET {path}")

    def create(self, path: str, obj: dict[str, Any]) -> dict[str, Any]:
        raise AssertionError(f"POST {path}")

    def delete(self, path: str, missing_ok: bool = True, uid: str | None = None) -> None:
        raise AssertionError(f"DELETE {path}")

    def list(self, path: str, label_selector: str | None = None,
             field_selector: str | None = None) -> Iterator[dict[str, Any]]:
        raise AssertionError(f"LIST {path}")


def pods() -> MpsPods:
    return MpsPods(_NoApi(), "topodra", "node-a", "localhost/topodra:1")


def test_the_pod_is_bound_to_the_node_ownerless_and_mounts_the_claims_dirs(tmp_path: Path) -> None:
    d = MpsDaemons(tmp_path, binary=STAND_IN, pods=pods())
    pod = d.pod_manifest(UID, ["GPU-a", "GPU-b"])
    meta, spec = pod["metadata"], pod["spec"]
    assert meta["name"] == f"topodra-mps-{UID}" and meta["namespace"] == "topodra"
    assert meta["labels"][mpspod.CLAIM_LABEL] == UID
    assert "ownerReferences" not in meta, "a plugin upgrade must not garbage-collect the daemon"
    assert spec["nodeName"] == "node-a" and spec["restartPolicy"] == "OnFailure"
    assert spec["hostNetwork"] is True, "no pod network: a node without a CNI still runs it"
    (c,) = spec["containers"]
    assert c["image"] == "localhost/topodra:1" and c["command"] == [STAND_IN, "-f"]
    assert c["securityContext"] == {"privileged": True, "runAsUser": 0, "runAsGroup": 0}
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-a,GPU-b"
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/nvidia-mps"
    assert env["CUDA_MPS_LOG_DIRECTORY"] == "/var/log/nvidia-mps"
    assert set(env) == {"CUDA_VISIBLE_DEVICES", "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"}, \
        "the plugin's own environment stays out of the pod (a stand-in needs no preload)"
    at = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    host = {v["name"]: (v["hostPath"]["path"], v["hostPath"]["type"]) for v in spec["volumes"]}
    pipe, logs = d.dirs(UID)
    assert at == {"pipe": "/tmp/nvidia-mps", "log": "/var/log/nvidia-mps", "shm": "/dev/shm",
                  "control-binary": STAND_IN}
    assert host == {"pipe": (str(pipe), "Directory"), "log": (str(logs), "Directory"),
                    "shm": (str(d.shm_dir(UID)), "Directory"), "control-binary": (STAND_IN, "File")}


def test_the_driver_root_is_mounted_where_the_plugin_sees_it(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "driver-root"
    (root / "usr/bin").mkdir(parents=True)
    tool = root / "usr/bin/nvidia-cuda-mps-control"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    (root / "usr/lib64").mkdir()
    for lib in ("libcuda.so.1", "libnvidia-ml.so.1"):
        (root / "usr/lib64" / lib).write_bytes(b"")
    monkeypatch.delenv(BINARY_ENV, raising=False)
    d = MpsDaemons(tmp_path / "state", driver_root=root, host_driver_root="/run/nvidia/driver", pods=pods())
    spec = d.pod_manifest(UID, ["GPU-a"])["spec"]
    (c,) = spec["containers"]
    assert c["command"] == [str(tool), "-f"]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert str(root / "usr/lib64/libcuda.so.1") in env["LD_PRELOAD"], "the servers it starts load the root's libcuda"
    assert env["PATH"].startswith(str(root / "usr/bin")), "and find nvidia-cuda-mps-server next to it"
    mount = next(m for m in c["volumeMounts"] if m["name"] == "driver-root")
    assert mount == {"name": "driver-root", "mountPath": str(root), "readOnly": True,
                     "mountPropagation": "HostToContainer"}
    assert {"name": "driver-root", "hostPath": {"path": "/run/nvidia/driver", "type": "Directory"}} in spec["volumes"]
    assert not any(m["name"] == "control-binary" for m in c["volumeMounts"])


def test_a_driver_root_of_slash_is_refused_with_a_way_out(tmp_path: Path) -> None:
    d = MpsDaemons(tmp_path, binary=STAND_IN, driver_root="/", pods=pods())
    with pytest.raises(MpsError, match="--mps-daemon process"):
        d.pod_manifest(UID, ["GPU-a"])


def test_the_stand_in_serves_in_the_foreground_until_quit(tmp_path: Path) -> None:
    pipe, logs = tmp_path / "pipe", tmp_path / "log"
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(logs)}
    daemon = subprocess.Popen([sys.executable, STAND_IN, "-f"], env=env, stdin=subprocess.DEVNULL)
    try:
        def ask(line: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, STAND_IN], input=line + "\n", env=env, capture_output=True,
                                  text=True, timeout=10)

        deadline = 50
        while ask("get_server_list").returncode != 0 and deadline:
            assert daemon.poll() is None, "the foreground daemon exited"
            deadline -= 1
            subprocess.run(["sleep", "0.1"], check=True)
        assert ask("set_default_active_thread_percentage 25").stdout.strip() == "25.0"
        assert daemon.poll() is None, "-f must not fork away: the pod's main process is the daemon"
        second = subprocess.run([sys.executable, STAND_IN, "-f"], env=env, capture_output=True, text=True, timeout=10)
        assert second.returncode == 1 and "already running" in second.stderr
        ask("quit")
        assert daemon.wait(10) == 0, "quit ends the pod's process with 0 (restartPolicy OnFailure: no restart)"
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()


def _cfg(**env: str) -> config.PluginConfig:
    import argparse

    p = argparse.ArgumentParser()
    config.configure(p)
    return config.from_args(p.parse_args([]), {"NODE_NAME": "n1", **env})


def test_the_plugin_setting_defaults_to_process_and_pod_needs_namespace_and_image() -> None:
    assert _cfg().mps_daemon == "process"
    with pytest.raises(ConfigError, match=r"--mps-daemon-namespace.*--mps-daemon-image"):
        _cfg(TOPODRA_MPS_DAEMON="pod", TOPODRA_MPS_DAEMON_IMAGE="img")
    with pytest.raises(ConfigError, match="--mps-daemon"):
        _cfg(TOPODRA_MPS_DAEMON="container")
    with pytest.raises(ConfigError, match="not a namespace"):
        _cfg(TOPODRA_MPS_DAEMON="pod", TOPODRA_MPS_DAEMON_IMAGE="img", TOPODRA_MPS_DAEMON_NAMESPACE="Bad_NS")
    ok = _cfg(TOPODRA_MPS_DAEMON="pod", TOPODRA_MPS_DAEMON_IMAGE="img", TOPODRA_MPS_DAEMON_NAMESPACE="topodra")
    assert (ok.mps_daemon, ok.mps_daemon_namespace, ok.mps_daemon_image) == ("pod", "topodra", "img")
