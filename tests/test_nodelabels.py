"""Node labels from discovery (``topodra.nodelabels``) and a multi-pod job placed by them.

The pure part runs the real discovery code on mock profiles. The cluster part publishes enterprise-400 and
an NVL72 rack with ``topodra simulate``'s code, checks the labels on the Node objects, and shows the real
kube-scheduler keeping both pods of a 2 x 8-GPU job in one scalable unit through pod affinity on
``topodra.io/scalable-unit``: with scalable unit 1 full except one node and 25 empty nodes in unit 2, the
second pod can only land on that one node.
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import REPO, ClusterHandle, wait_for

from topodra.apipaths import claim_path, namespace_path, node_path, pod_path, template_path
from topodra.nodelabels import (
    GPU_COUNT,
    GPU_MODEL,
    NVLINK_CLIQUE,
    SCALABLE_UNIT,
    label_patch,
    label_value,
    node_labels,
)
from topodra.simulate import SimNode, Simulation, discover, load_cluster, plan

Obj = dict[str, Any]


def devices_of(profile: str, **overrides: Any) -> Any:
    return discover(SimNode(name="n", profile=profile, labels={}, overrides=overrides))


def test_dgx_labels_have_no_clique() -> None:
    assert node_labels(devices_of("dgx-h100")) == {GPU_COUNT: "8", GPU_MODEL: "H100-SXM5-80GB"}
    assert node_labels(devices_of("dgx-h100", hideGpus=[3]))[GPU_COUNT] == "7"
    assert NVLINK_CLIQUE not in node_labels(devices_of("l4"))  # no NVLink at all


def test_nvl72_trays_of_one_rack_share_the_clique_label() -> None:
    nodes = plan(load_cluster(REPO / "hack/clusters/nvl72-rack.yaml"))
    labels = [node_labels(discover(n)) for n in nodes[:3]]
    cliques = {lab[NVLINK_CLIQUE] for lab in labels}
    assert len(cliques) == 1
    uuid, _, clique = cliques.pop().rpartition(".")
    assert len(uuid) == 36 and clique.isdigit()
    assert all(lab[GPU_COUNT] == "4" and lab[GPU_MODEL] == "GB200" for lab in labels)


def test_admin_labels_and_patch() -> None:
    wanted = node_labels(devices_of("dgx-h100"), scalable_unit="su 1", rail_group="rg-a")
    assert wanted[SCALABLE_UNIT] == "su-1" and wanted["topodra.io/rail-group"] == "rg-a"
    current = {"kubernetes.io/hostname": "n", GPU_COUNT: "8", GPU_MODEL: "A100-SXM4-80GB", NVLINK_CLIQUE: "x.1"}
    patch = label_patch(current, {GPU_COUNT: "8", GPU_MODEL: "H100-SXM5-80GB"})
    assert patch == {GPU_MODEL: "H100-SXM5-80GB", NVLINK_CLIQUE: None}  # hostname untouched, count unchanged
    assert label_patch({GPU_COUNT: "8"}, {GPU_COUNT: "8"}) == {}
    with pytest.raises(ValueError, match="not a topodra node label"):
        label_patch({}, {"kubernetes.io/hostname": "other"})


@pytest.mark.parametrize(("text", "value"), [("H100 SXM5/80GB", "H100-SXM5-80GB"), ("-a-", "a"), ("x" * 80, "x" * 63)])
def test_label_value(text: str, value: str) -> None:
    assert label_value(text) == value


# --------------------------------------------------------------------------- on the real cluster


def pod(name: str, ns: str, node_selector: Obj | None = None, affinity_to: str | None = None) -> Obj:
    spec: Obj = {"restartPolicy": "Never",
                 "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": "eight"}],
                 "containers": [{"name": "main", "image": "localhost/busybox:1.35", "command": ["true"],
                                 "resources": {"claims": [{"name": "gpus"}]}}],
                 # Only enterprise-400's nodes (they carry a scalable unit); other tests' nodes stay out.
                 "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                     "nodeSelectorTerms": [{"matchExpressions": [
                         {"key": SCALABLE_UNIT, "operator": "In", "values": ["su1", "su2"]}]}]}}}}
    labels = {}
    if node_selector:
        spec["nodeSelector"] = node_selector
    if affinity_to:
        labels["job"] = affinity_to
        spec["affinity"]["podAffinity"] = {"requiredDuringSchedulingIgnoredDuringExecution": [
            {"labelSelector": {"matchLabels": {"job": affinity_to}}, "topologyKey": SCALABLE_UNIT}]}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns, "labels": labels},
            "spec": spec}


@pytest.mark.cluster
def test_simulated_nodes_are_labelled_and_affinity_keeps_a_job_in_one_scalable_unit(cluster: ClusterHandle) -> None:
    kube = cluster.kube
    cluster.apply_yaml(REPO / "deviceclasses")
    sims = [Simulation(kube, load_cluster(REPO / "hack/clusters" / f)) for f in ("enterprise-400.yaml",
                                                                                 "nvl72-rack.yaml")]
    ns = cluster.namespace("affinity")
    try:
        for sim in sims:
            sim.setup()
            sim.reconcile_all()
        nodes = {n["metadata"]["name"]: n["metadata"]["labels"] for n in kube.list(node_path())}
        assert nodes["h100-su1-0"][GPU_MODEL] == "H100-SXM5-80GB" and nodes["h100-su1-0"][GPU_COUNT] == "8"
        assert nodes["a100-su1-3"][GPU_MODEL] == "A100-SXM4-80GB" and nodes["h200-su2-9"][SCALABLE_UNIT] == "su2"
        assert NVLINK_CLIQUE not in nodes["h100-su1-0"]
        trays = [lab for name, lab in nodes.items() if name.startswith("gb200-tray-")]
        assert len(trays) == 18 and len({t[NVLINK_CLIQUE] for t in trays}) == 1

        su1 = sorted(n for n, lab in nodes.items() if lab.get(SCALABLE_UNIT) == "su1")
        assert len(su1) == 25
        wait_for(lambda: all(not (n.get("spec") or {}).get("taints")
                             for n in kube.list(node_path(), label_selector=SCALABLE_UNIT)), 60, "nodes untainted")
        kube.create(template_path(ns), {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": "eight"},
            "spec": {"spec": {"devices": {
                "requests": [{"name": "gpus", "exactly": {"deviceClassName": "gpu.topodra.io", "count": 8}}],
                "constraints": [{"requests": ["gpus"], "matchAttribute": "gpu.topodra.io/nvlinkDomain"}]}}}})
        # Fill scalable unit 1 except its last node; the job's first pod goes to its first node.
        first, free_node, fill = su1[0], su1[-1], su1[1:-1]
        for i, node in enumerate(fill):
            kube.create(pod_path(ns), pod(f"fill-{i}", ns, {"kubernetes.io/hostname": node}))
        kube.create(pod_path(ns), pod("job-0", ns, {"kubernetes.io/hostname": first}, affinity_to="job"))

        def bound() -> dict[str, str] | None:
            pods = {p["metadata"]["name"]: p["spec"].get("nodeName") for p in kube.list(pod_path(ns))}
            return pods if all(pods.values()) else None

        wait_for(bound, 180, "fillers and the job's first pod bound")
        # The second pod says nothing about nodes: only "next to job pods, same scalable unit".
        kube.create(pod_path(ns), pod("job-1", ns, affinity_to="job"))
        placed = wait_for(bound, 120, "the job's second pod bound")
        assert placed["job-1"] == free_node, (placed["job-1"], nodes[placed["job-1"]].get(SCALABLE_UNIT))
        claims = [c for c in kube.list(claim_path(ns)) if (c.get("status") or {}).get("allocation")]
        assert len(claims) == len(fill) + 2
    finally:
        kube.request("DELETE", pod_path(ns), {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0})
        kube.delete(namespace_path(ns))
        for sim in sims:
            sim.delete()

