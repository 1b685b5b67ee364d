"""Issue 21: the placement scorer counts node CPU and memory, beside the real kube-scheduler.

Two simulated DGX H100 nodes (224 CPUs, 2Ti each, from the profile), all 16 GPUs free. A CPU-only pod
bound to node ``hog`` takes 204 CPUs and 1900Gi, leaving 20 CPUs there. The scorer runs with
``--host-resources on`` (the default) as the scheduler's prioritize extender.

* A 1-GPU pod with 12 CPUs: on ``hog`` only one such GPU can ever be used, its other GPUs are stranded
  by CPU whatever happens, so placing the pod there strands nothing new; on ``roomy`` it breaks a whole
  free server. The scorer answers hog 10, roomy 1, and the scheduler follows it, although NodeResourcesFit's
  LeastAllocated alone would pick the emptier ``roomy``.
* An 8-GPU NVLink pod with 96 CPUs: ``hog`` has 7 free GPUs in one domain but 8 CPUs: the scorer answers 0
  for it (it cannot hold the pod), and the pod lands on ``roomy``. (The scheduler's own filter already
  rules ``hog`` out, so with one feasible node it does not call the extender for this pod: the scorer's
  answer is read directly from its /prioritize.)
"""

from __future__ import annotations

import copy
import json
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from test_placement_e2e import ScorerProcess, one_gpu_template
from test_scheduling_topology import Scenario, apply_example, scenario_maker
from testkit.handle import ClusterHandle, wait_for

pytestmark = pytest.mark.cluster


@pytest.fixture
def scenarios(cluster: ClusterHandle) -> Iterator[Callable[..., Scenario]]:
    yield from scenario_maker(cluster)


@pytest.fixture
def stock_scheduler(cluster: ClusterHandle) -> Iterator[None]:
    yield
    if cluster.lc.meta().get("scheduler_config"):
        cluster.lc.restart_scheduler()


def prioritize(scorer: ScorerProcess, pod: dict[str, Any], nodes: list[str]) -> dict[str, int]:
    body = json.dumps({"Pod": pod, "NodeNames": nodes}).encode()
    req = urllib.request.Request(f"{scorer.url}/prioritize", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as r:
        return {h["Host"]: h["Score"] for h in json.loads(r.read())}


def scores_once(scorer: ScorerProcess, pod: dict[str, Any], nodes: list[str],
                ready: Callable[[dict[str, int]], bool], what: str) -> dict[str, int]:
    """The scorer's answer, polled until ``ready`` says its view has caught up (a positive signal)."""
    def answer() -> dict[str, int] | None:
        got = prioritize(scorer, pod, nodes)
        return got if ready(got) else None

    return wait_for(answer, 30, what)  # type: ignore[no-any-return]


def with_requests(pod: dict[str, Any], cpu: str, memory: str) -> dict[str, Any]:
    pod = copy.deepcopy(pod)
    res = pod["spec"]["containers"][0].setdefault("resources", {})
    res["requests"] = {"cpu": cpu, "memory": memory}
    res.setdefault("claims", [{"name": "gpus"}])
    return pod


def test_gpus_stranded_by_cpu_are_scored_and_the_scheduler_follows(
        cluster: ClusterHandle, scenarios: Callable[..., Scenario], tmp_path: Path,
        stock_scheduler: None) -> None:
    scorer = ScorerProcess(cluster, tmp_path / "scorer.log")
    try:
        cluster.lc.restart_scheduler(scheduler_extender=scorer.url)
        s = scenarios([("hog", "dgx-h100", 1), ("roomy", "dgx-h100", 1)], "cpumem")
        hog, roomy = s.nodes("hog")[0], s.nodes("roomy")[0]
        for name in (hog, roomy):
            obj = cluster.kube.get(f"/api/v1/nodes/{name}")
            assert obj is not None
            alloc = obj["status"]["allocatable"]
            assert (alloc["cpu"], alloc["memory"]) == ("224", "2Ti"), alloc
        s.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "cpu-hog"}, "spec": {
            "nodeName": hog, "restartPolicy": "Never",
            "containers": [{"name": "main", "image": "localhost/busybox:1.35", "imagePullPolicy": "Never",
                            "command": ["true"], "resources": {"requests": {"cpu": "204", "memory": "1900Gi"}}}]}})

        small = one_gpu_template(s)
        probe = with_requests({"metadata": {"name": "probe", "namespace": s.ns}, "spec": {
            "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": small}],
            "containers": [{"name": "main"}]}}, "12", "16Gi")
        # The scorer has seen the hog once its answer for the 1-GPU pod separates the two nodes.
        got = scores_once(scorer, probe, [hog, roomy], lambda sc: sc[hog] != sc[roomy],
                          "scorer sees the CPU hog's requests")
        assert got == {hog: 10, roomy: 1}, got

        base = with_requests({"apiVersion": "v1", "kind": "Pod", "metadata": {}, "spec": {
            "restartPolicy": "Never", "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": small}],
            "containers": [{"name": "main", "image": "localhost/busybox:1.35", "imagePullPolicy": "Never",
                            "command": ["true"]}]}}, "12", "16Gi")
        calls = scorer.metric('topodra_placement_prioritize_total{result="ok"}')
        s.pod("one-gpu", small, s.nodes(), base)
        node, _results = s.wait_allocated("one-gpu")
        assert node == hog, f"1-GPU pod went to {node}, not the node whose GPUs CPU had stranded"
        assert scorer.metric('topodra_placement_prioritize_total{result="ok"}') > calls  # the scheduler asked

        big, big_base = apply_example(s, "gpu-8-nvlink")
        big_pod = with_requests(big_base, "96", "128Gi")
        probe8 = copy.deepcopy(big_pod)
        probe8["metadata"] = {"name": "probe8", "namespace": s.ns}
        # Ready once the view has the 1-GPU pod bound on hog and the 8-GPU template (until the template
        # arrives every node scores 0, which would pass a check on hog alone).
        scores = scores_once(scorer, probe8, [hog, roomy], lambda sc: sc[hog] == 0 and sc[roomy] > 0,
                             "scorer sees the 1-GPU pod bound on the hog node and the 8-GPU template")
        assert scores == {hog: 0, roomy: 10}, scores
        s.pod("eight-gpu", big, s.nodes(), big_pod)
        node, results = s.wait_allocated("eight-gpu")
        assert node == roomy and len(results) == 8
    finally:
        scorer.stop()
