"""Health, both directions.

* Device health for the kubelet (KEP-4680): ``NodeWatchResources`` of
  ``v1alpha1.DRAResourceHealth`` and ``v1.DRAResourceHealth`` on the DRA socket.
  Every message is the complete device list; the kubelet marks devices it has
  not heard about within the timeout as Unknown, so the snapshot is re-sent
  periodically and immediately whenever health changes.
* Process health for probes: the standard ``grpc.health.v1.Health`` service on
  127.0.0.1 only. Because a kubelet gRPC probe dials the pod IP, use an exec probe
  (``python -m topodra.plugin.health --port N``) against it.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import IntEnum
from types import ModuleType
from typing import Any

import grpc

from topodra.pb.grpchealth.v1 import health_pb2, health_pb2_grpc
from topodra.plugin import metrics

log = logging.getLogger(__name__)

# Probe answers when all is well for this service name, or for "" (the whole server).
PLUGIN_SERVICE = "topodra.kubelet-plugin"
MAX_MESSAGE_CHARS = 1024


class Health(IntEnum):
    """Same numbers as the HealthStatus enum of both DRA health API versions."""

    UNKNOWN = 0
    HEALTHY = 1
    UNHEALTHY = 2


@dataclass(frozen=True)
class DeviceHealth:
    name: str
    health: Health
    message: str = ""
    since: float = 0.0


class DeviceHealthBoard:
    """The current health of this node's devices, shared by all watch streams."""

    def __init__(self, pool_name: str, resend_interval: float = 10.0, timeout_seconds: int = 30) -> None:
        if resend_interval <= 0 or timeout_seconds <= resend_interval:
            raise ValueError("need 0 < resend_interval < timeout_seconds so reports never expire")
        self.pool_name = pool_name
        self.resend_interval = resend_interval
        self.timeout_seconds = timeout_seconds
        self._cond = threading.Condition()
        self._devices: dict[str, DeviceHealth] = {}
        self._version = 0
        self._closed = False

    def set_devices(self, names: Iterable[str]) -> None:
        """Replace the device list; new devices start HEALTHY, known ones keep their state."""
        now = time.time()
        with self._cond:
            old = self._devices
            self._devices = {n: old.get(n) or DeviceHealth(n, Health.HEALTHY, "", now) for n in names}
            self._version += 1
            self._cond.notify_all()

    def set_health(self, name: str, health: Health, message: str = "") -> None:
        """Record a health change of one known device and wake every stream."""
        with self._cond:
            if name not in self._devices:
                raise KeyError(f"unknown device {name!r} in pool {self.pool_name}")
            if health != self._devices[name].health:
                log.warning("device health changed pool=%s device=%s health=%s message=%r",
                            self.pool_name, name, health.name, message)
            self._devices[name] = DeviceHealth(name, health, message[:MAX_MESSAGE_CHARS], time.time())
            self._version += 1
            self._cond.notify_all()

    def snapshot(self) -> tuple[int, list[DeviceHealth]]:
        with self._cond:
            return self._version, list(self._devices.values())

    @property
    def closed(self) -> bool:
        with self._cond:
            return self._closed

    def wait_for_change(self, version: int, timeout: float) -> None:
        """Block until the board moves past ``version``, is closed, is poked, or timeout."""
        with self._cond:
            if self._version == version and not self._closed:
                self._cond.wait(timeout)

    def poke(self) -> None:
        """Wake all waiting streams so they re-check whether their RPC is still alive."""
        with self._cond:
            self._cond.notify_all()

    def close(self) -> None:
        """End all streams (server shutdown)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class DeviceHealthServicer:
    """NodeWatchResources for one API version; ``pb`` is that version's ``api_pb2`` module."""

    def __init__(self, board: DeviceHealthBoard, pb: ModuleType, api: str,
                 streams: threading.BoundedSemaphore) -> None:
        self._board = board
        self._pb = pb
        self._api = api
        self._streams = streams

    def _response(self, devices: list[DeviceHealth]) -> Any:
        pb = self._pb
        return pb.NodeWatchResourcesResponse(devices=[
            pb.DeviceHealth(
                device=pb.DeviceIdentifier(pool_name=self._board.pool_name, device_name=d.name),
                health=int(d.health),
                # Each message re-asserts the state, so "last updated" is now.
                last_updated_time=int(time.time()),
                health_check_timeout_seconds=self._board.timeout_seconds,
                message=d.message,
            )
            for d in devices
        ])

    def NodeWatchResources(self, request: Any, context: Any) -> Iterator[Any]:
        # Each open stream holds a server thread; a bounded number keeps prepare calls served.
        if not self._streams.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many NodeWatchResources streams open")
        metrics.HEALTH_STREAMS.inc()
        log.info("kubelet opened a device health stream api=%s pool=%s", self._api, self._board.pool_name)
        context.add_callback(self._board.poke)
        try:
            while context.is_active() and not self._board.closed:
                version, devices = self._board.snapshot()
                yield self._response(devices)
                self._board.wait_for_change(version, self._board.resend_interval)
        finally:
            metrics.HEALTH_STREAMS.dec()
            self._streams.release()
            log.info("device health stream ended api=%s pool=%s", self._api, self._board.pool_name)


