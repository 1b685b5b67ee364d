"""Prometheus gauges of the inventory (``topodra inventory --serve HOST:PORT``).

``METRICS`` is the one list of exported names, their help and labels: ``families`` builds
exactly these from a view, docs/metrics.md documents them, and the Grafana dashboard in
deploy/grafana/ may use only them (both checked by tests). A scrape rebuilds the view from
the API server at most once per ``min_interval`` seconds; while the API server cannot be read,
only ``topodra_inventory_up 0`` and the refresh gauges are exported (no stale numbers).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from topodra.clusterview.model import ALLOCATED, FREE, RESERVED, TAINTED, ClusterView
from topodra.kube import KubeError

log = logging.getLogger(__name__)

DEFAULT_LISTEN = "127.0.0.1:9418"  # below the ephemeral port range, beside the scorer's 9417

METRICS: dict[str, tuple[str, tuple[str, ...]]] = {
    "topodra_inventory_gpus": ("GPUs published by the driver, per model and node.", ("model", "node")),
    "topodra_inventory_gpus_free": ("GPUs neither allocated nor tainted (NoSchedule/NoExecute), per model and node.",
                                    ("model", "node")),
    "topodra_inventory_gpus_allocated": ("GPUs in an allocated ResourceClaim, per model and node.", ("model", "node")),
    "topodra_inventory_gpus_tainted": ("Unallocated GPUs with a NoSchedule/NoExecute device taint, per model and node.",
                                       ("model", "node")),
    "topodra_inventory_gpus_free_unschedulable": (
        "Free GPUs on unschedulable nodes (cordoned, not Ready, NoSchedule/NoExecute node taint), per model: "
        "counted in topodra_inventory_gpus_free, yet no claim can get them now.", ("model",)),
    "topodra_inventory_nodes_unschedulable": ("Nodes with GPUs of the model that no pod can land on now.",
                                              ("model",)),
    "topodra_inventory_nvlink_domains": ("NVLink domains, per GPU model.", ("model",)),
    "topodra_inventory_nvlink_domains_free": ("NVLink domains whose GPUs are all free, per GPU model.", ("model",)),
    "topodra_inventory_largest_claim_gpus": (
        "GPUs of the largest claim placeable now on one schedulable node, per model; placement is any, "
        "nvlink (one NVLink domain) or rail (each GPU with a free NIC on its rail).", ("model", "placement")),
    "topodra_inventory_fragmented_gpus": (
        "Free GPUs the next request is expected not to be able to use (the placement scorer's fragmentation, "
        "summed over the model's nodes).", ("model",)),
    "topodra_inventory_fragmentation_ratio": ("topodra_inventory_fragmented_gpus / free GPUs, per model (0 when none "
                                              "is free).", ("model",)),
    "topodra_inventory_pending_claims": ("Unallocated ResourceClaims, per DeviceClass they request.",
                                         ("device_class",)),
    "topodra_inventory_node_cpu_allocatable_cores": ("Allocatable CPU of the node (status.allocatable).", ("node",)),
    "topodra_inventory_node_cpu_free_cores": (
        "Allocatable CPU minus the requests of the node's bound, non-terminal pods (NodeResourcesFit).", ("node",)),
    "topodra_inventory_node_memory_allocatable_bytes": ("Allocatable memory of the node.", ("node",)),
    "topodra_inventory_node_memory_free_bytes": (
        "Allocatable memory minus the requests of the node's bound, non-terminal pods.", ("node",)),
    "topodra_inventory_gpus_stranded": (
        "Free GPUs the node's free CPU (resource=cpu) or memory (resource=memory) leaves no pod size the cluster "
        "runs able to use, with the CPU and memory per GPU its bound pods of that size asked for (the node's "
        "allocatable / GPUs before any is seen).", ("node", "resource")),
    "topodra_inventory_gpus_idle": ("Allocated GPUs whose claim carries the Idle condition, per model and node.",
                                    ("model", "node")),
    "topodra_inventory_node_gpu_activity_ratio": (
        "Mean compute activity of the node's allocated GPUs, from their claims' last telemetry summary (0-1).",
        ("node",)),
    "topodra_inventory_node_gpu_memory_used_ratio": (
        "Mean share of memory in use of the node's allocated GPUs, from their claims' last telemetry summary.",
        ("node",)),
    "topodra_inventory_namespace_gpu_hours_allocated": (
        "GPU-hours the namespace's existing claims have held their GPUs, as their last summaries say.",
        ("namespace",)),
    "topodra_inventory_namespace_gpu_hours_active": (
        "Of topodra_inventory_namespace_gpu_hours_allocated, the hours above the idle thresholds.", ("namespace",)),
    "topodra_inventory_namespace_gpus": ("GPUs the namespace's claims hold now (reporting: with a telemetry "
                                         "summary).", ("namespace", "reporting")),
    "topodra_inventory_idle_claim_seconds": (
        "Seconds an idle claim's GPUs have been below the idle thresholds (one series per idle claim).",
        ("namespace", "claim", "pod")),
    "topodra_inventory_idle_claim_gpus": ("GPUs of an idle claim.", ("namespace", "claim", "pod")),
    "topodra_inventory_up": ("1 when the last refresh read the API server, 0 when it failed.", ()),
    "topodra_inventory_refresh_seconds": ("Seconds the last refresh took (list the objects, build the view).", ()),
    "topodra_inventory_last_refresh_timestamp_seconds": ("Unix time of the last successful refresh.", ()),
}


def _family(name: str) -> GaugeMetricFamily:
    help_text, labels = METRICS[name]
    return GaugeMetricFamily(name, help_text, labels=list(labels))


def families(view: ClusterView) -> list[GaugeMetricFamily]:
    """The view's gauges (every name of METRICS except the refresh ones)."""
    fams = {n: _family(n) for n in METRICS if n not in ("topodra_inventory_up", "topodra_inventory_refresh_seconds",
                                                          "topodra_inventory_last_refresh_timestamp_seconds")}
    for node in view.nodes:
        counts: dict[str, Counter[str]] = {}
        for g in node.gpus:
            counts.setdefault(g.model or "unknown", Counter())[g.state] += 1
        for model, c in sorted(counts.items()):
            labels = [model, node.name]
            fams["topodra_inventory_gpus"].add_metric(labels, sum(c.values()))
            fams["topodra_inventory_gpus_free"].add_metric(labels, c[FREE])
            fams["topodra_inventory_gpus_allocated"].add_metric(labels, c[ALLOCATED])
            fams["topodra_inventory_gpus_tainted"].add_metric(labels, c[TAINTED] + c[RESERVED])  # reservations too
            fams["topodra_inventory_gpus_idle"].add_metric(labels, sum(1 for g in node.gpus
                                                                       if g.idle and (g.model or "unknown") == model))
        if node.activity is not None:
            fams["topodra_inventory_node_gpu_activity_ratio"].add_metric([node.name], node.activity)
        if node.memory_used is not None:
            fams["topodra_inventory_node_gpu_memory_used_ratio"].add_metric([node.name], node.memory_used)
        h = node.host
        if h is not None:
            fams["topodra_inventory_node_cpu_allocatable_cores"].add_metric([node.name], h.cpu_allocatable_milli / 1000)
            fams["topodra_inventory_node_cpu_free_cores"].add_metric([node.name], h.cpu_free_milli / 1000)
            fams["topodra_inventory_node_memory_allocatable_bytes"].add_metric([node.name], h.memory_allocatable_bytes)
            fams["topodra_inventory_node_memory_free_bytes"].add_metric([node.name], h.memory_free_bytes)
            fams["topodra_inventory_gpus_stranded"].add_metric([node.name, "cpu"], h.gpus_stranded_cpu)
            fams["topodra_inventory_gpus_stranded"].add_metric([node.name, "memory"], h.gpus_stranded_memory)
    for m in view.models:
        fams["topodra_inventory_gpus_free_unschedulable"].add_metric([m.model], m.free_unschedulable)
        fams["topodra_inventory_nodes_unschedulable"].add_metric([m.model], m.unschedulable_nodes)
        fams["topodra_inventory_nvlink_domains"].add_metric([m.model], m.nvlink_domains)
        fams["topodra_inventory_nvlink_domains_free"].add_metric([m.model], m.nvlink_domains_free)
        for placement, value in (("any", m.largest.count), ("nvlink", m.largest.nvlink),
                                 ("rail", m.largest.rail_aligned)):
            fams["topodra_inventory_largest_claim_gpus"].add_metric([m.model, placement], value)
        fams["topodra_inventory_fragmented_gpus"].add_metric([m.model], m.fragmentation)
        fams["topodra_inventory_fragmentation_ratio"].add_metric([m.model], m.fragmentation_ratio)
    for ns in view.namespaces:
        fams["topodra_inventory_namespace_gpu_hours_allocated"].add_metric([ns.namespace], ns.gpu_hours_allocated)
        fams["topodra_inventory_namespace_gpu_hours_active"].add_metric([ns.namespace], ns.gpu_hours_active)
        fams["topodra_inventory_namespace_gpus"].add_metric([ns.namespace, "false"], ns.gpus - ns.gpus_reporting)
        fams["topodra_inventory_namespace_gpus"].add_metric([ns.namespace, "true"], ns.gpus_reporting)
    for ic in view.idle_claims:
        labels = [ic.namespace, ic.claim, ",".join(ic.pods)]
        fams["topodra_inventory_idle_claim_seconds"].add_metric(labels, ic.idle_seconds)
        fams["topodra_inventory_idle_claim_gpus"].add_metric(labels, ic.gpus)
    for cls, n in view.pending_by_class().items():
        fams["topodra_inventory_pending_claims"].add_metric([cls], n)
    return list(fams.values())


