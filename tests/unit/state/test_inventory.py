"""The device inventory: one owner, change detection in one place, ordered notification."""

from __future__ import annotations

import pytest

from topodra.devices import Device
from topodra.inventory import Inventory


def gpu(n: int, uuid: str = "") -> Device:
    return Device(name=f"gpu-{n}", kind="gpu", uuid=uuid or f"GPU-{n}")


def test_subscribers_get_the_current_set_then_every_change_in_order() -> None:
    inv = Inventory([gpu(0)])
    seen: list[tuple[str, list[str]]] = []
    inv.subscribe(lambda ds: seen.append(("a", [d.name for d in ds])))
    inv.subscribe(lambda ds: seen.append(("b", [d.name for d in ds])))
    assert seen == [("a", ["gpu-0"]), ("b", ["gpu-0"])]
    assert inv.set([gpu(0), gpu(1)])
    assert seen[2:] == [("a", ["gpu-0", "gpu-1"]), ("b", ["gpu-0", "gpu-1"])]
    assert inv.version == 1 and set(inv.by_name) == {"gpu-0", "gpu-1"}


def test_no_change_no_notification_but_attribute_changes_count() -> None:
    inv = Inventory([gpu(0)])
    calls: list[int] = []
    inv.subscribe(lambda ds: calls.append(len(ds)))
    assert not inv.set([gpu(0)])
    assert calls == [1] and inv.version == 0
    assert inv.set([gpu(0, uuid="GPU-other")])  # same names, different facts: a change
    assert calls == [1, 1] and inv.by_name["gpu-0"].uuid == "GPU-other"


def test_a_failing_subscriber_does_not_stop_the_others() -> None:
    inv = Inventory()
    got: list[int] = []

    def broken(_devices: tuple[Device, ...]) -> None:
        if _devices:
            raise RuntimeError("boom")

    inv.subscribe(broken)
    inv.subscribe(lambda ds: got.append(len(ds)))
    assert inv.set([gpu(0)])
    assert got == [0, 1]


def test_duplicate_names_are_refused_and_change_nothing() -> None:
    inv = Inventory([gpu(0)])
    with pytest.raises(ValueError, match=r"duplicate device names \['gpu-1'\]"):
        inv.set([gpu(1), gpu(1)])
    assert [d.name for d in inv.devices] == ["gpu-0"] and inv.version == 0
