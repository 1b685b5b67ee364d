"""Keeps the scorer's ClusterState current: one list + watch loop per kind, no API call per request.

The loop is ``topodra.informer`` (shared with the controller): each kind is listed into the state
(``ClusterState.replace``), then watched, each event applied by ``apply_event``; after a relist every
node's view is built and the heap settled (``settle_heap``), so no ``prioritize`` call pays for either.

Pods and PodGroups are watched for gangs (``fleet.pods``: where a gang's siblings are, its size); the
PodGroup API is optional like the DeviceTaintRule API (served only with the GenericWorkload gate).

DeviceTaintRules are watched too (a blocking rule makes a device unavailable, ``fleet.taints``). Their
API is optional: where it is not served (404) or not granted (403), the kind counts as listed with no
rules and is retried every ``OPTIONAL_RETRY`` seconds, so the scorer still becomes ready.

``OPTIONAL_RETRY``, ``Source`` and ``settle_heap`` are re-exported for the benches that import them here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from topodra.apipaths import (
    claim_path,
    device_class_path,
    device_taint_rule_path,
    node_path,
    pod_path,
    podgroup_path,
    slices_path,
    template_path,
)
from topodra.fleet.state import ClusterState
from topodra.informer import OPTIONAL_RETRY, Informer, Source, settle_heap
from topodra.kube import Kube, Obj

__all__ = ["KINDS", "OPTIONAL_RETRY", "Cache", "Source", "apply_event", "pods_source", "settle_heap", "sources"]

log = logging.getLogger(__name__)

KINDS = ("slices", "classes", "nodes", "claims", "templates", "taintrules", "pods", "podgroups")


def sources(driver: str) -> list[Source]:
    return [
        Source("slices", slices_path(), f"spec.driver={driver}"),
        Source("classes", device_class_path()),
        Source("nodes", node_path()),
        Source("claims", claim_path()),
        Source("templates", template_path()),
        Source("taintrules", device_taint_rule_path(), optional=True),
        pods_source(),  # CPU/memory held (fleet.hostres) and a gang's siblings (fleet.pods)
        Source("podgroups", podgroup_path(), optional=True),  # absent without the GenericWorkload gate
    ]


def pods_source() -> Source:
    """Every pod (bound ones hold node CPU and memory; unbound ones carry their pod group). Terminal
    pods are filtered by the server: they hold nothing (``fleet.hostres``)."""
    return Source("pods", pod_path(), "status.phase!=Succeeded,status.phase!=Failed")


def apply_event(state: ClusterState, kind: str, event_type: str, obj: Obj) -> None:
    """One watch event into the state (pure function of state and event)."""
    meta = obj.get("metadata") or {}
    name, ns = str(meta.get("name", "")), str(meta.get("namespace", ""))
    deleted = event_type == "DELETED"
    if kind == "slices":
        state.delete_slice(name) if deleted else state.set_slice(obj)
    elif kind == "classes":
        state.delete_class(name) if deleted else state.set_class(obj)
    elif kind == "nodes":
        state.delete_node(name) if deleted else state.set_node(obj)
    elif kind == "claims":
        state.delete_claim(ns, name) if deleted else state.set_claim(obj)
    elif kind == "templates":
        state.delete_template(ns, name) if deleted else state.set_template(obj)
    elif kind == "taintrules":
        state.delete_taint_rule(name) if deleted else state.set_taint_rule(obj)
    elif kind == "pods":
        state.delete_pod(ns or "default", name) if deleted else state.set_pod(obj)
    elif kind == "podgroups":
        state.pods.delete_group(ns or "default", name) if deleted else state.pods.set_group(obj)
    else:
        raise ValueError(f"unknown kind {kind!r}")


class Cache(Informer):
    """The watched state behind one lock, fed by one thread per kind (``topodra.informer``)."""

    def __init__(self, kube: Kube, state: ClusterState, watch_timeout: int = 300,
                 on_relist: Callable[[str], None] | None = None) -> None:
        self.state = state
        self._on_relist = on_relist
        super().__init__(kube, sources(state.driver), self._replace_kind,
                         lambda kind, etype, obj: apply_event(self.state, kind, etype, obj),
                         watch_timeout=watch_timeout, after_relist=self._relisted)

    def _replace_kind(self, kind: str, items: Sequence[Obj]) -> None:
        self.state.replace(kind, items)
        if kind in ("slices", "classes"):
            self.state.warm_views()  # the first prioritize call would build them all

    def _relisted(self, kind: str) -> None:
        settle_heap()
        if self._on_relist:
            self._on_relist(kind)
