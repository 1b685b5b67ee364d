"""The Helm chart deploy/helm/topodra: lint, render, schema, one source with deploy/, and the real apiserver.

In the cluster tier as a whole: every test runs the pinned helm binary (hack/build-bins).

Rendered objects go through server-side dry-run on the real apiserver; the ValidatingAdmissionPolicy is
installed for real and exercised with a real pod-bound ServiceAccount token.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import uuid
from typing import Any

import gen_manifests
import pytest
import yaml
from testkit.handle import ClusterHandle, wait_for
from testkit.paths import REPO

from topodra.apipaths import slices_path
from topodra.controller import main as controller_main
from topodra.plugin import config as plugin_config

CHART = REPO / "deploy" / "helm" / "topodra"
Obj = dict[str, Any]


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(gen_manifests.helm()), *args], capture_output=True, text=True, timeout=120,
                          check=False)


def render(*values: str, namespace: str = "topodra-system") -> list[Obj]:
    return [o for o, _ in gen_manifests.split(gen_manifests.render(list(values), namespace=namespace))]


def only(objs: list[Obj], kind: str) -> Obj:
    found = [o for o in objs if o["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind}"
    return found[0]


def container(objs: list[Obj], kind: str) -> Obj:
    (c,) = only(objs, kind)["spec"]["template"]["spec"]["containers"]
    return dict(c)


def env_of(c: Obj) -> dict[str, Obj]:
    return {e["name"]: e for e in c.get("env", [])}


# --------------------------------------------------------------------------- without a cluster


def test_helm_lint_is_clean() -> None:
    r = helm("lint", "--strict", str(CHART))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 chart(s) failed" in r.stdout


def test_deploy_manifests_are_generated_from_the_chart() -> None:
    """deploy/{plugin,controller,rbac,admission} equal the chart's defaults: one source."""
    assert gen_manifests.main(["--check"]) == 0, "run hack/gen-manifests"


@pytest.mark.parametrize(("setting", "message"), [
    ("plugin.hardware=cuda", "/plugin/hardware"),
    ("plugin.healthPort=70000", "/plugin/healthPort"),
    ("logLevel=LOUD", "/logLevel"),
    ("deviceClasses.gpu-x100=false", "gpu-x100"),
    ("plugin.nvidiaDriverRoot=relative/path", "/plugin/nvidiaDriverRoot"),
    ("controller.replica=2", "replica"),
])
def test_bad_values_fail_with_a_clear_message(setting: str, message: str) -> None:
    r = helm("template", "t", str(CHART), "--set", setting)
    assert r.returncode != 0
    assert "values don't meet the specifications of the schema" in r.stderr and message in r.stderr, r.stderr


