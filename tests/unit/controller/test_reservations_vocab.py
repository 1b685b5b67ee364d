"""The reservation vocabulary (topodra.reservations): the toleration and what counts as tolerating the key."""

from __future__ import annotations

from topodra import reservations as r


def test_toleration_names_exactly_the_held_taint_of_one_uid() -> None:
    tol = r.toleration("0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0")
    assert tol == {
        "key": "topodra.io/reservation",
        "operator": "Equal",
        "value": "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0",
        "effect": "NoSchedule",
    }
    assert r.tolerates_reservation(tol)


def test_tolerates_reservation_catches_the_key_and_a_keyless_exists_only() -> None:
    assert r.tolerates_reservation({"key": r.RESERVATION_TAINT_KEY, "operator": "Exists"})
    assert r.tolerates_reservation({"operator": "Exists"})
    assert r.tolerates_reservation({"key": "", "operator": "Exists", "effect": "NoSchedule"})
    assert not r.tolerates_reservation({"key": "other.io/taint", "operator": "Exists"})
    assert not r.tolerates_reservation({"operator": "Equal", "value": "x"})
    assert not r.tolerates_reservation({})
