"""Issue 13, part 1: DRA-backed extended resources (KEP-5004) on topodra's DeviceClasses.

A pod that asks ``gpu.topodra.io/gpu: 2`` (or ``gpu.topodra.io/h100: 3``) as an ordinary resource gets
real DRA devices: the real kube-scheduler creates a ResourceClaim for it and allocates devices of the
class that names the resource.  Proven here on simulated nodes (allocation, model pinning, ResourceQuota,
the device-plugin rule) and on the real node, where our kubelet plugin prepares the claim and the
container sees exactly what a claim-template pod sees.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import REPO, ClusterHandle, wait_for
from pluginproc import CDI_ROOT, DRIVER, PluginProcess
from test_scheduling_topology import Scenario, one, scenario_maker

from topodra import classcatalog as dc
from topodra.apipaths import claim_path, node_path, pod_path
from topodra.kube import Kube, KubeError

Obj = dict[str, Any]
GPU = "gpu.topodra.io/gpu"
LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
QUALIFIED = re.compile(rf"^{LABEL}(\.{LABEL})+/{LABEL}$")


# --- the catalog ---------------------------------------------------------------------------------

def test_generic_and_model_classes_name_an_extended_resource() -> None:
    objs = {o["metadata"]["name"]: o for o in (dc.to_device_class(s) for s in dc.catalog())}
    names = {n: o["spec"].get("extendedResourceName") for n, o in objs.items()}
    assert names["gpu.topodra.io"] == GPU
    assert names["gpu-h200"] == "gpu.topodra.io/h200"
    assert names["gpu-a100-80gb"] == "gpu.topodra.io/a100-80gb"
    kinds = {s.name: s.kind for s in dc.catalog()}
    for name, ext in names.items():
        if kinds[name] in ("generic", "model"):
            # A domain-qualified name outside kubernetes.io: what the API accepts for extended resources.
            assert ext and QUALIFIED.match(ext) and "kubernetes.io" not in ext, (name, ext)
        else:
            assert ext is None, (name, ext)
    named = [e for e in names.values() if e]
    assert len(named) == len(set(named)), "two classes must never claim one extended resource"


def test_classes_for_unknown_models_get_a_name_too() -> None:
    objs = dc.classes_for_models(["RTX-PRO-6000"])
    ext = {o["metadata"]["name"]: o["spec"].get("extendedResourceName") for o in objs}
    assert ext["gpu-model-rtx-pro-6000"] == "gpu.topodra.io/model-rtx-pro-6000"
    assert ext["gpu.topodra.io"] == GPU


def test_committed_classes_carry_the_names() -> None:
    for path in sorted((REPO / "deviceclasses").glob("*.yaml")):
        obj = yaml.safe_load(path.read_text())
        kind = obj["metadata"]["labels"]["topodra.io/class-kind"]
        assert ("extendedResourceName" in obj["spec"]) == (kind in ("generic", "model")), path.name


def test_admin_guide_lists_every_name() -> None:
    guide = (REPO / "docs" / "admin-guide.md").read_text()
    for s in dc.catalog():
        ext = dc.extended_resource_name(s)
        if ext:
            assert f"`{ext}`" in guide, ext


# --- simulated nodes, real scheduler ------------------------------------------------------------

def ext_pod(name: str, resources: dict[str, int], nodes: list[str], *, node_label: str = "kubernetes.io/hostname",
            script: str = "true", host_network: bool = False) -> Obj:
    """A pod asking for extended resources (requests == limits), allowed only on ``nodes``."""
    qty = {k: str(v) for k, v in resources.items()}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1, "hostNetwork": host_network,
                     "automountServiceAccountToken": False,
                     "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                         "nodeSelectorTerms": [{"matchExpressions": [
                             {"key": node_label, "operator": "In", "values": sorted(nodes)}]}]}}},
                     "containers": [{"name": "main", "image": "localhost/busybox:1.35", "imagePullPolicy": "Never",
                                     "command": ["sh", "-c", script],
                                     "resources": {"requests": qty, "limits": qty}}]}}


def ext_claim(kube: Kube, ns: str, pod_name: str) -> Obj | None:
    """The claim the scheduler made for the pod's extended resources, once allocated."""
    pod = kube.get(pod_path(ns, pod_name)) or {}
    st = (pod.get("status") or {}).get("extendedResourceClaimStatus") or {}
    name = st.get("resourceClaimName")
    claim = kube.get(claim_path(ns, name)) if name else None
    if claim and (claim.get("status") or {}).get("allocation") and pod["spec"].get("nodeName"):
        return claim
    return None


