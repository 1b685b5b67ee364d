"""bench/placement policy (g): a short multi-node stream replayed with reservations through the real kube-scheduler.

Five simulated DGX H100 nodes in one scalable unit: leaf group ``la`` of 4 nodes, ``lb`` of 1. Twenty 2-GPU jobs
fill all 40 GPUs at t=0 (ending one after another from t=900 to t=2040); a 32-GPU gang (4 pods, so only ``la``
can hold it) arrives at t=700, when at most 14 GPUs are free (``tick`` 600 groups the events), and 1-GPU jobs
keep arriving. With ``afterWaiting`` 0 the gang is eligible at once, so the replay must make a hold (NoSchedule
DeviceTaintRules of the job's uid, which only its claims tolerate), the gang must start in ``la``, and the run
must end with every job placed, no type violation and no rule left behind. The assertions are on what the
benchmark reports and on the API (rules counted before the teardown deletes them: ``reservations_leaked``), so
a (g) that reserved nothing, or left a rule, fails.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from bench.placement import gang, reserve
from bench.placement import main as pb
from bench.placement import model as pm

from topodra.apipaths import device_taint_rule_path
from topodra.reservations import PROFILE_NS_LABEL

pytestmark = pytest.mark.cluster


def stream() -> list[pm.Job]:
    fill = [pm.Job(id=i, arrival=0.0, duration=900.0 + 60 * i, gpus=2, prefs="h200>h100") for i in range(20)]
    big = pm.Job(id=20, arrival=700.0, duration=600.0, gpus=32, prefs="h200>h100")
    flow = [pm.Job(id=21 + k, arrival=600.0 + 300 * k, duration=1200.0, gpus=1, prefs="h200>h100") for k in range(4)]
    return [*fill, big, *flow]


def test_policy_g_reserves_for_the_gang_and_leaves_no_rule(workload_cluster: Any) -> None:
    from topodra.simulate import SimulatedCluster

    c = workload_cluster
    label = f"rsv{uuid.uuid4().hex[:5]}"
    spec = SimulatedCluster.model_validate({"groups": [
        {"namePrefix": f"{label}-{leaf}-", "count": n, "profile": "dgx-h100",
         "labels": {pm.SU_LABEL: f"{label}-su", gang.LEAF_LABEL: f"{label}-{leaf}"}}
        for leaf, n in (("la", 4), ("lb", 1))]})
    matches = pb.install_classes(c.kube)
    sim, node_su = pb.publish(c.kube, pb.prefixed(spec, "", label))
    env: pb.Env | None = None
    rules_left: list[Any] = []
    try:
        inv = pb.build_inventory(c.kube, node_su, matches)
        assert inv.total() == 40
        env = pb.Env(lc=c.lc, kube=c.kube, inv=inv, node_selector={pb.NODE_LABEL: label},
                     fabric=gang.fabric_of(sim.nodes))
        env.use_policy("g")
        replay = pb.Replay(env, "g", stream(), tick=600, settle=0.1, timeout=240,
                           reservation=reserve.Settings(after_s=0, max_hold_s=7200, max_reservations=1))
        replay.setup()
        try:
            r = replay.execute()
        finally:
            replay.teardown()
            rules_left = list(c.kube.list(device_taint_rule_path(), label_selector=f"{PROFILE_NS_LABEL}={replay.ns}"))
    finally:
        if env is not None:
            env.stop_scorer()
            c.lc.restart_scheduler(None, None)  # the session's other tests expect the stock scheduler
        sim.delete()

    m = r.metrics
    print(f"policy (g) smoke: {r.steps} steps, {r.wall_s:.0f}s, phases {r.phases_s}, metrics {m}")
    assert (m["jobs"], m["placed"], m["unplaced"]) == (25, 25, 0), m
    assert m["type_violations"] == 0 and m["multi_node_unplaced"] == 0
    assert m["reservations_made"] >= 1, m  # the gang waited with the cluster full: it must have held
    assert m["reservations_leaked"] == 0 and rules_left == []
    assert m["reservation_idle_gpu_hours"] >= 0 and m["reservations_expired"] == 0
    big = replay.clock.states[20]
    assert big.start is not None and len({p.node for p in big.placements}) == 4
    assert {env.fabric[p.node]["leaf"] for p in big.placements} == {f"{label}-la"}
