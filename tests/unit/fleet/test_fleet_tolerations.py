"""Device tolerations in the fleet model (issue 33): the scheduler's matching rule, what a claim's requests
tolerate, and the reservation vocabulary's helpers agreeing with both."""

from __future__ import annotations

import pytest
from testkit.views import gpus

from topodra import DEFAULT_DRIVER_NAME as DRIVER
from topodra.fleet.demand import DemandError, parse_demand, pod_tolerance
from topodra.fleet.fgd import make_mix
from topodra.fleet.reserve import owns
from topodra.fleet.taints import Taint, Toleration, tolerated, tolerates, toleration_tuple
from topodra.reservations import RESERVATION_TAINT_KEY, tolerates_reservation, toleration

UID = "6f1c2a3e-0000-4000-8000-00000000a001"
HELD: Taint = (RESERVATION_TAINT_KEY, UID, "NoSchedule")


@pytest.mark.parametrize(("tol", "want"), [
    ((RESERVATION_TAINT_KEY, "Equal", UID, "NoSchedule"), True),  # exactly the held taint
    ((RESERVATION_TAINT_KEY, "", UID, "NoSchedule"), True),  # empty operator: Equal (API default)
    ((RESERVATION_TAINT_KEY, "Equal", "other-uid", "NoSchedule"), False),  # another reservation
    ((RESERVATION_TAINT_KEY, "Equal", UID, "NoExecute"), False),  # another effect
    ((RESERVATION_TAINT_KEY, "Equal", UID, ""), True),  # empty effect: every effect
    ((RESERVATION_TAINT_KEY, "Exists", "", "NoSchedule"), True),  # every value of the key
    (("other.io/key", "Exists", "", ""), False),  # another key
    (("", "Exists", "", ""), True),  # no key, Exists: every taint
    (("", "Exists", "", "NoExecute"), False),  # ... of that effect only
    (("", "Equal", UID, "NoSchedule"), True),  # empty key matches every key (the API refuses it with Equal)
    ((RESERVATION_TAINT_KEY, "Lt", UID, "NoSchedule"), False),  # an operator the rule does not know
])
def test_the_toleration_rule_is_the_schedulers(tol: Toleration, want: bool) -> None:
    assert tolerates(tol, HELD) is want


def test_every_alternative_must_tolerate_a_device_for_the_pod_to_count_it_free() -> None:
    mine: Toleration = toleration_tuple(toleration(UID))
    assert tolerated(HELD, ((mine,), (mine,)))
    assert not tolerated(HELD, ((mine,), ()))  # one subrequest without: not free for the pod
    assert not tolerated(HELD, ())  # an ordinary pod tolerates nothing


def test_a_claims_tolerations_are_read_per_request_and_subrequest() -> None:
    spec = gpus(2)
    spec["devices"]["requests"][0]["exactly"]["tolerations"] = [toleration(UID)]
    spec["devices"]["requests"].append({"name": "alt", "firstAvailable": [
        {"name": "h200", "deviceClassName": "gpu-h200", "count": 1, "tolerations": [{"operator": "Exists"}]},
        {"name": "h100", "deviceClassName": "gpu-h100", "count": 1}]})
    d = parse_demand(spec)
    alts = [a for r in d.requests for a in r.alternatives]
    assert [a.tolerations for a in alts] == [((RESERVATION_TAINT_KEY, "Equal", UID, "NoSchedule"),),
                                             (("", "Exists", "", ""),), ()]
    assert d.has_tolerations and not parse_demand(gpus(2)).has_tolerations
    assert d != d.without_tolerations() and not d.without_tolerations().has_tolerations
    assert pod_tolerance([d]) == tuple(a.tolerations for a in alts)
    assert pod_tolerance([parse_demand(gpus(1))]) == ()


def test_tolerations_that_are_not_a_list_of_objects_are_refused() -> None:
    spec = gpus(1)
    spec["devices"]["requests"][0]["exactly"]["tolerations"] = "all"
    with pytest.raises(DemandError, match="tolerations"):
        parse_demand(spec)


def test_the_request_mix_counts_a_tolerating_claim_as_its_ordinary_class() -> None:
    plain = parse_demand(gpus(8, nvlink=True))
    spec = gpus(8, nvlink=True)
    spec["devices"]["requests"][0]["exactly"]["tolerations"] = [toleration(UID)]
    mix = make_mix({}, 0, {plain: 1, parse_demand(spec): 1}, DRIVER)
    assert mix.classes == ((plain, 1.0),)


@pytest.mark.parametrize("tol", [toleration(UID), {"operator": "Exists"}, {"key": "", "operator": "Exists"}])
def test_the_vocabulary_and_the_rule_agree_on_who_owns_a_reservation(tol: dict[str, str]) -> None:
    assert tolerates_reservation(tol)
    assert owns(UID, ((toleration_tuple(tol),),))


def test_a_pod_owns_no_reservation_it_does_not_tolerate() -> None:
    assert not owns(UID, ((toleration_tuple(toleration("other")),),))
    assert not owns(UID, ())
