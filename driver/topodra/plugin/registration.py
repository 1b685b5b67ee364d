"""Kubelet plugin-watcher registration: socket names and the Registration service.

The kubelet watches its registry directory for sockets, calls GetInfo on each
(1 s deadline) and then NotifyRegistrationStatus. GetInfo tells it that we are a
DRA plugin, our driver name, where the DRA socket is and which gRPC services we
serve; v1.DRAPlugin is listed first because 1.34+ kubelets take the first entry
they know, and v1beta1.DRAPlugin keeps 1.32/1.33 kubelets working.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import threading
from pathlib import Path
from typing import Any

from topodra.pb.pluginregistration.v1 import api_pb2 as reg_pb2
from topodra.pb.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from topodra.plugin import metrics

log = logging.getLogger(__name__)

PLUGIN_TYPE = "DRAPlugin"
DRA_SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
HEALTH_SERVICES = ("v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth")
# AF_UNIX sun_path is 108 bytes including the terminating NUL.
MAX_SOCKET_PATH = 107


class SocketPathError(ValueError):
    """A socket path that the kernel (and the kubelet) cannot use."""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode().rstrip("=")


def _fits(path: Path) -> bool:
    return len(str(path).encode()) <= MAX_SOCKET_PATH


def registration_socket_path(registry_dir: Path, driver_name: str, pod_uid: str | None = None) -> Path:
    """``<driver>-reg.sock``, or a per-pod name that still fits AF_UNIX when a pod UID is set.

    Per-pod names let two instances of the driver (rolling update) register at once.
    Longer names are shortened the way the Go kubeletplugin library does, so both
    behave alike on one node: full UID, then a hash of the UID, then a hash of both.
    """
    if pod_uid:
        both = driver_name.encode() + b"\0" + pod_uid.encode()
        candidates = [
            f"{driver_name}-{pod_uid}-reg.sock",
            f"{driver_name}-{_b64(pod_uid.encode())[:8]}-reg.sock",
            f"dra-{_b64(both)[:16]}-reg.sock",
        ]
    else:
        candidates = [f"{driver_name}-reg.sock"]
    for name in candidates:
        if _fits(registry_dir / name):
            return registry_dir / name
    raise SocketPathError(
        f"registration socket path under {registry_dir} is longer than {MAX_SOCKET_PATH} bytes "
        f"even when shortened: {registry_dir / candidates[-1]}"
    )


def dra_socket_path(plugin_dir: Path, pod_uid: str | None = None) -> Path:
    """``dra.sock``, or ``dra-<pod uid>.sock`` so that two instances do not collide."""
    path = plugin_dir / (f"dra-{pod_uid}.sock" if pod_uid else "dra.sock")
    if not _fits(path):
        raise SocketPathError(f"DRA socket path is longer than {MAX_SOCKET_PATH} bytes: {path}")
    return path


def supported_services(with_health: bool) -> list[str]:
    """What GetInfo advertises: DRA services first (v1 before v1beta1), then health."""
    return [*DRA_SERVICES, *(HEALTH_SERVICES if with_health else ())]


class RegistrationServicer(reg_grpc.RegistrationServicer):
    """Answers the kubelet's plugin watcher for the whole life of the plugin."""

    def __init__(self, driver_name: str, endpoint: Path, services: list[str]) -> None:
        if not endpoint.is_absolute():
            raise ValueError(f"the DRA endpoint must be an absolute path, got {endpoint}")
        self._info = reg_pb2.PluginInfo(
            type=PLUGIN_TYPE, name=driver_name, endpoint=str(endpoint), supported_versions=services
        )
        self._driver = driver_name
        self._lock = threading.Lock()
        self._registered = False
        self._last_error = ""
        metrics.REGISTRATION_STATUS.set(0)

    @property
    def registered(self) -> bool:
        with self._lock:
            return self._registered

    @property
    def last_error(self) -> str:
        with self._lock:
            return self._last_error

    def GetInfo(self, request: Any, context: Any) -> Any:
        log.debug("kubelet asked for plugin info driver=%s endpoint=%s", self._driver, self._info.endpoint)
        return self._info

    def NotifyRegistrationStatus(self, request: Any, context: Any) -> Any:
        with self._lock:
            self._registered = bool(request.plugin_registered)
            self._last_error = "" if request.plugin_registered else request.error
        if request.plugin_registered:
            metrics.REGISTRATION_STATUS.set(1)
            log.info("kubelet registered the plugin driver=%s endpoint=%s services=%s",
                     self._driver, self._info.endpoint, ",".join(self._info.supported_versions))
        else:
            metrics.REGISTRATION_STATUS.set(0)
            metrics.REGISTRATION_FAILURES.inc()
            log.error("kubelet failed to register the plugin driver=%s endpoint=%s error=%r",
                      self._driver, self._info.endpoint, request.error)
        return reg_pb2.RegistrationStatusResponse()
