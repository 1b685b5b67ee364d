"""Issue 20: the real kube-scheduler's gang (GenericWorkload, TopologyAwareWorkloadScheduling) with the scorer.

Seven simulated DGX H100 nodes in one scalable unit: leaf group ``la`` of 3 nodes, one of them holding a
1-GPU pod (so ``la`` has room for exactly two 8-GPU pods), and leaf group ``lb`` of 4 empty nodes. A
PodGroup of two 8-GPU NVLink pods (gang ``minCount: 2``, topology constraint on the scalable unit, as
``bench/placement`` policy (f) renders it) is created with the scorer as extender. The scheduler offers
the one unit as its placement and evaluates both pods in one cycle; the scorer, seeing neither pod's
sibling bound yet, steers both into ``la``, the leaf group that holds the job tightest, and leaves ``lb``
whole. Without the scorer the two pods land on 2 of the 6 whole servers at random (both in ``la`` with
probability 1/15); the assertion is on where they are, so a scorer that did nothing would fail it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from test_placement_e2e import ScorerProcess
from test_scheduling_topology import Scenario, apply_example, one, scenario_maker
from testkit.handle import ClusterHandle, wait_for

from topodra.apipaths import node_path, podgroup_path, slices_path

pytestmark = pytest.mark.cluster

LEAF = "topodra.io/leaf-group"
SU = "topodra.io/scalable-unit"


@pytest.fixture
def scenarios(workload_cluster: ClusterHandle) -> Iterator[Callable[..., Scenario]]:
    yield from scenario_maker(workload_cluster)


@pytest.fixture
def stock_scheduler(workload_cluster: ClusterHandle) -> Iterator[None]:
    yield
    if workload_cluster.lc.meta().get("scheduler_config"):
        workload_cluster.lc.restart_scheduler()


def label_fabric(s: Scenario) -> dict[str, str]:
    """Leaf group per role, one unit for all; returns node -> leaf group."""
    leaves = {}
    for role in s.roles:
        for n in s.nodes(role):
            leaves[n] = f"{s.run}-{role}"
            s.kube.merge_patch(node_path(n), {"metadata": {"labels": {LEAF: leaves[n], SU: f"{s.run}-su"}}})
    return leaves


def test_a_2x8_gang_fills_the_partly_used_leaf_group_not_the_empty_one(
        workload_cluster: ClusterHandle, scenarios: Callable[..., Scenario], tmp_path: Path,
        stock_scheduler: None) -> None:
    c = workload_cluster
    s = scenarios([("la", "dgx-h100", 3), ("lb", "dgx-h100", 4)], "gang")
    leaves = label_fabric(s)
    s.hold_first_gpu(s.nodes("la")[0], "hold")  # la: 7 + 8 + 8 free GPUs

    scorer = ScorerProcess(c, tmp_path / "scorer.log")
    try:
        c.lc.restart_scheduler(scheduler_extender=scorer.url)
        published = len(list(c.kube.list(slices_path(), field_selector="spec.driver=gpu.topodra.io")))
        wait_for(lambda: scorer.metric('topodra_placement_cache_objects{kind="slices"}') >= published, 30,
                 f"scorer sees all {published} slices")

        group = "job"
        pg: dict[str, Any] = {"apiVersion": "scheduling.k8s.io/v1beta1", "kind": "PodGroup",
                              "metadata": {"name": group, "namespace": s.ns},
                              "spec": {"schedulingPolicy": {"gang": {"minCount": 2}},
                                       "schedulingConstraints": {"topology": [{"key": SU}]}}}
        c.kube.create(podgroup_path(s.ns), pg)
        template, base = apply_example(s, "gpu-8-nvlink")
        base["spec"]["schedulingGroup"] = {"podGroupName": group}
        for i in range(2):
            s.pod(f"job-{i}", template, s.nodes(), base)
        placed = {s.wait_allocated(f"job-{i}", timeout=120)[0] for i in range(2)}
        assert len(placed) == 2
        assert {leaves[n] for n in placed} == {f"{s.run}-la"}, (placed, leaves)
        assert s.nodes("la")[0] not in placed  # its 7 free GPUs cannot take 8
        for i in range(2):
            _node, results = s.wait_allocated(f"job-{i}")
            one(d["nvlinkDomain"] for d in s.devices(results))
        assert scorer.metric('topodra_placement_cache_objects{kind="slices"}') >= published
        assert scorer.metric('topodra_placement_prioritize_total{result="ok"}') >= 2
    finally:
        scorer.stop()
        c.kube.delete(podgroup_path(s.ns, "job"))
