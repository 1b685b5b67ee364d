"""The install manifests in deploy/: consistent with the code, accepted by a real apiserver, and their
RBAC is exactly enough — proven by running the real plugin and controller with ServiceAccount tokens.

Split by tier; the rest: tests/cluster/test_deploy_manifests_cluster.py.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from testkit.manifests import DEPLOY, controller_deploy, docs, env_of, one, plugin_ds

from topodra.controller import main as controller_main
from topodra.plugin import config as plugin_config

NS = "topodra-system"
DRIVER = "gpu.topodra.io"

Obj = dict[str, Any]


# --------------------------------------------------------------------------- without a cluster


def test_daemonset_matches_the_plugin_code() -> None:
    ds = plugin_ds()
    spec = ds["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    assert c["command"] == ["topodra", "--log-level=INFO", "kubelet-plugin"]
    assert c["securityContext"]["privileged"] is True
    env = env_of(c)
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["TOPODRA_POD_UID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.uid"
    flags = {f.env for f in plugin_config.FLAGS}
    unknown = {n for n in env if n.startswith("TOPODRA_")} - flags
    assert not unknown, f"env vars the plugin does not read: {unknown}"
    # The literal settings validate with the plugin's own configuration code.
    values = {n: e["value"] for n, e in env.items() if "value" in e}
    assert env["TOPODRA_MPS_DAEMON_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    cfg = plugin_config.from_args(argparse.Namespace(), {**values, "NODE_NAME": "gpu-node-1",
                                                         "TOPODRA_POD_UID": str(uuid.uuid4()),
                                                         "TOPODRA_MPS_DAEMON_NAMESPACE": NS})
    assert cfg.mps_daemon == "pod" and cfg.mps_daemon_image == c["image"], "the daemon pods run the plugin's image"
    assert cfg.plugin_dir == Path("/var/lib/kubelet/plugins") / DRIVER
    # Host paths at the same paths as on the host (the kubelet dials the reported socket path).
    vols = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    for path in (cfg.plugin_dir.parent, cfg.registry_dir, cfg.cdi_root):
        m = mounts[str(path)]
        assert vols[m["name"]]["hostPath"]["path"] == str(path)
        assert not m.get("readOnly")
    sys_mount = mounts[f"{cfg.sysfs_root}/sys"]
    assert vols[sys_mount["name"]]["hostPath"]["path"] == "/sys" and sys_mount["readOnly"] is True
    # The exec probe runs a module that exists, against the port the plugin listens on.
    for probe in ("livenessProbe", "startupProbe"):
        cmd = c[probe]["exec"]["command"]
        assert cmd[:3] == ["python", "-m", "topodra.plugin.probes"]
        assert cmd[cmd.index("--port") + 1] == str(cfg.health_port)
    r = subprocess.run([sys.executable, *cmd[1:3], "--help"], capture_output=True, text=True, check=False)
    assert r.returncode == 0 and "--port" in r.stdout, r.stderr
    assert ds["spec"]["updateStrategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}


def test_controller_deployment_args_parse_with_the_controller() -> None:
    dep = controller_deploy()
    assert dep["spec"]["replicas"] == 2
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["topodra", "--log-level=INFO", "controller"]
    parser = argparse.ArgumentParser()
    controller_main.configure(parser)
    args = parser.parse_args([a.replace("$(POD_NAMESPACE)", NS).replace("$(POD_NAME)", "p") for a in c["args"]])
    assert args.leader_elect and args.all_namespaces and args.lease_namespace == NS
    # The chart's reservation defaults reach the controller as seconds.
    assert (args.reservations, args.reservation_after, args.reservation_max_hold, args.max_reservations) == (
        "on", 900, 86400, 2)
    env = env_of(c)
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    # The Lease role lives where the controller puts its Lease.
    role = one(docs(DEPLOY / "rbac"), "Role", "topodra-controller-leader-election")
    assert role["metadata"]["namespace"] == dep["metadata"]["namespace"] == NS


def test_service_accounts_and_bindings_line_up() -> None:
    rbac = docs(DEPLOY / "rbac")
    for sa_name, workload in (("topodra-kubelet-plugin", plugin_ds()), ("topodra-controller", controller_deploy())):
        assert workload["spec"]["template"]["spec"]["serviceAccountName"] == sa_name
        assert one(rbac, "ServiceAccount", sa_name)["metadata"]["namespace"] == NS
        binding = one(rbac, "ClusterRoleBinding", sa_name)
        assert binding["roleRef"]["name"] == one(rbac, "ClusterRole", sa_name)["metadata"]["name"]
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa_name, "namespace": NS}]
