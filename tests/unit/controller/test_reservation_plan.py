"""The reservation planner (controller/reservation.py): who waits, who may reserve, where, until when."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest

from topodra.controller.reservation import (
    HELD,
    HINT,
    Existing,
    Job,
    NodeState,
    RunningPod,
    choose_place,
    plan,
)

NOW = 100_000.0


def per(count: int) -> Any:
    def capacity(devices: Sequence[Any]) -> int:
        return len(devices) // count
    return capacity


def node(name: str, domain: str | None, free: int, *running: tuple[str, int, float | None]) -> NodeState:
    """``free`` free GPUs, then (pod, GPUs it holds, its end) for each running pod."""
    devs = iter(range(1000))
    return NodeState(name, domain, tuple(f"{name}/{next(devs)}" for _ in range(free)),
                     tuple(RunningPod(p, tuple(f"{name}/{p}/{i}" for i in range(g)), end) for p, g, end in running))


def job(uid: str = "u1", pods: int = 2, waited: float = 1000.0, nodes: Sequence[NodeState] = (),
        after: float = 600.0, hold: float = 3600.0, existing: Existing | None = None,
        expired_at: float | None = None, count: int = 8, cooldown: float = 1800.0, grace: float = 900.0) -> Job:
    return Job("ml", f"job-{uid}", uid, pods, NOW - waited if pods else None, after, hold, tuple(nodes), per(count),
               existing, expired_at, cooldown, grace)


LEAF_A = [node("a1", "A", 8), node("a2", "A", 2, ("ml/s1", 6, None)), node("a3", "A", 0, ("ml/s2", 8, None))]
LEAF_B = [node("b1", "B", 4, ("ml/s3", 2, None), ("ml/s4", 2, None)), node("b2", "B", 6, ("ml/s5", 2, None))]


def test_not_eligible_before_after_waiting_then_the_domain_with_fewest_pods_to_wait_for() -> None:
    early = plan([job(waited=500, nodes=LEAF_A + LEAF_B)], NOW, 2)
    assert [r.state for r in early.reservations] == [HINT]  # the hint: where it would go, nothing held
    assert early.notes["u1"] == "waiting 500s of 600s before it may reserve"
    p = plan([job(nodes=LEAF_A + LEAF_B)], NOW, 2)
    (r,) = p.reservations
    # A: a1 is free, then one pod to wait for (a2's s1 or a3's s2); B needs three (s3, s4, s5).
    assert (r.state, r.place.domain, r.since, r.waiting_since) == (HELD, "A", NOW, NOW - 1000)
    assert r.place.nodes == ("a1", "a2") and r.place.waits == ("ml/s1",)  # only the nodes the job needs
    assert r.place.gpus_free == 10  # a1's 8 and a2's 2 are held idle
    assert r.place.expected_start is None  # s1 declares no deadline


def test_expected_start_is_the_last_deadline_of_the_pods_waited_for_when_all_declare_one() -> None:
    nodes = [node("a1", "A", 0, ("ml/s1", 4, NOW + 300), ("ml/s2", 4, NOW + 900)),
             node("a2", "A", 4, ("ml/s3", 4, NOW + 60))]
    (r,) = plan([job(nodes=nodes)], NOW, 1).reservations
    assert r.place.waits == ("ml/s1", "ml/s2", "ml/s3") and r.place.expected_start == NOW + 900
    free = [node("f1", "F", 8), node("f2", "F", 8)]
    (r,) = plan([job(nodes=nodes + free)], NOW, 1).reservations
    assert r.place.domain == "F" and r.place.waits == () and r.place.expected_start == NOW


def test_equal_waits_prefer_the_earlier_known_end_then_more_free_gpus() -> None:
    a = [node("a1", "A", 0, ("ml/x", 8, NOW + 500))]
    b = [node("b1", "B", 0, ("ml/y", 8, NOW + 100))]
    c = [node("c1", "C", 4, ("ml/z", 4, None))]
    got = choose_place(job(pods=1, nodes=a + b + c), NOW)
    assert got is not None and got.domain == "B"
    got = choose_place(job(pods=1, nodes=a + c), NOW)
    assert got is not None and got.domain == "A"  # a known end beats an unknown one
    d = [node("d1", "D", 6, ("ml/w", 2, None))]
    got = choose_place(job(pods=1, nodes=c + d), NOW)
    assert got is not None and got.domain == "D"  # one pod each to wait for: D has more free


def test_a_domain_too_small_even_when_everything_ends_is_never_chosen() -> None:
    small = [node("s1", "S", 8)]
    p = plan([job(pods=2, nodes=[*small, node("x", None, 8)])], NOW, 1)
    assert p.reservations == ()
    assert p.notes["u1"] == "eligible, but no domain can hold the whole job even when its running pods end"


def test_at_most_max_reservations_oldest_eligible_first_and_the_next_gets_the_hint() -> None:
    nodes = [node(f"n{i}", "D", 8) for i in range(6)]
    jobs = [job("young", waited=700, nodes=nodes), job("old", waited=5000, nodes=nodes),
            job("mid", waited=2000, nodes=nodes)]
    p = plan(jobs, NOW, 2)
    held = {r.uid: r for r in p.reservations if r.state == HELD}
    assert set(held) == {"old", "mid"}
    assert not set(held["old"].place.nodes) & set(held["mid"].place.nodes)  # no node reserved twice
    (hint,) = [r for r in p.reservations if r.state == HINT]
    assert hint.uid == "young" and not set(hint.place.nodes) & {n for r in held.values() for n in r.place.nodes}
    assert p.notes["young"] == "eligible, but 2 reservation(s) already hold (oldest first)"
    assert plan(jobs, NOW, 0).reservations[0].state == HINT  # 0: reservations hold nowhere


def test_a_hold_is_kept_where_it_is_until_the_job_binds_or_max_hold_passes() -> None:
    nodes = LEAF_A + LEAF_B
    ex = Existing(HELD, ("b1", "b2"), "B", NOW - 100)
    (r,) = plan([job(nodes=nodes, existing=ex)], NOW, 2).reservations
    assert (r.state, r.place.nodes, r.since) == (HELD, ("b1", "b2"), NOW - 100)  # not moved to the better A
    bound = plan([job(pods=0, nodes=nodes, existing=ex)], NOW, 2)
    assert bound.reservations == () and bound.expired == ()  # released: nothing left to wait for
    late = plan([job(nodes=nodes, existing=Existing(HELD, ("b1", "b2"), "B", NOW - 3600))], NOW, 2)
    assert late.reservations == () and [j.uid for j in late.expired] == ["u1"]
    assert late.notes["u1"] == "released after holding 3600s (maxHold 3600s)"


def test_a_hold_with_a_known_start_ends_grace_after_it_capped_by_max_hold() -> None:
    nodes = [node("a1", "A", 0, ("ml/x", 8, NOW + 300)), node("a2", "A", 8)]
    # Made 2000 s ago expecting a start 1000 s ago: the grace (900 s) is over, maxHold (3600 s) is not.
    ex = Existing(HELD, ("a1", "a2"), "A", NOW - 2000, NOW - 1000)
    late = plan([job(nodes=nodes, existing=ex)], NOW, 2)
    assert [j.uid for j in late.expired] == ["u1"] and late.reservations == ()
    assert late.notes["u1"] == "released after holding 2000s (900s past its expected start)"
    # Within the grace: kept, with the earliest start it was given (the pod's end now says NOW + 300).
    ex = Existing(HELD, ("a1", "a2"), "A", NOW - 2000, NOW - 500)
    (r,) = plan([job(nodes=nodes, existing=ex)], NOW, 2).reservations
    assert (r.state, r.place.expected_start) == (HELD, NOW - 500)
    # A start later than maxHold allows: maxHold wins.
    far = [node("a1", "A", 0, ("ml/x", 8, NOW + 50_000)), node("a2", "A", 8)]
    ex = Existing(HELD, ("a1", "a2"), "A", NOW - 3600, NOW + 50_000)
    late = plan([job(nodes=far, existing=ex)], NOW, 2)
    assert late.notes["u1"] == "released after holding 3600s (maxHold 3600s)"
    # A long maxHold keeps a hold that waits for a far start (the old 2 h rule released it).
    (r,) = plan([job(nodes=far, existing=ex, hold=86_400)], NOW, 2).reservations
    assert (r.state, r.place.expected_start) == (HELD, NOW + 50_000)


def test_an_expired_wait_reserves_again_after_the_cool_down() -> None:
    nodes = LEAF_A + LEAF_B
    cooling = plan([job(nodes=nodes, expired_at=NOW - 100)], NOW, 2)  # the status says Expired 100 s ago
    assert cooling.reservations == ()
    assert cooling.notes["u1"] == "its reservation ran out; may reserve again in 1700s (cool-down 1800s)"
    (r,) = plan([job(nodes=nodes, expired_at=NOW - 1800)], NOW, 2).reservations
    assert (r.state, r.since, r.place.domain) == (HELD, NOW, "A")


def test_the_domain_that_starts_soonest_wins_over_fewer_pods_to_wait_for() -> None:
    one_long = [node("x1", "X", 0, ("ml/long", 8, NOW + 30_000)), node("x2", "X", 8)]
    three_short = [node("y1", "Y", 0, ("ml/s1", 4, NOW + 100), ("ml/s2", 4, NOW + 200)),
                   node("y2", "Y", 0, ("ml/s3", 8, NOW + 300))]
    got = choose_place(job(nodes=one_long + three_short), NOW)
    assert got is not None and (got.domain, got.expected_start, len(got.waits)) == ("Y", NOW + 300, 3)
    # Equal starts: fewer pods to wait for.
    same = [node("z1", "Z", 0, ("ml/z", 8, NOW + 300)), node("z2", "Z", 8)]
    got = choose_place(job(nodes=three_short + same), NOW)
    assert got is not None and got.domain == "Z"


def test_inside_a_domain_the_nodes_that_drain_soonest_are_reserved() -> None:
    nodes = [node("n1", "D", 0, ("ml/one", 8, NOW + 5000)),
             node("n2", "D", 0, ("ml/a", 4, NOW + 100), ("ml/b", 4, NOW + 200)), node("n3", "D", 8)]
    got = choose_place(job(nodes=nodes), NOW)
    assert got is not None and got.nodes == ("n2", "n3") and got.expected_start == NOW + 200
    assert got.waits == ("ml/a", "ml/b")


def test_a_hold_whose_nodes_cannot_hold_the_job_any_more_is_planned_again() -> None:
    ex = Existing(HELD, ("gone", "a1"), "A", NOW - 100)
    (r,) = plan([job(nodes=LEAF_A + LEAF_B, existing=ex)], NOW, 2).reservations
    assert r.state == HELD and r.since == NOW and r.place.nodes == ("a1", "a2")


def test_a_hint_keeps_its_since_while_it_points_at_the_same_nodes() -> None:
    ex = Existing(HINT, ("a1", "a2"), "A", NOW - 50)
    (r,) = plan([job(waited=10, nodes=LEAF_A, existing=ex)], NOW, 2).reservations
    assert (r.state, r.since) == (HINT, NOW - 50)


def test_whole_server_jobs_take_the_node_that_frees_soonest() -> None:
    nodes = [node("a", "a", 0, ("ml/p", 4, None), ("ml/q", 4, None)), node("b", "b", 6, ("ml/r", 2, None))]
    (r,) = plan([job(pods=1, nodes=nodes)], NOW, 1).reservations
    assert r.place.nodes == ("b",) and r.place.waits == ("ml/r",)


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="needs the profile's uid"):
        job(uid="")
    with pytest.raises(ValueError, match="maxHold must be positive"):
        job(hold=0)
    with pytest.raises(ValueError, match="must not be negative"):
        job(cooldown=-1)
    with pytest.raises(ValueError, match="two jobs share a uid"):
        plan([job(), job()], NOW, 1)
    with pytest.raises(ValueError, match="max_reservations must not be negative"):
        plan([], NOW, -1)


def two_level(name: str, leaf: str, free: int, *running: tuple[str, int, float | None]) -> NodeState:
    """A node of unit "su" (the job's own level) in leaf ``leaf`` (the narrower level it prefers)."""
    n = node(name, "su", free, *running)
    return NodeState(n.name, n.domain, n.free, n.running, (leaf,))


def test_a_leaf_is_held_only_when_it_starts_the_job_at_most_narrower_within_after_the_unit() -> None:
    nodes = [two_level("a1", "A", 8), two_level("a2", "A", 0, ("ml/long", 8, NOW + 36_000)),
             two_level("b1", "B", 0, ("ml/short", 8, NOW + 3_600)), two_level("b2", "B", 0, ("ml/l2", 8, NOW + 43_200))]
    # Leaf A starts the job in 10 h, B in 12 h; the unit's soonest nodes (a1 now, b1 in 1 h) in 1 h.
    got = choose_place(Job("ml", "j", "u1", 2, NOW - 1000, 600, 3600, tuple(nodes), per(8),
                           narrower_within_s=1800), NOW)
    assert got is not None and (got.domain, got.nodes, got.narrowed) == ("su", ("a1", "b1"), None)
    assert got.expected_start == NOW + 3_600
    # Accepting up to 10 h later: leaf A (10 h <= 1 h + 10 h).
    got = choose_place(Job("ml", "j", "u1", 2, NOW - 1000, 600, 3600, tuple(nodes), per(8),
                           narrower_within_s=36_000), NOW)
    assert got is not None and (got.domain, got.nodes, got.narrowed) == ("A", ("a1", "a2"), 0)
    # Unknown ends everywhere: the narrow level (nothing says the unit is sooner).
    blind = [two_level(n.name, n.narrower[0] or "", len(n.free), *((p.name, len(p.devices), None) for p in n.running))
             for n in nodes]
    got = choose_place(Job("ml", "j", "u1", 2, NOW - 1000, 600, 3600, tuple(blind), per(8)), NOW)
    assert got is not None and got.narrowed == 0
    # A held hold keeps its level through plan (Existing.narrowed).
    j = Job("ml", "j", "u1", 2, NOW - 1000, 600, 86_400, tuple(nodes), per(8),
            Existing(HELD, ("a1", "a2"), "A", NOW - 60, NOW + 36_000, 0), narrower_within_s=0)
    (r,) = plan([j], NOW, 1).reservations
    assert (r.state, r.place.domain, r.place.nodes, r.place.narrowed) == (HELD, "A", ("a1", "a2"), 0)
    with pytest.raises(ValueError, match="narrowerWithin"):
        Job("ml", "j", "u1", 2, NOW, 600, 3600, (), per(8), narrower_within_s=-1)


def held_for_other(name: str, domain: str, reserved: int, *running: tuple[str, int, float | None]) -> NodeState:
    """A node whose ``reserved`` free devices another job's hold keeps (free for that job, not for this one)."""
    n = node(name, domain, 0, *running)
    return replace(n, reserved=tuple(f"{name}/r{i}" for i in range(reserved)))


def test_a_job_behind_an_earlier_hold_with_a_known_runtime_holds_the_rest_at_its_earliest_start() -> None:
    # Five 8-GPU servers of the one model both jobs accept: h1, h2 free, h3-h5 running pods that end at +500, +9000
    # and +20000. "first" (older, 2 servers, runs at most 3000 s) holds h1, h2 and starts now. "big" (4 servers)
    # cannot start before first ends: it holds h3, h4 now and counts on h1, h2 from +3000 (Slurm's backfill order).
    running = [node("h3", "H", 0, ("ml/s1", 8, NOW + 500)), node("h4", "H", 0, ("ml/s2", 8, NOW + 9000)),
               node("h5", "H", 0, ("ml/s3", 8, NOW + 20_000))]
    first = replace(job("first", pods=2, waited=5000, nodes=[node("h1", "H", 8), node("h2", "H", 8), *running]),
                    runtime_s=3000.0)
    behind = [held_for_other("h1", "H", 8), held_for_other("h2", "H", 8), *running]
    big = job("big", pods=4, waited=4000, nodes=behind)
    p = plan([first, big], NOW, 2)
    held = {r.uid: r for r in p.reservations}
    assert held["first"].place.nodes == ("h1", "h2") and held["first"].place.expected_start == NOW
    b = held["big"]
    assert (b.state, b.place.nodes, b.place.after) == (HELD, ("h3", "h4"), ("h1", "h2"))
    assert b.place.expected_start == NOW + 9000 and b.place.waits == ("ml/s1", "ml/s2")
    assert b.place.gpus_free == 0  # h3 and h4 are busy now: nothing held idle yet
    # Without a runtime for first, its servers are out of big's plan: 3 servers are too few, no hold (as before).
    blind = plan([replace(first, runtime_s=None), big], NOW, 2)
    assert [r.uid for r in blind.reservations] == ["first"]
    assert blind.notes["big"] == "eligible, but no domain can hold the whole job even when its running pods end"
    # The next pass keeps both holds where they are, big's still counting on h1, h2.
    first_ex = Existing(HELD, ("h1", "h2"), "H", NOW, NOW)
    big_ex = Existing(HELD, ("h3", "h4"), "H", NOW, NOW + 9000)
    later = plan([replace(first, existing=first_ex), replace(big, existing=big_ex)], NOW + 100, 2)
    kept = later.of("big")
    assert kept is not None and (kept.since, kept.place.nodes, kept.place.after) == (NOW, ("h3", "h4"), ("h1", "h2"))
    # first binds (its pods run on h1, h2 until +3000): big plans again over all four servers it needs.
    bound = [node("h1", "H", 0, ("ml/f0", 8, NOW + 3000)), node("h2", "H", 0, ("ml/f1", 8, NOW + 3000)), *running]
    after_bind = plan([replace(first, pods=0, existing=first_ex), replace(big, nodes=tuple(bound), existing=big_ex)],
                      NOW + 100, 2)
    (b,) = after_bind.reservations
    assert (b.uid, b.place.nodes, b.place.after, b.since) == ("big", ("h1", "h2", "h3", "h4"), (), NOW + 100)
    assert b.place.expected_start == NOW + 9000


def test_a_place_made_only_of_servers_held_for_an_earlier_job_holds_nothing() -> None:
    first = replace(job("first", pods=2, waited=5000, nodes=[node("h1", "H", 8), node("h2", "H", 8)]),
                    runtime_s=600.0)
    big = job("big", pods=2, waited=4000, nodes=[held_for_other("h1", "H", 8), held_for_other("h2", "H", 8),
                                                 node("h3", "H", 0, ("ml/x", 8, None))])
    p = plan([first, big], NOW, 2)
    assert [r.uid for r in p.reservations] == ["first"]  # h1, h2 at +600 beat h3 (unknown end): nothing to hold
    assert p.notes["big"].endswith("and the holds of jobs before it with a known runtime end")
    with pytest.raises(ValueError, match="runtime bound must be positive"):
        replace(first, runtime_s=0.0)
