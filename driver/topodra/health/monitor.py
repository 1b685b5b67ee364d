"""The node's health monitor: one thread that turns hardware signals into taints and device health.

It follows the device ``Inventory`` (re-opening its sources when the devices
change), waits on NVML events between polls, and tells its subscribers — the
ResourceSlice publisher and the kubelet health board — whenever the taints or
health states changed, and only then.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from topodra.devices import Device
from topodra.health.policy import (
    DEFAULT_HOLD_SECONDS,
    UNMONITORED_KEY,
    DeviceHealth,
    DeviceTaint,
    Effect,
    HealthPolicy,
    Observation,
    label_value,
)
from topodra.health.sources import mig_parents, nvlink_domains
from topodra.inventory import Inventory

log = logging.getLogger(__name__)


class HealthSource(Protocol):
    def open(self) -> None: ...

    def close(self) -> None: ...

    def wait_events(self, timeout: float) -> list[Observation]: ...

    def poll(self) -> list[Observation]: ...


SourceFactory = Callable[[tuple[Device, ...]], HealthSource]


@dataclass(frozen=True)
class HealthSnapshot:
    taints: Mapping[str, tuple[DeviceTaint, ...]] = field(default_factory=dict)
    states: Mapping[str, DeviceHealth] = field(default_factory=dict)


Subscriber = Callable[[HealthSnapshot], None]


class HealthMonitor:
    """Owns the ``HealthPolicy``; ``step`` is one round, ``start`` runs rounds in a thread."""

    def __init__(self, inventory: Inventory, sources: SourceFactory, *,
                 hold_seconds: float = DEFAULT_HOLD_SECONDS, poll_interval: float = 5.0,
                 clock: Callable[[], float] = time.time, no_execute: Iterable[str] = ()) -> None:
        if poll_interval <= 0:
            raise ValueError(f"poll_interval must be > 0, got {poll_interval}")
        self.policy = HealthPolicy(hold_seconds, no_execute)
        self.poll_interval = poll_interval
        self._factory = sources
        self._clock = clock
        self._lock = threading.Lock()
        self._subscribers: list[Subscriber] = []
        self._snapshot = HealthSnapshot()
        self._devices: tuple[Device, ...] = ()
        self._source: HealthSource | None = None
        self._devices_dirty = True
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._next_poll = 0.0
        self._events_seen = 0  # observations the last wait_events returned
        self._polled = False  # the current source has polled at least once
        # (since, why) while rounds fail: every device then carries UNMONITORED_KEY (effect None) until one works.
        self._unmonitored: tuple[int, str] | None = None
        inventory.subscribe(self._devices_changed)

    # ----- wiring

    def _devices_changed(self, devices: tuple[Device, ...]) -> None:
        """``Inventory`` subscriber: the monitor thread re-opens its sources on the new devices."""
        with self._lock:
            self._devices = devices
            self._devices_dirty = True

    def subscribe(self, callback: Subscriber) -> None:
        """Call ``callback(snapshot)`` now and after every change."""
        with self._lock:
            self._subscribers.append(callback)
            current = self._snapshot
        callback(current)

    @property
    def snapshot(self) -> HealthSnapshot:
        with self._lock:
            return self._snapshot

    def taints(self) -> Mapping[str, tuple[DeviceTaint, ...]]:
        """What the publisher puts into the ResourceSlices."""
        return self.snapshot.taints

    def adopt(self, taints: Mapping[str, Iterable[DeviceTaint]]) -> None:
        """Taints found in the ResourceSlices at start (see ``HealthPolicy.adopt``); call before ``start``."""
        if any(taints.values()):
            log.info("carrying over published device taints: %s",
                     {d: [t.text for t in ts] for d, ts in taints.items() if ts})
        with self._lock:
            known = {d.name for d in self._devices}
        # ``unmonitored`` is this instance's own state, not an event to hold: it is set again if rounds fail.
        self.policy.adopt({d: [t for t in ts if t.key != UNMONITORED_KEY] for d, ts in taints.items() if d in known},
                          self._clock())
        self._apply([], self._clock())

    # ----- one round

    def _reopen(self) -> None:
        with self._lock:
            devices, self._devices_dirty = self._devices, False
        if self._source is not None:
            self._source.close()
        self.policy.set_domains(nvlink_domains(devices))
        self.policy.set_parents(mig_parents(devices))
        self.policy.forget(d.name for d in devices)
        self._source = None
        source = self._factory(devices)
        try:
            source.open()
        except BaseException:
            with self._lock:
                self._devices_dirty = True  # the next round opens them again (the old source is closed)
            raise
        self._source = source
        self._next_poll = 0.0
        self._polled = False

    def step(self, wait: float = 0.0) -> bool:
        """Wait up to ``wait`` s for events, poll if due, apply the policy; True if the result changed."""
        if self._devices_dirty:
            self._reopen()
        assert self._source is not None
        observations = list(self._source.wait_events(wait))
        self._events_seen = len(observations)
        now = self._clock()
        if now >= self._next_poll:
            observations.extend(self._source.poll())
            self._next_poll = now + self.poll_interval
            self._polled = True
        return self._apply(observations, now)

    def _apply(self, observations: Iterable[Observation], now: float) -> bool:
        with self._lock:
            # A GPU discovery could not read is lost until the source's first poll says how it is now, so it is
            # never published untainted; from then on the source's own poll is the signal (a GPU that answers
            # again is not held lost until the next re-discovery).
            lost = [] if self._polled else [Observation(d.name, "gpu-lost", d.lost) for d in self._devices if d.lost]
        obs = [*observations, *lost]
        for o in obs:
            log.debug("health signal device=%s kind=%s detail=%s", o.device, o.kind, o.detail)
        self.policy.observe(obs, now)
        self.policy.expire(now)
        with self._lock:
            names = [d.name for d in self._devices]
        taints = self.policy.taints()
        states = self.policy.states(names)
        if self._unmonitored is not None:
            since, why = self._unmonitored
            mark = DeviceTaint(UNMONITORED_KEY, why, Effect.NONE, since)
            taints = {n: (*taints.get(n, ()), mark)[-16:] for n in names}
        snap = HealthSnapshot(taints=taints, states=states)
        with self._lock:
            if snap == self._snapshot:
                return False
            old, self._snapshot = self._snapshot, snap
            subscribers = list(self._subscribers)
        _log_changes(old, snap)
        for cb in subscribers:
            try:
                cb(snap)
            except Exception:
                log.exception("health subscriber %r failed", cb)
        return True

    # ----- thread

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="health-monitor", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._source is not None:
            self._source.close()
            self._source = None

    @property
    def unmonitored(self) -> bool:
        """Whether the last round failed (every device then carries ``UNMONITORED_KEY``)."""
        return self._unmonitored is not None

    def round(self, wait: float) -> bool:
        """One round as the thread runs it: ``step``, and when it raises (NVML cannot initialise, a source
        fails), every device is marked unmonitored (taint effect None, so nothing is evicted or refused,
        but the slices and metrics say that "healthy" is unknown), cleared by the next round that works.
        True when the round worked."""
        try:
            self.step(wait)
        except Exception as e:
            if self._unmonitored is None:
                log.error("health monitoring failed; every device is tainted %s until it works again: %s",
                          UNMONITORED_KEY, e, exc_info=True)
                self._unmonitored = (int(self._clock()), label_value(type(e).__name__) or "error")
                self._apply([], self._clock())
            else:
                log.debug("health monitor round failed again: %s", e)
            return False
        if self._unmonitored is not None:
            self._unmonitored = None
            log.warning("health monitoring works again; %s cleared", UNMONITORED_KEY)
            self._apply([], self._clock())
        return True

    def _run(self) -> None:
        # Short waits: expiry and stop are checked at least this often, events still arrive at once.
        wait = min(self.poll_interval, 1.0)
        while not self._stop.is_set():
            started = time.monotonic()
            if not self.round(wait):
                self._stop.wait(wait)
                continue
            # A source whose wait returned early with nothing (NVML failing fast) must not make this loop spin.
            left = wait - (time.monotonic() - started)
            if self._events_seen == 0 and left > 0:
                self._stop.wait(left)


def _log_changes(old: HealthSnapshot, new: HealthSnapshot) -> None:
    for device in sorted(set(old.taints) | set(new.taints)):
        before = {t.text for t in old.taints.get(device, ())}
        after = {t.text for t in new.taints.get(device, ())}
        for t in sorted(after - before):
            log.warning("device taint added device=%s taint=%s", device, t)
        for t in sorted(before - after):
            log.info("device taint cleared device=%s taint=%s", device, t)
