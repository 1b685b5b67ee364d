"""The publisher learns of its slices from a watch (issue 22), against the real apiserver.

Deleted slices come back without a resync; an idle publisher, and an idle simulated cluster, make no
requests while the old code listed every pool on every resync; a watch the server ends is resumed, not
relisted. Every window is bounded by something the test observes happening (resync passes, watch
renewals), never by a bare sleep.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from testkit.handle import ClusterHandle, wait_for

from topodra.apipaths import slices_path
from topodra.devices import Device, int_attr, string_attr
from topodra.inventory import Inventory
from topodra.kube import Kube, Obj
from topodra.publisher import SlicePublisher
from topodra.simulate import SimulatedCluster, Simulation
from topodra.slicewatch import SliceWatch

DRIVER = "gpu.topodra.io"


class CountingKube(Kube):
    """The project's client, counting what it sends: requests and watch requests apart."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.requests: list[tuple[str, str]] = []
        self.watches = 0
        self._lock = threading.Lock()

    def request(self, method: str, path: str, *args: Any, **kwargs: Any) -> Obj:
        with self._lock:
            self.requests.append((method, path))
        return super().request(method, path, *args, **kwargs)

    def watch(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            self.watches += 1
        return super().watch(*args, **kwargs)


def counting(cluster: ClusterHandle) -> CountingKube:
    kube = CountingKube.from_kubeconfig(cluster.kubeconfig)
    assert isinstance(kube, CountingKube)
    return kube


def gpus(n: int) -> list[Device]:
    return [Device(name=f"gpu-{k}", kind="gpu", uuid=f"GPU-{k:08x}",
                   attributes={"type": string_attr("gpu"), "model": string_attr("H100-SXM5-80GB"),
                               "index": int_attr(k)}, capacity={"memory": "80Gi"}) for k in range(n)]


def pool(cluster: ClusterHandle, node: str, driver: str = DRIVER) -> list[Obj]:
    return list(cluster.kube.list(slices_path(), field_selector=f"spec.driver={driver},spec.nodeName={node}"))


def newer_than(cluster: ClusterHandle, node: str, gen: int) -> Callable[[], list[Obj]]:
    return lambda: [s for s in pool(cluster, node) if s["spec"]["pool"]["generation"] > gen]


@pytest.mark.cluster
def test_deleted_slices_come_back_from_the_watch_not_a_resync(cluster: ClusterHandle) -> None:
    node = "pubwatch-node-0"
    cluster.fake_nodes([node])
    # A resync an hour away: only the watch can bring the slices back within the test's bound.
    pub = SlicePublisher(cluster.kube, DRIVER, node, Inventory(gpus(4)), resync_seconds=3600, min_write_interval=0.1)
    pub.start()
    try:
        assert pub.wait_synced(30)
        [first] = pool(cluster, node)
        gen = first["spec"]["pool"]["generation"]
        for _ in range(2):  # twice: the second delete hits the slice the watch-driven pass re-created
            cluster.kube.delete(slices_path(first["metadata"]["name"]))
            back = wait_for(newer_than(cluster, node, gen), 30, "the deleted slice re-created")
            [first] = back
            gen = first["spec"]["pool"]["generation"]
            assert len(first["spec"]["devices"]) == 4
    finally:
        pub.stop()
    assert len(pool(cluster, node)) == 1  # left in place on shutdown


@pytest.mark.cluster
def test_an_idle_publisher_makes_no_requests_over_many_resyncs(cluster: ClusterHandle) -> None:
    node = "pubwatch-node-1"
    cluster.fake_nodes([node])
    kube = counting(cluster)
    pub = SlicePublisher(kube, DRIVER, node, Inventory(gpus(8)), resync_seconds=0.2, min_write_interval=0.1)
    pub.start()
    try:
        assert pub.wait_synced(30)
        assert pub.slices is not None and pub.slices.wait_synced(30)
        wait_for(lambda: pub.passes >= 2, 30, "a resync after the first publish")
        before, watches, passes = len(kube.requests), kube.watches, pub.passes
        # 20 resync passes: the polling publisher listed its pool on each of them (20 requests).
        wait_for(lambda: pub.passes >= passes + 20, 60, "20 resync passes")
        window = kube.requests[before:]
        assert window == [], f"an idle publisher sent {window}"
        assert kube.watches - watches <= 1  # at most a renewal of its one watch
        assert [s["spec"]["pool"]["generation"] for s in pool(cluster, node)] == [pub.generation]

        # A change of the devices is still published at once, from the same watch.
        assert pub.inventory.set(gpus(7))
        wait_for(lambda: len(pool(cluster, node)[0]["spec"]["devices"]) == 7, 30, "7-device pool")
        lists = [p for m, p in kube.requests[before:] if m == "GET"]
        assert lists == [], f"the change was published after listing: {lists}"
    finally:
        pub.stop()


@pytest.mark.cluster
def test_a_watch_the_server_ends_is_resumed_without_a_list(cluster: ClusterHandle) -> None:
    node = "pubwatch-node-2"
    cluster.fake_nodes([node])
    kube = counting(cluster)
    w = SliceWatch(kube, DRIVER, node, watch_timeout=(2, 2))  # the server ends each watch after 2 s
    w.start()
    try:
        assert w.wait_synced(30)
        assert w.wait_for(lambda: w.watches >= 4, 60), "the watch was not renewed"
        assert w.lists == 1 and [m for m, _ in kube.requests] == ["GET"]  # the first list, nothing since
        # Still live after the renewals: a slice created now is seen.
        pub = SlicePublisher(cluster.kube, DRIVER, node, Inventory(gpus(2)))
        assert pub.reconcile_once()
        assert w.wait_for(lambda: len(w.pool(node)) == 1, 30)
        assert w.pool(node)[0]["spec"]["pool"]["generation"] == pub.generation
    finally:
        w.stop()


@pytest.mark.cluster
def test_a_simulated_cluster_shares_one_watch_and_idles_without_requests(cluster: ClusterHandle) -> None:
    kube = counting(cluster)
    sim = Simulation(kube, SimulatedCluster.model_validate({"groups": [
        {"namePrefix": "pubwatch-sim-", "count": 12, "profile": "dgx-h100"}]}))
    sim.setup()
    assert sim.reconcile_all() == 12
    stop = threading.Event()
    runner = threading.Thread(target=sim.run, args=(stop, 0.2), daemon=True)
    runner.start()
    try:
        pubs = list(sim.publishers.values())
        wait_for(lambda: all(p.passes >= 2 for p in pubs), 30, "a resync of every pool")
        threads = [t.name for t in threading.enumerate()]
        assert threads.count(f"slicewatch-{DRIVER}") == 1, threads  # one stream for the 12 nodes
        assert not any(n.startswith("publisher-pubwatch-sim-") for n in threads), threads
        before, passes = len(kube.requests), [p.passes for p in pubs]
        wait_for(lambda: all(p.passes >= k + 10 for p, k in zip(pubs, passes, strict=True)), 60,
                 "10 resyncs of every pool")
        assert kube.requests[before:] == []  # polling listed 12 pools x 10 resyncs = 120 times

        victim = "pubwatch-sim-5"
        [old] = pool(cluster, victim)
        cluster.kube.delete(slices_path(old["metadata"]["name"]))
        wait_for(lambda: [s for s in pool(cluster, victim)
                          if s["spec"]["pool"]["generation"] > old["spec"]["pool"]["generation"]], 30,
                 "the simulated node's slice re-created")
        writes = [(m, p) for m, p in kube.requests[before:] if m != "GET"]
        assert writes == [("POST", slices_path())], writes  # only the deleted pool was written
    finally:
        stop.set()
        runner.join(30)
        sim.delete()
