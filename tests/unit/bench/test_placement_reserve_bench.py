"""bench/placement/reserve.py: policy (g)'s view for the controller's planner, rules, metrics, adversarial stream.

Pure: the inventory comes from hand-written slices (test_placement_bench.fake_slices); no cluster.
"""

from __future__ import annotations

import copy
import math

import pytest
from bench.placement import gang, reserve
from bench.placement import model as pm
from test_placement_bench import inventory

from topodra import reservations as vocab
from topodra.controller import reservation as rsv
from topodra.controller.reserve import rule_changes

# two leaf groups of H100 (la: 2 nodes, lb: 3 nodes) and one H200 node
NODES = {"a1": "h100", "a2": "h100", "b1": "h100", "b2": "h100", "b3": "h100", "h1": "h200"}
FABRIC = {"a1": {"leaf": "la", "su": "s1"}, "a2": {"leaf": "la", "su": "s1"}, "b1": {"leaf": "lb", "su": "s1"},
          "b2": {"leaf": "lb", "su": "s1"}, "b3": {"leaf": "lb", "su": "s1"}, "h1": {"leaf": "lh", "su": "s1"}}
ALL = tuple(f"gpu-{i}" for i in range(8))


def job(jid: int, gpus: int, arrival: float = 0.0, duration: float = 3600.0, prefs: str = "h200>h100") -> pm.Job:
    return pm.Job(id=jid, arrival=arrival, duration=duration, gpus=gpus, prefs=prefs)


def started(clock: pm.VirtualClock, j: pm.Job, *nodes: str, devices: tuple[str, ...] = ALL) -> \
        dict[str, pm.Placement]:
    ps = [pm.Placement(n, devices, "h100") for n in nodes]
    clock.started(j.id, ps)
    return dict(zip(j.pod_names(), ps, strict=True))


def used_of(placements: dict[str, pm.Placement]) -> set[tuple[str, str]]:
    return {(p.node, d) for p in placements.values() for d in p.devices}


def test_who_reserves_uid_and_toleration_as_the_controller_renders_it() -> None:
    assert [reserve.reserves(job(1, g)) for g in (1, 2, 4, 8, 16, 64)] == [False] * 4 + [True] * 2
    whole = reserve.Settings(whole_server=True)  # 8-GPU whole-server jobs reserve too (else they backfill)
    assert [reserve.reserves(job(1, g), whole) for g in (1, 2, 4, 8, 16, 64)] == [False] * 3 + [True] * 3
    big = reserve.Settings(min_gpus=32)  # only the profiles of 32 GPUs and more carry a reservation
    assert [reserve.reserves(job(1, g), big) for g in (8, 16, 32, 64)] == [False, False, True, True]
    # A 16-GPU gang that does not reserve does not backfill either (no runtime bound for its pods); 4 GPUs do.
    assert [reserve.backfills(job(1, g), big) for g in (4, 16)] == [True, False]
    uid = reserve.job_uid("run1", 7)
    assert len(uid) == 36 and uid == reserve.job_uid("run1", 7) and uid != reserve.job_uid("run2", 7)
    spec = pm.claim_spec_for(job(1, 64), "g")
    assert spec == pm.claim_spec_for(job(1, 64), "f")  # (g) renders (f)'s claim; the runner adds the toleration
    assert spec is not None
    tol = reserve.tolerating(spec, uid)
    subs = tol["devices"]["requests"][0]["firstAvailable"]
    assert len(subs) == 2 and all(s["tolerations"] == [vocab.toleration(uid), vocab.window_toleration()] for s in subs)
    assert "tolerations" not in spec["devices"]["requests"][0]["firstAvailable"][0]  # the input is not changed


def test_settings_refuse_bad_values() -> None:
    assert reserve.Settings() == reserve.Settings(900.0, 86400.0, 2, "true")
    for bad in ({"after_s": -1}, {"max_hold_s": 0}, {"max_reservations": -1}, {"deadlines": "maybe"},
                {"grace_s": -1}, {"cooldown_s": -1}):
        with pytest.raises(ValueError):
            reserve.Settings(**bad)


