"""bench/placement/gang.py: multi-node jobs, policies (e)/(f) as API objects, the fabric goodput and gang metrics.

Pure: the inventory comes from hand-written slices (test_placement_bench.fake_slices); no cluster.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from bench.placement import gang, reserve
from bench.placement import model as pm
from test_placement_bench import inventory

NODES = {"a1": "h100", "a2": "h100", "b1": "h100", "b2": "h100", "c1": "h100", "c2": "h100"}
FABRIC = {"a1": {"leaf": "la", "su": "s1"}, "a2": {"leaf": "la", "su": "s1"},
          "b1": {"leaf": "lb", "su": "s1"}, "b2": {"leaf": "lb", "su": "s1"},
          "c1": {"leaf": "lc", "su": "s2"}, "c2": {"leaf": "lc", "su": "s2"}}


def job(gpus: int, jid: int = 1, prefs: str = "h200>h100") -> pm.Job:
    return pm.Job(id=jid, arrival=0.0, duration=100.0, gpus=gpus, prefs=prefs)


def whole(node: str) -> pm.Placement:
    return pm.Placement(node=node, devices=tuple(f"gpu-{i}" for i in range(8)), subrequest="h100")


@pytest.mark.parametrize(("gpus", "pods"), [(1, 1), (8, 1), (16, 2), (32, 4), (64, 8)])
def test_multi_node_sizes_are_8_gpu_pods(gpus: int, pods: int) -> None:
    j = job(gpus)
    assert (j.pods, j.per_pod) == (pods, min(gpus, 8))
    assert len(j.pod_names()) == pods


def test_policy_e_and_f_render_a_gang_instead_of_pod_affinity() -> None:
    j = job(32)
    group = gang.podgroup_for(j, "e", "run1")
    assert group is not None and group["metadata"]["name"] == "j00001"
    assert group["spec"]["schedulingPolicy"] == {"gang": {"minCount": 4}}
    assert group["spec"]["schedulingConstraints"] == {"topology": [{"key": pm.SU_LABEL}]}
    assert gang.podgroup_for(j, "c", "run1") is None and gang.podgroup_for(job(8), "f", "run1") is None
    pod = gang.gang_pod(pm.pod_for(j, 0, "f", "run1", {}), j, "f")
    assert pod["spec"]["schedulingGroup"] == {"podGroupName": "j00001"} and "affinity" not in pod["spec"]
    assert pm.claim_spec_for(j, "f") == pm.claim_spec_for(j, "c")
    today = gang.gang_pod(pm.pod_for(j, 0, "c", "run1", {}), j, "c")
    assert "schedulingGroup" not in today["spec"] and today["spec"]["affinity"]["podAffinity"]
    assert gang.features(["c"]) == [] and len(gang.features(["c", "e"])) == 2


def test_fabric_busbw_one_leaf_then_spine_then_across_units() -> None:
    inv = inventory(NODES)
    leaf = gang.fabric_busbw(inv, FABRIC, [whole("a1"), whole("a2")])
    spine = gang.fabric_busbw(inv, FABRIC, [whole("a1"), whole("b1")])
    core = gang.fabric_busbw(inv, FABRIC, [whole("a1"), whole("c1")])
    assert spine == pytest.approx(leaf * gang.SPINE_FACTOR)
    assert core == pytest.approx(leaf * gang.SPINE_FACTOR ** 2)
    j = job(16)
    assert gang.fabric_slowdown(j, inv, FABRIC, [whole("a1"), whole("a2")]) < \
        gang.fabric_slowdown(j, inv, FABRIC, [whole("a1"), whole("c1")])
    assert gang.fabric_slowdown(job(1), inv, FABRIC, [whole("a1")]) == 1.0


def test_leaf_could_hold_needs_enough_whole_servers_of_a_listed_type_in_one_leaf() -> None:
    inv = inventory(NODES)
    free = {n: 8 for n in NODES}
    assert gang.leaf_could_hold(job(16), inv, FABRIC, free)
    assert not gang.leaf_could_hold(job(32), inv, FABRIC, free)  # 2 servers per leaf
    assert not gang.leaf_could_hold(job(16, prefs="h200"), inv, FABRIC, free)
    assert not gang.leaf_could_hold(job(16), inv, FABRIC, {**free, "a1": 7, "b1": 0, "c2": 3})


def test_tracker_counts_partial_jobs_leaf_containment_and_fabric_goodput() -> None:
    inv = inventory(NODES)
    split, packed = job(16, jid=1), job(16, jid=2)
    clock = pm.VirtualClock([split, packed, pm.Job(id=3, arrival=100.0, duration=10.0, gpus=1, prefs="mem80")])
    tracker = gang.GangTracker(inv, FABRIC)
    clock.advance(0.0)
    arrived = clock.due_arrivals()
    # step 0: the packed job starts in la; the split job has one pod bound (holding 8 GPUs), one pending
    placements = {"j00002-0": whole("a1"), "j00002-1": whole("a2"), "j00001-0": whole("b1")}
    clock.started(2, [placements["j00002-0"], placements["j00002-1"]])
    used = {(p.node, d) for p in placements.values() for d in p.devices}
    tracker.observe(clock, arrived, placements, used)
    clock.advance(50.0)
    placements["j00001-1"] = whole("c1")  # its second pod lands in the other unit
    clock.started(1, [placements["j00001-0"], placements["j00001-1"]])
    tracker.observe(clock, [], placements, used | {("c1", f"gpu-{i}") for i in range(8)})
    clock.advance(100.0)
    tracker.observe(clock, clock.due_arrivals(), placements, used)
    m = tracker.metrics(clock)
    assert m["partial_gpus"] == pytest.approx(8 * 50 / 100)  # 8 GPUs held for half the window
    assert m["partial_gpu_hours"] == pytest.approx(8 * 50 / 3600)
    assert (m["in_one_leaf"], m["in_one_su"]) == (0.5, 0.5)
    # at arrival a leaf could hold each: job 1's own pod on b1 counts as free, so lb (b1, b2) could
    assert tracker.leaf_possible == {1: True, 2: True}
    assert m["in_leaf_when_possible"] == 0.5
    assert 0 < m["goodput_fabric"] <= 1 and m["multi_node_unplaced"] == 0


def test_table_rows_name_reported_metrics() -> None:
    keys = {k for k, _label, _d in gang.TABLE_ROWS}
    tracker = gang.GangTracker(inventory(NODES), FABRIC)
    clock = pm.VirtualClock([job(16), job(64, jid=2)])
    clock.advance(0.0)
    clock.due_arrivals()
    tracker.observe(clock, [], {}, set())
    reserver = reserve.Reserver(reserve.Settings(after_s=0), "run", "ns", inventory(NODES), FABRIC)
    reserver.first_hold[2] = (0.0, 10.0)  # what a hold of the 64-GPU job records (test_placement_reserve_bench)
    reported = set(tracker.metrics(clock)) | set(reserver.metrics(clock)) | set(reserve.big_job_metrics(clock)) | {
                                              "utilisation", "goodput", "unplaced", "stranded_gpus",
                                              "type_violations", "scheduler_pods_per_s", "scorer_p99_ms",
                                              "scorer_cpu_p99_ms"}
    assert {k.split(".")[0] for k in keys} <= reported | {"wait_p95_s"}
    assert math.isnan(tracker.metrics(clock)["in_one_leaf"])


def test_fabric_of_reads_the_simulated_labels() -> None:
    nodes = [SimpleNamespace(name="n1", labels={gang.LEAF_LABEL: "l1", pm.SU_LABEL: "s1"}),
             SimpleNamespace(name="n2", labels={})]
    assert gang.fabric_of(nodes) == {"n1": {"leaf": "l1", "su": "s1"}, "n2": {"leaf": "", "su": ""}}


def test_gang_idle_view_ignores_the_backoff_retries_of_a_gang_that_does_not_fit() -> None:
    from bench.placement import main as pb
    from test_placement_bench import METRICS

    plain, gangs = pb.SchedulerState.of(METRICS), pb.SchedulerState.of(METRICS, gangs=True)
    assert plain.busy and not gangs.busy  # 2 pods in backoff: a gang retried every second
    assert gangs.signature == (40, 0.0)  # only scheduled pods count as work
    retried = METRICS.replace('result="unschedulable"} 5', 'result="unschedulable"} 9')
    assert pb.SchedulerState.of(retried, gangs=True).signature == gangs.signature
    assert pb.SchedulerState.of(retried).signature != plain.signature
    assert pb.SchedulerState.of(METRICS.replace('"active"} 0', '"active"} 1'), gangs=True).busy


def test_paired_differences_only_use_seeds_both_policies_ran() -> None:
    runs = [{"policy": "c", "seed": 1, "metrics": {"x": 10.0, "w": {"8": 1.0}}},
            {"policy": "c", "seed": 2, "metrics": {"x": 20.0, "w": {"8": 1.0}}},
            {"policy": "c", "seed": 3, "metrics": {"x": 99.0}},
            {"policy": "f", "seed": 1, "metrics": {"x": 7.0, "w": {"8": 2.0}}},
            {"policy": "f", "seed": 2, "metrics": {"x": 15.0, "w": {"8": 3.0}}}]
    d = gang.paired(runs, "c", "f", ["x", "w.8"])
    assert d["x"]["mean"] == pytest.approx(-4.0) and d["x"]["n"] == 2
    assert d["w.8"]["mean"] == pytest.approx(1.5)
