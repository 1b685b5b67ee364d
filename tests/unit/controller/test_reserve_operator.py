"""Reservations against an in-memory API (controller/reserve.py): rules made, kept, released and collected."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from test_controller_operator import PROFILES, FakeKube, add_profile, kube  # noqa: F401 - kube is a fixture
from test_gang_profile import held, hgx, node

from topodra import reservations as vocab
from topodra.apipaths import claim_path, device_taint_rule_path, node_path, pod_path, slices_path, template_path
from topodra.controller.operator import ControllerConfig, SnapshotCache, process, refresh_all
from topodra.controller.reservation import HELD, Place, Reservation
from topodra.controller.reserve import existing_reservations, reconcile_reservations, render_rule

Obj = dict[str, Any]
CFG = ControllerConfig(snapshot_ttl_s=0, reservation_after_s=60, max_reservations=2)
D = "gpu.topodra.io"
SPEC: Obj = {"alternatives": [{"deviceClassName": "gpu-h100", "count": 8}], "pods": 2,
             "acrossNodes": {"sameDomain": ["leafGroup"]}, "reservation": {"afterWaiting": "5m"}}
RULES = device_taint_rule_path()


def ago(seconds: float) -> str:
    return datetime.fromtimestamp(datetime.now(UTC).timestamp() - seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def cluster(k: FakeKube, small: dict[str, int]) -> None:
    """Nodes n0..n3 in leaf l1, each with 8 H100s; ``small[node]`` 1-GPU pods running there (no deadline)."""
    for i in range(4):
        name = f"n{i}"
        k.create(slices_path(), hgx(name))
        k.create(node_path(), node(name, leaf_group="l1"))
        for j in range(small.get(name, 0)):
            claim = f"{name}-c{j}"
            k.create(claim_path("ml"), {"metadata": {"name": claim, "namespace": "ml"}, "status": {"allocation": {
                "devices": {"results": [{"request": "gpus", "driver": D, "pool": name, "device": f"gpu-{j}"}]}}}})
            k.create(pod_path("ml"), {"metadata": {"name": f"{name}-p{j}", "namespace": "ml"},
                                      "spec": {"nodeName": name},
                                      "status": {"phase": "Running", "startTime": ago(100),
                                                 "resourceClaimStatuses": [{"name": "gpus",
                                                                            "resourceClaimName": claim}]}})


def gang_pods(k: FakeKube, waited: float, n: int = 2) -> None:
    for i in range(n):
        k.create(pod_path("ml"), {"metadata": {"name": f"train-{i}", "namespace": "ml",
                                               "creationTimestamp": ago(waited)},
                                  "spec": {"schedulingGroup": {"podGroupName": "train"}},
                                  "status": {"phase": "Pending"}})


def refresh(k: FakeKube, cfg: ControllerConfig = CFG) -> Obj:
    assert refresh_all(k, cfg, SnapshotCache(cfg)) == 0  # type: ignore[arg-type]
    return dict(k.objs[f"{PROFILES}/train"].get("status") or {})


def rules(k: FakeKube) -> dict[str, Obj]:
    return {name.rsplit("/", 1)[1]: o for name, o in k.objs.items() if name.startswith(RULES + "/")}


def test_a_waiting_gang_reserves_the_nodes_with_fewest_pods_then_releases_when_bound(kube: FakeKube) -> None:  # noqa: F811
    cluster(kube, {"n0": 3, "n1": 1, "n2": 2, "n3": 0})
    add_profile(kube, SPEC)
    uid = kube.objs[f"{PROFILES}/train"]["metadata"]["uid"]
    tmpl = kube.objs.get(template_path("ml", "train"))
    gang_pods(kube, waited=30)
    st = refresh(kube)
    # The template tolerates the profile's own taint from the start.
    tmpl = kube.objs[template_path("ml", "train")]
    (req,) = tmpl["spec"]["spec"]["devices"]["requests"]
    assert req["exactly"]["tolerations"] == [vocab.toleration(uid), vocab.window_toleration()]
    # Waiting 30 s of 5 min: a hint (effect None) only, where it would go.
    assert st["reservation"]["state"] == "Hint" and st["reservation"]["nodes"] == ["n1", "n3"]
    assert {r["spec"]["taint"]["effect"] for r in rules(kube).values()} == {"None"}

    for name in [f"train-{i}" for i in range(2)]:
        kube.objs[f"{pod_path('ml')}/{name}"]["metadata"]["creationTimestamp"] = ago(400)
    st = refresh(kube)
    res = st["reservation"]
    assert (res["state"], res["domain"], res["level"], res["nodes"]) == ("Held", "l1", "leafGroup", ["n1", "n3"])
    assert (res["gpusHeldIdle"], res["podsToWaitFor"]) == (15, 1) and "expectedStart" not in res
    assert res["backfillWindow"] == vocab.CLOSED  # no expected start: no backfill
    windows = {n: r for n, r in rules(kube).items() if r["spec"]["taint"]["key"] == vocab.BACKFILL_WINDOW_KEY}
    assert sorted(r["spec"]["deviceSelector"]["pool"] for r in windows.values()) == ["n1", "n3"]
    assert all(r["spec"]["taint"] == {"key": vocab.BACKFILL_WINDOW_KEY, "value": vocab.CLOSED,
                                      "effect": "NoSchedule"} for r in windows.values())
    got = {n: r for n, r in rules(kube).items() if n not in windows}
    assert sorted(r["spec"]["deviceSelector"]["pool"] for r in got.values()) == ["n1", "n3"]
    for r in got.values():
        assert r["spec"]["taint"] == {"key": vocab.RESERVATION_TAINT_KEY, "value": uid, "effect": "NoSchedule"}
        assert r["spec"]["deviceSelector"]["driver"] == D
        assert r["metadata"]["labels"] == {vocab.MANAGED_LABEL: vocab.MANAGED_VALUE, vocab.PROFILE_NS_LABEL: "ml",
                                           vocab.PROFILE_NAME_LABEL: "train", vocab.UID_LABEL: uid}
    events = [o["reason"] for p, o in kube.objs.items() if "/events/" in p]
    assert events.count("Reserved") == 1

    # A second pass changes nothing (the hold is kept, no new writes of rules).
    before = set(rules(kube))
    refresh(kube)
    assert set(rules(kube)) == before

    # The gang binds: the rules go, the status is cleared, and an Event says so.
    for i in range(2):
        kube.objs[f"{pod_path('ml')}/train-{i}"]["spec"]["nodeName"] = ["n1", "n3"][i]
    st = refresh(kube)
    assert rules(kube) == {} and st["reservation"] is None
    assert [o["reason"] for p, o in kube.objs.items() if "/events/" in p].count("ReservationReleased") == 1


def test_a_deleted_profiles_rules_are_collected_and_turning_reservations_off_drops_them(kube: FakeKube) -> None:  # noqa: F811
    cluster(kube, {})
    add_profile(kube, SPEC)
    gang_pods(kube, waited=400)
    refresh(kube)
    assert len(rules(kube)) == 4  # two holds, two backfill windows
    # Off cluster-wide: the rules go and the template loses its toleration in the same pass.
    off = ControllerConfig(snapshot_ttl_s=0, reservations=False)
    st = refresh(kube, off)
    assert rules(kube) == {} and st["reservation"] is None
    (req,) = kube.objs[template_path("ml", "train")]["spec"]["spec"]["devices"]["requests"]
    assert "tolerations" not in req["exactly"]
    refresh(kube)
    assert len(rules(kube)) == 4
    # The profile disappears while the controller is down: the next pass (a start) deletes its rules.
    del kube.objs[f"{PROFILES}/train"]
    assert reconcile_reservations(kube, CFG, "cannot read", []) is None  # type: ignore[arg-type]
    assert rules(kube) == {}


def test_a_stranger_rule_is_never_touched_and_a_profile_turned_off_drops_its_rules_at_once(kube: FakeKube) -> None:  # noqa: F811
    cluster(kube, {})
    kube.create(RULES, {"metadata": {"name": "admin-drain"}, "spec": {
        "deviceSelector": {"driver": D, "pool": "n0"}, "taint": {"key": "x.io/drain", "effect": "NoSchedule"}}})
    add_profile(kube, SPEC)
    gang_pods(kube, waited=400)
    st = refresh(kube)
    assert st["reservation"]["nodes"] == ["n1", "n2"]  # n0's GPUs are drained by the admin's rule
    body = kube.objs[f"{PROFILES}/train"]
    body["spec"] = {**SPEC, "reservation": {"enabled": False}}
    process(kube, kube.get(f"{PROFILES}/train"), CFG, SnapshotCache(CFG))  # type: ignore[arg-type]
    assert set(rules(kube)) == {"admin-drain"}
    assert kube.objs[f"{PROFILES}/train"]["status"]["reservation"] is None


def test_rules_read_back_as_the_reservation_they_make() -> None:
    r = Reservation("ml", "train", "u-1", HELD, Place("l1", ("n1", "n2"), (), None, 16), 1000.0, 900.0)
    made = [render_rule(r, n, D) for n in r.place.nodes]
    for m in made:
        m["metadata"]["creationTimestamp"] = "1970-01-01T00:16:40Z"
    assert existing_reservations([*made, {"metadata": {"name": "stranger"}}], 5.0)["u-1"].nodes == ("n1", "n2")
    ex = existing_reservations(made, 5.0)["u-1"]
    assert (ex.state, ex.domain, ex.since) == (HELD, "l1", 1000.0)
    del made[0]["metadata"]["creationTimestamp"], made[1]["metadata"]["creationTimestamp"]
    assert existing_reservations(made, 5.0)["u-1"].since == 5.0


def test_a_job_no_domain_can_hold_says_why_and_holds_nothing(kube: FakeKube) -> None:  # noqa: F811
    cluster(kube, {})
    add_profile(kube, {**SPEC, "pods": 5})
    gang_pods(kube, waited=400, n=5)
    st = refresh(kube)
    assert rules(kube) == {}
    assert st["reservation"]["state"] == "Waiting"
    assert st["reservation"]["message"] == ("eligible, but no domain can hold the whole job even when its running "
                                            "pods end")


def test_a_rule_read_back_with_the_api_servers_time_added_is_the_same_rule(kube: FakeKube) -> None:  # noqa: F811
    cluster(kube, {})
    add_profile(kube, SPEC)
    gang_pods(kube, waited=400)
    refresh(kube)
    for r in rules(kube).values():
        r["spec"]["taint"]["timeAdded"] = "2026-01-01T00:00:00Z"  # as kube-apiserver writes it
    uids = {r["metadata"]["uid"] for r in rules(kube).values()}
    refresh(kube)
    assert {r["metadata"]["uid"] for r in rules(kube).values()} == uids  # kept, not re-made every pass


def test_a_hold_with_a_known_start_opens_a_backfill_window_and_keeps_its_first_estimate(kube: FakeKube) -> None:  # noqa: F811
    cluster(kube, {"n1": 1})
    pod = kube.objs[f"{pod_path('ml')}/n1-p0"]
    pod["spec"]["activeDeadlineSeconds"] = 100 + 3 * 3600  # started 100 s ago: ends in 3 h
    add_profile(kube, {**SPEC, "pods": 4})  # all four nodes: n1's pod is waited for
    gang_pods(kube, waited=400, n=4)
    st = refresh(kube)
    res = st["reservation"]
    assert res["state"] == "Held" and "expectedStart" in res
    assert res["backfillWindow"] == "2h"  # 3 h less the margin (refresh interval + facts TTL) fits 2h, not 4h
    windows = {r["spec"]["deviceSelector"]["pool"]: r["spec"]["taint"]["value"] for r in rules(kube).values()
               if r["spec"]["taint"]["key"] == vocab.BACKFILL_WINDOW_KEY}
    assert windows == {f"n{i}": "2h" for i in range(4)}
    holds = [r for r in rules(kube).values() if r["spec"]["taint"]["key"] == vocab.RESERVATION_TAINT_KEY]
    assert {r["metadata"]["annotations"]["topodra.io/reservation-expected-start"] for r in holds} == {
        res["expectedStart"]}
    ex = existing_reservations(list(rules(kube).values()), 0.0)
    (only,) = ex.values()  # window rules are not a second reservation
    assert only.nodes == ("n0", "n1", "n2", "n3") and only.expected_start is not None


def test_a_gang_holds_its_units_soonest_nodes_unless_a_leaf_starts_it_within_narrower_within(
        kube: FakeKube) -> None:  # noqa: F811
    """sameDomain [leafGroup, scalableUnit]: nothing holds the gang now, so its PodGroup gets the unit; the hold
    goes to a leaf only when that leaf starts it at most narrowerWithin later than the unit's soonest nodes."""
    labels = {"n0": "l1", "n1": "l1", "n2": "l2", "n3": "l2"}
    ends = {"n1": 36000, "n2": 3600, "n3": 43200}  # seconds from now each node's one 8-GPU pod still runs
    for name, leaf in labels.items():
        kube.create(slices_path(), hgx(name))
        kube.create(node_path(), node(name, leaf_group=leaf, scalable_unit="su1"))
        if name in ends:
            claim = f"{name}-c"
            kube.create(claim_path("ml"), {"metadata": {"name": claim, "namespace": "ml"}, **held(name)})
            kube.create(pod_path("ml"), {"metadata": {"name": f"{name}-p", "namespace": "ml"},
                                         "spec": {"nodeName": name, "activeDeadlineSeconds": ends[name] + 100},
                                         "status": {"phase": "Running", "startTime": ago(100),
                                                    "resourceClaimStatuses": [{"name": "gpus",
                                                                               "resourceClaimName": claim}]}})
    spec = {**SPEC, "acrossNodes": {"sameDomain": ["leafGroup", "scalableUnit"]}}
    add_profile(kube, spec)
    gang_pods(kube, waited=400)
    res = refresh(kube)["reservation"]
    # l1 starts the job in 10 h (n1), l2 in 12 h, the unit in 1 h (n0 now, n2 in 1 h): the unit, across leaves.
    assert (res["state"], res["level"], res["domain"], res["nodes"]) == ("Held", "scalableUnit", "su1", ["n0", "n2"])
    assert not any(vocab_rule_narrowed(r) for r in rules(kube).values())

    # The profile accepts a leaf up to 10 h later: l1 (10 h <= 1 h + 10 h) is held, and stays held as a leaf.
    kube.objs[f"{PROFILES}/train"]["spec"] = {**spec, "reservation": {"afterWaiting": "5m", "narrowerWithin": "10h"}}
    for r in list(rules(kube)):
        kube.delete(f"{RULES}/{r}")
    for _ in range(2):
        res = refresh(kube)["reservation"]
        assert (res["state"], res["level"], res["domain"], res["nodes"]) == ("Held", "leafGroup", "l1", ["n0", "n1"])
    holds = [r for r in rules(kube).values() if r["spec"]["taint"]["key"] == vocab.RESERVATION_TAINT_KEY]
    assert len(holds) == 2 and {vocab_rule_narrowed(r) for r in holds} == {"0"}


