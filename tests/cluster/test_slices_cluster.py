"""devices -> ResourceSlices (pure), and the publisher against the real apiserver.

Split by tier; the rest: tests/unit/slices/test_slices.py.
"""

from __future__ import annotations

import functools
from datetime import UTC, datetime

import pytest
from testkit.handle import ClusterHandle, wait_for

from topodra import slicewire
from topodra.apipaths import slices_path
from topodra.devices import Device, bool_attr, int_attr, string_attr, version_attr
from topodra.health.policy import DeviceTaint, Effect
from topodra.inventory import Inventory
from topodra.kube import KubeError
from topodra.publisher import SlicePublisher
from topodra.slices import build_slices, same_content

DRIVER = "gpu.topodra.io"


def gpus(n: int, model: str = "H100-SXM5-80GB") -> list[Device]:
    return [Device(name=f"gpu-{k}", kind="gpu", uuid=f"GPU-{k:08x}",
                   attributes={"type": string_attr("gpu"), "model": string_attr(model), "index": int_attr(k),
                               "resource.kubernetes.io/pcieRoot": string_attr(f"pci0000:{k:02x}")},
                   capacity={"memory": "80Gi"}) for k in range(n)]


def _pool(cluster: ClusterHandle, node: str) -> list[dict]:  # type: ignore[type-arg]
    return list(cluster.kube.list(slices_path(), field_selector=f"spec.driver={DRIVER},spec.nodeName={node}"))


@pytest.mark.cluster
def test_publisher_publishes_reconciles_and_bumps_generation(cluster: ClusterHandle) -> None:
    node = "pub-node-0"
    cluster.fake_nodes([node])
    inventory = Inventory(gpus(8))
    pub = SlicePublisher(cluster.kube, DRIVER, node, inventory, resync_seconds=0.5, min_write_interval=0.1)
    pub.start()
    try:
        assert pub.wait_synced(30)
        first = _pool(cluster, node)
        assert len(first) == 1
        gen1 = first[0]["spec"]["pool"]["generation"]
        assert len(first[0]["spec"]["devices"]) == 8
        assert first[0]["metadata"]["ownerReferences"][0]["kind"] == "Node"

        # Someone (e.g. a restarting kubelet) deletes the node's slices: they come back, newer.
        for sl in first:
            cluster.kube.delete(slices_path(sl["metadata"]["name"]))
        back = wait_for(lambda: _pool(cluster, node), 30, "slices to be re-published")
        assert back[0]["spec"]["pool"]["generation"] > gen1

        # Hardware change: a GPU disappears -> republished with a new generation.
        gen2 = back[0]["spec"]["pool"]["generation"]
        assert inventory.set(gpus(7))
        wait_for(lambda: len(_pool(cluster, node)[0]["spec"]["devices"]) == 7, 30, "7-device pool")
        assert _pool(cluster, node)[0]["spec"]["pool"]["generation"] > gen2

        # No change -> no writes (generation stable across resyncs): wait for two completed passes, so at
        # least one whole resync started after gen3 was read.
        gen3 = _pool(cluster, node)[0]["spec"]["pool"]["generation"]
        passes = pub.passes
        wait_for(lambda: pub.passes >= passes + 2, 30, "two resync passes")
        assert _pool(cluster, node)[0]["spec"]["pool"]["generation"] == gen3
    finally:
        pub.stop()
    # Stopping leaves the slices in place.
    assert len(_pool(cluster, node)) == 1


@pytest.mark.cluster
def test_restarted_publisher_adopts_generation(cluster: ClusterHandle) -> None:
    node = "pub-node-1"
    cluster.fake_nodes([node])
    p1 = SlicePublisher(cluster.kube, DRIVER, node, Inventory(gpus(4)))
    assert p1.reconcile_once()
    gen = p1.generation
    p2 = SlicePublisher(cluster.kube, DRIVER, node, Inventory(gpus(4)))
    assert not p2.reconcile_once(), "identical content must not be rewritten after a restart"
    assert p2.generation == gen


