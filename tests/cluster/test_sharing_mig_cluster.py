"""MIG as partitionable devices: fake NVML MIG semantics, discovery, counters, and the real apiserver's validation.

Split by tier; the rest: tests/unit/sharing/test_sharing_mig.py.
"""

from __future__ import annotations

import pytest
from testkit.handle import ClusterHandle

from topodra.apipaths import slices_path
from topodra.hardware import load_backend
from topodra.inventory import Inventory
from topodra.publisher import SlicePublisher

DRIVER = "gpu.topodra.io"


# -- discovery and publishing ---------------------------------------------------------------------


@pytest.mark.cluster
def test_apiserver_accepts_mig_pool(cluster: ClusterHandle) -> None:
    node = "mig-pub-0"
    cluster.fake_nodes([node])
    devs = load_backend("mock:dgx-a100-80gb-mig", node).discover()
    pub = SlicePublisher(cluster.kube, DRIVER, node, Inventory(devs))
    try:
        assert pub.reconcile_once()
        got = list(cluster.kube.list(slices_path(), field_selector=f"spec.driver={DRIVER},spec.nodeName={node}"))
        assert sum(len(s["spec"].get("devices") or []) for s in got) == len(devs)
        assert sum(len(s["spec"].get("sharedCounters") or []) for s in got) == 8
        assert not pub.reconcile_once(), "what the apiserver stored must read back as the same content"
    finally:
        for s in cluster.kube.list(slices_path(), field_selector=f"spec.driver={DRIVER},spec.nodeName={node}"):
            cluster.kube.delete(slices_path(s["metadata"]["name"]))
