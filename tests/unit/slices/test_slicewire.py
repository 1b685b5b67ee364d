"""ResourceSlices in protobuf wire form (topodra.slicewire) and the publisher's choice of form.

What the API server makes of the bytes is proven against the real one: tests/cluster/test_slices_cluster.py.
Here: nothing ``build_slices`` writes is lost or changed on the way into the message, and anything the
message cannot carry is refused rather than dropped.
"""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from typing import Any

import pytest

from topodra import slicewire
from topodra.devices import Device, bool_attr, int_attr, string_attr, version_attr
from topodra.health.policy import DeviceTaint, Effect
from topodra.inventory import Inventory
from topodra.kube import KubeError
from topodra.pb.kubewire.v1 import resourceslice_pb2 as pb
from topodra.publisher import SlicePublisher
from topodra.slices import build_slices

DRIVER = "gpu.topodra.io"
ADDED = int(datetime(2026, 12, 3, 8, 0, 5, tzinfo=UTC).timestamp())


def rich_devices() -> list[Device]:
    """Every field build_slices can write: all attribute kinds, capacity policies, shared and consumed
    counters, several allocations, taints."""
    gpu = Device(name="gpu-0", kind="gpu", uuid="GPU-0",
                 attributes={"type": string_attr("gpu"), "index": int_attr(0), "migCapable": bool_attr(False),
                             "driverVersion": version_attr("580.95.5"), "numaNode": int_attr(-1),
                             "resource.kubernetes.io/pcieRoot": string_attr("pci0000:15")},
                 capacity={"memory": "80Gi", "multiprocessors": "132"},
                 shared_counters={"gpu-0-counters": {"memory": "80Gi", "multiprocessors": "132"}})
    mig = Device(name="gpu-0-mig-1g10gb-0", kind="mig",
                 attributes={"type": string_attr("mig"), "parentDevice": string_attr("gpu-0")},
                 capacity={"memory": "10Gi"},
                 consumes_counters={"gpu-0-counters": {"memory": "10Gi", "multiprocessors": "16"}})
    shared = Device(name="gpu-1", kind="gpu", attributes={"type": string_attr("gpu")},
                    capacity={"memory": "80Gi"}, allow_multiple_allocations=True,
                    capacity_policies={"memory": {"default": "1Gi", "min": "1Gi", "step": "1Gi"}})
    return [gpu, mig, shared]


def rich_slices() -> list[dict[str, Any]]:
    taints = {"gpu-1": [DeviceTaint("gpu.topodra.io/xid", "79", Effect.NO_EXECUTE, ADDED),
                        DeviceTaint("gpu.topodra.io/ecc", "", Effect.NO_SCHEDULE, ADDED)]}
    return build_slices(DRIVER, "node-a", "uid-a", rich_devices(), 4, taints)


def decode(data: bytes) -> dict[str, Any]:
    """The JSON form of the encoded bytes, as the API server would read them (test-side reader)."""
    assert data[:4] == slicewire.MAGIC
    env = pb.Unknown.FromString(data[4:])
    msg = pb.ResourceSlice.FromString(env.raw)
    meta: dict[str, Any] = {"name": msg.metadata.name}
    if msg.metadata.HasField("resourceVersion"):
        meta["resourceVersion"] = msg.metadata.resourceVersion
    if msg.metadata.labels:
        meta["labels"] = dict(msg.metadata.labels)
    if msg.metadata.ownerReferences:
        meta["ownerReferences"] = [
            {f.name: v for f, v in o.ListFields()} for o in msg.metadata.ownerReferences]
    spec: dict[str, Any] = {"driver": msg.spec.driver, "nodeName": msg.spec.nodeName,
                            "pool": {f.name: v for f, v in msg.spec.pool.ListFields()}}
    if msg.spec.sharedCounters:
        spec["sharedCounters"] = [{"name": cs.name, "counters": {k: {"value": c.value.string}
                                                                for k, c in cs.counters.items()}}
                                  for cs in msg.spec.sharedCounters]
    devices = []
    for d in msg.spec.devices:
        dev: dict[str, Any] = {"name": d.name}
        if d.attributes:
            dev["attributes"] = {k: {f.name: v for f, v in a.ListFields()} for k, a in d.attributes.items()}
        if d.capacity:
            dev["capacity"] = {}
            for k, c in d.capacity.items():
                cap: dict[str, Any] = {"value": c.value.string}
                if c.HasField("requestPolicy"):
                    p = c.requestPolicy
                    cap["requestPolicy"] = {"default": p.default.string, "validRange": {
                        f.name: v.string for f, v in p.validRange.ListFields()}}
                dev["capacity"][k] = cap
        if d.HasField("allowMultipleAllocations"):
            dev["allowMultipleAllocations"] = d.allowMultipleAllocations
        if d.consumesCounters:
            dev["consumesCounters"] = [{"counterSet": c.counterSet, "counters": {
                k: {"value": v.value.string} for k, v in c.counters.items()}} for c in d.consumesCounters]
        if d.taints:
            dev["taints"] = [{"key": t.key, "effect": t.effect,
                              "timeAdded": datetime.fromtimestamp(t.timeAdded.seconds, UTC).strftime(
                                  "%Y-%m-%dT%H:%M:%SZ"), **({"value": t.value} if t.HasField("value") else {})}
                             for t in d.taints]
        devices.append(dev)
    if devices:
        spec["devices"] = devices
    return {"apiVersion": env.typeMeta.apiVersion, "kind": env.typeMeta.kind, "metadata": meta, "spec": spec}


