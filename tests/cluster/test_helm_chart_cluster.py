"""The Helm chart deploy/helm/topodra: lint, render, schema, one source with deploy/, and the real apiserver.

Rendered objects go through server-side dry-run on the real apiserver; the ValidatingAdmissionPolicy is
installed for real and exercised with a real pod-bound ServiceAccount token.
"""

from __future__ import annotations

import uuid
from typing import Any

import gen_manifests
import pytest
import yaml
from testkit.handle import ClusterHandle, wait_for
from testkit.manifests import CHART, helm

from topodra.apipaths import slices_path

Obj = dict[str, Any]


# --------------------------------------------------------------------------- against the apiserver


@pytest.mark.cluster
def test_rendered_objects_pass_server_side_dry_run(cluster: ClusterHandle) -> None:
    ns = cluster.namespace("helm")
    try:
        r = helm("template", "t", str(CHART), "--namespace", ns, "--include-crds",
                 "--set", "metrics.service=true", "--set", "plugin.hardware=mock:dgx-h100")
        assert r.returncode == 0, r.stderr
        n = len([d for d in yaml.safe_load_all(r.stdout) if d])
        out = cluster.kubectl("apply", "--dry-run=server", "-n", ns, "-f", "-", input=r.stdout)
        assert out.count("(server dry run)") == n, out
        kinds = {d["kind"] for d in yaml.safe_load_all(r.stdout) if d}
        assert {"CustomResourceDefinition", "DaemonSet", "Deployment", "DeviceClass", "ValidatingAdmissionPolicy",
                "ValidatingAdmissionPolicyBinding", "PriorityClass", "Service", "ClusterRole"} <= kinds
    finally:
        cluster.kube.delete(f"/api/v1/namespaces/{ns}")


def _slice(name: str, node: str) -> Obj:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": name},
            "spec": {"driver": "gpu.topodra.io", "nodeName": node,
                     "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                     "devices": [{"name": "gpu-0"}]}}


@pytest.mark.cluster
def test_admission_policy_keeps_the_plugin_to_its_own_node(cluster: ClusterHandle) -> None:
    """Installs the chart's RBAC + policy for a throwaway ServiceAccount, then writes slices with a real
    pod-bound token (node-name extra) and with an unbound one."""
    nc = cluster
    ns = nc.namespace("vap")
    sa = f"vap-plugin-{uuid.uuid4().hex[:6]}"
    here, there = f"vap-a-{uuid.uuid4().hex[:5]}", f"vap-b-{uuid.uuid4().hex[:5]}"
    text = gen_manifests.render([f"serviceAccounts.plugin={sa}", "controller.enabled=false",
                                 "plugin.hardware=mock:dgx-h100"], namespace=ns)
    objs = [o for o, _ in gen_manifests.split(text)
            if o["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy",
                             "ValidatingAdmissionPolicyBinding")]
    assert len(objs) == 7  # + the own-node-labels policy and binding (tests/node/test_nodelabels_plugin_node.py)
    manifest = "\n---\n".join(yaml.safe_dump(o) for o in objs)
    nc.kubectl("apply", "-n", ns, "-f", "-", input=manifest)
    created: list[str] = []
    try:
        nc.fake_nodes([here, there])
        bound = nc.pod_bound_token(ns, sa, here)
        unbound = nc.kubectl("create", "token", sa, "-n", ns, "--duration=1h").strip()
        other = f"{there}-gpu.topodra.io-x"

        def denied() -> Obj | None:  # the apiserver loads new policies asynchronously
            code, body = nc.as_token(bound, "POST", slices_path(), _slice(other, there))
            if code == 201:
                created.append(other)
                nc.kube.delete(f"{slices_path()}/{other}")
                return None
            assert code == 403, (code, body.get("message"))
            return body
        body = wait_for(denied, 60, "the ValidatingAdmissionPolicy to deny another node's slice")
        print(f"\ndenial shown to the plugin writing node {there}'s slice from node {here}:\n  {body['message']}")
        assert f"on node '{here}' may only write ResourceSlices of that node, not of '{there}'" in body["message"]
        assert "ValidatingAdmissionPolicy" in body["message"]

        own = f"{here}-gpu.topodra.io-x"
        code, body = nc.as_token(bound, "POST", slices_path(), _slice(own, here))
        assert code == 201, body
        created.append(own)
        code, body = nc.as_token(bound, "DELETE", f"{slices_path()}/{own}", None)
        assert code == 200, body
        created.remove(own)

        code, body = nc.as_token(unbound, "POST", slices_path(), _slice(own, here))
        assert code == 403 and "no node association found" in body["message"], body
        # Admins are not affected.
        nc.kube.create(slices_path(), _slice(other, there))
        created.append(other)
        code, body = nc.as_token(bound, "DELETE", f"{slices_path()}/{other}", None)
        assert code == 403 and "may only write ResourceSlices of that node" in body["message"], body
    finally:
        for name in created:
            nc.kube.delete(f"{slices_path()}/{name}")
        for o in objs:
            if "namespace" not in o["metadata"]:
                nc.kubectl("delete", o["kind"].lower(), o["metadata"]["name"], "--ignore-not-found", check=False)
        nc.kube.request("DELETE", f"/api/v1/namespaces/{ns}/pods/plugin", {"gracePeriodSeconds": 0})
        for n in (here, there):
            nc.kube.delete(f"/api/v1/nodes/{n}")
        nc.kube.delete(f"/api/v1/namespaces/{ns}")
