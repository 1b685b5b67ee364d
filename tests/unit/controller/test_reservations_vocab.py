"""The reservation vocabulary (topodra.reservations): the toleration and what counts as tolerating the key."""

from __future__ import annotations

import pytest

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


def test_window_is_the_largest_bucket_before_the_expected_start_less_the_margin() -> None:
    assert r.window(None, 0, 60) == r.CLOSED  # no estimate: no backfill
    assert r.window(900 + 59, 0, 60) == r.CLOSED  # 899 s left: under the smallest bucket
    assert r.window(900 + 60, 0, 60) == "15m"
    assert r.window(10_000, 0, 900) == "2h"  # 9,100 s
    assert r.window(10**9, 0, 0) == "16h"  # the ladder ends at 16h


def test_backfill_tolerations_open_every_bucket_at_least_the_bound() -> None:
    tols = r.backfill_tolerations(3600)
    assert tols[0] == {"key": r.RESERVATION_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}
    assert [(t["key"], t["operator"], t["value"]) for t in tols[1:]] == [
        (r.BACKFILL_WINDOW_KEY, "Equal", v) for v in ("1h", "2h", "4h", "8h", "16h")]
    assert [t["value"] for t in r.backfill_tolerations(3601)[1:]] == ["2h", "4h", "8h", "16h"]
    assert not any(t.get("value") == r.CLOSED for t in r.backfill_tolerations(1))
    assert r.window_toleration() == {"key": r.BACKFILL_WINDOW_KEY, "operator": "Exists", "effect": "NoSchedule"}
    assert r.tolerates_window(r.window_toleration()) and r.tolerates_window({"operator": "Exists"})
    assert not r.tolerates_window(r.toleration("u"))
    for bad in (0, -5, 57_601):
        with pytest.raises(ValueError):
            r.backfill_tolerations(bad)
