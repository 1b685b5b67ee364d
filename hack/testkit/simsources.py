"""A simulated cluster file's API objects in process, for the inventory's tests and offline profiles.

What ``topodra simulate`` would publish (slices from the real discovery code on each profile, Nodes with
the file's labels and the profile's allocatable), plus a deterministic load on top: claims holding GPUs in a
few namespaces, bound pods holding node CPU, a tainted GPU, a cordoned node. Nothing talks to an API
server, so 2,048 nodes take seconds, not a control plane.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from testkit.views import claim, device_classes, gpus, node_slices

from topodra import DEFAULT_DRIVER_NAME as DRIVER
from topodra.clusterview.model import Sources
from topodra.simulate import fake_node, fake_node_status, load_cluster, plan, profile_allocatable, with_fabric

Obj = dict[str, Any]
NAMESPACES = ("team-a", "team-b", "ml-train", "inference")
SIZES = (8, 4, 1, 2, 8, 1, 4, 8)  # GPUs per job, cycled


def _pod(ns: str, name: str, node: str, cpu: str) -> Obj:
    return {"metadata": {"name": name, "namespace": ns}, "spec": {
        "nodeName": node, "containers": [{"name": "main", "resources": {"requests": {"cpu": cpu}}}]},
        "status": {"phase": "Running"}}


def cluster_sources(path: str | Path, *, fill: float = 0.5, seed: int = 7, nodes: int | None = None) -> Sources:
    """The file's first ``nodes`` nodes (all when None) with about ``fill`` of the GPUs held by claims.

    Jobs of ``SIZES`` GPUs go first-fit onto randomly ordered nodes (so some nodes are full, some partly
    used, some idle). Every 16th node's first GPU is tainted NoSchedule in its slice, every 64th node is
    cordoned, and every 32nd node has a pod holding all but 8 of its CPUs (so its free GPUs are stranded).
    """
    planned = plan(load_cluster(path))[:nodes]
    rng = random.Random(seed)
    slices: list[Obj] = []
    node_objs: list[Obj] = []
    pods: list[Obj] = []
    free: dict[str, list[str]] = {}
    for i, n in enumerate(planned):
        mine = node_slices(n.name, n.profile)
        devices = [d for s in mine for d in s["spec"]["devices"]]
        names = [str(d["name"]) for d in devices if d.get("attributes", {}).get("type", {}).get("string") == "gpu"]
        if i % 16 == 5 and names:
            devices[[d["name"] for d in devices].index(names[0])].setdefault("taints", []).append(
                {"key": "topodra.io/xid", "value": "79", "effect": "NoSchedule"})
            names = names[1:]
        free[n.name] = names
        slices += mine
        cpus, memory = profile_allocatable(n.profile)
        obj = {**fake_node(n.name, with_fabric({}, n.labels)), **fake_node_status(n.name, cpus, memory)}
        if i % 64 == 9:
            obj["spec"] = {"unschedulable": True}
        node_objs.append(obj)
        if i % 32 == 17:
            pods.append(_pod("batch", f"cpu-hog-{i}", n.name, str(max(int(cpus) - 8, 1))))
    claims: list[Obj] = []
    order = list(free)
    rng.shuffle(order)
    target = fill * sum(len(v) for v in free.values())
    held = 0
    job = 0
    while held < target:
        size = SIZES[job % len(SIZES)]
        node = next((n for n in order if len(free[n]) >= size), None)
        if node is None:
            break
        taken, free[node] = free[node][:size], free[node][size:]
        ns = NAMESPACES[job % len(NAMESPACES)]
        claims.append(claim(f"job-{job}", gpus(size), namespace=ns, allocated=[(node, d) for d in taken]))
        held += size
        job += 1
    return Sources(slices=tuple(slices), claims=tuple(claims), classes=device_classes(), nodes=tuple(node_objs),
                   pods=tuple(pods))


__all__ = ["DRIVER", "cluster_sources"]
