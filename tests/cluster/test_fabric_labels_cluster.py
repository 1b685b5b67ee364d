"""Fabric tiers as node labels on the real apiserver: ``topodra simulate`` of a small fabric file, a Node that
Topograph labelled first, the real ``NodeLabeler`` with a real pod-bound plugin token through the chart's
own-node admission policy (new keys allowed, a foreign key refused, Topograph's keys never touched), and the
plugin process (kubelet-less, private directories) taking the tiers from Topograph and --hardware-config.

Split by tier; the rest: tests/unit/nodelabels/test_fabric_labels.py, tests/unit/slices/test_fabric_cluster_files.py.
"""

from __future__ import annotations

import signal
import uuid
from pathlib import Path
from typing import Any

import gen_manifests
import pytest
import yaml
from testkit.handle import ClusterHandle, wait_for
from testkit.nodes import devices, label, labels_of
from testkit.pluginproc import PluginProcess

from topodra.apipaths import node_path
from topodra.kube import Kube, SimpleConfig, Urllib3Transport
from topodra.nodelabels import GPU_COUNT, LEAF_GROUP, SCALABLE_UNIT, SPINE_GROUP
from topodra.plugin.nodelabel import NodeLabeler
from topodra.simulate import Simulation, load_cluster

Obj = dict[str, Any]
MERGE = "application/merge-patch+json"
TOPOGRAPH = {"fabric.topograph.run/tier-0": "ib-leaf-17", "fabric.topograph.run/tier-1": "ib-spine-2",
             "fabric.topograph.run/tier-2": "ib-core-1", "accelerator.topograph.run/domain": "nvl-x"}


@pytest.mark.cluster
def test_simulate_labels_a_fabric_file_and_mirrors_a_topograph_labelled_node(cluster: ClusterHandle,
                                                                            tmp_path: Path) -> None:
    p = f"fab{uuid.uuid4().hex[:5]}-"
    f = tmp_path / "fabric.yaml"
    f.write_text(yaml.safe_dump({"apiVersion": "topodra.io/v1alpha1", "kind": "SimulatedCluster", "groups": [
        {"namePrefix": f"{p}a-", "count": 3, "profile": "dgx-h100",
         "fabric": {"scalableUnit": f"{p}su1", "leafGroupSize": 2, "spineGroup": f"{p}sg1"}},
        {"namePrefix": f"{p}b-", "count": 1, "profile": "dgx-h200",
         "fabric": {"scalableUnit": f"{p}su2", "leafGroup": f"{p}lone", "spineGroup": f"{p}sg1"}}]}))
    # Topograph ran before topodra on one node (v0.5 keys on another, one tier only).
    cluster.fake_nodes([f"{p}a-2"], {**TOPOGRAPH, "team": "t"})
    cluster.fake_nodes([f"{p}b-0"], {"network.topology.nvidia.com/spine": "old-spine"})
    sim = Simulation(cluster.kube, load_cluster(f))
    try:
        sim.setup()
        got = {n: labels_of(cluster, n) for n in (f"{p}a-0", f"{p}a-1", f"{p}a-2", f"{p}b-0")}
        tiers = {n: (v.get(LEAF_GROUP), v.get(SCALABLE_UNIT), v.get(SPINE_GROUP)) for n, v in got.items()}
        assert tiers == {f"{p}a-0": (f"{p}su1-leaf1", f"{p}su1", f"{p}sg1"),
                         f"{p}a-1": (f"{p}su1-leaf1", f"{p}su1", f"{p}sg1"),
                         f"{p}a-2": ("ib-leaf-17", "ib-spine-2", "ib-core-1"),
                         f"{p}b-0": (f"{p}lone", "old-spine", f"{p}sg1")}
        # Topograph's own labels are exactly as Topograph left them.
        assert {k: got[f"{p}a-2"].get(k) for k in TOPOGRAPH} == TOPOGRAPH and got[f"{p}a-2"]["team"] == "t"
        assert got[f"{p}b-0"]["network.topology.nvidia.com/spine"] == "old-spine"
        assert got[f"{p}a-0"][GPU_COUNT] == "8"  # discovery labels as before
        # Topograph moved a node; the next simulate pass mirrors the new tier and leaves Topograph's key be.
        cluster.kube.merge_patch(node_path(f"{p}a-2"), label("fabric.topograph.run/tier-0", "ib-leaf-18"))
        Simulation(cluster.kube, load_cluster(f)).setup()
        again = labels_of(cluster, f"{p}a-2")
        assert again[LEAF_GROUP] == "ib-leaf-18" and again["fabric.topograph.run/tier-0"] == "ib-leaf-18"
    finally:
        sim.delete()


