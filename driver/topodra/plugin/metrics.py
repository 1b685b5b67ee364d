"""Prometheus metrics of the kubelet plugin, as module-level singletons.

They live in one small module (no gRPC import).  The core (prepare state, slice
publisher) never imports it: it reports through a ``topodra.observe.Observer``,
and ``MetricsObserver`` here turns those reports into metrics.
All metrics go to prometheus_client's default registry, which also carries the
process collector (RSS, CPU, open fds) that the memory budget is checked against.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING
from wsgiref.simple_server import WSGIServer

from prometheus_client import Counter, Gauge, Histogram, start_http_server

if TYPE_CHECKING:
    from topodra.health.monitor import HealthSnapshot

log = logging.getLogger(__name__)

# Prepare normally writes one small CDI file: most calls should land well under
# 100 ms; the kubelet gives up after 45 s.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 45.0)

REQUESTS = Counter(
    "topodra_plugin_requests",
    "NodePrepareResources/NodeUnprepareResources gRPC calls received, by method and API version.",
    ["method", "api"],
)
REQUEST_ERRORS = Counter(
    "topodra_plugin_request_errors",
    "Failed gRPC calls (scope=call: the whole call got a gRPC error) and failed claims inside "
    "successful calls (scope=claim).",
    ["method", "scope"],
)
REQUEST_LATENCY = Histogram(
    "topodra_plugin_request_duration_seconds",
    "Time spent serving NodePrepareResources/NodeUnprepareResources calls.",
    ["method"],
    buckets=LATENCY_BUCKETS,
)
REQUESTS_IN_FLIGHT = Gauge(
    "topodra_plugin_requests_in_flight",
    "NodePrepareResources/NodeUnprepareResources calls being served right now.",
    ["method"],
)
PREPARED_CLAIMS = Gauge("topodra_plugin_prepared_claims", "ResourceClaims currently prepared on this node.")
PREPARED_DEVICES = Gauge("topodra_plugin_prepared_devices", "Devices prepared for claims on this node.")
PUBLISHED_DEVICES = Gauge("topodra_plugin_published_devices", "Devices in this node's ResourceSlices.")
LAST_PUBLISH = Gauge(
    "topodra_plugin_last_publish_timestamp_seconds",
    "Unix time of the last successful ResourceSlice publish (0 = never).",
)
REGISTRATION_STATUS = Gauge(
    "topodra_plugin_registration_status",
    "1 when the kubelet last reported a successful registration, 0 when it reported a failure or has "
    "not reported yet.",
)
REGISTRATION_FAILURES = Counter(
    "topodra_plugin_registration_failures",
    "NotifyRegistrationStatus calls in which the kubelet reported that registration failed.",
)
LOCK_HOLD = Histogram(
    "topodra_plugin_lock_hold_seconds",
    "Time the node-wide prepare lock (thread lock + flock) was held, by operation. Only local work "
    "(checkpoint, CDI specs) happens under it; API reads happen before it is taken.",
    ["operation"],
    buckets=LATENCY_BUCKETS,
)
HEALTH_STREAMS = Gauge(
    "topodra_plugin_health_streams",
    "Open NodeWatchResources streams (kubelet device-health watches).",
)
HEALTH_UNMONITORED = Gauge(
    "topodra_plugin_health_unmonitored_devices",
    "Devices whose health the plugin cannot read now (NVML or a health source failing): each carries the "
    "gpu.topodra.io/unmonitored taint (effect None) until monitoring works again. Alert on > 0.",
)
NODE_LABELS_SYNCED = Gauge(
    "topodra_plugin_node_labels_synced",
    "1 when the last attempt to sync this Node's topodra.io/ labels succeeded, 0 after a failure or before "
    "the first attempt.",
)
NODE_LABEL_FAILURES = Counter(
    "topodra_plugin_node_label_failures",
    "Failed attempts to read or patch this Node's topodra.io/ labels (each is retried with backoff).",
)


def node_labels_result(ok: bool) -> None:
    """``NodeLabeler`` on_result: one sync attempt finished."""
    NODE_LABELS_SYNCED.set(1 if ok else 0)
    if not ok:
        NODE_LABEL_FAILURES.inc()


def health_changed(snapshot: HealthSnapshot) -> None:
    """HealthMonitor subscriber: how many devices carry the unmonitored taint."""
    from topodra.health.policy import UNMONITORED_KEY

    HEALTH_UNMONITORED.set(sum(1 for ts in snapshot.taints.values() if any(t.key == UNMONITORED_KEY for t in ts)))


class MetricsObserver:
    """``topodra.observe.Observer`` that updates the metrics above."""

    def prepared(self, claims: int, devices: int) -> None:
        PREPARED_CLAIMS.set(claims)
        PREPARED_DEVICES.set(devices)

    def lock_held(self, operation: str, seconds: float) -> None:
        LOCK_HOLD.labels(operation).observe(seconds)

    def published(self, devices: int) -> None:
        PUBLISHED_DEVICES.set(devices)
        LAST_PUBLISH.set_to_current_time()


def serve(port: int, host: str = "127.0.0.1") -> WSGIServer:
    """Serve /metrics on host:port in a daemon thread; port 0 picks a free port."""
    server, _thread = start_http_server(port, addr=host)
    log.info("metrics served address=http://%s:%d/metrics", host, server.server_port)
    return server