def wait_ext_allocated(s: Scenario, pod_name: str, timeout: float = 60) -> tuple[str, Obj, list[Obj]]:
    """(node, claim, attributes of allocated devices) for an extended-resource pod."""
    claim: Obj = wait_for(lambda: ext_claim(s.kube, s.ns, pod_name), timeout,
                          f"extended-resource claim of {pod_name} allocated")
    node = s.get_pod(pod_name)["spec"]["nodeName"]
    return node, claim, s.devices(claim["status"]["allocation"]["devices"]["results"])


@pytest.fixture
def scenarios(cluster: ClusterHandle) -> Iterator[Callable[..., Scenario]]:
    yield from scenario_maker(cluster)


@pytest.mark.cluster
def test_pod_asking_two_gpus_gets_two_dra_devices(scenarios: Callable[..., Scenario]) -> None:
    s = scenarios([("h200", "dgx-h200", 1), ("h100", "dgx-h100", 1)], "ext")
    s.create(ext_pod("any", {GPU: 2}, s.nodes()))
    node, claim, devs = wait_ext_allocated(s, "any")
    assert len(devs) == 2 and {d["_pool"] for d in devs} == {node}
    assert {d["type"] for d in devs} == {"gpu"}
    # The scheduler's claim: annotated as an extended-resource claim, owned by the pod, class of the name.
    assert claim["metadata"]["annotations"].get("resource.kubernetes.io/extended-resource-claim") == "true"
    assert [r["kind"] for r in claim["metadata"]["ownerReferences"]] == ["Pod"]
    reqs = claim["spec"]["devices"]["requests"]
    assert [(r["exactly"]["deviceClassName"], r["exactly"]["count"]) for r in reqs] == [("gpu.topodra.io", 2)]
    mappings = s.get_pod("any")["status"]["extendedResourceClaimStatus"]["requestMappings"]
    assert [(m["containerName"], m["resourceName"]) for m in mappings] == [("main", GPU)]

    # A per-model name pins the model: 3 H100s land on the H100 node, even with the H200 node free.
    s.create(ext_pod("h100", {"gpu.topodra.io/h100": 3}, s.nodes()))
    node, _claim, devs = wait_ext_allocated(s, "h100")
    assert node in s.nodes("h100") and len(devs) == 3
    assert one(d["model"] for d in devs) == "H100-SXM5-80GB"

    # More than any node has left stays Pending: 8 - 3 - (2 if "any" took H100s) < 6 on the H100 node.
    s.create(ext_pod("too-many", {"gpu.topodra.io/h100": 6}, s.nodes()))
    msg = wait_for(lambda: next((c.get("message") for c in s.conditions("too-many")
                                 if c.get("type") == "PodScheduled" and c.get("reason") == "Unschedulable"), None),
                   60, "too-many Unschedulable")
    assert not s.get_pod("too-many")["spec"].get("nodeName"), msg