@pytest.mark.cluster
def test_the_plugins_labeler_mirrors_topograph_through_the_own_node_policy(cluster: ClusterHandle) -> None:
    """The chart's RBAC + policies for a throwaway ServiceAccount; the real labeler with a pod-bound token."""
    nc = cluster
    ns = nc.namespace("fabp")
    sa = f"fabp-plugin-{uuid.uuid4().hex[:6]}"
    here, there = f"fabp-a-{uuid.uuid4().hex[:5]}", f"fabp-b-{uuid.uuid4().hex[:5]}"
    text = gen_manifests.render([f"serviceAccounts.plugin={sa}", "controller.enabled=false",
                                 "plugin.hardware=mock:dgx-h100"], namespace=ns)
    objs = [o for o, _ in gen_manifests.split(text)
            if o["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy",
                             "ValidatingAdmissionPolicyBinding")]
    nc.kubectl("apply", "-n", ns, "-f", "-", input="\n---\n".join(yaml.safe_dump(o) for o in objs))
    labeler: NodeLabeler | None = None
    kube: Kube | None = None
    try:
        nc.fake_nodes([here], {**TOPOGRAPH, "team": "a"})
        nc.fake_nodes([there])
        bound = nc.pod_bound_token(ns, sa, here)

        def denied() -> Obj | None:  # the apiserver loads new policies asynchronously
            code, body = nc.as_token(bound, "PATCH", node_path(there), label(LEAF_GROUP, "x"), MERGE)
            if code == 200:
                nc.kube.merge_patch(node_path(there), label(LEAF_GROUP, None))
                return None
            assert code == 403, (code, body.get("message"))
            return body
        wait_for(denied, 60, "the ValidatingAdmissionPolicy to deny labelling another node")

        # A foreign key, even one the plugin reads: refused (set, change, remove), and left as it was.
        for key, value in (("fabric.topograph.run/tier-0", "forged"), ("fabric.topograph.run/tier-0", None),
                           ("network.topology.nvidia.com/leaf", "forged")):
            code, body = nc.as_token(bound, "PATCH", node_path(here), label(key, value), MERGE)
            assert code == 403 and f"not: {key}" in body["message"], (key, value, code, body.get("message"))
        print(f"\ndenial shown to the plugin writing Topograph's key:\n  {body['message']}")
        assert {k: labels_of(nc, here).get(k) for k in TOPOGRAPH} == TOPOGRAPH

        kube = Kube(Urllib3Transport(SimpleConfig(server=nc.kube.host, ca_file=str(nc.lc.pki / "ca.crt"),
                                                  token=bound)))
        results: list[bool] = []
        labeler = NodeLabeler(kube, here, None, on_result=results.append, resync_seconds=0.5,
                              backoff_base=0.05, backoff_cap=0.2)
        labeler.devices_changed(devices())
        labeler.start()

        def synced(want: dict[str, str | None]) -> dict[str, str] | None:
            have = labels_of(nc, here)
            return have if all(have.get(k) == v for k, v in want.items()) else None

        # The new keys pass the policy: mirrored from Topograph's tiers with the plugin's own token.
        have = wait_for(lambda: synced({LEAF_GROUP: "ib-leaf-17", SCALABLE_UNIT: "ib-spine-2",
                                        SPINE_GROUP: "ib-core-1", GPU_COUNT: "8"}), 30, "mirrored tiers")
        assert {k: have.get(k) for k in TOPOGRAPH} == TOPOGRAPH and have["team"] == "a"
        wait_for(lambda: results and results[-1] is True, 30, "the labeler to record its success")
        # Topograph relabels the node (admin token: Topograph's own writer); the labeler's next resync follows.
        nc.kube.merge_patch(node_path(here), {"metadata": {"labels": {
            "fabric.topograph.run/tier-0": "ib-leaf-18", "fabric.topograph.run/tier-2": None}}})
        wait_for(lambda: synced({LEAF_GROUP: "ib-leaf-18", "fabric.topograph.run/tier-0": "ib-leaf-18"}), 30,
                 "the mirror following Topograph's new leaf")
        # Without a --hardware-config the last spine group stays (it could be a hand-set label); with one, the
        # file's value takes over from the tier Topograph no longer gives.
        assert labels_of(nc, here)[SPINE_GROUP] == "ib-core-1"
        labeler.topology_changed({"spine_group": "cfg-sg"})
        wait_for(lambda: synced({SPINE_GROUP: "cfg-sg", LEAF_GROUP: "ib-leaf-18"}), 30, "the config's spine group")
        final = labels_of(nc, here)
        assert "fabric.topograph.run/tier-2" not in final and final["fabric.topograph.run/tier-1"] == "ib-spine-2"
        assert False not in results, results  # no write of the labeler was ever denied
    finally:
        if labeler is not None:
            labeler.stop()
        if kube is not None:
            kube.close()
        for o in objs:
            if "namespace" not in o["metadata"]:
                nc.kubectl("delete", o["kind"].lower(), o["metadata"]["name"], "--ignore-not-found", check=False)
        nc.kube.request("DELETE", f"/api/v1/namespaces/{ns}/pods/plugin", {"gracePeriodSeconds": 0})
        for n in (here, there):
            nc.kube.delete(node_path(n))
        nc.kube.delete(f"/api/v1/namespaces/{ns}")


