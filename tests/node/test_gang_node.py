"""Issue 20 on the real node: one pod of a 4-pod gang runs on the real kubelet, prepared by topodra's plugin.

The plugin runs as a host process on the real node (mock dgx-h100, as in test_plugin_e2e.py); three simulated
DGX H100 nodes hold the siblings.  The real controller renders the profile (``pods: 4``, one domain of a label
of the test's own, since a level may be any node label key); kube-scheduler (gates on) places the gang as one
unit; the kubelet calls our plugin's NodePrepareResources for the local pod and containerd injects its CDI
edits, which the container prints.
"""

from __future__ import annotations

import contextlib
import functools
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_plugin_e2e import env_of, pod_claim, wait_phase
from testkit.controllerproc import controller_process
from testkit.handle import ClusterHandle, wait_for
from testkit.paths import REPO
from testkit.pluginproc import CDI_ROOT, PluginProcess

from topodra.apipaths import node_path, profile_path
from topodra.controller.gang import podgroup_path
from topodra.simulate import SimulatedCluster, Simulation

pytestmark = pytest.mark.node

DOMAIN = "gang-test.topodra.io/domain"  # a label of this test's own: no labeler owns it


@pytest.fixture(scope="module")
def gang_plugin(workload_node_cluster: ClusterHandle, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[PluginProcess]:
    nc = workload_node_cluster
    for f in CDI_ROOT.glob("k8s.gpu.topodra.io-claim_*.json"):
        f.unlink()
    nc.install_claimprofile_crd()
    nc.apply_yaml(REPO / "deviceclasses")
    boot = tmp_path_factory.mktemp("boot") / "boot_id"
    boot.write_text(Path("/proc/sys/kernel/random/boot_id").read_text())
    hw = tmp_path_factory.mktemp("hw") / "hardware.yaml"
    hw.write_text("{}\n")
    p = PluginProcess(nc.kubeconfig, nc.node_name, nc.lc.logs / "topodra-plugin-gang.log",
                      extra_env={"TOPODRA_BOOT_ID_FILE": str(boot), "TOPODRA_HARDWARE_CONFIG": str(hw)})
    p.start()
    yield p
    p.stop()


@contextlib.contextmanager
def controller(nc: ClusterHandle, ns: str) -> Iterator[None]:
    with controller_process(nc.kubeconfig, ns, "gang-node", nc.lc.logs / f"topodra-controller-{ns}.log"):
        yield


def test_local_gang_pod_is_prepared_by_our_plugin(workload_node_cluster: ClusterHandle,
                                                  gang_plugin: PluginProcess) -> None:
    nc = workload_node_cluster
    run = uuid.uuid4().hex[:5]
    value = f"d-{run}"
    sims = [f"g{run}-h100-{i}" for i in range(3)]
    sim = Simulation(nc.kube, SimulatedCluster.model_validate({"groups": [
        {"namePrefix": f"g{run}-h100-", "count": 3, "profile": "dgx-h100", "labels": {DOMAIN: value}}]}))
    ns = nc.namespace("gangnode")
    nc.kube.merge_patch(node_path(nc.node_name), {"metadata": {"labels": {DOMAIN: value}}})
    try:
        sim.setup()
        assert sim.reconcile_all() == 3
        with controller(nc, ns):
            nc.kube.create(profile_path(ns), {
                "apiVersion": "topodra.io/v1alpha1", "kind": "ClaimProfile", "metadata": {"name": "train"},
                "spec": {"alternatives": [{"deviceClassName": "gpu-h100", "count": 8}],
                         "topology": {"nvlink": "Required"}, "pods": 4, "acrossNodes": {"sameDomain": [DOMAIN]}}})

            def rendered() -> bool:
                g = ((nc.kube.get(profile_path(ns, "train")) or {}).get("status") or {}).get("gang") or {}
                return bool(g.get("fitsNow")) and nc.kube.get(podgroup_path(ns, "train")) is not None
            wait_for(rendered, 60, "the controller to render the gang (4 nodes of the domain free)")
            pods = {"train-local": [nc.node_name], **{f"train-sim-{i}": [n] for i, n in enumerate(sims)}}
            for name, nodes in pods.items():
                nc.kube.create(f"/api/v1/namespaces/{ns}/pods", {
                    "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
                    "spec": {"hostNetwork": True, "restartPolicy": "Never", "automountServiceAccountToken": False,
                             "terminationGracePeriodSeconds": 1, "schedulingGroup": {"podGroupName": "train"},
                             "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": "train"}],
                             "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                                 "nodeSelectorTerms": [{"matchExpressions": [
                                     {"key": "kubernetes.io/hostname", "operator": "In", "values": nodes}]}]}}},
                             "containers": [{"name": "c", "image": "localhost/busybox:1.35",
                                             "imagePullPolicy": "Never", "command": ["sh", "-c", "env; sleep 2"],
                                             "resources": {"claims": [{"name": "gpus"}]}}]}})
            claim = pod_claim(nc, ns, "train-local")
            results = claim["status"]["allocation"]["devices"]["results"]
            assert {r["pool"] for r in results} == {nc.node_name} and len(results) == 8
            def node_of(name: str) -> str | None:
                got = (nc.kube.get(f"/api/v1/namespaces/{ns}/pods/{name}") or {}).get("spec", {}).get("nodeName")
                return str(got) if got else None

            for name, nodes in pods.items():
                bound = wait_for(functools.partial(node_of, name), 60, f"gang pod {name} bound")
                assert [bound] == nodes
            wait_phase(nc, ns, "train-local", "Succeeded")
            env = env_of(nc.kubectl("logs", "-n", ns, "train-local"))
            assert sorted(env["TOPODRA_VISIBLE_DEVICES"].split(",")) == sorted(r["device"] for r in results)
            assert env.get("NVIDIA_VISIBLE_DEVICES") == "void"
            pg = nc.kube.get(podgroup_path(ns, "train")) or {}
            conds = {c["type"]: c for c in (pg.get("status") or {}).get("conditions") or []}
            assert conds["PodGroupInitiallyScheduled"]["status"] == "True", conds
    finally:
        nc.kube.request("DELETE", f"/api/v1/namespaces/{ns}/pods",
                        {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0})
        nc.kube.delete(f"/api/v1/namespaces/{ns}")
        nc.kube.request("PATCH", node_path(nc.node_name), {"metadata": {"labels": {DOMAIN: None}}},
                        content_type="application/merge-patch+json")
        sim.delete()