HealthCheck = Callable[[], str | None]
"""Returns None when healthy, else the reason why not."""


class ProbeServicer(health_pb2_grpc.HealthServicer):
    """grpc.health.v1.Health: SERVING while ``check`` finds nothing wrong."""

    def __init__(self, check: HealthCheck, watch_interval: float = 1.0) -> None:
        self._check = check
        self._watch_interval = watch_interval
        self._last_reason: str | None = None
        self._lock = threading.Lock()
        self._stopped = threading.Event()

    def status(self) -> health_pb2.HealthCheckResponse.ServingStatus:
        reason = self._check()
        with self._lock:
            if reason != self._last_reason:
                if reason:
                    log.warning("plugin is unhealthy: %s", reason)
                else:
                    log.info("plugin is healthy")
                self._last_reason = reason
        r = health_pb2.HealthCheckResponse
        return r.NOT_SERVING if reason else r.SERVING

    def Check(self, request: Any, context: Any) -> Any:
        if request.service not in ("", PLUGIN_SERVICE):
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=self.status())

    def Watch(self, request: Any, context: Any) -> Iterator[Any]:
        if request.service not in ("", PLUGIN_SERVICE):
            yield health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
            return
        last: health_pb2.HealthCheckResponse.ServingStatus | None = None
        while context.is_active() and not self._stopped.is_set():
            current = self.status()
            if current != last:
                yield health_pb2.HealthCheckResponse(status=current)
                last = current
            self._stopped.wait(self._watch_interval)

    def stop(self) -> None:
        self._stopped.set()


class ProbeServer:
    """The grpc.health.v1 server on 127.0.0.1:<port> (port 0 picks a free one)."""

    def __init__(self, port: int, check: HealthCheck) -> None:
        self.servicer = ProbeServicer(check)
        self._server = grpc.server(ThreadPoolExecutor(max_workers=4, thread_name_prefix="probe"),
                                   maximum_concurrent_rpcs=8)
        add: Callable[[Any, Any], None] = health_pb2_grpc.add_HealthServicer_to_server
        add(self.servicer, self._server)
        try:
            self.port: int = self._server.add_insecure_port(f"127.0.0.1:{port}")
        except RuntimeError:  # grpcio >= 1.5x raises instead of returning 0
            self.port = 0
        if not self.port:
            raise OSError(f"cannot listen on 127.0.0.1:{port} for the health service (address in use?)")

    def start(self) -> None:
        self._server.start()
        log.info("health service listening address=127.0.0.1:%d", self.port)

    def stop(self, grace: float = 1.0) -> None:
        self.servicer.stop()
        self._server.stop(grace).wait()


def probe(port: int, service: str = "", timeout: float = 2.0) -> int:
    """Ask the loopback health service; returns the ServingStatus (UNKNOWN on any failure)."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub_class: Callable[[Any], Any] = health_pb2_grpc.HealthStub
        stub = stub_class(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as e:
            log.error("health check failed: %s %s", e.code(), e.details())
            return int(health_pb2.HealthCheckResponse.UNKNOWN)
        return int(reply.status)


def main(argv: list[str] | None = None) -> int:
    """Exec-probe entry point: exit 0 only when the plugin reports SERVING."""
    parser = argparse.ArgumentParser(prog="python -m topodra.plugin.health", description=main.__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--service", default="")
    parser.add_argument("--timeout", type=float, default=2.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    status = probe(args.port, args.service, args.timeout)
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    print(name)
    return 0 if status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
