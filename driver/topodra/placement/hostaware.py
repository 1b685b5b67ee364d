"""The scorer's CPU/memory input for one pod: per candidate node, its free CPU and memory and the pod's
per-GPU share (``fleet.hostfrag``). Pure over the cache's state.

A node whose allocatable the scorer has not seen gets None (GPU-only scoring there). When the pod's claims
ask for no countable GPUs, every seen node still gets a fit, with no per-GPU share (``share`` None): a node
whose free CPU or memory cannot hold the pod still does not fit, and fragmentation there is GPU-only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from topodra.fleet.demand import Demand
from topodra.fleet.hostfrag import HostFit, HostJob, class_gpus
from topodra.fleet.hostres import Share, pod_requests
from topodra.fleet.shares import Shares
from topodra.fleet.state import ClusterState


def host_job(pod: dict[str, Any], demands: Sequence[Demand], observed: Shares | None = None) -> HostJob:
    """The pod's CPU and memory request and its per-GPU share (None when a claim's GPU count is unknown, or
    the pod has no claims of ours). ``observed``: the cluster's shares by pod size (``fleet.shares``), for
    judging each class with its own share (issue 34, ``--host-resources mix``); None: the pod's share for all."""
    cpu, mem = pod_requests(pod)
    gpus = sum(class_gpus(d) for d in demands)
    share = Share.of(cpu, mem, gpus) if all(class_gpus(d) for d in demands) else None
    if observed is None:
        return HostJob(pod_cpu=cpu, pod_memory=mem, share=share)
    return HostJob(pod_cpu=cpu, pod_memory=mem, share=share, observed=observed, gpus=gpus if share else 0,
                   per_class=True)


def host_fits(state: ClusterState, pod: dict[str, Any], demands: Sequence[Demand],
              names: Sequence[str], observed: Shares | None = None) -> list[HostFit | None]:
    """One ``HostFit`` (or None) per candidate name, in order. ``observed`` as in ``host_job``: each class is
    capped with its own share, sizes not seen yet with the node's allocatable per GPU (as ``fleet.nodestates``
    gives the per-state path)."""
    job = host_job(pod, demands, observed)
    out: list[HostFit | None] = []
    for n in names:
        room = state.hosts.room(n)
        if room is None:
            out.append(None)
            continue
        view = state.node_view(n) if job.per_class else None
        fair = None if view is None else Share.of(room.cpu_alloc, room.memory_alloc, view.gpus)
        out.append(job.on(room.cpu_free, room.memory_free, fair))
    return out
