"""Issue 34: pods without GPU claims are scored too, beside the real kube-scheduler.

kube-scheduler runs with the shipped extender entry (``deploy/placement/scheduler-config.yaml``, its urlPrefix
pointed at the test's scorer): no ``managedResources``, so the scheduler asks the scorer about every pod
(k8s.io/kubernetes@v1.37.2 pkg/scheduler/extender.go:429, ``IsInterested``), GPU claims or not. The scorer runs
with ``--host-resources mix``.

* A CPU-only pod allowed on a DGX H100 with 8 free GPUs (224 CPUs) and on a CPU-only node (32 CPUs): stock
  LeastAllocated prefers the DGX (a smaller share of it is taken); the scorer answers 10 for the CPU-only node and
  1 for the DGX, whose whole-server slot the pod's CPU would break, and the pod lands on the CPU-only node.
* A CPU-only pod allowed on that DGX and on a second one whose 8 GPUs are all allocated (to a pod that also holds
  96 CPUs there, so LeastAllocated prefers the free DGX): the scorer prefers the full one, and the pod lands there.
* With the scorer down (the same entry pointed where nothing listens), a CPU-only pod still schedules
  (``ignorable: true``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_placement_cpumem_cluster import scores_once
from test_placement_e2e import ScorerProcess
from test_scheduling_topology import Scenario, apply_example, scenario_maker
from testkit.handle import ClusterHandle, wait_for
from testkit.paths import REPO
from testkit.ports import free_port

from topodra.apipaths import node_path
from topodra.simulate import ensure_node

pytestmark = pytest.mark.cluster
Obj = dict[str, Any]


@pytest.fixture
def scenarios(cluster: ClusterHandle) -> Iterator[Callable[..., Scenario]]:
    yield from scenario_maker(cluster)


@pytest.fixture
def stock_scheduler(cluster: ClusterHandle) -> Iterator[None]:
    yield
    if cluster.lc.meta().get("scheduler_config"):
        cluster.lc.restart_scheduler()


def shipped_config(url: str) -> dict[str, Any]:
    """The shipped KubeSchedulerConfiguration snippet with its extender pointed at ``url``."""
    cfg = yaml.safe_load((REPO / "deploy" / "placement" / "scheduler-config.yaml").read_text())
    assert len(cfg["extenders"]) == 1 and "managedResources" not in cfg["extenders"][0]
    cfg["extenders"][0]["urlPrefix"] = url
    return dict(cfg)


@pytest.fixture
def cpu_node(cluster: ClusterHandle) -> Iterator[str]:
    """A kubelet-less Ready node without devices (32 CPUs, 256Gi: the trace's most common CPU-only server)."""
    name = f"cpuonly-{free_port()}"
    ensure_node(cluster.kube, name, {}, ("32", "256Gi"))

    def untainted() -> bool:
        node = cluster.kube.get(node_path(name)) or {}
        return not (node.get("spec") or {}).get("taints")

    wait_for(untainted, 120, f"node {name} untainted")
    try:
        yield name
    finally:
        cluster.kube.delete(node_path(name))


def cpu_pod(name: str, nodes: list[str], cpu: str, memory: str) -> Obj:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": {
        "restartPolicy": "Never",
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": sorted(nodes)}]}]}}},
        "containers": [{"name": "main", "image": "localhost/busybox:1.35", "imagePullPolicy": "Never",
                        "command": ["true"], "resources": {"requests": {"cpu": cpu, "memory": memory}}}]}}


def bound_node(s: Scenario, name: str) -> str:
    got: str = wait_for(lambda: s.get_pod(name)["spec"].get("nodeName"), 60, f"pod {name} bound")
    return got


def probe(s: Scenario, cpu: str, memory: str) -> Obj:
    pod = cpu_pod("probe", [], cpu, memory)
    pod["metadata"]["namespace"] = s.ns
    return pod


def test_cpu_only_pod_avoids_a_server_with_8_free_gpus(
        cluster: ClusterHandle, scenarios: Callable[..., Scenario], cpu_node: str, tmp_path: Path,
        stock_scheduler: None) -> None:
    scorer = ScorerProcess(cluster, tmp_path / "scorer.log", ["--host-resources", "mix"])
    try:
        cluster.lc.restart_scheduler(scheduler_config=shipped_config(scorer.url))
        s = scenarios([("free", "dgx-h100", 1), ("full", "dgx-h100", 1)], "strand")
        free, full = s.nodes("free")[0], s.nodes("full")[0]

        # 1. A CPU-only node beside a whole free server.
        got = scores_once(scorer, probe(s, "4", "8Gi"), [free, cpu_node], lambda sc: sc[cpu_node] > sc[free],
                          "scorer sees the CPU-only node")
        assert got == {cpu_node: 10, free: 1}, got
        calls = scorer.metric('topodra_placement_prioritize_total{result="ok"}')
        s.create(cpu_pod("to-cpu-node", [free, cpu_node], "4", "8Gi"))
        assert bound_node(s, "to-cpu-node") == cpu_node
        assert scorer.metric('topodra_placement_prioritize_total{result="ok"}') > calls  # the scheduler asked

        # 2. A server whose GPUs are all allocated beside a whole free one.
        big, big_base = apply_example(s, "gpu-8-nvlink")
        holder = copy.deepcopy(big_base)
        holder["spec"]["containers"][0].setdefault("resources", {})["requests"] = {"cpu": "96", "memory": "256Gi"}
        s.pod("holder", big, [full], holder)
        assert s.wait_allocated("holder")[0] == full
        got = scores_once(scorer, probe(s, "16", "32Gi"), [free, full], lambda sc: sc[full] > sc[free],
                          "scorer sees the full server's allocation")
        assert got == {full: 10, free: 1}, got
        calls = scorer.metric('topodra_placement_prioritize_total{result="ok"}')
        s.create(cpu_pod("to-full-node", [free, full], "16", "32Gi"))
        assert bound_node(s, "to-full-node") == full
        assert scorer.metric('topodra_placement_prioritize_total{result="ok"}') > calls
    finally:
        scorer.stop()


def test_cpu_only_pod_schedules_with_the_scorer_down(
        cluster: ClusterHandle, scenarios: Callable[..., Scenario], cpu_node: str, stock_scheduler: None) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    cluster.lc.restart_scheduler(scheduler_config=shipped_config(dead))
    extenders = cluster.lc.meta()["scheduler_config"]["extenders"]
    assert [e["urlPrefix"] for e in extenders] == [dead] and extenders[0]["ignorable"] is True
    s = scenarios([("free", "dgx-h100", 1)], "strand-down")
    nodes = [s.nodes("free")[0], cpu_node]
    for i in range(2):
        s.create(cpu_pod(f"p-{i}", nodes, "4", "8Gi"))
        assert bound_node(s, f"p-{i}") in nodes
