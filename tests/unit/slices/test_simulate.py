"""Simulated clusters: every mock profile published through the real apiserver with the documented topology.

Split by tier; the rest: tests/cluster/test_simulate_cluster.py.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from testkit.paths import REPO

from topodra.simulate import TTL_ANNOTATION, SimulatedCluster, fake_node, load_cluster, node_ttl_seconds, plan


def test_enterprise_plan_is_50_nodes_in_2_scalable_units() -> None:
    nodes = plan(load_cluster(REPO / "hack/clusters/enterprise-400.yaml"))
    assert len(nodes) == 50
    assert Counter(n.labels["topodra.io/profile"] for n in nodes) == {
        "dgx-a100-80gb": 16, "dgx-h100": 24, "dgx-h200": 10}
    assert Counter(n.labels["topodra.io/scalable-unit"] for n in nodes) == {"su1": 25, "su2": 25}


def test_racks_share_a_fabric_uuid() -> None:
    c = SimulatedCluster.model_validate({"groups": [
        {"namePrefix": "t-", "count": 4, "profile": "gb200-nvl72", "nodesPerRack": 2}]})
    uuids = [n.overrides["clusterUUID"] for n in plan(c)]
    assert uuids[0] == uuids[1] != uuids[2] == uuids[3]


@pytest.mark.parametrize("bad, msg", [
    ({"groups": []}, "at least 1"),
    ({"groups": [{"namePrefix": "a-", "count": 0, "profile": "l4"}]}, "greater than or equal to 1"),
    ({"groups": [{"namePrefix": "a-", "count": 1, "profile": "l4"},
                 {"namePrefix": "a-", "count": 1, "profile": "l4"}]}, "more than once"),
    ({"groups": [{"namePrefix": "A_", "count": 1, "profile": "l4"}]}, "pattern"),
    ({"kind": "Cluster", "groups": [{"namePrefix": "a-", "count": 1, "profile": "l4"}]}, "SimulatedCluster"),
])
def test_invalid_cluster_files_are_rejected(tmp_path: Path, bad: dict[str, Any], msg: str) -> None:
    import yaml
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump(bad))
    with pytest.raises(ValueError, match=msg):
        load_cluster(f)


@pytest.mark.parametrize(("nodes", "ttl"), [(1, 0), (100, 0), (101, 15), (500, 15), (501, 30), (1000, 30),
                                            (1001, 60), (2000, 60), (2001, 300), (16384, 300)])
def test_node_ttl_is_the_ttl_controllers_step_for_the_cluster_size(nodes: int, ttl: int) -> None:
    assert node_ttl_seconds(nodes) == ttl


def test_a_created_node_carries_the_ttl_annotation_only_when_asked() -> None:
    assert "annotations" not in fake_node("n1")["metadata"]
    assert fake_node("n1", ttl=300)["metadata"]["annotations"] == {TTL_ANNOTATION: "300"}


class _Nodes:
    """The Node list as the node lifecycle controller lifts not-ready from one more Node per list."""

    def __init__(self, names: list[str], lifted_per_list: int) -> None:
        self.tainted = list(names)
        self.per_list = lifted_per_list
        self.lists = 0

    def list(self, path: str) -> list[dict[str, Any]]:
        assert path == "/api/v1/nodes"
        self.lists += 1
        out = [{"metadata": {"name": n}, "spec": {"taints": [{"key": "node.kubernetes.io/not-ready",
                                                               "effect": "NoSchedule"}]}} for n in self.tainted]
        out.append({"metadata": {"name": "someone-elses"}, "spec": {"taints": [
            {"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}]}})  # not ours: never waited for
        del self.tainted[:self.per_list]
        return out


def _sim(kube: Any) -> Any:
    from topodra.simulate import Simulation

    return Simulation(kube, SimulatedCluster.model_validate(
        {"groups": [{"namePrefix": "w-", "count": 3, "profile": "dgx-h100"}]}))


def test_wait_schedulable_waits_for_the_controller_to_lift_not_ready() -> None:
    kube = _Nodes(["w-0", "w-1", "w-2"], lifted_per_list=1)
    now = [0.0]
    sim = _sim(kube)
    left = sim.wait_schedulable(60, clock=lambda: now[0], pause=lambda s: now.__setitem__(0, now[0] + s))
    assert left == [] and kube.lists == 4  # 3, 2, 1, then none of ours


def test_wait_schedulable_names_the_nodes_left_at_the_timeout() -> None:
    kube = _Nodes(["w-0", "w-1", "w-2"], lifted_per_list=0)
    now = [0.0]
    sim = _sim(kube)
    left = sim.wait_schedulable(5, clock=lambda: now[0], pause=lambda s: now.__setitem__(0, now[0] + s))
    assert left == ["w-0", "w-1", "w-2"] and now[0] >= 5


def test_a_negative_ready_timeout_is_refused_before_anything_is_sent(tmp_path: Path) -> None:
    import argparse

    from topodra import simulate

    p = argparse.ArgumentParser()
    simulate.configure(p)
    args = p.parse_args([str(REPO / "hack/clusters/mixed-8.yaml"), "--once", "--ready-timeout", "-1",
                         "--kubeconfig", str(tmp_path / "no-such-kubeconfig")])
    assert simulate.run(args) == 2