class InventoryCollector(Collector):
    """Builds the view on scrape (at most once per ``min_interval`` seconds) and exports it."""

    def __init__(self, load: Callable[[], ClusterView], min_interval: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.load = load
        self.min_interval = min_interval
        self.clock = clock
        self._lock = threading.Lock()
        self._view: ClusterView | None = None
        self._at = float("-inf")
        self._ok = False
        self._took = 0.0
        self._last_success = 0.0

    def refresh(self) -> None:
        with self._lock:
            if self._view is not None and self._ok and self.clock() - self._at < self.min_interval:
                return
            t0 = time.perf_counter()
            try:
                self._view = self.load()
                self._ok = True
                self._last_success = time.time()
            except (KubeError, OSError) as e:
                log.warning("inventory refresh failed: %s", e)
                self._ok = False
            self._took = time.perf_counter() - t0
            self._at = self.clock()

    def describe(self) -> Iterator[GaugeMetricFamily]:
        """The names without values, so registering does not read the API server."""
        for name in METRICS:
            yield _family(name)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        self.refresh()
        yield from self._refresh_families()
        if self._ok and self._view is not None:
            yield from families(self._view)

    def _refresh_families(self) -> Iterable[GaugeMetricFamily]:
        up = _family("topodra_inventory_up")
        up.add_metric([], 1.0 if self._ok else 0.0)
        took = _family("topodra_inventory_refresh_seconds")
        took.add_metric([], self._took)
        last = _family("topodra_inventory_last_refresh_timestamp_seconds")
        last.add_metric([], self._last_success)
        return [up, took, last]