@pytest.mark.cluster
def test_apiserver_rejects_nothing_we_publish_and_errors_are_clear(cluster: ClusterHandle) -> None:
    """Every mock profile's devices (MIG counter sets, NICs, shared GPUs), with a taint of every effect, are
    accepted by the real apiserver and stored as built; a node that does not exist is a clear error."""
    from topodra.hardware import mockprofile
    from topodra.simulate import SimNode, discover

    profiles = sorted(mockprofile.profile_names())
    assert len(profiles) >= 8, profiles
    nodes = [f"every-{i}" for i in range(len(profiles))]
    cluster.fake_nodes(nodes)
    added = int(datetime(2026, 12, 3, 8, 0, 5, tzinfo=UTC).timestamp())
    effects = [Effect.NONE, Effect.NO_SCHEDULE, Effect.NO_EXECUTE]
    for node, profile in zip(nodes, profiles, strict=True):
        devices = discover(SimNode(name=node, profile=profile, labels={}, overrides={}))
        taints = {d.name: (DeviceTaint("gpu.topodra.io/xid", "79", effects[i % 3], added),)
                  for i, d in enumerate(devices[:3])}
        pub = SlicePublisher(cluster.kube, DRIVER, node, Inventory(devices), taints=functools.partial(dict, taints),
                             min_write_interval=0, watch=False)
        assert pub.reconcile_once(), profile
        stored = _pool(cluster, node)
        uid = stored[0]["metadata"]["ownerReferences"][0]["uid"]
        want = build_slices(DRIVER, node, uid, devices, pub.generation, taints)
        assert len(stored) == len(want), profile
        by_name = {s["metadata"]["name"]: s for s in stored}
        for w in want:
            assert same_content(by_name[w["metadata"]["name"]], w), (profile, w["metadata"]["name"])
    p = SlicePublisher(cluster.kube, DRIVER, "no-such-node", Inventory(gpus(1)))
    with pytest.raises(KubeError, match="does not exist"):
        p.reconcile_once()


@pytest.mark.cluster
def test_protobuf_writes_reach_the_apiserver_unchanged(cluster: ClusterHandle, monkeypatch: pytest.MonkeyPatch) -> None:
    """The publisher writes slices as protobuf (topodra.slicewire): what the real apiserver stores, read back
    as JSON, is exactly what build_slices made, for every field it writes (all attribute kinds, capacity
    request policies, shared and consumed counters, several allocations, taints), on create and on replace."""
    node = "pub-node-pb"
    cluster.fake_nodes([node])
    added = int(datetime(2026, 12, 3, 8, 0, 5, tzinfo=UTC).timestamp())
    devices = [
        Device(name="gpu-0", kind="gpu", attributes={
            "type": string_attr("gpu"), "index": int_attr(0), "migCapable": bool_attr(False),
            "driverVersion": version_attr("580.95.5"), "numaNode": int_attr(-1), "label": string_attr("")},
            capacity={"memory": "80Gi", "multiprocessors": "132"},
            shared_counters={"gpu-0-counters": {"memory": "80Gi", "multiprocessors": "132"}}),
        Device(name="gpu-0-mig-1g10gb-0", kind="mig",
               attributes={"type": string_attr("mig"), "parentDevice": string_attr("gpu-0")},
               capacity={"memory": "10Gi"},
               consumes_counters={"gpu-0-counters": {"memory": "10Gi", "multiprocessors": "16"}}),
        Device(name="gpu-1", kind="gpu", attributes={"type": string_attr("gpu")}, capacity={"memory": "80Gi"},
               allow_multiple_allocations=True,
               capacity_policies={"memory": {"default": "1Gi", "min": "1Gi", "step": "1Gi"}}),
    ]
    taints = {"gpu-1": [DeviceTaint("gpu.topodra.io/xid", "79", Effect.NO_EXECUTE, added),
                        DeviceTaint("gpu.topodra.io/ecc", "", Effect.NO_SCHEDULE, added)]}
    sent: list[tuple[str, str]] = []
    real = cluster.kube.request

    def spy(method: str, path: str, *args: object, **kwargs: object) -> dict:  # type: ignore[type-arg]
        if method in ("POST", "PUT"):
            sent.append((method, str(kwargs.get("content_type", "application/json"))))
        return real(method, path, *args, **kwargs)  # type: ignore[arg-type]

    inventory = Inventory(devices)
    pub = SlicePublisher(cluster.kube, DRIVER, node, inventory, taints=lambda: taints, min_write_interval=0,
                         watch=False)
    monkeypatch.setattr(cluster.kube, "request", spy)
    assert pub.reconcile_once()
    created = {s["metadata"]["name"]: s for s in _pool(cluster, node)}
    uid = created[next(iter(created))]["metadata"]["ownerReferences"][0]["uid"]
    want = build_slices(DRIVER, node, uid, devices, pub.generation, taints)
    assert set(created) == {w["metadata"]["name"] for w in want}
    for w in want:
        got = created[w["metadata"]["name"]]
        assert got["spec"] == w["spec"], w["metadata"]["name"]
        assert got["metadata"]["labels"] == w["metadata"]["labels"]
        assert got["metadata"]["ownerReferences"] == w["metadata"]["ownerReferences"]
        assert same_content(got, w)
    # A change: the same slices replaced (PUT with their resourceVersions), again as protobuf.
    taints["gpu-1"] = taints["gpu-1"][:1]
    assert pub.reconcile_once()
    replaced = {s["metadata"]["name"]: s for s in _pool(cluster, node)}
    for w in build_slices(DRIVER, node, uid, devices, pub.generation, taints):
        assert replaced[w["metadata"]["name"]]["spec"] == w["spec"]
    monkeypatch.undo()
    assert {m for m, _ in sent} == {"POST", "PUT"}
    assert all(ct == slicewire.CONTENT_TYPE for _, ct in sent), sent
