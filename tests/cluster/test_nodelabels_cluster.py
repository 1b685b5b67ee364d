"""Node labels from discovery (``topodra.nodelabels``) and a multi-pod job placed by them.

The pure part runs the real discovery code on mock profiles. The cluster part publishes enterprise-400 and
an NVL72 rack with ``topodra simulate``'s code, checks the labels on the Node objects, and shows the real
kube-scheduler keeping both pods of a 2 x 8-GPU job in one scalable unit through pod affinity on
``topodra.io/scalable-unit``: with scalable unit 1 full except one node and 25 empty nodes in unit 2, the
second pod can only land on that one node.

Split by tier; the rest: tests/unit/nodelabels/test_nodelabels.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from testkit.handle import ClusterHandle, wait_for
from testkit.nodes import pod
from testkit.paths import REPO

from topodra.apipaths import claim_path, namespace_path, node_path, pod_path, template_path
from topodra.nodelabels import (
    GPU_COUNT,
    GPU_MODEL,
    NVLINK_CLIQUE,
    SCALABLE_UNIT,
)
from topodra.simulate import Simulation, load_cluster

Obj = dict[str, Any]


# --------------------------------------------------------------------------- on the real cluster


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