def test_planner_job_from_the_bench_view() -> None:
    inv = inventory(NODES)
    small, big = job(1, 2), job(2, 16, arrival=10.0, prefs="h200>h100")
    clock = pm.VirtualClock([small, big])
    clock.advance(0.0)
    clock.due_arrivals()
    placements = started(clock, small, "a1", devices=("gpu-0", "gpu-1"))
    pods_on = reserve.pods_by_node(clock, placements, {"j00001-0": small}, "true")
    assert pods_on == {"a1": [("j00001-0", ("gpu-0", "gpu-1"), 3600.0)]}
    assert reserve.pods_by_node(clock, placements, {"j00001-0": small}, "none")["a1"][0][2] is None
    pj = reserve.planner_job(big, "run1", "ns", inv, FABRIC, used_of(placements), pods_on, {"b1": "other-uid"},
                             reserve.Settings(after_s=60), None, False)
    assert (pj.pods, pj.waiting_since, pj.after_s, pj.uid) == (2, 10.0, 60, reserve.job_uid("run1", 2))
    by = {n.name: n for n in pj.nodes}
    assert set(by) == set(NODES)  # every node of a listed model (H200, H100)
    # The gang's own level is its unit (its PodGroup's constraint); the leaf is the narrower level it prefers.
    assert by["a1"].domain == "s1" and by["a1"].narrower == ("la",) and pj.narrower_within_s == 1800.0
    assert len(by["a1"].free) == 6 and by["a1"].running[0].end == 3600.0
    assert by["b1"].free == ()  # held by another job: nothing free for this one
    assert len(by["b2"].free) == 8 and pj.capacity(by["b2"].free) == 1 and pj.capacity(by["a1"].free) == 0
    whole = reserve.planner_job(job(3, 8), "run1", "ns", inv, FABRIC, set(), {}, {}, reserve.Settings(), None, False)
    assert {n.name: (n.domain, n.narrower) for n in whole.nodes}["a2"] == ("a2", ())  # an 8-GPU job: its node
    a100 = reserve.planner_job(job(4, 16, prefs="mem80"), "r", "ns", inventory({**NODES, "x": "a100"}),
                               FABRIC, set(), {}, {}, reserve.Settings(), None, False)
    assert "x" in {n.name for n in a100.nodes} and {n.domain for n in a100.nodes if n.name == "x"} == {None}


def test_reserver_holds_the_leaf_with_fewest_pods_to_wait_for_then_releases_when_bound() -> None:
    inv = inventory(NODES)
    s1, s2, big = job(1, 1, duration=500.0), job(2, 1, duration=5000.0), job(3, 16, arrival=0.0, duration=100.0)
    jobs = [s1, s2, big]
    clock = pm.VirtualClock(jobs)
    clock.advance(0.0)
    clock.due_arrivals()
    placements = {**started(clock, s1, "a1", devices=("gpu-0",)), **started(clock, s2, "b1", devices=("gpu-0",))}
    by_pod = {n: j for j in jobs for n in j.pod_names()}
    r = reserve.Reserver(reserve.Settings(after_s=100, max_hold_s=3000, max_reservations=1), "run1", "ns", inv,
                         FABRIC)
    plan, want = r.step(clock, placements, used_of(placements), by_pod)
    assert [x.state for x in plan.reservations] == [rsv.HINT] and r.made == 0  # not eligible yet: a hint only
    assert all(w["spec"]["taint"]["effect"] == vocab.HINT_EFFECT for w in want.values())
    clock.advance(200.0)
    plan, want = r.step(clock, placements, used_of(placements), by_pod)
    held = plan.of(reserve.job_uid("run1", 3))
    assert held is not None and held.state == rsv.HELD and r.made == 1
    # la (a1 busy until 500) and lb (b1 busy until 5000, but b2, b3 are whole): lb needs no pod to end
    assert held.place.domain == "lb" and held.place.nodes == ("b2", "b3") and held.place.waits == ()
    assert {w["spec"]["deviceSelector"]["pool"] for w in want.values()} == {"b2", "b3"}
    rule = next(iter(want.values()))
    assert rule["apiVersion"] == "resource.k8s.io/v1" and rule["spec"]["taint"] == {
        "key": vocab.RESERVATION_TAINT_KEY, "value": reserve.job_uid("run1", 3), "effect": vocab.HOLD_EFFECT}
    assert rule["metadata"]["labels"][vocab.PROFILE_NS_LABEL] == "ns"
    r.observe(200.0, used_of(placements))
    assert r.series[-1] == (200.0, 16)  # both held nodes whole and free: 16 GPUs held idle
    assert r.first_hold[3] == (200.0, 0.0)
    # what the planner said, on change only: the hint while not eligible, then the hold with its domain
    assert [t for t, _ in r.timeline[3]] == [0, 200]
    assert r.timeline[3][0][1].startswith(f"{rsv.HINT} 2 nodes in ")
    assert r.timeline[3][1][1] == f"{rsv.HELD} 2 nodes in lb (narrowed), expected start 200"
    # the same plan again: the hold is kept, not made again
    clock.advance(300.0)
    r.step(clock, placements, used_of(placements), by_pod)
    assert r.made == 1 and len(r.timeline[3]) == 2  # unchanged: nothing new recorded
    # the gang binds: nothing waits, nothing is wanted
    placements.update(started(clock, big, "b2", "b3"))
    plan, want = r.step(clock, placements, used_of(placements), by_pod)
    assert plan.reservations == () and want == {} and r.held_nodes() == set()
    r.observe(300.0, used_of(placements))
    clock.advance(400.0)
    m = r.metrics(clock)
    assert m["reservations_made"] == 1 and m["reservations_leaked"] == 0
    assert m["reservation_idle_gpu_hours"] == 0.0  # the window [0, 0] (every job arrived at 0) has no length


