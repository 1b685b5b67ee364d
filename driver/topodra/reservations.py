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

Backfill (issue 33 deliverable 3). v1.37.2's DeviceToleration operators are only ``Exists`` and ``Equal``
(k8s.io/api@v0.37.2 resource/v1/types.go:2052-2056), so "runs shorter than the time left" is spelled with
buckets: every held node gets a second rule with key ``BACKFILL_WINDOW_KEY``, effect NoSchedule and as value
the largest bucket of ``WINDOW_LADDER`` that fits before the reservation's expected start (``window``), or
``CLOSED`` without an estimate or with too little time. The reserving job tolerates the key with ``Exists``;
a backfill claim (runtime bound B) tolerates every reservation (``Exists``) and the window key ``Equal`` to
each bucket >= B (``backfill_tolerations``): it can take a held device only where a bucket >= B is open.
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
BACKFILL_WINDOW_KEY = "topodra.io/backfill-window"
CLOSED = "closed"  # no backfill: no expected start, or less time left than the smallest bucket
# (value, seconds), shortest first: the runtime bounds a backfill window can promise.
WINDOW_LADDER: tuple[tuple[str, int], ...] = (("15m", 900), ("30m", 1800), ("1h", 3600), ("2h", 7200),
                                              ("4h", 14400), ("8h", 28800), ("16h", 57600))


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


def window_toleration() -> dict[str, Any]:
    """What the reserving job's claims carry besides ``toleration(uid)``: any backfill window."""
    return {"key": BACKFILL_WINDOW_KEY, "operator": "Exists", "effect": HOLD_EFFECT}


def window(expected_start: float | None, now: float, margin_s: float) -> str:
    """The window value of a held node: the largest bucket <= ``expected_start - now - margin_s``, else ``CLOSED``.

    ``margin_s`` must cover how late the value can be rewritten (the controller's reconcile period): a pod bound
    just before the next rewrite still ends before ``expected_start``."""
    if expected_start is None:
        return CLOSED
    room = expected_start - now - margin_s
    fits = [value for value, secs in WINDOW_LADDER if secs <= room]
    return fits[-1] if fits else CLOSED


def bucket_for(max_runtime_s: float) -> int:
    """Index in ``WINDOW_LADDER`` of the smallest bucket >= ``max_runtime_s``; ValueError above the largest."""
    for i, (_value, secs) in enumerate(WINDOW_LADDER):
        if max_runtime_s <= secs:
            return i
    raise ValueError(f"a backfill runtime bound of {max_runtime_s:.0f}s is longer than the largest window "
                     f"({WINDOW_LADDER[-1][0]})")


def backfill_tolerations(max_runtime_s: float) -> list[dict[str, Any]]:
    """A backfill claim's tolerations (runtime bound ``max_runtime_s``, > 0): every held reservation, but only
    where the window is a bucket >= the bound."""
    if max_runtime_s <= 0:
        raise ValueError(f"a backfill runtime bound must be positive (got {max_runtime_s})")
    first = bucket_for(max_runtime_s)
    return [{"key": RESERVATION_TAINT_KEY, "operator": "Exists", "effect": HOLD_EFFECT},
            *({"key": BACKFILL_WINDOW_KEY, "operator": "Equal", "value": value, "effect": HOLD_EFFECT}
              for value, _secs in WINDOW_LADDER[first:])]


def tolerates_window(tol: dict[str, Any]) -> bool:
    """True when ``tol`` tolerates some backfill window taint (its key, or an ``Exists`` without a key)."""
    key = tol.get("key") or ""
    if key == BACKFILL_WINDOW_KEY:
        return True
    return tol.get("operator") == "Exists" and key == ""


def claim_backfill_bound(claim: dict[str, Any]) -> int | None:
    """The runtime bound a backfill claim was placed under: the smallest window bucket any of its requests or
    subrequests tolerates with ``Equal`` (it may sit on a held node whose window is that bucket); None when it
    is no backfill claim (a reserving job tolerates the window key with ``Exists``, others not at all)."""
    seconds = dict(WINDOW_LADDER)
    found: list[int] = []
    for req in ((claim.get("spec") or {}).get("devices") or {}).get("requests") or []:
        alts = [req.get("exactly") or {}, *(req.get("firstAvailable") or [])]
        for alt in alts:
            for tol in alt.get("tolerations") or []:
                if tol.get("key") == BACKFILL_WINDOW_KEY and tol.get("operator", "Equal") == "Equal":
                    found.append(seconds.get(str(tol.get("value", "")), 0))
    return min(found) if found else None


def backfill_refusal(claim: dict[str, Any], pods: list[dict[str, Any] | None]) -> str | None:
    """Why a backfill claim must not be prepared for ``pods`` (its ``status.reservedFor`` pods as read; None:
    a pod not found), or None when every one declares ``activeDeadlineSeconds`` <= the claim's bound (so it
    cannot run past the reservation's expected start). A claim that is no backfill claim is never refused."""
    bound = claim_backfill_bound(claim)
    if bound is None:
        return None
    meta = claim.get("metadata") or {}
    what = f"claim {meta.get('namespace', '')}/{meta.get('name', '')}"
    if not pods:
        return f"{what} is a backfill claim (runtime bound {bound}s) reserved for no pod; not prepared"
    for pod in pods:
        if pod is None:
            return f"{what} is a backfill claim and a pod it is reserved for cannot be read; not prepared"
        name = (pod.get("metadata") or {}).get("name", "")
        deadline = (pod.get("spec") or {}).get("activeDeadlineSeconds")
        if not isinstance(deadline, int) or isinstance(deadline, bool) or deadline > bound:
            return (f"{what} is a backfill claim (it may use devices reserved for another job, only where that "
                    f"job starts in {bound}s or later): pod {name} must declare activeDeadlineSeconds <= {bound} "
                    f"(it declares {deadline if deadline is not None else 'none'}); not prepared")
    return None


def reserved_pods(claim: dict[str, Any]) -> list[str]:
    """Names of the pods in a claim's ``status.reservedFor`` (same namespace as the claim)."""
    return [str(r.get("name", "")) for r in (claim.get("status") or {}).get("reservedFor") or []
            if r.get("resource") == "pods" and not r.get("apiGroup")]
