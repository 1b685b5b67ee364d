"""The reservation vocabulary (issue 33): taint key, effects, labels, the toleration.

A neutral, pure module (imports nothing of topodra) so the controller that
writes DeviceTaintRules and renders tolerations, the admission policy that
refuses any other toleration of the key, and the scorer that steers around
reserved domains all speak the same words.

A reservation is one DeviceTaintRule per reserved node whose taint value is
the reserving ClaimProfile's ``metadata.uid`` (36 characters: a valid label
value).  Effect ``NoSchedule`` holds the devices (the scheduler gives them only
to claims tolerating the taint); effect ``None`` is a hint the scheduler
ignores and the scorer uses.
"""

from __future__ import annotations

from typing import Any

RESERVATION_TAINT_KEY = "topodra.io/reservation"
HOLD_EFFECT = "NoSchedule"  # a held reservation: the scheduler gives these devices only to claims tolerating it
HINT_EFFECT = "None"  # the domain the next waiting job would reserve: the scheduler ignores it, the scorer steers
MANAGED_LABEL = "app.kubernetes.io/managed-by"
MANAGED_VALUE = "topodra-controller"
PROFILE_NS_LABEL = "topodra.io/reservation-namespace"
PROFILE_NAME_LABEL = "topodra.io/reservation-profile"
UID_LABEL = "topodra.io/reservation-uid"


def toleration(uid: str) -> dict[str, Any]:
    """The toleration a reserving profile's claims carry: exactly its own held taint."""
    return {"key": RESERVATION_TAINT_KEY, "operator": "Equal", "value": uid, "effect": HOLD_EFFECT}


def tolerates_reservation(tol: dict[str, Any]) -> bool:
    """True when ``tol`` tolerates some reservation taint.

    That is a toleration of the reservation key, or an ``Exists`` toleration
    with no (or an empty) key, which tolerates every taint.
    """
    key = tol.get("key") or ""
    if key == RESERVATION_TAINT_KEY:
        return True
    return tol.get("operator") == "Exists" and key == ""