def test_max_hold_expires_and_the_job_reserves_again_after_the_cool_down() -> None:
    inv = inventory({"a1": "h100", "a2": "h100"})
    fabric = {"a1": {"leaf": "la"}, "a2": {"leaf": "la"}}
    busy, big = job(1, 1, duration=1e6), job(2, 16)
    clock = pm.VirtualClock([busy, big])
    clock.advance(0.0)
    clock.due_arrivals()
    placements = started(clock, busy, "a1", devices=("gpu-0",))
    by_pod = {n: j for j in (busy, big) for n in j.pod_names()}
    r = reserve.Reserver(reserve.Settings(after_s=0, max_hold_s=100), "run", "ns", inv, fabric)
    plan, _ = r.step(clock, placements, used_of(placements), by_pod)
    assert r.made == 1 and plan.reservations[0].place.waits == ("j00001-0",)
    assert r.first_hold[2] == (0.0, 1e6)  # the longest remaining time of the pods it waits for
    clock.advance(150.0)
    plan, want = r.step(clock, placements, used_of(placements), by_pod)
    assert [j.uid for j in plan.expired] == [reserve.job_uid("run", 2)] and want == {} and r.expired_count == 1
    clock.advance(300.0)
    plan, want = r.step(clock, placements, used_of(placements), by_pod)
    assert want == {} and r.made == 1 and r.expired_count == 1
    clock.advance(150.0 + 1800.0)  # the cool-down (Settings.cooldown_s) is over: reserved again
    plan, want = r.step(clock, placements, used_of(placements), by_pod)
    assert [x.state for x in plan.reservations] == [rsv.HELD] and r.made == 2


def test_backfill_jobs_tolerate_windows_that_fit_their_duration_and_held_nodes_get_windows() -> None:
    small, short, huge = job(1, 2, duration=1000.0), job(2, 1, duration=100.0), job(3, 1, duration=60_000.0)
    s = reserve.Settings()
    assert [reserve.backfills(j, s) for j in (small, short, huge, job(4, 8), job(5, 16))] == [
        True, True, False, True, False]
    assert not reserve.backfills(job(4, 8), reserve.Settings(whole_server=True))
    assert not reserve.backfills(small, reserve.Settings(backfill=False))
    spec = pm.claim_spec_for(small, "g")
    assert spec is not None
    tols = reserve.backfilling(spec, small)["devices"]["requests"][0]
    got = (tols.get("exactly") or tols["firstAvailable"][0])["tolerations"]
    assert got == vocab.backfill_tolerations(1000)
    assert [t["value"] for t in got[1:]] == ["30m", "1h", "2h", "4h", "8h", "16h"]  # 1000 s needs 30m or more
    assert reserve.deadline_s(job(6, 1, duration=99.2)) == 100
    # A held node gets its window: the hold waits for a pod ending at 10,000; margin = one step (900 s).
    inv = inventory({"a1": "h100", "a2": "h100"})
    fabric = {"a1": {"leaf": "la"}, "a2": {"leaf": "la"}}
    busy, big, small = job(7, 8, duration=10_000.0), job(8, 16), job(1, 2, arrival=50.0, duration=1000.0)
    clock = pm.VirtualClock([busy, big, small])
    clock.advance(0.0)
    clock.due_arrivals()
    placements = started(clock, busy, "a1")
    by_pod = {n: j for j in (busy, big, small) for n in j.pod_names()}
    r = reserve.Reserver(reserve.Settings(after_s=0), "run", "ns", inv, fabric)
    plan, want = r.step(clock, placements, used_of(placements), by_pod)
    (held,) = plan.reservations
    assert held.place.expected_start == 10_000.0
    windows = {w["spec"]["deviceSelector"]["pool"]: w["spec"]["taint"]["value"] for w in want.values()
               if w["spec"]["taint"]["key"] == vocab.BACKFILL_WINDOW_KEY}
    assert windows == {"a1": "2h", "a2": "2h"}  # 10,000 - 0 - 900 = 9,100 s: 2h is the largest bucket that fits
    # A backfill job bound on a held node after the hold counts as backfilled GPUs.
    clock.advance(100.0)
    clock.due_arrivals()
    placements.update(started(clock, small, "a2", devices=("gpu-0", "gpu-1")))
    r.observe(100.0, used_of(placements), clock, placements, by_pod)
    assert r.backfill_series[-1] == (100.0, 2)
    none = reserve.Reserver(reserve.Settings(after_s=0, deadlines="none"), "run", "ns", inv, fabric)
    _plan, want = none.step(clock, placements, used_of(placements), by_pod)
    assert {w["spec"]["taint"]["value"] for w in want.values()
            if w["spec"]["taint"]["key"] == vocab.BACKFILL_WINDOW_KEY} == {vocab.CLOSED}  # no estimate, no backfill