def vocab_rule_narrowed(rule: Obj) -> str | None:
    return (rule["metadata"].get("annotations") or {}).get("topodra.io/reservation-narrowed")


def test_a_gang_behind_an_older_hold_with_declared_deadlines_holds_the_rest_and_counts_on_it(kube: FakeKube) -> None:  # noqa: F811
    cluster(kube, {})
    add_profile(kube, {**SPEC, "pods": 2}, name="first")
    for i in range(2):  # the older gang: its pods declare a 1 h runtime bound
        kube.create(pod_path("ml"), {"metadata": {"name": f"first-{i}", "namespace": "ml",
                                                  "creationTimestamp": ago(800)},
                                     "spec": {"schedulingGroup": {"podGroupName": "first"},
                                              "activeDeadlineSeconds": 3600},
                                     "status": {"phase": "Pending"}})
    add_profile(kube, {**SPEC, "pods": 3})
    gang_pods(kube, waited=400, n=3)
    st = refresh(kube)
    first = kube.objs[f"{PROFILES}/first"]["status"]["reservation"]
    assert first["state"] == "Held" and len(first["nodes"]) == 2
    res = st["reservation"]
    # train needs 3 of the 4 nodes: the 2 first does not hold now, and 1 of first's once first ends (in 1 h)
    assert res["state"] == "Held" and sorted(res["nodes"] + first["nodes"]) == ["n0", "n1", "n2", "n3"]
    assert res["message"].endswith(", counting on 1 node(s) held for jobs before it once they end")
    assert "expectedStart" in res and res["expectedStart"] > first["expectedStart"]
    holds = {r["spec"]["deviceSelector"]["pool"]: r["spec"]["taint"]["value"] for r in rules(kube).values()
             if r["spec"]["taint"]["key"] == vocab.RESERVATION_TAINT_KEY}
    assert len(holds) == 4 and len(set(holds.values())) == 2  # every node held once, by one of the two jobs
    # Without a runtime bound on first's pods, train cannot plan past first's hold: nothing held, and why.
    for i in range(2):
        del kube.objs[f"{pod_path('ml')}/first-{i}"]["spec"]["activeDeadlineSeconds"]
    st = refresh(kube)
    assert st["reservation"]["state"] == "Waiting" and st["reservation"]["message"] == (
        "eligible, but no domain can hold the whole job even when its running pods end")
    first_uid = kube.objs[f"{PROFILES}/first"]["metadata"]["uid"]
    assert {r["spec"]["taint"]["value"] for r in rules(kube).values()
            if r["spec"]["taint"]["key"] == vocab.RESERVATION_TAINT_KEY} == {first_uid}  # train's holds are gone
