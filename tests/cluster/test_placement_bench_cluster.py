"""bench/placement: the pure parts (workloads, objects, clock, metrics) and a smoke replay on the real cluster.

The smoke replay runs policies (c) and (a) of a short synthetic stream through the real
kube-scheduler on 12 simulated DGX nodes and checks what the benchmark reports: every job placed or
accounted for, no GPU of a type the job did not list, metrics within their ranges. The gang policies
(e) and (f) need the Workload API's gates and the fabric labels: not replayed here.

Split by tier; the rest: tests/unit/bench/test_placement_bench.py.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from bench.placement import main as pb
from bench.placement import model as pm

# --------------------------------------------------------------------------- smoke replay on the real cluster

SMOKE_GROUPS = [("a100-su1-", "dgx-a100-80gb", 3, "su1"), ("h100-su1-", "dgx-h100", 2, "su1"),
                ("h100-su2-", "dgx-h100", 3, "su2"), ("h200-su2-", "dgx-h200", 4, "su2")]


@pytest.mark.cluster
def test_smoke_replay_on_the_real_scheduler(cluster: Any) -> None:
    """A short synthetic stream (~150 events) under (c) and (a) on 12 simulated DGX nodes."""
    from topodra.simulate import SimulatedCluster

    label = f"smoke{uuid.uuid4().hex[:5]}"
    spec = SimulatedCluster.model_validate({"groups": [
        {"namePrefix": f"{label}-{prefix}", "count": n, "profile": prof, "labels": {pm.SU_LABEL: su}}
        for prefix, prof, n, su in SMOKE_GROUPS]})
    matches = pb.install_classes(cluster.kube)
    sim, node_su = pb.publish(cluster.kube, pb.prefixed(spec, "", label))
    env: pb.Env | None = None
    try:
        inv = pb.build_inventory(cluster.kube, node_su, matches)
        assert inv.total() == 96
        env = pb.Env(lc=cluster.lc, kube=cluster.kube, inv=inv, node_selector={pb.NODE_LABEL: label})
        jobs = pm.synthetic_jobs(pm.SyntheticSpec(jobs=75, capacity_gpus=inv.total(), median_duration=1800), 11)
        results = {}
        for policy in ("c", "a"):
            env.use_policy(policy)
            replay = pb.Replay(env, policy, jobs, tick=120, settle=0.1, timeout=120)
            replay.setup()
            try:
                results[policy] = replay.execute()
            finally:
                replay.teardown()
    finally:
        if env is not None:
            env.stop_scorer()
            cluster.lc.restart_scheduler(None, None)  # the session's other tests expect the stock scheduler
        sim.delete()

    for policy, r in results.items():
        m = r.metrics
        assert (m["jobs"], m["placed"], m["unplaced"]) == (75, 75, 0), (policy, m)
        assert r.events >= 75 + 1 and r.steps >= 10
        assert 0 < m["utilisation"] <= 1 and 0 < m["goodput"] <= m["utilisation"] + 1e-9
        assert 0 <= m["stranded_gpus"] <= 96 and 0 <= m["fgd_fragmentation"] <= 1
        assert sum(m["choice"].values()) == 75
        assert all(w >= 0 for ws in r.waits.values() for w in ws)
        assert sum(len(ws) for ws in r.waits.values()) == 75
        assert r.scheduler["scheduled"] >= 75 + sum(j.pods - 1 for j in jobs)
    c = results["c"].metrics
    assert c["type_violations"] == 0 and c["subrequest_mismatches"] == 0, c
    assert c["nvlink_locality"] == 1.0
    # The same stream, so the same per-size job counts under both policies.
    assert {k: len(v) for k, v in results["a"].waits.items()} == {k: len(v) for k, v in results["c"].waits.items()}