def test_every_field_build_slices_writes_survives_encoding() -> None:
    slices = rich_slices()
    assert any("sharedCounters" in s["spec"] for s in slices)  # the fixture covers what it claims
    devs = [d for s in slices for d in s["spec"].get("devices", [])]
    assert any("taints" in d for d in devs) and any("consumesCounters" in d for d in devs)
    assert any("requestPolicy" in c for d in devs for c in d.get("capacity", {}).values())
    for s in slices:
        assert decode(slicewire.encode(s)) == s


def test_falsy_values_keep_their_presence() -> None:
    # proto2 optional fields carry presence: int 0, bool false and "" must arrive set, not absent.
    s = build_slices(DRIVER, "n", "u", [Device(name="gpu-0", kind="gpu", attributes={
        "index": int_attr(0), "migCapable": bool_attr(False), "label": string_attr("")})], 1)[0]
    attrs = decode(slicewire.encode(s))["spec"]["devices"][0]["attributes"]
    assert attrs == {"index": {"int": 0}, "migCapable": {"bool": False}, "label": {"string": ""}}


def test_replace_carries_the_resource_version() -> None:
    s = rich_slices()[0]
    s["metadata"]["resourceVersion"] = "123"
    assert decode(slicewire.encode(s))["metadata"]["resourceVersion"] == "123"


def _edit(path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    s = copy.deepcopy(build_slices(DRIVER, "n", "u", rich_devices()[2:], 1, {"gpu-1": [
        DeviceTaint("gpu.topodra.io/xid", "79", Effect.NO_EXECUTE, ADDED)]})[0])
    target: Any = s
    for p in path[:-1]:
        target = target[p]
    target[path[-1]] = value
    return s


@pytest.mark.parametrize("path,value,message", [
    (("spec", "perDeviceNodeSelection"), True, "perDeviceNodeSelection"),
    (("spec", "devices", 0, "bindsToNode"), True, "bindsToNode"),
    (("spec", "devices", 0, "attributes", "type"), {"strings": ["a"]}, "'strings'"),
    (("spec", "devices", 0, "attributes", "type"), {"string": "a", "int": 1}, "exactly one"),
    (("spec", "devices", 0, "attributes", "type"), {"int": "1"}, "not an integer"),
    (("spec", "devices", 0, "attributes", "type"), {"int": True}, "not an integer"),
    (("spec", "devices", 0, "taints", 0, "timeAdded"), "2026-12-03T08:00:05.5Z", "YYYY-MM-DD"),
    (("spec", "devices", 0, "capacity", "memory", "requestPolicy", "validValues"), ["1Gi"], "validValues"),
    (("spec", "pool", "generation"), "1", "not an integer"),
    (("metadata", "finalizers"), ["x"], "finalizers"),
    (("kind",), "ResourceClaim", "not a resource.k8s.io/v1 ResourceSlice"),
])
def test_what_the_message_cannot_carry_is_refused(path: tuple[Any, ...], value: Any, message: str) -> None:
    with pytest.raises(slicewire.NotEncodable, match=message):
        slicewire.encode(_edit(path, value))


class RecordingKube:
    """Records each write's form; answers like the API server (the object back, as JSON)."""

    def __init__(self, protobuf_status: int = 0) -> None:
        self.protobuf_status = protobuf_status
        self.writes: list[tuple[str, str]] = []  # (method, content type)

    def request(self, method: str, path: str, body: Any = None, query: Any = None,
                content_type: str = "application/json", data: bytes | None = None) -> dict[str, Any]:
        if method == "GET":  # the pool's slices: none yet
            return {"items": [], "metadata": {}}
        self.writes.append((method, content_type if data is not None else "json"))
        if data is not None and self.protobuf_status:
            raise KubeError(self.protobuf_status, "UnsupportedMediaType", "no protobuf here")
        obj = decode(data) if data is not None else body
        return {**obj, "metadata": {**obj["metadata"], "resourceVersion": "1"}}

    def list(self, path: str, label_selector: str | None = None, field_selector: str | None = None) -> Any:
        return iter(())


def _publisher(kube: RecordingKube, devices: list[Device]) -> SlicePublisher:
    return SlicePublisher(kube, DRIVER, "node-a", Inventory(devices), node_uid="uid-a",  # type: ignore[arg-type]
                          min_write_interval=0, watch=False)


def test_publisher_writes_protobuf() -> None:
    kube = RecordingKube()
    assert _publisher(kube, rich_devices()).reconcile_once()
    assert kube.writes and all(w == ("POST", slicewire.CONTENT_TYPE) for w in kube.writes)


def test_publisher_falls_back_to_json_for_good_on_415() -> None:
    kube = RecordingKube(protobuf_status=415)
    pub = _publisher(kube, rich_devices())
    assert pub.reconcile_once()
    # The first slice tried protobuf once, was refused and went as JSON; every later one went as JSON only.
    assert kube.writes[:2] == [("POST", slicewire.CONTENT_TYPE), ("POST", "json")]
    assert all(w == ("POST", "json") for w in kube.writes[2:]) and len(kube.writes) > 2


def test_publisher_does_not_retry_other_errors_as_json() -> None:
    kube = RecordingKube(protobuf_status=400)
    with pytest.raises(KubeError, match="400"):
        _publisher(kube, rich_devices()).reconcile_once()
    assert kube.writes == [("POST", slicewire.CONTENT_TYPE)]


def test_publisher_sends_json_what_protobuf_cannot_carry(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(obj: Any) -> bytes:
        raise slicewire.NotEncodable("a field the message lacks")

    monkeypatch.setattr(slicewire, "encode", refuse)
    kube = RecordingKube()
    assert _publisher(kube, rich_devices()).reconcile_once()
    assert kube.writes and all(w == ("POST", "json") for w in kube.writes)
