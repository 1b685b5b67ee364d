"""The chart's telemetry RBAC on the real apiserver, with real pod-bound ServiceAccount tokens: the plugin may
apply the Idle condition (docs/telemetry.md) to its driver's devices of claims allocated on its own node, and
nothing else in a claim's status. Denials come from the status strategy's field checks, so they are 422
(``status.devices: Forbidden``), not 403.

Kubernetes v1.37.2 (pkg/registry/resource/utils.go:150, ``AuthorizedForDeviceStatus``): a change to
``status.devices`` needs ``resourceclaims/driver`` with ``associated-node:patch`` (a token bound to a pod on the
claim's node) or ``arbitrary-node:patch``; the chart grants only the first, for its driver name.
"""

from __future__ import annotations

import contextlib
import uuid
from typing import Any

import gen_manifests
import pytest
import yaml
from testkit.handle import ClusterHandle, wait_for

from topodra.apipaths import claim_path, node_path
from topodra.kube import KubeError
from topodra.telemetry.claimstatus import FIELD_MANAGER, condition, status_apply
from topodra.telemetry.reclaim import LABEL, eviction

DRIVER = "gpu.topodra.io"
APPLY = "application/apply-patch+yaml"
R = "/apis/resource.k8s.io/v1"


def allocated_claim(nc: ClusterHandle, ns: str, name: str, node: str) -> str:
    """A claim allocated to ``node`` (written by the admin, as the scheduler would); its UID."""
    created = nc.kube.create(f"{R}/namespaces/{ns}/resourceclaims", {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {"deviceClassName": DRIVER, "count": 1}}]}}})
    nc.kube.request("PATCH", claim_path(ns, name) + "/status", {"status": {"allocation": {
        "devices": {"results": [{"request": "gpus", "driver": DRIVER, "pool": node, "device": "gpu-0"}]},
        "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": [node]}]}]}}}},
        content_type="application/merge-patch+json")
    return str(created["metadata"]["uid"])


def apply(nc: ClusterHandle, token: str, ns: str, name: str, uid: str, pool: str) -> tuple[int, dict[str, Any]]:
    body = status_apply(ns, name, uid, DRIVER, [(pool, "gpu-0", None)], condition(True, 0.0, "idle"))
    return nc.as_token(token, "PATCH", f"{claim_path(ns, name)}/status?fieldManager={FIELD_MANAGER}&force=true",
                       body, APPLY)


@pytest.mark.cluster
def test_plugin_writes_the_idle_condition_only_on_its_own_nodes_claims(cluster: ClusterHandle) -> None:
    nc = cluster
    ns = nc.namespace("telrbac")
    sa = f"tel-plugin-{uuid.uuid4().hex[:6]}"
    here, there = f"tel-a-{uuid.uuid4().hex[:5]}", f"tel-b-{uuid.uuid4().hex[:5]}"
    text = gen_manifests.render([f"serviceAccounts.plugin={sa}", "controller.enabled=false"], namespace=ns)
    objs = [o for o, _ in gen_manifests.split(text)
            if o["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding")
            and o["metadata"]["name"] == sa]  # fmt: skip
    assert len(objs) == 3
    nc.kubectl("apply", "-n", ns, "-f", "-", input="\n---\n".join(yaml.safe_dump(o) for o in objs))
    try:
        nc.fake_nodes([here, there])
        bound = nc.pod_bound_token(ns, sa, here)
        mine = allocated_claim(nc, ns, "mine", here)
        theirs = allocated_claim(nc, ns, "theirs", there)

        def applied() -> dict[str, Any] | None:  # RBAC of a new binding reaches the authorizer asynchronously
            code, body = apply(nc, bound, ns, "mine", mine, here)
            if code == 403 and "resourceclaims/status" in body.get("message", ""):
                return None
            assert code == 200, (code, body.get("message"))
            return body
        wait_for(applied, 30, "the plugin's apply of the Idle condition on its own node's claim")
        claim = nc.kube.get(claim_path(ns, "mine")) or {}
        (dev,) = claim["status"]["devices"]
        assert (dev["driver"], dev["pool"], dev["device"]) == (DRIVER, here, "gpu-0")
        assert [(c["type"], c["status"], c["reason"]) for c in dev["conditions"]] == [("Idle", "True",
                                                                                       "BelowThresholds")]
        assert claim["status"]["allocation"]["devices"]["results"][0]["pool"] == here  # untouched

        # A claim of another node: the strategy's field check answers 422 (status.devices: Forbidden), naming the
        # arbitrary-node verb the plugin lacks.
        code, body = apply(nc, bound, ns, "theirs", theirs, there)
        assert code == 422 and "changing status.devices requires" in body["message"], (code, body.get("message"))
        assert "arbitrary-node:patch" in body["message"] and '"resourceclaims/driver"' in body["message"]
        assert not (nc.kube.get(claim_path(ns, "theirs")) or {}).get("status", {}).get("devices")

        code, body = nc.as_token(bound, "PATCH", f"{claim_path(ns, 'mine')}/status?fieldManager={FIELD_MANAGER}",
                                 {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                                  "metadata": {"name": "mine"}, "status": {"reservedFor": [
                                      {"resource": "pods", "name": "x", "uid": str(uuid.uuid4())}]}}, APPLY)
        assert code == 422 and "status.reservedFor" in body["message"] and "binding" in body["message"], \
            (code, body.get("message"))
    finally:
        for o in objs:
            if o["kind"].startswith("Cluster"):
                nc.kubectl("delete", o["kind"].lower(), o["metadata"]["name"], "--ignore-not-found", check=False)
        nc.kube.request("DELETE", f"/api/v1/namespaces/{ns}/pods/plugin", {"gracePeriodSeconds": 0})
        for n in (here, there):
            nc.kube.delete(node_path(n))
        nc.kube.delete(f"/api/v1/namespaces/{ns}")


