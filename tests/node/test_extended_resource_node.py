"""Issue 13, part 1: DRA-backed extended resources (KEP-5004) on topodra's DeviceClasses.

A pod that asks ``gpu.topodra.io/gpu: 2`` (or ``gpu.topodra.io/h100: 3``) as an ordinary resource gets
real DRA devices: the real kube-scheduler creates a ResourceClaim for it and allocates devices of the
class that names the resource.  Proven here on simulated nodes (allocation, model pinning, ResourceQuota,
the device-plugin rule) and on the real node, where our kubelet plugin prepares the claim and the
container sees exactly what a claim-template pod sees.

Split by tier; the rest: tests/cluster/test_extended_resource_cluster.py,
tests/unit/deviceclasses/test_extended_resource.py.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from testkit.extres import ext_claim, ext_pod
from testkit.handle import ClusterHandle, wait_for
from testkit.paths import REPO
from testkit.pluginproc import CDI_ROOT, DRIVER, PluginProcess

from topodra.apipaths import pod_path

Obj = dict[str, Any]
GPU = "gpu.topodra.io/gpu"


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
