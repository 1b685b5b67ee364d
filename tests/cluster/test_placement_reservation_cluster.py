"""Issue 33: the placement scorer steers around reservations, beside the real kube-scheduler and kube-apiserver.

Two simulated DGX H100 nodes ``a`` and ``b`` (one NVLink domain of 8 GPUs each), both empty, and the scorer as
the scheduler's extender:

1. A reservation *hint* on ``a`` (a DeviceTaintRule with key ``topodra.io/reservation``, effect ``None``: the
   scheduler ignores it). An ordinary 1-GPU pod could go to either node (equal for every plugin and for FGD);
   the scorer answers ``a`` 10 - 5, ``b`` 10, and the pod lands on ``b``.
2. The reservation is *held*: the rule on ``a`` becomes effect ``NoSchedule``. A 1-GPU pod whose claim
   tolerates exactly that taint (``reservations.toleration(uid)``, as the controller renders it) would be
   packed onto ``b`` by FGD alone (7 free there); the scorer ranks its reservation first (``a`` 10, ``b`` 1)
   and the scheduler, which allocates the tolerated devices, binds it to ``a``.
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
from topodra.reservations import (
    HINT_EFFECT,
    HOLD_EFFECT,
    MANAGED_LABEL,
    MANAGED_VALUE,
    RESERVATION_TAINT_KEY,
    UID_LABEL,
    toleration,
)

pytestmark = pytest.mark.cluster
UID = "0b5d7c4e-3f2a-4c1b-9e8d-7a6b5c4d3e2f"  # stands for the reserving ClaimProfile's uid


@pytest.fixture
def scenarios(cluster: ClusterHandle) -> Iterator[Callable[..., Scenario]]:
    yield from scenario_maker(cluster)


@pytest.fixture
def stock_scheduler_after(cluster: ClusterHandle) -> Iterator[None]:
    """The next test gets the stock scheduler back, whatever this one configured."""
    yield
    if cluster.lc.meta().get("scheduler_config"):
        cluster.lc.restart_scheduler()


def template(s: Scenario, name: str, tolerations: list[Obj] | None = None) -> None:
    body: Obj = {"deviceClassName": "gpu.topodra.io", "count": 1}
    if tolerations:
        body["tolerations"] = tolerations
    s.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
              "spec": {"spec": {"devices": {"requests": [{"name": "gpus", "exactly": body}]}}}})


def reservation(name: str, node: str, effect: str) -> Obj:
    """One node's reservation rule as the controller writes it (CONTRACT.md)."""
    return {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceTaintRule",
            "metadata": {"name": name, "labels": {MANAGED_LABEL: MANAGED_VALUE, UID_LABEL: UID}},
            "spec": {"deviceSelector": {"driver": DRIVER, "pool": node},
                     "taint": {"key": RESERVATION_TAINT_KEY, "value": UID, "effect": effect}}}


def prioritize(url: str, pod: Obj, nodes: list[str]) -> dict[str, int]:
    body = json.dumps({"Pod": pod, "NodeNames": nodes}).encode()
    req = urllib.request.Request(f"{url}/prioritize", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as r:
        return {h["Host"]: int(h["Score"]) for h in json.load(r)}


def test_small_jobs_leave_a_hinted_node_and_the_reserving_job_takes_its_reservation(
        cluster: ClusterHandle, scenarios: Callable[..., Scenario], tmp_path: Path,
        stock_scheduler_after: None) -> None:
    if cluster.lc.meta().get("scheduler_config"):
        cluster.lc.restart_scheduler()
    s = scenarios([("h100", "dgx-h100", 2)], "rsvscore")
    a, b = s.nodes("h100")
    template(s, "one")
    template(s, "mine", [toleration(UID)])
    hint, hold = f"rsvscore-hint-{s.run}", f"rsvscore-hold-{s.run}"

    def probe(tmpl: str) -> Obj:
        return {"metadata": {"name": f"probe-{tmpl}", "namespace": s.ns},
                "spec": {"resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": tmpl}]}}

    scorer = ScorerProcess(cluster, tmp_path / "scorer.log")
    try:
        wait_for(lambda: prioritize(scorer.url, probe("one"), [a, b]) == {a: 10, b: 10}, 30,
                 "the scorer sees both empty nodes as equal (the control)")
        cluster.kube.create(device_taint_rule_path(), reservation(hint, a, HINT_EFFECT))
        wait_for(lambda: prioritize(scorer.url, probe("one"), [a, b]) == {a: 5, b: 10}, 30,
                 f"the scorer steers an ordinary pod off the hinted node {a}")
        cluster.lc.restart_scheduler(scheduler_extender=scorer.url)
        s.pod("small", "one", [a, b])
        node, _results = s.wait_allocated("small")
        assert node == b, f"the ordinary 1-GPU pod went to the hinted node {node}"

        cluster.kube.create(device_taint_rule_path(), reservation(hold, a, HOLD_EFFECT))
        cluster.kube.delete(device_taint_rule_path(hint))
        s.wait_scheduler_sees_taints(a, 0)  # the scheduler's own view: nothing on a for an ordinary claim
        wait_for(lambda: prioritize(scorer.url, probe("mine"), [a, b]) == {a: 10, b: 1}, 30,
                 f"the scorer ranks the reserving pod's reservation {a} first (FGD alone packs it onto {b})")
        assert prioritize(scorer.url, probe("one"), [a, b]) == {a: 0, b: 10}  # held: no fit for an ordinary pod
        s.pod("reserving", "mine", [a, b])
        node, results = s.wait_allocated("reserving")
        assert node == a and {r["pool"] for r in results} == {a}, (node, results)
    finally:
        scorer.stop()
        for name in (hint, hold):
            cluster.kube.delete(device_taint_rule_path(name))
