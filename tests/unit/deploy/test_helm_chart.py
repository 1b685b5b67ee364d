"""The Helm chart deploy/helm/topodra: lint, render, schema, one source with deploy/, and the real apiserver.

Rendered objects go through server-side dry-run on the real apiserver; the ValidatingAdmissionPolicy is
installed for real and exercised with a real pod-bound ServiceAccount token.
"""

from __future__ import annotations

import argparse
import json
import uuid
from typing import Any

import gen_manifests
import pytest
import yaml
from testkit.manifests import CHART, helm, only, render
from testkit.paths import REPO

from topodra.controller import main as controller_main
from topodra.plugin import config as plugin_config

Obj = dict[str, Any]


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
    cfg = plugin_config.from_args(argparse.Namespace(), {**literal, "NODE_NAME": "n",
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
    assert env_of(c)["LD_LIBRARY_PATH"]["value"].startswith("/driver-root/")


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