def test_mock_hardware_renders_the_plugin_without_host_hardware_mounts() -> None:
    objs = render("plugin.hardware=mock:dgx-h100", "logLevel=DEBUG")
    c = container(objs, "DaemonSet")
    env = env_of(c)
    assert env["TOPODRA_HARDWARE"]["value"] == "mock:dgx-h100"
    assert not {"TOPODRA_SYSFS_ROOT", "NVIDIA_VISIBLE_DEVICES", "LD_LIBRARY_PATH"} & env.keys()
    assert {m["mountPath"] for m in c["volumeMounts"]} == {
        "/var/lib/kubelet/plugins", "/var/lib/kubelet/plugins_registry", "/var/run/cdi", "/etc/cdi"}
    assert c["command"] == ["topodra", "--log-level=DEBUG", "kubelet-plugin"]
    # Every TOPODRA_ variable is one the plugin reads, and the literal ones validate with its own code.
    flags = {f.env for f in plugin_config.FLAGS}
    assert {n for n in env if n.startswith("TOPODRA_")} <= flags
    literal = {n: e["value"] for n, e in env.items() if "value" in e}
    # What the kubelet fills in from the downward API (the MPS daemon pods' namespace: the plugin's own).
    downward = {n: "topodra-system" for n, e in env.items()
                if (e.get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath") == "metadata.namespace"}
    cfg = plugin_config.from_args(argparse.Namespace(), {**literal, **downward, "NODE_NAME": "n",
                                                         "TOPODRA_POD_UID": str(uuid.uuid4())})
    assert str(cfg.registry_dir) == "/var/lib/kubelet/plugins_registry"


def test_nvml_renders_driver_root_and_host_sys() -> None:
    c = container(render("plugin.nvidiaDriverRoot=/run/nvidia/driver"), "DaemonSet")
    ds_vols = {v["name"]: v for v in only(render("plugin.nvidiaDriverRoot=/run/nvidia/driver"),
                                          "DaemonSet")["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/driver-root"]["readOnly"] is True
    assert ds_vols[mounts["/driver-root"]["name"]]["hostPath"]["path"] == "/run/nvidia/driver"
    assert ds_vols[mounts["/host/sys"]["name"]]["hostPath"]["path"] == "/sys"
    assert "LD_LIBRARY_PATH" not in env_of(c)  # issue 19 finding 1: NVML is loaded by path from the driver root
    assert env_of(c)["TOPODRA_NVIDIA_DRIVER_ROOT"]["value"] == "/driver-root"
    assert env_of(c)["TOPODRA_NVIDIA_HOST_DRIVER_ROOT"]["value"] == "/run/nvidia/driver"  # CDI mount host paths


def test_controller_args_parse_and_api_server_override() -> None:
    objs = render("apiServer.host=127.0.0.1", "apiServer.port=6443", "controller.hostNetwork=true")
    c = container(objs, "Deployment")
    parser = argparse.ArgumentParser()
    controller_main.configure(parser)
    args = parser.parse_args([a.replace("$(POD_NAMESPACE)", "ns").replace("$(POD_NAME)", "p") for a in c["args"]])
    assert args.leader_elect and args.lease_namespace == "ns" and args.driver_name == "gpu.topodra.io"
    for kind in ("Deployment", "DaemonSet"):
        env = env_of(container(objs, kind))
        assert env["KUBERNETES_SERVICE_HOST"]["value"] == "127.0.0.1"
        assert env["KUBERNETES_SERVICE_PORT"]["value"] == "6443"
    spec = only(objs, "Deployment")["spec"]["template"]["spec"]
    assert spec["hostNetwork"] is True and spec["securityContext"]["runAsUser"] == 65532
    assert "KUBERNETES_SERVICE_HOST" not in env_of(container(render(), "DaemonSet"))


def test_device_classes_one_by_one() -> None:
    files = {p.stem for p in (REPO / "deviceclasses").glob("*.yaml")}
    names = {o["metadata"]["name"] for o in render() if o["kind"] == "DeviceClass"}
    assert names == files
    names = {o["metadata"]["name"] for o in render("deviceClasses.gpu-l4=false", "deviceClasses.gpu-b200=false")
             if o["kind"] == "DeviceClass"}
    assert names == files - {"gpu-l4", "gpu-b200"}
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert set(values["deviceClasses"]) == files == set(schema["properties"]["deviceClasses"]["propertyNames"]["enum"])


def test_toggles() -> None:
    kinds = [o["kind"] for o in render("metrics.service=true", "metrics.serviceMonitor=true")]
    assert "Service" in kinds and "ServiceMonitor" in kinds
    kinds = [o["kind"] for o in render("admissionPolicy.enabled=false", "priorityClass.create=false",
                                       "controller.enabled=false")]
    assert not {"ValidatingAdmissionPolicy", "PriorityClass", "Deployment"} & set(kinds)
    assert "DaemonSet" in kinds
    assert "priorityClassName" not in only(render("priorityClass.create=false"),
                                           "Deployment")["spec"]["template"]["spec"]


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
    assert len(objs) == 7  # + the own-node-labels policy and binding (tests/test_nodelabels_plugin.py)
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