def test_rule_changes_and_leaks() -> None:
    def rule(name: str, effect: str, uid: str = "u1", ns: str = "ns") -> dict[str, object]:
        return {"metadata": {"name": name, "labels": {vocab.PROFILE_NS_LABEL: ns, vocab.UID_LABEL: uid,
                                                      vocab.MANAGED_LABEL: vocab.MANAGED_VALUE}},
                "spec": {"taint": {"key": vocab.RESERVATION_TAINT_KEY, "value": uid, "effect": effect}}}

    have = {"keep": rule("keep", "NoSchedule"), "gone": rule("gone", "NoSchedule"), "flip": rule("flip", "None")}
    want = {"keep": rule("keep", "NoSchedule"), "flip": rule("flip", "NoSchedule"), "new": rule("new", "None")}
    delete, create = rule_changes(have, want)
    assert delete == ["flip", "gone"] and [c["metadata"]["name"] for c in create] == ["flip", "new"]
    assert rule_changes(want, want) == ([], [])
    # Read back, a rule carries the API server's timeAdded: still the same rule (the bench re-made every rule
    # on every step with its own copy of this comparison, which counted it).
    stamped = copy.deepcopy(want)
    for r in stamped.values():
        r["spec"]["taint"]["timeAdded"] = "2026-12-03T18:00:00Z"  # type: ignore[index]
    assert rule_changes(stamped, want) == ([], [])
    rules = [rule("a", "NoSchedule", "u1"), rule("b", "NoSchedule", "u2"), rule("c", "NoSchedule", "u3", ns="other")]
    assert reserve.leaked(rules, "ns", {"u1"}) == 1  # u2's job is not waiting; u3 is another replay's
    assert reserve.hold_rules(rules) == 3


def test_adversarial_stream_small_jobs_and_one_64_gpu_job() -> None:
    spec = pm.SyntheticSpec(jobs=40, capacity_gpus=400)
    jobs = gang.adversarial_jobs(spec, 3)
    assert len(jobs) == 40 and jobs == gang.adversarial_jobs(spec, 3)
    big = [j for j in jobs if j.gpus == 64]
    assert len(big) == 1 and big[0].id == 39 and big[0].prefs == gang.BIG_JOB_PREFS
    assert {j.gpus for j in jobs if j.gpus != 64} <= {1, 2}
    assert {j.prefs for j in jobs if j.gpus != 64} <= {p for p, _w in gang.ADVERSARIAL_PREFS}
    assert big[0].arrival == jobs[int(gang.BIG_JOB_AT * 39)].arrival
    with pytest.raises(pm.WorkloadError):
        gang.adversarial_jobs(pm.SyntheticSpec(jobs=1), 1)
    clock = pm.VirtualClock(jobs)
    clock.advance(big[0].arrival)
    clock.due_arrivals()
    m = reserve.big_job_metrics(clock)
    assert m["big_job_started"] == 0 and math.isnan(m["big_job_wait_s"])
    clock.advance(big[0].arrival + 1200)
    clock.started(big[0].id, [])
    m = reserve.big_job_metrics(clock)
    assert (m["big_job_wait_s"], m["big_job_started"]) == (1200, 1)
    assert reserve.big_job_metrics(pm.VirtualClock([job(1, 64), job(2, 64)])) == {}
