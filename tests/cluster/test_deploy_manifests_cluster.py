"""The install manifests in deploy/: consistent with the code, accepted by a real apiserver, and their
RBAC is exactly enough — proven by running the real plugin and controller with ServiceAccount tokens.

Split by tier; the rest: tests/unit/deploy/test_deploy_manifests.py.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from testkit.handle import ClusterHandle, wait_for
from testkit.kubeletstub import KubeletStub
from testkit.manifests import DEPLOY, controller_deploy, docs, env_of, plugin_ds
from testkit.paths import REPO
from testkit.ports import free_port

from topodra.apipaths import claim_path, slices_path, template_path
from topodra.cdi import spec_path

NS = "topodra-system"
PLUGIN_SA = f"system:serviceaccount:{NS}:topodra-kubelet-plugin"
CONTROLLER_SA = f"system:serviceaccount:{NS}:topodra-controller"
DRIVER = "gpu.topodra.io"
R = "/apis/resource.k8s.io/v1"

Obj = dict[str, Any]


# --------------------------------------------------------------------------- against the apiserver


@pytest.fixture(scope="module")
def installed(cluster: ClusterHandle) -> Iterator[ClusterHandle]:
    """CRD, DeviceClasses, namespace and RBAC applied for real (workloads only as server dry-runs)."""

    def not_terminating() -> bool:
        ns = cluster.kube.get(f"/api/v1/namespaces/{NS}")
        return ns is None or (ns.get("status") or {}).get("phase") != "Terminating"

    # Another module using this fixture deleted the namespace with --wait=false: applying into a
    # terminating namespace is refused ("because it is being terminated").
    wait_for(not_terminating, 180, f"namespace {NS} of an earlier module to finish terminating")
    cluster.apply_yaml(DEPLOY / "crds")
    cluster.apply_yaml(REPO / "deviceclasses")
    out = cluster.kubectl("apply", "-f", str(DEPLOY / "rbac"))
    assert out.count("\n") == len(docs(DEPLOY / "rbac")), out
    wait_for(lambda: cluster.kube.get(f"/api/v1/namespaces/{NS}/serviceaccounts/topodra-kubelet-plugin"), 30,
             "plugin ServiceAccount")
    yield cluster
    for kind, name in (("clusterrolebinding", "topodra-kubelet-plugin"), ("clusterrole", "topodra-kubelet-plugin"),
                       ("clusterrolebinding", "topodra-controller"), ("clusterrole", "topodra-controller")):
        cluster.kubectl("delete", kind, name, "--ignore-not-found", check=False)
    cluster.kubectl("delete", "namespace", NS, "--ignore-not-found", "--wait=false", check=False)


@pytest.mark.cluster
def test_workloads_pass_server_side_dry_run(installed: ClusterHandle) -> None:
    for path in (DEPLOY / "plugin", DEPLOY / "controller"):
        out = installed.kubectl("apply", "--dry-run=server", "-f", str(path))
        assert out.count("(server dry run)") == len(docs(path)), out
    # The kind variant: the same DaemonSet with the mock-hardware patch hack/kind-up applies.
    patched = installed.kubectl("patch", "--local", "-f", str(DEPLOY / "plugin/daemonset.yaml"), "--type",
                                "strategic", "--patch-file", str(DEPLOY / "kind/plugin-mock-hardware.yaml"),
                                "-o", "yaml")
    env = env_of(yaml.safe_load(patched)["spec"]["template"]["spec"]["containers"][0])
    assert env["TOPODRA_HARDWARE"]["value"] == "mock:dgx-h100"
    assert "TOPODRA_SYSFS_ROOT" not in env and "NODE_NAME" in env and "TOPODRA_POD_UID" in env
    out = installed.kubectl("apply", "--dry-run=server", "-f", "-", input=patched)
    assert "(server dry run)" in out, out
    kind = yaml.safe_load((DEPLOY / "kind/kind-config.yaml").read_text())
    assert kind["kind"] == "Cluster"
    assert [n["role"] for n in kind["nodes"]].count("worker") >= 1
    assert all(n.get("labels", {}).get("topodra.io/kubelet-plugin") == "true"
               for n in kind["nodes"] if n["role"] == "worker")


def can_i(nc: ClusterHandle, who: str, verb: str, resource: str, ns: str | None = None) -> bool:
    """``kubectl auth can-i`` as ``who``: in ``ns``, else cluster-wide; ``resource`` may end in /<subresource>."""
    resource, _, sub = resource.partition("/")
    r = subprocess.run([str(nc.bin_dir / "kubectl"), f"--kubeconfig={nc.kubeconfig}", "auth", "can-i", verb,
                        resource, f"--as={who}", *(["-n", ns] if ns else ["--all-namespaces"]),
                        *([f"--subresource={sub}"] if sub else [])],
                       capture_output=True, text=True, timeout=60, check=False)
    answer = r.stdout.strip()
    assert answer in ("yes", "no"), (r.stdout, r.stderr)
    return answer == "yes"


PLUGIN_ALLOWED = [(v, "resourceslices.resource.k8s.io") for v in
                  ("get", "list", "watch", "create", "update", "patch", "delete")] + [
    ("get", "resourceclaims.resource.k8s.io"), ("get", "nodes"), ("patch", "nodes"),
    # telemetry: the Idle condition in status.devices (the per-driver, own-node check is
    # tests/cluster/test_telemetry_rbac_cluster.py) and the pod Events
    ("patch", "resourceclaims.resource.k8s.io/status"), ("create", "events"),
    ("get", "pods")]  # a backfill claim's pods: their activeDeadlineSeconds (plugin/server.py)
PLUGIN_DENIED = [("get", "secrets"), ("list", "secrets"), ("list", "pods"), ("update", "pods"), ("update", "nodes"),
                 ("update", "resourceclaims.resource.k8s.io"), ("update", "resourceclaims.resource.k8s.io/status"),
                 ("patch", "resourceclaims.resource.k8s.io/binding"),
                 ("list", "resourceclaims.resource.k8s.io"), ("create", "deviceclasses.resource.k8s.io"),
                 ("update", "events"), ("delete", "events")]
CONTROLLER_ALLOWED = [
    *[(v, "claimprofiles.topodra.io") for v in ("get", "list", "watch", "patch")],
    *[(v, "claimprofiles.topodra.io/status") for v in ("get", "patch")],
    *[(v, "resourceclaimtemplates.resource.k8s.io") for v in ("get", "create", "delete")],
    *[(v, f"{r}.resource.k8s.io") for v in ("get", "list", "watch") for r in
      ("deviceclasses", "resourceslices", "resourceclaims")],
    *[(v, "devicetaintrules.resource.k8s.io") for v in ("list", "watch", "create", "delete")],  # reservations
    ("create", "events"), ("list", "customresourcedefinitions.apiextensions.k8s.io")]
CONTROLLER_DENIED = [("get", "secrets"),
                     ("patch", "resourceclaims.resource.k8s.io/status"), ("create", "resourceslices.resource.k8s.io"),
                     ("update", "resourceclaims.resource.k8s.io"), ("create", "deviceclasses.resource.k8s.io"),
                     ("delete", "claimprofiles.topodra.io"), ("create", "pods"),
                     ("update", "devicetaintrules.resource.k8s.io"), ("patch", "devicetaintrules.resource.k8s.io")]


@pytest.mark.cluster
def test_rbac_grants_what_the_code_uses_and_nothing_obvious_more(installed: ClusterHandle) -> None:
    nc = installed
    wrong = []
    for who, allowed, denied in ((PLUGIN_SA, PLUGIN_ALLOWED, PLUGIN_DENIED),
                                 (CONTROLLER_SA, CONTROLLER_ALLOWED, CONTROLLER_DENIED)):
        wrong += [f"{who} cannot {v} {r}" for v, r in allowed if not can_i(nc, who, v, r)]
        wrong += [f"{who} can {v} {r}" for v, r in denied if can_i(nc, who, v, r)]
    for verb in ("get", "create", "update"):
        if not can_i(nc, CONTROLLER_SA, verb, "leases.coordination.k8s.io", NS):
            wrong.append(f"controller cannot {verb} leases in {NS}")
    if can_i(nc, CONTROLLER_SA, "update", "leases.coordination.k8s.io", "default"):
        wrong.append("controller can update leases outside its namespace")
    for verb in ("get", "list", "create", "delete"):  # the MPS daemon pods (plugin.mpsDaemon=pod), its namespace only
        if not can_i(nc, PLUGIN_SA, verb, "pods", NS):
            wrong.append(f"plugin cannot {verb} pods in {NS}")
        # get: everywhere, for a backfill claim's pods (PLUGIN_ALLOWED); the rest only in its namespace
        if verb != "get" and can_i(nc, PLUGIN_SA, verb, "pods", "default"):
            wrong.append(f"plugin can {verb} pods outside its namespace")
    assert not wrong, "\n".join(wrong)


# --------------------------------------------------------------------------- the real processes, as the SAs


def sa_kubeconfig(nc: ClusterHandle, sa: str, path: Path) -> Path:
    """A kubeconfig that authenticates with a fresh token of ``sa`` (TokenRequest), nothing else."""
    token = nc.kubectl("create", "token", sa, "-n", NS, "--duration=1h").strip()
    assert token.count(".") == 2, "not a JWT"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": sa,
        "clusters": [{"name": "local", "cluster": {"server": "https://127.0.0.1:6443",
                                                   "certificate-authority": str(nc.lc.pki / "ca.crt")}}],
        "users": [{"name": sa, "user": {"token": token}}],
        "contexts": [{"name": sa, "context": {"cluster": "local", "user": sa, "namespace": NS}}]}))
    return path


def kubectl_as(nc: ClusterHandle, kubeconfig: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(nc.bin_dir / "kubectl"), f"--kubeconfig={kubeconfig}", *args],
                          capture_output=True, text=True, timeout=60, check=False)


def stop(proc: subprocess.Popen[bytes]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


# Not a bare "403": log timestamps end in milliseconds (",403").
FORBIDDEN = re.compile(r"forbidden|Not enough permissions|Unauthorized", re.I)


@pytest.mark.cluster
def test_plugin_publishes_and_prepares_with_only_its_rbac(installed: ClusterHandle, tmp_path: Path) -> None:
    """The plugin, authenticated as its ServiceAccount, publishes its slice and prepares a claim that the
    real scheduler allocated (kubelet-less node; this test plays the kubelet on the real socket)."""
    nc = installed
    sockets = Path(tempfile.mkdtemp(prefix="tdm-"))  # short: AF_UNIX paths are limited to 107 bytes
    kubeconfig = sa_kubeconfig(nc, "topodra-kubelet-plugin", tmp_path / "plugin.kubeconfig")
    denied = kubectl_as(nc, kubeconfig, "get", "secrets", "-A")
    assert denied.returncode != 0 and "forbidden" in denied.stderr.lower(), denied
    node = f"rbac-{uuid.uuid4().hex[:6]}"
    nc.fake_nodes([node])
    log = tmp_path / "plugin.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOPODRA_")}
    ds_env = env_of(plugin_ds()["spec"]["template"]["spec"]["containers"][0])
    env.update({"NODE_NAME": node, "TOPODRA_POD_UID": str(uuid.uuid4()), "TOPODRA_HARDWARE": "mock:dgx-h100",
                "TOPODRA_KUBECONFIG": str(kubeconfig), "TOPODRA_CDI_ROOT": str(tmp_path / "cdi"),
                "TOPODRA_PLUGIN_DIR": str(sockets / "plugin"), "TOPODRA_REGISTRY_DIR": str(sockets / "registry"),
                "TOPODRA_HEALTH_PORT": str(free_port()), "TOPODRA_METRICS_PORT": str(free_port()),
                "PYTHONUNBUFFERED": "1"})
    assert {"NODE_NAME", "TOPODRA_POD_UID"} <= ds_env.keys()
    ns = nc.namespace("rbac")
    with log.open("wb") as logf:
        proc = subprocess.Popen([sys.executable, "-m", "topodra.cli", *plugin_ds()["spec"]["template"]["spec"]
                                 ["containers"][0]["command"][1:]], stdout=logf, stderr=subprocess.STDOUT, env=env,
                                cwd=REPO)
    try:
        sel = f"spec.driver={DRIVER},spec.nodeName={node}"

        def published() -> bool:
            assert proc.poll() is None, log.read_text()
            return sum(len(s["spec"]["devices"]) for s in nc.kube.list(slices_path(), field_selector=sel)) == 16
        wait_for(published, 60, "slice published by the plugin as its ServiceAccount")
        nc.kube.create(f"{R}/namespaces/{ns}/resourceclaims", {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "two"},
            "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {"deviceClassName": DRIVER,
                                                                            "count": 2}}]}}})
        nc.kube.create(f"/api/v1/namespaces/{ns}/pods", {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
            "spec": {"nodeSelector": {"kubernetes.io/hostname": node}, "automountServiceAccountToken": False,
                     "resourceClaims": [{"name": "gpus", "resourceClaimName": "two"}],
                     "containers": [{"name": "c", "image": "localhost/busybox:1.35", "imagePullPolicy": "Never",
                                     "resources": {"claims": [{"name": "gpus"}]}}]}})
        claim = wait_for(lambda: (c := nc.kube.get(claim_path(ns, "two"))) and
                         (c.get("status") or {}).get("allocation") and c, 60, "allocation")
        uid = claim["metadata"]["uid"]
        (dra_socket,) = (sockets / "plugin").glob("dra*.sock")  # per-pod name (TOPODRA_POD_UID)
        assert env["TOPODRA_POD_UID"] in dra_socket.name
        with KubeletStub(dra_socket) as stub:
            resp = stub.prepare([(ns, uid, "two")])
            assert resp.claims[uid].error == ""
            assert sorted(d.device_name for d in resp.claims[uid].devices) == sorted(
                r["device"] for r in claim["status"]["allocation"]["devices"]["results"])
            assert spec_path(tmp_path / "cdi", DRIVER, uid).exists()
            assert stub.unprepare([(ns, uid, "two")]).claims[uid].error == ""
        assert stop(proc) == 0, log.read_text()
        text = log.read_text()
        assert not FORBIDDEN.search(text), text
    finally:
        stop(proc)
        nc.kube.request("DELETE", f"/api/v1/namespaces/{ns}/pods/p", {"gracePeriodSeconds": 0})
        nc.kube.delete(f"/api/v1/nodes/{node}")
        nc.kube.delete(f"/api/v1/namespaces/{ns}")
        shutil.rmtree(sockets, ignore_errors=True)


@pytest.mark.cluster
def test_controller_reconciles_with_only_its_rbac(installed: ClusterHandle, tmp_path: Path) -> None:
    """The controller, run with the Deployment's arguments as its ServiceAccount, takes the Lease in
    topodra-system and renders a ClaimProfile into a template with status."""
    nc = installed
    kubeconfig = sa_kubeconfig(nc, "topodra-controller", tmp_path / "controller.kubeconfig")
    ns = nc.namespace("rbacctl")
    identity = f"rbac-test-{uuid.uuid4().hex[:6]}"
    (c,) = controller_deploy()["spec"]["template"]["spec"]["containers"]
    args = [a.replace("$(POD_NAMESPACE)", NS).replace("$(POD_NAME)", identity) for a in c["args"]]
    log = tmp_path / "controller.log"
    with log.open("wb") as logf:
        proc = subprocess.Popen([sys.executable, "-m", "topodra.cli", *c["command"][1:], *args,
                                 f"--kubeconfig={kubeconfig}", "--refresh-interval=2"],
                                stdout=logf, stderr=subprocess.STDOUT, cwd=REPO,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        lease = f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases/topodra-controller"
        wait_for(lambda: (nc.kube.get(lease) or {}).get("spec", {}).get("holderIdentity") == identity, 60,
                 "controller to hold its Lease")
        nc.kube.create(f"/apis/topodra.io/v1alpha1/namespaces/{ns}/claimprofiles", {
            "apiVersion": "topodra.io/v1alpha1", "kind": "ClaimProfile", "metadata": {"name": "train"},
            "spec": {"alternatives": [{"deviceClassName": "gpu-h100", "count": 2}]}})
        tmpl = wait_for(lambda: nc.kube.get(template_path(ns, "train")), 60, "template rendered")
        assert tmpl["spec"]["spec"]["devices"]["requests"]

        def ready() -> bool:
            prof = nc.kube.get(f"/apis/topodra.io/v1alpha1/namespaces/{ns}/claimprofiles/train") or {}
            conds = {x["type"]: x["status"] for x in (prof.get("status") or {}).get("conditions") or []}
            return conds.get("Ready") == "True"
        wait_for(ready, 60, "profile status Ready written by the controller")

        def refreshed_after(stamp: str) -> str | None:  # status.lastRefresh is written after each pass
            prof = nc.kube.get(f"/apis/topodra.io/v1alpha1/namespaces/{ns}/claimprofiles/train") or {}
            got = (prof.get("status") or {}).get("lastRefresh")
            return str(got) if got and str(got) > stamp else None
        # at least one full refresh pass (lists slices, claims, classes, writes status) after the first render
        first = wait_for(lambda: refreshed_after(""), 30, "status.lastRefresh")
        wait_for(lambda: refreshed_after(first), 30, "a later refresh pass")
        assert proc.poll() is None, log.read_text()
        assert stop(proc) == 0, log.read_text()
        text = log.read_text()
        assert not FORBIDDEN.search(text), text
    finally:
        stop(proc)
        nc.kube.delete(f"/api/v1/namespaces/{ns}")
