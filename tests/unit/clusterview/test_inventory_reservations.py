"""The inventory shows a reservation's held devices as their own state (issue 33), counted with the tainted ones
(no ordinary claim gets them) and named by the reserving profile."""

from __future__ import annotations

from typing import Any

from testkit.views import device_classes, node_slices

from topodra import DEFAULT_DRIVER_NAME as DRIVER
from topodra.clusterview.exporter import families
from topodra.clusterview.model import FREE, RESERVED, TAINTED, Sources, build_view
from topodra.clusterview.table import node_table, summary_line
from topodra.reservations import (
    HINT_EFFECT,
    HOLD_EFFECT,
    PROFILE_NAME_LABEL,
    PROFILE_NS_LABEL,
    RESERVATION_TAINT_KEY,
)

Obj = dict[str, Any]
UID = "6f1c2a3e-0000-4000-8000-00000000a001"


def rule(name: str, node: str, effect: str, labels: bool = True, key: str = RESERVATION_TAINT_KEY,
         device: str | None = None) -> Obj:
    meta: Obj = {"name": name}
    if labels:
        meta["labels"] = {PROFILE_NS_LABEL: "team", PROFILE_NAME_LABEL: "big"}
    sel = {"driver": DRIVER, "pool": node, **({"device": device} if device else {})}
    return {"metadata": meta, "spec": {"deviceSelector": sel, "taint": {"key": key, "value": UID, "effect": effect}}}


def view(*rules: Obj) -> Any:
    src = Sources(slices=tuple(node_slices("a", "dgx-h100") + node_slices("b", "dgx-h100")),
                  classes=device_classes(), taint_rules=rules)
    return build_view(src)


def test_held_devices_are_reserved_by_the_profile_hinted_ones_stay_free() -> None:
    v = view(rule("hold-a", "a", HOLD_EFFECT), rule("hint-b", "b", HINT_EFFECT),
             rule("drain-b7", "b", "NoSchedule", labels=False, key="topodra.io/maintenance", device="gpu-7"))
    a, b = v.nodes
    assert {g.state for g in a.gpus} == {RESERVED} and {g.reservation for g in a.gpus} == {"team/big"}
    assert a.reserved_gpus == {"team/big": 8}
    assert [g.name for g in b.gpus if g.state == TAINTED] == ["gpu-7"]
    assert sum(1 for g in b.gpus if g.state == FREE) == 7  # a hint blocks nothing
    (m,) = v.models
    assert (m.total, m.free, m.tainted, m.reserved, m.allocated) == (16, 7, 9, 8, 0)
    out = v.to_dict()
    assert out["summary"]["reserved"] == 8 and out["summary"]["tainted"] == 9
    assert out["nodes"][0]["gpus_reserved"] == 8 and out["nodes"][0]["reserved_by"] == {"team/big": 8}
    assert any("reserved team/big: 8" in line for line in node_table(v))
    assert "9 tainted (8 of them reserved)" in summary_line(v)
    tainted = next(f for f in families(v) if f.name == "topodra_inventory_gpus_tainted")
    assert {s.labels["node"]: s.value for s in tainted.samples} == {"a": 8, "b": 1}


def test_a_rule_without_the_profile_labels_names_the_uid() -> None:
    a = view(rule("hold-a", "a", HOLD_EFFECT, labels=False)).nodes[0]
    assert a.reserved_gpus == {UID: 8}


def test_a_device_also_tainted_otherwise_is_tainted_not_reserved() -> None:
    a = view(rule("hold-a", "a", HOLD_EFFECT),
             rule("drain-a0", "a", "NoExecute", key="topodra.io/maintenance", device="gpu-0")).nodes[0]
    assert [g.name for g in a.gpus if g.state == TAINTED] == ["gpu-0"]
    assert a.reserved_gpus == {"team/big": 7}