@pytest.mark.cluster
def test_the_plugin_process_takes_each_tier_from_topograph_else_its_hardware_config(cluster: ClusterHandle,
                                                                                    tmp_path: Path) -> None:
    """The whole path: --hardware-config parsed, SIGHUP re-read, the labeler; no kubelet needed for labels."""
    name = f"fabproc-{uuid.uuid4().hex[:6]}"
    topograph = {"fabric.topograph.run/tier-0": "ib-leaf-3", "network.topology.nvidia.com/core": "old-core"}
    cluster.fake_nodes([name], {**topograph, "team": "p"})
    hw = tmp_path / "hardware.yaml"
    hw.write_text("leafGroup: cfg-leaf\nscalableUnit: cfg-su\nspineGroup: cfg-sg\n")
    proc = PluginProcess(cluster.kubeconfig, name, tmp_path / "plugin.log", extra_env={
        "TOPODRA_HARDWARE_CONFIG": str(hw)}, plugin_dir=tmp_path / "plugin", registry_dir=tmp_path / "registry",
        cdi_root=tmp_path / "cdi", inherit_topodra_env=False)

    def synced(want: dict[str, str | None]) -> dict[str, str] | None:
        have = labels_of(cluster, name)
        return have if all(have.get(k) == v for k, v in want.items()) else None

    def sighup(text: str) -> None:
        hw.write_text(text)
        assert proc.proc is not None
        proc.proc.send_signal(signal.SIGHUP)

    try:
        proc.start(wait=False)
        # Per key: the leaf from Topograph v1.0, the unit from the config (Topograph gave none), the spine
        # group from Topograph v0.5's core.
        wait_for(lambda: synced({LEAF_GROUP: "ib-leaf-3", SCALABLE_UNIT: "cfg-su", SPINE_GROUP: "old-core",
                                 GPU_COUNT: "8", "team": "p", **topograph}), 60, "tiers from both sources")
        # A bad name: refused with the file and the key named, the previous labels kept.
        sighup("leafGroup: '///'\nscalableUnit: cfg-su2\n")
        wait_for(lambda: "leafGroup: cannot make a label value of '///'" in proc.tail(200), 60,
                 "the plugin to log the refused leafGroup")
        assert synced({SCALABLE_UNIT: "cfg-su", LEAF_GROUP: "ib-leaf-3"}), labels_of(cluster, name)
        # Topograph drops the core tier; the config's spine group takes over on the next relabel.
        cluster.kube.merge_patch(node_path(name), label("network.topology.nvidia.com/core", None))
        sighup("scalableUnit: cfg-su2\nspineGroup: cfg-sg2\n")
        have = wait_for(lambda: synced({SCALABLE_UNIT: "cfg-su2", SPINE_GROUP: "cfg-sg2", LEAF_GROUP: "ib-leaf-3"}),
                        60, "the new config under Topograph's leaf")
        assert have["fabric.topograph.run/tier-0"] == "ib-leaf-3" and "network.topology.nvidia.com/core" not in have
        assert proc.metric("topodra_plugin_node_label_failures_total") == 0.0
        assert proc.stop() == 0, proc.tail()
    finally:
        proc.stop()
        cluster.kube.delete(node_path(name))