@pytest.mark.cluster
def test_resource_quota_on_the_extended_resource(scenarios: Callable[..., Scenario]) -> None:
    """``requests.gpu.topodra.io/gpu`` limits extended-resource pods and claims of the class alike."""
    s = scenarios([("h100", "dgx-h100", 1)], "extq")
    s.create({"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "gpus"},
              "spec": {"hard": {f"requests.{GPU}": "3"}}})

    def used() -> str | None:
        q = s.kube.get(f"/api/v1/namespaces/{s.ns}/resourcequotas/gpus") or {}
        return str(((q.get("status") or {}).get("used") or {}).get(f"requests.{GPU}")) \
            if (q.get("status") or {}).get("hard") else None

    wait_for(lambda: used() == "0", 30, "quota status computed")
    s.create(ext_pod("a", {GPU: 2}, s.nodes()))
    wait_ext_allocated(s, "a")
    with pytest.raises(KubeError) as err:
        s.create(ext_pod("b", {GPU: 2}, s.nodes()))
    assert err.value.status == 403 and "exceeded quota" in str(err.value), err.value

    # A claim of the same class counts toward the same name: 1 more fits, then the next claim is refused.
    s.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": "one"},
              "spec": {"spec": {"devices": {"requests": [
                  {"name": "gpus", "exactly": {"deviceClassName": "gpu.topodra.io", "count": 1}}]}}}})
    s.pod("c", "one", s.nodes())
    s.wait_allocated("c")
    wait_for(lambda: used() == "3", 30, "quota used = 2 (extended) + 1 (claim)")
    with pytest.raises(KubeError) as err:
        s.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "d"},
                  "spec": {"devices": {"requests": [
                      {"name": "gpus", "exactly": {"deviceClassName": "gpu.topodra.io", "count": 1}}]}}})
    assert err.value.status == 403 and "exceeded quota" in str(err.value), err.value


@pytest.mark.cluster
def test_device_plugin_resource_on_a_node_wins_over_dra(scenarios: Callable[..., Scenario]) -> None:
    """A node that advertises the name in allocatable (a device plugin) serves it from there, not from DRA.

    The stand-in: the node's status says ``gpu.topodra.io/gpu: 8`` as a device plugin would.  The
    scheduler then charges the node's allocatable and makes no claim, so the GPUs our driver publishes
    on that node are a second, separate pool: the double-count the admin guide's rule forbids.
    """
    s = scenarios([("dp", "dgx-h100", 1)], "extdp")
    node = s.nodes("dp")[0]
    s.kube.request("PATCH", node_path(node) + "/status",
                   {"status": {"capacity": {GPU: "8"}, "allocatable": {GPU: "8"}}},
                   content_type="application/merge-patch+json")
    # The scheduler learns of the new allocatable from its Node informer, which may lag under load; a pod
    # it places meanwhile gets DRA devices because the node did not advertise the name yet. Such a pod
    # proves only the lag: it is removed (with the claim the scheduler made for it) and the next one asked.
    deadline = time.monotonic() + 60
    for attempt in range(1000):
        name = f"dp-{attempt}"
        s.create(ext_pod(name, {GPU: 2}, [node]))
        wait_for(lambda n=name: s.get_pod(n)["spec"].get("nodeName") == node,  # type: ignore[misc]
                 max(1.0, deadline - time.monotonic()), f"pod {name} bound to the device-plugin node")
        st = s.get_pod(name).get("status") or {}
        if not st.get("extendedResourceClaimStatus"):
            break
        assert time.monotonic() < deadline, f"the scheduler still makes DRA claims on {node}: {st}"
        s.kube.request("DELETE", pod_path(s.ns, name),
                       {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0})
        wait_for(lambda: not list(s.kube.list(claim_path(s.ns))), 60, f"the claim of {name} gone with it")
    assert not [c for c in s.kube.list(claim_path(s.ns))], "no DRA claim for a device-plugin node"
    # ...while a claim on the same node still gets DRA devices: both pools hand out the same GPUs.
    s.hold_first_gpu(node, "claim-pod")


# --- the real node: our plugin prepares the scheduler's claim ----------------------------------------

