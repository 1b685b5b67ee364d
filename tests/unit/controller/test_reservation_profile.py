"""spec.reservation of a ClaimProfile (issue 33): who may reserve, durations, and the rendered tolerations."""

from __future__ import annotations

from typing import Any

import pytest

from topodra.controller.profile import ClaimProfile, ProfileError, parse_duration
from topodra.controller.render import claim_spec, render_template
from topodra.reservations import toleration, window_toleration

UID = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
GANG: dict[str, Any] = {"alternatives": [{"deviceClassName": "gpu-h100", "count": 8}], "pods": 4,
                        "acrossNodes": {"sameDomain": ["leafGroup"]}}


def prof(spec: dict[str, Any], uid: str = UID) -> ClaimProfile:
    return ClaimProfile.from_api({"metadata": {"name": "train", "namespace": "ml", "uid": uid}, "spec": spec})


def test_a_gang_or_whole_server_profile_may_reserve_with_its_own_or_the_default_times() -> None:
    rsv = {"afterWaiting": "1h30m", "maxHold": 600, "narrowerWithin": "2h"}
    r = prof({**GANG, "reservation": rsv}).spec.reservation
    assert r is not None and r.enabled and r.after_waiting_s == 5400 and r.max_hold_s == 600
    assert r.narrower_within_s == 7200
    whole = prof({"alternatives": [{"deviceClassName": "gpu-h100", "count": 8},
                                   {"deviceClassName": "gpu-h200", "count": 8}], "reservation": {}})
    r = whole.spec.reservation
    assert r is not None and r.after_waiting_s is None and r.max_hold_s is None  # the controller's defaults
    assert r.narrower_within_s is None


@pytest.mark.parametrize(("spec", "needle"), [
    ({"alternatives": [{"deviceClassName": "gpu-h100", "count": 4}], "reservation": {}},
     "reservation needs a multi-node job (pods) or a whole-server profile (count 8 in every alternative, got [4])"),
    ({"alternatives": [{"deviceClassName": "gpu-h100", "count": 8}, {"deviceClassName": "gpu-h200", "count": 2}],
      "reservation": {}}, "got [2, 8]"),
    ({**GANG, "reservation": {"afterWaiting": "15 minutes"}},
     "reservation.afterWaiting: '15 minutes' is not a duration"),
    ({**GANG, "reservation": {"maxHold": "0s"}}, "reservation.maxHold must be above 0s"),
    ({**GANG, "reservation": {"narrowerWithin": "soon"}}, "reservation.narrowerWithin: 'soon' is not a duration"),
    ({**GANG, "reservation": {"afterWaiting": -1}}, "must be between 0s and 7 days"),
    ({**GANG, "reservation": {"afterWaiting": "200h"}}, "must be between 0s and 7 days"),
    ({**GANG, "reservation": {"afterWaiting": True}}, "afterWaiting.int: Input should be a valid integer"),
    ({**GANG, "reservation": {"after": "15m"}}, "reservation.after: Extra inputs are not permitted"),
    ({"alternatives": [{"deviceClassName": "gpu-h100", "count": 8}], "queueing": "Kueue", "localQueue": "q",
      "reservation": {}}, "reservation cannot be combined with queueing Kueue"),
])
def test_bad_reservations_are_refused_with_the_reason(spec: dict[str, Any], needle: str) -> None:
    with pytest.raises(ProfileError) as e:
        prof(spec)
    assert needle in str(e.value)


@pytest.mark.parametrize(("text", "seconds"), [("900", 900), (900, 900), ("15m", 900), ("2h", 7200),
                                               ("1h30m", 5400), ("90s", 90), ("0s", 0)])
def test_durations(text: int | str, seconds: int) -> None:
    assert parse_duration(text, "x") == seconds


@pytest.mark.parametrize("text", ["", "m", "1d", "15 m", "1m1h", "-5"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError, match="x: "):
        parse_duration(text, "x")


def _tolerations(devices: dict[str, Any]) -> list[Any]:
    out = []
    for req in devices["requests"]:
        if "exactly" in req:
            out.append(req["exactly"].get("tolerations"))
        for sub in req.get("firstAvailable") or []:
            out.append(sub.get("tolerations"))
    return out


def test_every_request_and_subrequest_tolerates_exactly_the_profiles_own_reservation() -> None:
    tol = [toleration(UID), window_toleration()]
    one = claim_spec(prof({**GANG, "reservation": {}}))["devices"]
    assert _tolerations(one) == [tol]
    two = claim_spec(prof({**GANG, "alternatives": [{"deviceClassName": "gpu-h100", "count": 8},
                                                    {"deviceClassName": "gpu-h200", "count": 8}],
                           "reservation": {}}))["devices"]
    assert _tolerations(two) == [tol, tol]
    rail = claim_spec(prof({**GANG, "topology": {"nic": "RailAligned"}, "reservation": {}}))["devices"]
    assert len(rail["requests"]) == 16 and _tolerations(rail) == [tol] * 16  # the NICs are on the held pool too


def test_no_toleration_without_reservation_when_it_is_off_or_when_the_cluster_turns_it_off() -> None:
    assert _tolerations(claim_spec(prof(GANG))["devices"]) == [None]
    off = prof({**GANG, "reservation": {"enabled": False}})
    assert _tolerations(claim_spec(off)["devices"]) == [None]
    on = prof({**GANG, "reservation": {}})
    assert _tolerations(claim_spec(on, reservations_on=False)["devices"]) == [None]
    # The template changes with it (its hash), so turning reservations on or off re-renders the template.
    assert (render_template(on)["metadata"]["annotations"] != render_template(on, reservations_on=False)
            ["metadata"]["annotations"])


def test_a_reserving_profile_without_a_uid_cannot_be_rendered() -> None:
    with pytest.raises(ProfileError, match=r"reservation needs the profile's metadata\.uid"):
        render_template(prof({**GANG, "reservation": {}}, uid=""))


SMALL: dict[str, Any] = {"alternatives": [{"deviceClassName": "gpu-h100", "count": 2},
                                          {"deviceClassName": "gpu-h200", "count": 2}]}


def test_a_backfill_profile_tolerates_held_devices_only_where_the_window_fits_its_bound() -> None:
    from topodra.reservations import backfill_tolerations
    p = prof({**SMALL, "backfill": {"maxRuntime": "45m"}})
    assert p.spec.backfill is not None and p.spec.backfill.max_runtime_s == 2700
    tols = _tolerations(claim_spec(p)["devices"])
    assert tols == [backfill_tolerations(2700)] * 2  # both subrequests: windows 1h and up
    assert [t["value"] for t in tols[0][1:]] == ["1h", "2h", "4h", "8h", "16h"]
    assert _tolerations(claim_spec(p, reservations_on=False)["devices"]) == [None, None]  # off: nothing held


@pytest.mark.parametrize(("spec", "needle"), [
    ({**SMALL, "backfill": {"maxRuntime": "17h"}}, "at most 16h"),
    ({**SMALL, "backfill": {"maxRuntime": 0}}, "must be above 0s"),
    ({**SMALL, "backfill": {}}, "backfill.maxRuntime"),
    ({**GANG, "reservation": {}, "backfill": {"maxRuntime": "1h"}}, "either reserves (reservation) or backfills"),
])
def test_bad_backfill_is_refused_with_the_reason(spec: dict[str, Any], needle: str) -> None:
    with pytest.raises(ProfileError) as e:
        prof(spec)
    assert needle in str(e.value)
