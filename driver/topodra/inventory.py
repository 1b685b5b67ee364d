"""The one owner of this node's discovered devices.

Discovery sets the inventory; the prepare state, the device-health board and the
ResourceSlice publisher subscribe to it instead of keeping their own copies and
their own "did it change?" checks.  Subscribers are called in subscription order,
serialized, and only when the device set really changed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType

from topodra.devices import Device

log = logging.getLogger(__name__)

Subscriber = Callable[[tuple[Device, ...]], None]


class Inventory:
    """The current device set (immutable snapshots), plus change notification."""

    def __init__(self, devices: Iterable[Device] = ()) -> None:
        self._lock = threading.Lock()
        self._notify = threading.Lock()  # one notification round at a time, in order
        self._subscribers: list[Subscriber] = []
        self._devices, self._by_name = _index(tuple(devices))
        self._version = 0

    @property
    def devices(self) -> tuple[Device, ...]:
        with self._lock:
            return self._devices

    @property
    def by_name(self) -> Mapping[str, Device]:
        """Name → device of the current snapshot (read-only; replaced, never mutated, on change)."""
        with self._lock:
            return self._by_name

    def snapshot(self) -> tuple[int, tuple[Device, ...]]:
        """(version, devices), read together."""
        with self._lock:
            return self._version, self._devices

    @property
    def version(self) -> int:
        """Bumped on every change; lets a reader tell whether what it worked on is still current."""
        with self._lock:
            return self._version

    def subscribe(self, callback: Subscriber) -> None:
        """Call ``callback(devices)`` now and after every change."""
        with self._notify:
            with self._lock:
                self._subscribers.append(callback)
                current = self._devices
            callback(current)

    def set(self, devices: Iterable[Device]) -> bool:
        """Replace the device set; notify subscribers and return True only if it changed."""
        with self._notify:
            new, by_name = _index(tuple(devices))
            with self._lock:
                if new == self._devices:
                    return False
                self._devices, self._by_name = new, by_name
                self._version += 1
                subscribers = list(self._subscribers)
            for callback in subscribers:
                try:
                    callback(new)
                except Exception:
                    log.exception("device inventory subscriber %r failed", callback)
            return True


def _index(devices: tuple[Device, ...]) -> tuple[tuple[Device, ...], Mapping[str, Device]]:
    by_name = {d.name: d for d in devices}
    if len(by_name) != len(devices):
        dup = sorted({d.name for d in devices if sum(x.name == d.name for x in devices) > 1})
        raise ValueError(f"duplicate device names {dup}")
    return devices, MappingProxyType(by_name)