@pytest.fixture(scope="module")
def ext_plugin(node_cluster: ClusterHandle, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PluginProcess]:
    boot = tmp_path_factory.mktemp("boot") / "boot_id"
    boot.write_text(Path("/proc/sys/kernel/random/boot_id").read_text())
    hw = tmp_path_factory.mktemp("hw") / "hardware.yaml"
    hw.write_text("{}\n")
    node_cluster.apply_yaml(REPO / "deviceclasses/gpu.topodra.io.yaml")
    p = PluginProcess(node_cluster.kubeconfig, node_cluster.node_name, node_cluster.lc.logs / "topodra-plugin-ext.log",
                      extra_env={"TOPODRA_BOOT_ID_FILE": str(boot), "TOPODRA_HARDWARE_CONFIG": str(hw)})
    p.start()
    yield p
    p.stop()


def _env(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


@pytest.mark.node
def test_real_node_prepares_extended_resource_like_a_claim(node_cluster: ClusterHandle,
                                                           ext_plugin: PluginProcess) -> None:
    nc = node_cluster
    ns = nc.namespace("extnode")
    on_node = [nc.node_name]
    script = "env | sort; sleep 2"
    nc.kube.create(f"/api/v1/namespaces/{ns}/pods", ext_pod("ext", {GPU: 2}, on_node, script=script, host_network=True))
    nc.kube.create(f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaimtemplates", {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": "two"},
        "spec": {"spec": {"devices": {"requests": [
            {"name": "gpus", "exactly": {"deviceClassName": DRIVER, "count": 2}}]}}}})
    claim_pod = ext_pod("claim", {}, on_node, script=script, host_network=True)
    claim_pod["spec"]["resourceClaims"] = [{"name": "gpus", "resourceClaimTemplateName": "two"}]
    claim_pod["spec"]["containers"][0]["resources"] = {"claims": [{"name": "gpus"}]}
    nc.kube.create(f"/api/v1/namespaces/{ns}/pods", claim_pod)

    claim = wait_for(lambda: ext_claim(nc.kube, ns, "ext"), 90, "extended-resource claim allocated")
    spec = CDI_ROOT / f"k8s.gpu.topodra.io-claim_{claim['metadata']['uid']}.json"
    wait_for(lambda: spec.exists(), 60, "our plugin wrote the CDI spec of the scheduler's claim")

    def finished(name: str) -> bool:
        phase = ((nc.kube.get(pod_path(ns, name)) or {}).get("status") or {}).get("phase")
        if phase == "Failed":
            raise AssertionError(nc.kubectl("describe", "pod", "-n", ns, name, check=False))
        return phase == "Succeeded"

    for name in ("ext", "claim"):
        wait_for(lambda n=name: finished(n), 90, f"pod {name} Succeeded")  # type: ignore[misc]
    devs = sorted(r["device"] for r in claim["status"]["allocation"]["devices"]["results"])
    env_ext = _env(nc.kubectl("logs", "-n", ns, "ext"))
    env_claim = _env(nc.kubectl("logs", "-n", ns, "claim"))
    assert sorted(env_ext["TOPODRA_VISIBLE_DEVICES"].split(",")) == devs and len(devs) == 2
    # Same variables, same shape: only the device names differ (the two pods hold different GPUs).
    def shape(env: dict[str, str]) -> list[str]:
        return sorted(re.sub(r"GPU_\d+", "GPU_N", k) for k in env if k.startswith(("TOPODRA_", "NVIDIA_")))

    assert shape(env_ext) == shape(env_claim) and "NVIDIA_VISIBLE_DEVICES" in env_ext
    theirs = env_claim["TOPODRA_VISIBLE_DEVICES"].split(",")
    assert set(env_ext["TOPODRA_VISIBLE_DEVICES"].split(",")).isdisjoint(theirs)
    nc.kube.request("DELETE", pod_path(ns), {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 1})
    wait_for(lambda: not spec.exists(), 90, "CDI spec removed after the pod is gone (unprepared)")
    nc.kube.delete(f"/api/v1/namespaces/{ns}")
