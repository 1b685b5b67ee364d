"""What listing the bound pods adds to one controller snapshot read (``SnapshotCache.get(host=True)``).

Ad hoc, not a benchmark with a results file: a private local cluster (``testkit.cluster.Cluster.private``, its own
ports and lock), 64 kubelet-less nodes, N CPU-only pods bound to them round-robin. Per N, the median of 7 reads
of the base snapshot (slices, claims, classes, nodes, taint rules) and of base + pods, process CPU and wall, and
the CPU of building the free CPU/memory view (``fleet.hostres``) from the listed pods.

    .venv/bin/python hack/measure_controller_pods.py 0 1000 4000
"""

from __future__ import annotations

import functools
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from testkit import cluster as localcluster

from topodra.apipaths import node_path, pod_path
from topodra.controller.availability import host_resources
from topodra.controller.operator import HOLDING_PODS, ControllerConfig, SnapshotCache

NODES = 64
RUNS = 7


def pod(i: int) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"p{i}", "namespace": "default"},
            "spec": {"nodeName": f"m-{i % NODES}", "restartPolicy": "Never",
                     "containers": [{"name": "c", "image": "localhost/busybox:1.35",
                                     "resources": {"requests": {"cpu": "1", "memory": "1Gi"}}}]}}


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """Median (wall, process CPU) seconds of ``RUNS`` calls."""
    walls, cpus = [], []
    for _ in range(RUNS):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        cpus.append(time.process_time() - c0)
        walls.append(time.perf_counter() - t0)
    return statistics.median(walls), statistics.median(cpus)


def main(sizes: list[int]) -> None:
    lc = localcluster.Cluster.private("ctlpods")
    lc.up(build=False)
    try:
        kube = lc.kube()
        lc.create_fake_nodes([f"m-{i}" for i in range(NODES)])
        made = 0
        for size in sizes:
            with ThreadPoolExecutor(4) as ex:
                list(ex.map(lambda i: kube.create(pod_path("default"), pod(i)), range(made, size)))
            made = max(made, size)
            cache = SnapshotCache(ControllerConfig(snapshot_ttl_s=0.0))
            base = timed(functools.partial(cache.get, kube))
            host = timed(functools.partial(cache.get, kube, host=True))
            pods = list(kube.list(pod_path(), field_selector=HOLDING_PODS))
            nodes = list(kube.list(node_path()))
            build = timed(functools.partial(host_resources, nodes, pods))
            print(f"pods={len(pods)} nodes={NODES}: base wall {base[0] * 1e3:.1f} ms cpu {base[1] * 1e3:.1f} ms | "
                  f"with pods wall {host[0] * 1e3:.1f} ms cpu {host[1] * 1e3:.1f} ms | "
                  f"host view build {build[1] * 1e3:.1f} ms cpu", flush=True)
    finally:
        lc.down(quiet=True)


if __name__ == "__main__":
    main([int(x) for x in sys.argv[1:]] or [0, 1000, 4000])
