"""Issue 18: the placement scorer counts a GPU tainted by a DeviceTaintRule as unavailable, beside the
real kube-scheduler and kube-apiserver.

Two simulated DGX H100 nodes (one NVLink domain of 8 GPUs each). Real pods take 3 GPUs on ``a`` and 2
on ``b``; then a DeviceTaintRule taints one of ``a``'s remaining GPUs NoSchedule. With the prior "only
4-GPU NVLink requests" (``--prior 4:1 --window 0``), F_n is a node's available GPUs mod 4:

* ``a``: 4 usable. A 1-GPU pod leaves 3 (F 0 -> 3, delta +3).
* ``b``: 6 usable. A 1-GPU pod leaves 5 (F 2 -> 1, delta -1): the scorer's choice.

A scorer blind to the taint sees 5 free GPUs on ``a`` (F 1 -> 0, delta -1, and the tighter fit), so it
would rank ``a`` 10 and ``b`` 1. The test asks the scorer directly, then lets the real scheduler place the
pod with the scorer as its extender.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from test_placement_e2e import ScorerProcess
from test_scheduling_topology import Scenario, scenario_maker
from testkit.handle import ClusterHandle, wait_for

from topodra import DEFAULT_DRIVER_NAME as DRIVER
from topodra.apipaths import device_taint_rule_path
from topodra.kube import Obj

pytestmark = pytest.mark.cluster


@pytest.fixture
def scenarios(cluster: ClusterHandle) -> Iterator[Callable[..., Scenario]]:
    yield from scenario_maker(cluster)


@pytest.fixture
def stock_scheduler_after(cluster: ClusterHandle) -> Iterator[None]:
    """The next test gets the stock scheduler back, whatever this one configured."""
    yield
    if cluster.lc.meta().get("scheduler_config"):
        cluster.lc.restart_scheduler()


def template(s: Scenario, name: str, count: int) -> None:
    s.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
              "spec": {"spec": {"devices": {"requests": [
                  {"name": "gpus", "exactly": {"deviceClassName": "gpu.topodra.io", "count": count}}]}}}})


def prioritize(url: str, pod: Obj, nodes: list[str]) -> dict[str, int]:
    """The scorer's answer to the scheduler's call, as the scheduler sends it."""
    body = json.dumps({"Pod": pod, "NodeNames": nodes}).encode()
    req = urllib.request.Request(f"{url}/prioritize", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as r:
        return {h["Host"]: int(h["Score"]) for h in json.load(r)}


def test_scorer_does_not_prefer_a_node_whose_free_domain_holds_a_tainted_gpu(
        cluster: ClusterHandle, scenarios: Callable[..., Scenario], tmp_path: Path,
        stock_scheduler_after: None) -> None:
    if cluster.lc.meta().get("scheduler_config"):
        cluster.lc.restart_scheduler()
    s = scenarios([("h100", "dgx-h100", 2)], "taintscore")
    a, b = s.nodes("h100")
    template(s, "three", 3)
    template(s, "two", 2)
    template(s, "one", 1)
    s.pod("hold-a", "three", [a])
    _node, held = s.wait_allocated("hold-a")
    s.pod("hold-b", "two", [b])
    s.wait_allocated("hold-b")
    taken = {r["device"] for r in held}
    victim = next(f"gpu-{i}" for i in range(7, -1, -1) if f"gpu-{i}" not in taken)
    rule = f"taintscore-{s.run}"
    cluster.kube.create(device_taint_rule_path(), {
        "apiVersion": "resource.k8s.io/v1", "kind": "DeviceTaintRule", "metadata": {"name": rule},
        "spec": {"deviceSelector": {"driver": DRIVER, "pool": a, "device": victim},
                 "taint": {"key": "topodra.io/maintenance", "effect": "NoSchedule"}}})
    try:
        s.wait_scheduler_sees_taints(a, 4)  # the scheduler's own view: 4 usable GPUs left on a
        scorer = ScorerProcess(cluster, tmp_path / "scorer.log", ["--prior", "4:1", "--window", "0"])
        try:
            probe = {"metadata": {"name": "probe", "namespace": s.ns},
                     "spec": {"resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": "one"}]}}
            # A positive signal that the scorer has seen both holds and the rule: b is ranked above a.
            wait_for(lambda: prioritize(scorer.url, probe, [a, b]) == {a: 1, b: 10}, 30,
                     f"the scorer ranks {b} (6 usable) above {a} (4 usable, {victim} tainted)")
            assert scorer.metric('topodra_placement_cache_objects{kind="taint_rules"}') >= 1
            cluster.lc.restart_scheduler(scheduler_extender=scorer.url)
            s.pod("next", "one", [a, b])
            node, results = s.wait_allocated("next")
            assert node == b, f"the 1-GPU pod went to {node} ({results}), leaving {b} fragmented"
        finally:
            scorer.stop()
    finally:
        cluster.kube.delete(device_taint_rule_path(rule))