def plugin_rbac(ns: str, sa: str, *values: str) -> list[dict[str, Any]]:
    text = gen_manifests.render([f"serviceAccounts.plugin={sa}", "controller.enabled=false", *values], namespace=ns)
    return [o for o, _ in gen_manifests.split(text)
            if o["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding")
            and o["metadata"]["name"] == sa]  # fmt: skip


@pytest.mark.cluster
def test_plugin_may_read_namespaces_and_evict_but_not_delete_pods(cluster: ClusterHandle) -> None:
    """Opt-in reclaim's RBAC (docs/telemetry.md "Opt-in reclaim"): the plugin's token reads a namespace and
    evicts a pod through the Eviction API (so PDBs hold); it may neither delete a pod nor label a namespace (opt in
    by itself). With plugin.telemetry.idleReclaim=false the chart grants neither."""
    nc = cluster
    ns = nc.namespace("rcrbac")
    sa = f"rc-plugin-{uuid.uuid4().hex[:6]}"
    node = f"rc-{uuid.uuid4().hex[:5]}"
    objs = plugin_rbac(ns, sa)
    assert len(objs) == 3
    nc.kubectl("apply", "-n", ns, "-f", "-", input="\n---\n".join(yaml.safe_dump(o) for o in objs))
    try:
        nc.fake_nodes([node])
        token = nc.pod_bound_token(ns, sa, node)
        for victim in ("v1", "v2"):
            nc.kube.create(f"/api/v1/namespaces/{ns}/pods", {
                "apiVersion": "v1", "kind": "Pod", "metadata": {"name": victim},
                "spec": {"nodeName": node, "automountServiceAccountToken": False, "containers": [
                    {"name": "c", "image": "localhost/busybox:1.35", "imagePullPolicy": "Never"}]}})

        def read_namespace() -> dict[str, Any] | None:  # RBAC of a new binding reaches the authorizer asynchronously
            code, body = nc.as_token(token, "GET", f"/api/v1/namespaces/{ns}", None)
            if code == 403:
                return None
            assert code == 200, (code, body.get("message"))
            return body
        assert wait_for(read_namespace, 30, "the plugin's read of a namespace")["metadata"]["name"] == ns

        code, body = nc.as_token(token, "DELETE", f"/api/v1/namespaces/{ns}/pods/v1", None)
        assert code == 403 and "cannot delete resource \"pods\"" in body["message"], (code, body.get("message"))
        code, body = nc.as_token(token, "PATCH", f"/api/v1/namespaces/{ns}",
                                 {"metadata": {"labels": {LABEL: "enabled"}}}, "application/merge-patch+json")
        assert code == 403, (code, body.get("message"))
        code, body = nc.as_token(token, "POST", f"/api/v1/namespaces/{ns}/pods/v2/eviction", eviction(ns, "v2"))
        assert code == 201, (code, body.get("message"))
        gone = nc.kube.get(f"/api/v1/namespaces/{ns}/pods/v2")
        assert gone is None or gone["metadata"].get("deletionTimestamp"), gone
        assert (nc.kube.get(f"/api/v1/namespaces/{ns}/pods/v1") or {}).get("metadata", {}).get(
            "deletionTimestamp") is None

        (role,) = [o for o in plugin_rbac(ns, sa, "plugin.telemetry.idleReclaim=false") if o["kind"] == "ClusterRole"]
        granted = {r for rule in role["rules"] for r in rule["resources"]}
        assert "pods/eviction" not in granted and "namespaces" not in granted, granted
        assert "resourceclaims/status" in granted  # the Idle condition stays
    finally:
        for o in objs:
            if o["kind"].startswith("Cluster"):
                nc.kubectl("delete", o["kind"].lower(), o["metadata"]["name"], "--ignore-not-found", check=False)
        for p in ("plugin", "v1", "v2"):
            with contextlib.suppress(KubeError):  # v2 may be gone already
                nc.kube.request("DELETE", f"/api/v1/namespaces/{ns}/pods/{p}", {"gracePeriodSeconds": 0})
        nc.kube.delete(node_path(node))
        nc.kube.delete(f"/api/v1/namespaces/{ns}")
