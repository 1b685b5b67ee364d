"""devices -> ResourceSlices (pure), and the publisher against the real apiserver.

Split by tier; the rest: tests/cluster/test_slices_cluster.py.
"""

from __future__ import annotations

import pytest

from topodra.devices import AttributeValue, Device, bool_attr, int_attr, string_attr, version_attr
from topodra.slices import build_slices, device_sort_key, same_content

DRIVER = "gpu.topodra.io"


def gpus(n: int, model: str = "H100-SXM5-80GB") -> list[Device]:
    return [Device(name=f"gpu-{k}", kind="gpu", uuid=f"GPU-{k:08x}",
                   attributes={"type": string_attr("gpu"), "model": string_attr(model), "index": int_attr(k),
                               "resource.kubernetes.io/pcieRoot": string_attr(f"pci0000:{k:02x}")},
                   capacity={"memory": "80Gi"}) for k in range(n)]


@pytest.mark.parametrize("value", [string_attr("hopper"), string_attr(""), int_attr(0), int_attr(-3),
                                   bool_attr(False), bool_attr(True), version_attr("13.0.0")])
def test_attribute_encoding_is_the_one_field_set(value: AttributeValue) -> None:
    # to_api is hand-written for speed: it must say what pydantic's own encoding says, falsy values included.
    assert value.to_api() == value.model_dump(exclude_none=True)
    assert len(value.to_api()) == 1


def test_order_is_natural_and_gpus_first() -> None:
    devs = [*gpus(12), Device(name="nic-0", kind="nic")]
    ordered = sorted(reversed(devs), key=device_sort_key)
    assert [d.name for d in ordered][:3] == ["gpu-0", "gpu-1", "gpu-2"]
    assert ordered[10].name == "gpu-10" and ordered[-1].name == "nic-0"


def test_one_slice_for_small_pool() -> None:
    out = build_slices(DRIVER, "n1", "uid-1", gpus(8), generation=3)
    assert len(out) == 1
    spec = out[0]["spec"]
    assert spec["pool"] == {"name": "n1", "generation": 3, "resourceSliceCount": 1}
    assert spec["nodeName"] == "n1" and spec["driver"] == DRIVER
    assert [d["name"] for d in spec["devices"]] == [f"gpu-{k}" for k in range(8)]
    assert spec["devices"][0]["attributes"]["model"] == {"string": "H100-SXM5-80GB"}
    assert spec["devices"][0]["capacity"]["memory"] == {"value": "80Gi"}
    assert out[0]["metadata"]["ownerReferences"][0] == {
        "apiVersion": "v1", "kind": "Node", "name": "n1", "uid": "uid-1", "controller": True}


def test_large_pool_is_split_with_consistent_count() -> None:
    out = build_slices(DRIVER, "big", None, gpus(300), generation=1)
    assert [len(x["spec"]["devices"]) for x in out] == [128, 128, 44]
    assert {x["spec"]["pool"]["resourceSliceCount"] for x in out} == {3}
    assert len({x["metadata"]["name"] for x in out}) == 3
    assert "ownerReferences" not in out[0]["metadata"]


def test_empty_pool_still_publishes_one_slice() -> None:
    out = build_slices(DRIVER, "n1", "u", [], generation=1)
    assert len(out) == 1 and out[0]["spec"]["devices"] == []


def test_duplicate_device_names_are_rejected() -> None:
    with pytest.raises(ValueError, match="duplicate device names"):
        build_slices(DRIVER, "n1", "u", [*gpus(2), *gpus(1)], generation=1)


def test_same_content_detects_generation_and_device_changes() -> None:
    a = build_slices(DRIVER, "n1", "u", gpus(2), 1)[0]
    assert same_content(a, build_slices(DRIVER, "n1", "u", gpus(2), 1)[0])
    assert not same_content(a, build_slices(DRIVER, "n1", "u", gpus(2), 2)[0])
    assert not same_content(a, build_slices(DRIVER, "n1", "u", gpus(3), 1)[0])
