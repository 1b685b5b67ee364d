"""The local cluster is real: API validation, controller-manager, quota, and a real kubelet running a pod.

Split by tier; the rest: tests/node/test_harness_node.py.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from testkit.handle import ClusterHandle, wait_for
from testkit.paths import REPO

from topodra.kube import KubeError

pytestmark = pytest.mark.cluster

R = "/apis/resource.k8s.io/v1"


def test_resource_v1_is_served_and_version_is_pinned(cluster: ClusterHandle) -> None:
    groups = cluster.kube.request("GET", "/apis/resource.k8s.io")
    assert "v1" in [v["version"] for v in groups["versions"]]
    res = {r["name"] for r in cluster.kube.request("GET", R)["resources"]}
    assert {"resourceslices", "resourceclaims", "resourceclaimtemplates", "deviceclasses"} <= res
    version = json.loads(cluster.kubectl("version", "-o", "json"))
    assert version["serverVersion"]["gitVersion"] == "v1.37.2"
    assert version["clientVersion"]["gitVersion"] == "v1.37.2"


def test_invalid_cel_deviceclass_is_rejected(cluster: ClusterHandle) -> None:
    bad = {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": "bad-cel"},
           "spec": {"selectors": [{"cel": {"expression": 'device.attributes["x"].model ==== 1'}}]}}
    with pytest.raises(KubeError) as e:
        cluster.kube.create(f"{R}/deviceclasses", bad)
    assert e.value.status == 422
    assert "compil" in e.value.message.lower() or "syntax" in e.value.message.lower()
    assert cluster.kube.get(f"{R}/deviceclasses/bad-cel") is None


def test_claim_template_yields_claim(cluster: ClusterHandle) -> None:
    ns = cluster.namespace("tmpl")
    cluster.fake_nodes(["harness-fake-0"])
    cluster.kube.create(f"{R}/deviceclasses", {
        "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": "harness-any"},
        "spec": {"selectors": [{"cel": {"expression": 'device.driver == "harness.example.com"'}}]}}) \
        if cluster.kube.get(f"{R}/deviceclasses/harness-any") is None else None
    cluster.kube.create(f"{R}/namespaces/{ns}/resourceclaimtemplates", {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": "one"},
        "spec": {"spec": {"devices": {"requests": [
            {"name": "dev", "exactly": {"deviceClassName": "harness-any"}}]}}}})
    cluster.kube.create(f"/api/v1/namespaces/{ns}/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
        "spec": {"nodeName": "harness-fake-0", "containers": [
            {"name": "c", "image": "localhost/busybox:1.35", "resources": {"claims": [{"name": "gpu"}]}}],
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one"}]}})
    claims = wait_for(lambda: list(cluster.kube.list(f"{R}/namespaces/{ns}/resourceclaims")), 60,
                      "controller-manager to create the ResourceClaim")
    assert len(claims) == 1
    owner = claims[0]["metadata"]["ownerReferences"][0]
    assert owner["kind"] == "Pod" and owner["name"] == "p"
    statuses = wait_for(lambda: ((cluster.kube.get(f"/api/v1/namespaces/{ns}/pods/p") or {}).get("status") or {})
                        .get("resourceClaimStatuses"), 30, "the pod's resourceClaimStatuses")
    assert statuses[0]["resourceClaimName"] == claims[0]["metadata"]["name"]


def test_resourcequota_rejects_excess_claim(cluster: ClusterHandle) -> None:
    ns = cluster.namespace("quota")
    cluster.kube.create(f"/api/v1/namespaces/{ns}/resourcequotas", {
        "apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "claims"},
        "spec": {"hard": {"count/resourceclaims.resource.k8s.io": "1"}}})
    wait_for(lambda: (cluster.kube.get(f"/api/v1/namespaces/{ns}/resourcequotas/claims") or {})
             .get("status", {}).get("hard"), 30, "quota status")

    def claim(name: str) -> dict[str, object]:
        return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
                "spec": {"devices": {"requests": [{"name": "dev", "exactly": {"deviceClassName": "any"}}]}}}

    cluster.kube.create(f"{R}/namespaces/{ns}/resourceclaims", claim("first"))
    with pytest.raises(KubeError) as e:
        cluster.kube.create(f"{R}/namespaces/{ns}/resourceclaims", claim("second"))
    assert e.value.status == 403
    assert "exceeded quota" in e.value.message
    assert cluster.kube.get(f"{R}/namespaces/{ns}/resourceclaims/second") is None


def test_up_twice_fails_clearly_and_disturbs_nothing(cluster: ClusterHandle) -> None:
    env_dir = str(cluster.run_dir)
    r = subprocess.run([str(REPO / "hack/cluster"), "up", "--no-build"],
                       capture_output=True, text=True, env={"TOPODRA_CLUSTER_DIR": env_dir, "PATH": "/usr/bin:/bin"},
                       check=False)
    assert r.returncode == 1
    assert "already running" in r.stderr
    assert cluster.kube.request("GET", "/version")["gitVersion"] == "v1.37.2"


def test_port_in_use_is_reported(tmp_path: Path, cluster: ClusterHandle) -> None:
    # The running cluster holds 6443: a second cluster in another dir must say so and start nothing.
    r = subprocess.run([str(REPO / "hack/cluster"), "up", "--no-build"],
                       capture_output=True, text=True,
                       env={"TOPODRA_CLUSTER_DIR": str(tmp_path / "other"), "PATH": "/usr/bin:/bin"},
                       check=False)
    assert r.returncode == 1
    assert "127.0.0.1:6443 (kube-apiserver) is in use" in r.stderr
    assert not (tmp_path / "other").exists()


def test_component_failure_names_it_and_shows_its_log(tmp_path: Path) -> None:
    from testkit import cluster as localcluster

    lc = localcluster.Cluster(state_dir=tmp_path / "c")
    lc.state_dir.mkdir()
    lc._save({"pids": {}})
    lc.start_process("fake-etcd", ["sh", "-c", "echo 'flag provided but not defined: -bogus'; exit 3"])
    with pytest.raises(localcluster.ClusterError) as e:
        lc._wait("fake-etcd", lambda: False, 10)
    assert "fake-etcd exited during startup" in str(e.value)
    assert "flag provided but not defined: -bogus" in str(e.value)


def test_build_refuses_early_when_disk_is_short(tmp_path: Path) -> None:
    r = subprocess.run([str(REPO / "hack/build-bins")], capture_output=True, text=True, check=False,
                       env={**os.environ, "TOPODRA_CACHE": str(tmp_path / "cache"),
                            "TOPODRA_MIN_FREE_GB": "1000000"})
    assert r.returncode == 1
    assert "need 1000000 GiB free for the build" in r.stderr
    assert not list((tmp_path / "cache").glob("bin-*"))
