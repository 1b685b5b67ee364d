"""plugin.sysfsHostPath, rendered by the real helm: the host sysfs the nvml branch mounts at /host/sys. /sys on a
real node; kind's stand-in nodes point it at their generated tree (deploy/kind/values.yaml)."""

from __future__ import annotations

from typing import Any

import gen_manifests


def sys_mount(*values: str) -> tuple[Any, Any]:
    objs = [o for o, _ in gen_manifests.split(gen_manifests.render(list(values)))]
    (ds,) = [o for o in objs if o["kind"] == "DaemonSet"]
    spec = ds["spec"]["template"]["spec"]
    (vol,) = [v for v in spec["volumes"] if v["name"] == "sys"]
    (mount,) = [m for c in spec["containers"] for m in c["volumeMounts"] if m["name"] == "sys"]
    return vol, mount


def test_default_is_the_hosts_sys() -> None:
    vol, mount = sys_mount()
    assert vol["hostPath"] == {"path": "/sys", "type": "Directory"}
    assert mount == {"name": "sys", "mountPath": "/host/sys", "readOnly": True}


def test_a_generated_tree_is_mounted_in_its_place() -> None:
    vol, mount = sys_mount("plugin.sysfsHostPath=/var/lib/kubelet/plugins/topodra-standin/sys")
    assert vol["hostPath"]["path"] == "/var/lib/kubelet/plugins/topodra-standin/sys"
    assert mount["mountPath"] == "/host/sys" and mount["readOnly"] is True
