"""The plugin process's health for liveness/readiness probes: ``grpc.health.v1.Health``.

Served on 127.0.0.1 only. Because a kubelet gRPC probe dials the pod IP, the
probes are exec probes (``python -m topodra.plugin.probes --port N``, ``main``
below) against it.  (Device health for the kubelet is ``topodra.plugin.device_health``.)

Readiness means "the kubelet could use us now": ``answers`` calls our own
sockets the way the kubelet does (GetInfo on the registration socket, an empty
NodePrepareResources on the DRA socket), so a wedged server is NOT_SERVING even
while its socket files exist.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc

from topodra.pb.dra.v1 import api_pb2 as dra_v1
from topodra.pb.dra.v1 import api_pb2_grpc as dra_v1_grpc
from topodra.pb.grpchealth.v1 import health_pb2, health_pb2_grpc
from topodra.pb.pluginregistration.v1 import api_pb2 as reg_pb2
from topodra.pb.pluginregistration.v1 import api_pb2_grpc as reg_grpc

log = logging.getLogger(__name__)

# Probe answers when all is well for this service name, or for "" (the whole server).
PLUGIN_SERVICE = "topodra.kubelet-plugin"


HealthCheck = Callable[[], str | None]
"""Returns None when healthy, else the reason why not."""


def answers(dra_socket: Path, registration_socket: Path, timeout: float = 1.0) -> str | None:
    """None when both sockets answer a kubelet-style call within ``timeout`` s; else what failed.

    The kubelet's own GetInfo deadline is 1 s; NodePrepareResources with no
    claims touches no state (the Go example driver's health check does the same).
    """
    reg_stub: Callable[[grpc.Channel], Any] = reg_grpc.RegistrationStub
    dra_stub: Callable[[grpc.Channel], Any] = dra_v1_grpc.DRAPluginStub
    calls: list[tuple[str, Path, Callable[[grpc.Channel], Any]]] = [
        ("registration GetInfo", registration_socket,
         lambda ch: reg_stub(ch).GetInfo(reg_pb2.InfoRequest(), timeout=timeout)),
        ("DRA NodePrepareResources", dra_socket,
         lambda ch: dra_stub(ch).NodePrepareResources(dra_v1.NodePrepareResourcesRequest(), timeout=timeout)),
    ]
    for what, path, call in calls:
        try:
            with grpc.insecure_channel(f"unix://{path}") as channel:
                call(channel)
        except grpc.RpcError as e:
            return f"{what} on {path} failed: {e.code().name} {e.details()}"
    return None


def all_of(*checks: HealthCheck) -> HealthCheck:
    """The first problem any of ``checks`` finds, in order (cheap checks first)."""
    def check() -> str | None:
        for c in checks:
            reason = c()
            if reason:
                return reason
        return None
    return check


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
    parser = argparse.ArgumentParser(prog="python -m topodra.plugin.probes", description=main.__doc__)
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
