"""Pods and PodGroups as the scorer needs them: where a gang's pods already are, and how big the gang is. Pure.

The scheduler asks the extender about one pod at a time and never says where that pod's siblings went,
so the scorer reads them from its own watch: a sibling counts where it is bound (``spec.nodeName``) or,
while waiting for preemption, nominated (``status.nominatedNodeName``). Finished pods (``Succeeded``,
``Failed``) hold nothing and are dropped. A PodGroup (``scheduling.k8s.io/v1beta1``) gives the gang's
``minCount`` and its topology key (``spec.schedulingConstraints.topology[0].key``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

Obj = dict[str, Any]
DONE_PHASES = frozenset({"Succeeded", "Failed"})


@dataclass(frozen=True)
class PodRecord:
    namespace: str
    name: str
    node: str  # bound node, else nominated node, else ""
    pod_group: str  # spec.schedulingGroup.podGroupName, "" when none
    phase: str
    bound: bool = False  # node is spec.nodeName (not only a nomination)


@dataclass(frozen=True)
class PodGroupRecord:
    namespace: str
    name: str
    min_count: int  # gang minCount; 1 for a basic (non-gang) policy
    topology_key: str | None  # the first topology constraint's label key


def _meta(obj: Obj) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace") or "default"), str(meta.get("name") or "")


def pod_group_name(pod: Obj) -> str:
    group = ((pod.get("spec") or {}).get("schedulingGroup") or {}).get("podGroupName")
    return str(group) if group else ""


def pod_record(obj: Obj) -> PodRecord:
    ns, name = _meta(obj)
    spec, status = obj.get("spec") or {}, obj.get("status") or {}
    bound = str(spec.get("nodeName") or "")
    node = bound or str(status.get("nominatedNodeName") or "")
    return PodRecord(namespace=ns, name=name, node=node, pod_group=pod_group_name(obj),
                     phase=str(status.get("phase") or ""), bound=bool(bound))


def pod_group_record(obj: Obj) -> PodGroupRecord:
    ns, name = _meta(obj)
    spec = obj.get("spec") or {}
    gang = (spec.get("schedulingPolicy") or {}).get("gang") or {}
    try:
        min_count = max(1, int(gang.get("minCount") or 1))
    except (TypeError, ValueError):
        min_count = 1
    topo = ((spec.get("schedulingConstraints") or {}).get("topology")) or []
    key = topo[0].get("key") if topo and isinstance(topo[0], dict) else None
    return PodGroupRecord(namespace=ns, name=name, min_count=min_count, topology_key=str(key) if key else None)


class Pods:
    """Live pods (finished ones dropped), indexed by gang; and the PodGroups. Not thread-safe."""

    def __init__(self) -> None:
        self.pods: dict[tuple[str, str], PodRecord] = {}
        self.groups: dict[tuple[str, str], PodGroupRecord] = {}
        self._members: dict[tuple[str, str], set[str]] = {}  # (namespace, group) -> pod names

    def set_pod(self, obj: Obj) -> None:
        rec = pod_record(obj)
        self.delete_pod(rec.namespace, rec.name)
        if rec.phase in DONE_PHASES or (obj.get("metadata") or {}).get("deletionTimestamp"):
            return
        self.pods[(rec.namespace, rec.name)] = rec
        if rec.pod_group:
            self._members.setdefault((rec.namespace, rec.pod_group), set()).add(rec.name)

    def delete_pod(self, namespace: str, name: str) -> None:
        old = self.pods.pop((namespace, name), None)
        if old is not None and old.pod_group:
            members = self._members.get((namespace, old.pod_group))
            if members is not None:
                members.discard(name)
                if not members:
                    del self._members[(namespace, old.pod_group)]

    def set_group(self, obj: Obj) -> None:
        rec = pod_group_record(obj)
        self.groups[(rec.namespace, rec.name)] = rec

    def delete_group(self, namespace: str, name: str) -> None:
        self.groups.pop((namespace, name), None)

    def replace_pods(self, objs: Iterable[Obj]) -> None:
        self.pods.clear()
        self._members.clear()
        for o in objs:
            self.set_pod(o)

    def replace_groups(self, objs: Iterable[Obj]) -> None:
        self.groups.clear()
        for o in objs:
            self.set_group(o)

    def siblings(self, namespace: str, group: str, exclude: str = "") -> list[PodRecord]:
        """The gang's other live pods, in name order."""
        names = sorted(self._members.get((namespace, group), ()))
        return [self.pods[(namespace, n)] for n in names if n != exclude]

    def group(self, namespace: str, group: str) -> PodGroupRecord | None:
        return self.groups.get((namespace, group))
