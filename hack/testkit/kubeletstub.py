"""A stand-in for the kubelet's side of the plugin sockets, for tests.

It speaks exactly what the kubelet speaks (our generated stubs, same method
paths) over a unix socket: the plugin watcher's GetInfo/NotifyRegistrationStatus,
NodePrepareResources/NodeUnprepareResources in v1 or v1beta1, and the
NodeWatchResources health stream in v1 or v1alpha1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc

from topodra.pb.dra.v1 import api_pb2 as dra_v1
from topodra.pb.dra.v1 import api_pb2_grpc as dra_v1_grpc
from topodra.pb.dra.v1beta1 import api_pb2 as dra_v1beta1
from topodra.pb.dra.v1beta1 import api_pb2_grpc as dra_v1beta1_grpc
from topodra.pb.drahealth.v1 import api_pb2 as health_v1
from topodra.pb.drahealth.v1 import api_pb2_grpc as health_v1_grpc
from topodra.pb.drahealth.v1alpha1 import api_pb2 as health_v1alpha1
from topodra.pb.drahealth.v1alpha1 import api_pb2_grpc as health_v1alpha1_grpc
from topodra.pb.pluginregistration.v1 import api_pb2 as reg_pb2
from topodra.pb.pluginregistration.v1 import api_pb2_grpc as reg_grpc

DRA_APIS: dict[str, tuple[ModuleType, Any]] = {
    "v1": (dra_v1, dra_v1_grpc.DRAPluginStub),
    "v1beta1": (dra_v1beta1, dra_v1beta1_grpc.DRAPluginStub),
}
HEALTH_APIS: dict[str, tuple[ModuleType, Any]] = {
    "v1": (health_v1, health_v1_grpc.DRAResourceHealthStub),
    "v1alpha1": (health_v1alpha1, health_v1alpha1_grpc.DRAResourceHealthStub),
}
# The kubelet's deadlines: GetInfo 1 s, NotifyRegistrationStatus 5 s, prepare/unprepare 45 s.
GET_INFO_TIMEOUT = 1.0
NOTIFY_TIMEOUT = 5.0
CALL_TIMEOUT = 45.0

Claim = tuple[str, str, str]
"""(namespace, uid, name)"""


class KubeletStub:
    """One client connection to one plugin socket."""

    def __init__(self, socket_path: str | Path) -> None:
        self.socket_path = Path(socket_path)
        self.channel = grpc.insecure_channel(f"unix:{self.socket_path}")

    def __enter__(self) -> KubeletStub:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    # --- registration socket ---

    def _registration(self) -> Any:
        stub: Callable[[Any], Any] = reg_grpc.RegistrationStub
        return stub(self.channel)

    def get_info(self, timeout: float = GET_INFO_TIMEOUT) -> Any:
        return self._registration().GetInfo(reg_pb2.InfoRequest(), timeout=timeout)

    def notify_registration(self, registered: bool, error: str = "", timeout: float = NOTIFY_TIMEOUT) -> Any:
        status = reg_pb2.RegistrationStatus(plugin_registered=registered, error=error)
        return self._registration().NotifyRegistrationStatus(status, timeout=timeout)

    # --- DRA socket ---

    @staticmethod
    def _claims(pb: ModuleType, claims: Iterable[Claim]) -> list[Any]:
        return [pb.Claim(namespace=ns, uid=uid, name=name) for ns, uid, name in claims]

    def prepare(self, claims: Iterable[Claim], api: str = "v1", timeout: float = CALL_TIMEOUT) -> Any:
        pb, stub = DRA_APIS[api]
        request = pb.NodePrepareResourcesRequest(claims=self._claims(pb, claims))
        return stub(self.channel).NodePrepareResources(request, timeout=timeout)

    def unprepare(self, claims: Iterable[Claim], api: str = "v1", timeout: float = CALL_TIMEOUT) -> Any:
        pb, stub = DRA_APIS[api]
        request = pb.NodeUnprepareResourcesRequest(claims=self._claims(pb, claims))
        return stub(self.channel).NodeUnprepareResources(request, timeout=timeout)

    def watch_health(self, api: str = "v1", timeout: float | None = None) -> Any:
        """The server stream; iterate it for responses, ``.cancel()`` it to hang up."""
        pb, stub = HEALTH_APIS[api]
        return stub(self.channel).NodeWatchResources(pb.NodeWatchResourcesRequest(), timeout=timeout)


def health_by_device(response: Any) -> dict[tuple[str, str], int]:
    """(pool, device) → HealthStatus number, from one NodeWatchResources response."""
    return {(d.device.pool_name, d.device.device_name): d.health for d in response.devices}


def take(stream: Iterator[Any], n: int) -> list[Any]:
    """The next ``n`` messages of a stream."""
    return [next(stream) for _ in range(n)]
