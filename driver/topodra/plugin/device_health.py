"""Device health for the kubelet (KEP-4680): what the kubelet shows as a device's health.

``NodeWatchResources`` of ``v1alpha1.DRAResourceHealth`` and ``v1.DRAResourceHealth``
on the DRA socket.  Every message is the complete device list; the kubelet marks
devices it has not heard about within the timeout as Unknown, so the snapshot is
re-sent periodically and immediately whenever health changes.  The board follows
the device inventory (``DeviceHealthBoard.devices_changed`` is its subscriber)
and the health monitor (``DeviceHealthBoard.health_changed``): a device is
UNHEALTHY exactly while it has a NoSchedule/NoExecute taint, so the kubelet's
``allocatedResourcesStatus`` and the ResourceSlice taints tell the same story.

The plugin process's own liveness for probes is ``topodra.plugin.probes``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from enum import IntEnum
from types import ModuleType
from typing import Any

import grpc

from topodra.devices import Device
from topodra.health.monitor import HealthSnapshot
from topodra.plugin import metrics

log = logging.getLogger(__name__)

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

    def devices_changed(self, devices: tuple[Device, ...]) -> None:
        """``Inventory`` subscriber."""
        self.set_devices(d.name for d in devices)

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

    def health_changed(self, snapshot: HealthSnapshot) -> None:
        """``HealthMonitor`` subscriber: every known device's state at once, one wake-up for all streams."""
        now = time.time()
        with self._cond:
            changed = False
            for name, cur in self._devices.items():
                st = snapshot.states.get(name)
                health = Health.UNHEALTHY if st is not None and st.unhealthy else Health.HEALTHY
                message = (st.message if st is not None else "")[:MAX_MESSAGE_CHARS]
                if (health, message) == (cur.health, cur.message):
                    continue
                if health != cur.health:
                    log.warning("device health changed pool=%s device=%s health=%s message=%r",
                                self.pool_name, name, health.name, message)
                self._devices[name] = DeviceHealth(name, health, message, now)
                changed = True
            if changed:
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
