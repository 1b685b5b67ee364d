"""Hand-built cluster views for the placement scorer's unit tests and its latency bench.

Slices come from the real discovery code on mock profiles (``topodra.simulate.discover``) and the
real slice builder, discovered once per profile and renamed per node; DeviceClasses are the shipped
ones in ``deviceclasses/``. Nothing here talks to an API server.
"""

from __future__ import annotations

import copy
import functools
import itertools
from typing import Any

import yaml
from testkit.paths import REPO

from topodra import DEFAULT_DRIVER_NAME as DRIVER
from topodra.fleet.state import ClusterState
from topodra.simulate import SimNode, discover
from topodra.slices import build_slices

Obj = dict[str, Any]
_uid = itertools.count()


@functools.cache
def _profile_slices(profile: str) -> tuple[Obj, ...]:
    devs = discover(SimNode(name="template", profile=profile, labels={}, overrides={}))
    return tuple(build_slices(DRIVER, "template", None, devs, 1))


def node_slices(node: str, profile: str) -> list[Obj]:
    """The profile's slices as published for ``node`` (names, pool and per-node attribute values)."""
    out = []
    for s in _profile_slices(profile):
        s = copy.deepcopy(s)
        s["metadata"]["name"] = s["metadata"]["name"].replace("template", node, 1)
        s["spec"]["nodeName"] = node
        s["spec"]["pool"]["name"] = node
        for d in s["spec"].get("devices", ()):  # a MIG GPU's counter sets come in slices with no devices
            for attr in d.get("attributes", {}).values():
                if isinstance(attr.get("string"), str) and attr["string"].startswith("template/"):
                    attr["string"] = node + attr["string"][len("template"):]
        out.append(s)
    return out


@functools.lru_cache(maxsize=1)
def device_classes() -> tuple[Obj, ...]:
    return tuple(yaml.safe_load(p.read_text()) for p in sorted((REPO / "deviceclasses").glob("*.yaml")))


def state(nodes: dict[str, str], window: int = 200) -> ClusterState:
    """A ClusterState with the shipped classes and ``{node: profile}`` published."""
    st = ClusterState(DRIVER, window=window)
    st.replace("classes", device_classes())
    st.replace("nodes", [{"metadata": {"name": n}} for n in nodes])
    st.replace("slices", [s for n, p in nodes.items() for s in node_slices(n, p)])
    return st


def claim(name: str, spec: Obj, namespace: str = "ns", allocated: list[tuple[str, str]] | None = None,
          created: str = "2026-01-01T00:00:00Z") -> Obj:
    """A ResourceClaim; ``allocated`` lists (pool, device) results of our driver."""
    obj: Obj = {"metadata": {"name": name, "namespace": namespace, "uid": f"uid-{namespace}-{name}",
                             "creationTimestamp": created}, "spec": spec}
    if allocated is not None:
        obj["status"] = {"allocation": {"devices": {"results": [
            {"request": "gpus", "driver": DRIVER, "pool": p, "device": d} for p, d in allocated]}}}
    return obj


def gpus(count: int, device_class: str = "gpu.topodra.io", nvlink: bool = False) -> Obj:
    """A ResourceClaimSpec for ``count`` GPUs of a class, optionally on one NVLink domain."""
    spec: Obj = {"devices": {"requests": [{"name": "gpus", "exactly": {
        "deviceClassName": device_class, "allocationMode": "ExactCount", "count": count}}]}}
    if nvlink:
        spec["devices"]["constraints"] = [{"requests": ["gpus"], "matchAttribute": f"{DRIVER}/nvlinkDomain"}]
    return spec


def hold(st: ClusterState, node: str, devices: list[str], name: str | None = None) -> None:
    """Mark devices of ``node`` as allocated to a claim."""
    st.set_claim(claim(name or f"hold-{node}-{next(_uid)}", gpus(len(devices)),
                       allocated=[(node, d) for d in devices]))


def pod(claims: list[Obj], namespace: str = "ns", statuses: list[Obj] | None = None) -> Obj:
    return {"metadata": {"name": "p", "namespace": namespace},
            "spec": {"resourceClaims": claims, "containers": []},
            "status": {"resourceClaimStatuses": statuses or []}}
