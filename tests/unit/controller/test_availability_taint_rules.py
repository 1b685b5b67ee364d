"""The controller's availability counts a device a DeviceTaintRule taints NoSchedule/NoExecute as not free,
as the inventory and the scorer do (one fleet model); a rule of another driver or without a blocking
effect changes nothing."""

from __future__ import annotations

from typing import Any

from test_controller_availability import CLASSES, claim, hgx, prof

from topodra.controller.availability import make_snapshot, profile_availability

D = "gpu.topodra.io"


def rule(effect: str, **selector: str) -> dict[str, Any]:
    return {"metadata": {"name": f"r-{effect}"},
            "spec": {"deviceSelector": selector, "taint": {"key": "topodra.io/maintenance", "effect": effect}}}


def status(rules: list[dict[str, Any]]) -> tuple[int | None, int | None]:
    snap = make_snapshot([hgx("n0")], [claim(("n0", "gpu-0"))], CLASSES, D, taint_rules=rules)
    p = prof([{"deviceClassName": "gpu-h200", "count": 7}], {"nvlink": "Required"})
    [s] = profile_availability(p, snap, driver=D)
    return s.devices_free, s.nodes_fit


def test_blocking_rule_takes_a_device_out_of_free_and_fit() -> None:
    assert status([]) == (7, 1)
    assert status([rule("NoExecute", driver=D, pool="n0", device="gpu-7")]) == (6, 0)
    assert status([rule("NoSchedule", pool="n0")]) == (0, 0)


def test_other_drivers_and_informational_rules_change_nothing() -> None:
    assert status([rule("NoSchedule", driver="other.example.com")]) == (7, 1)
    assert status([rule("None", pool="n0")]) == (7, 1)
