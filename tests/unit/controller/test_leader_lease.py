"""The controller's own Lease loop (``topodra.controller.leader``), step by step on an in-memory Lease API.

The store below keeps the one API behaviour the election relies on: a write carrying a stale
resourceVersion is refused with 409. The loop against the real API server (standby waits, SIGTERM
releases the Lease, takeover) is tested in tests/test_controller_cluster.py.
"""

from __future__ import annotations

import copy
import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from topodra.apipaths import lease_path
from topodra.controller.leader import LeaderElector, lease_body, microtime, released_body
from topodra.kube import KubeError

Obj = dict[str, Any]
PATH = lease_path("ns", "ctl")
T0 = datetime(2026, 1, 1, 12, 0, 0, 123456, tzinfo=UTC)


class LeaseStore:
    """get/create/replace of Leases with resourceVersion checks; ``fail`` makes the next calls raise."""

    def __init__(self) -> None:
        self.objs: dict[str, Obj] = {}
        self.rv = 0
        self.fail: KubeError | None = None
        self.writes = 0
        self.before_write: list[Any] = []  # callables run once, just before the next write lands

    def _check(self) -> None:
        if self.fail is not None:
            raise self.fail

    def _stamp(self, obj: Obj) -> Obj:
        self.rv += 1
        self.writes += 1
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(self.rv)
        return obj

    def _hook(self) -> None:
        while self.before_write:
            self.before_write.pop(0)()

    def get(self, path: str) -> Obj | None:
        self._check()
        obj = self.objs.get(path)
        return copy.deepcopy(obj) if obj is not None else None

    def create(self, path: str, obj: Obj) -> Obj:
        self._check()
        self._hook()
        full = f"{path}/{obj['metadata']['name']}"
        if full in self.objs:
            raise KubeError(409, "AlreadyExists", "exists")
        self.objs[full] = self._stamp(obj)
        return copy.deepcopy(self.objs[full])

    def replace(self, path: str, obj: Obj) -> Obj:
        self._check()
        self._hook()
        cur = self.objs.get(path)
        if cur is None:
            raise KubeError(404, "NotFound", path)
        if obj["metadata"].get("resourceVersion") != cur["metadata"]["resourceVersion"]:
            raise KubeError(409, "Conflict", "resourceVersion mismatch")
        self.objs[path] = self._stamp(obj)
        return copy.deepcopy(self.objs[path])


class Clock:
    def __init__(self) -> None:
        self.mono = 1000.0

    def wall(self) -> datetime:
        return T0 + timedelta(seconds=self.mono - 1000.0)


def candidate(store: LeaseStore, clock: Clock, identity: str) -> LeaderElector:
    return LeaderElector(store, "ns", "ctl", identity, monotonic=lambda: clock.mono,  # type: ignore[arg-type]
                         wall=clock.wall)


def spec(store: LeaseStore) -> Obj:
    out: Obj = store.objs[PATH]["spec"]
    return out


def test_microtime_is_rfc3339_utc_with_microseconds() -> None:
    assert microtime(T0) == "2026-01-01T12:00:00.123456Z"
    assert microtime(T0.astimezone(datetime.now().astimezone().tzinfo)) == "2026-01-01T12:00:00.123456Z"
    with pytest.raises(ValueError, match="retry period < renew deadline < lease duration"):
        LeaderElector(LeaseStore(), "ns", "ctl", "a", lease_duration_s=10, renew_deadline_s=10)  # type: ignore[arg-type]


def test_lease_body_counts_holder_changes_and_keeps_acquire_time_on_renewal() -> None:
    created = lease_body("ns", "l", "me", 15, T0, None)
    assert created["spec"] == {"holderIdentity": "me", "leaseDurationSeconds": 15, "leaseTransitions": 0,
                               "acquireTime": microtime(T0), "renewTime": microtime(T0)}
    assert "resourceVersion" not in created["metadata"]
    held = {"metadata": {"resourceVersion": "7"}, "spec": {"holderIdentity": "other", "leaseTransitions": 2,
                                                             "acquireTime": "old"}}
    later = T0 + timedelta(seconds=5)
    taken = lease_body("ns", "l", "me", 15, later, held)
    assert (taken["spec"]["leaseTransitions"], taken["metadata"]["resourceVersion"]) == (3, "7")
    assert taken["spec"]["acquireTime"] == microtime(later)
    renewed = lease_body("ns", "l", "me", 15, later + timedelta(seconds=2),
                         {"metadata": {"resourceVersion": "8"}, "spec": taken["spec"]})
    assert renewed["spec"]["leaseTransitions"] == 3
    assert renewed["spec"]["acquireTime"] == microtime(later)
    assert renewed["spec"]["renewTime"] == microtime(later + timedelta(seconds=2))
    gone = released_body({"metadata": {"resourceVersion": "9"}, "spec": renewed["spec"]}, later)
    assert (gone["spec"]["holderIdentity"], gone["spec"]["leaseDurationSeconds"]) == ("", 1)
    assert gone["spec"]["leaseTransitions"] == 3 and gone["metadata"]["resourceVersion"] == "9"


def test_one_leader_and_takeover_after_expiry_by_the_candidates_own_clock() -> None:
    store, clock = LeaseStore(), Clock()
    a, b = candidate(store, clock, "a"), candidate(store, clock, "b")
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew()
    clock.mono += 10
    assert a.try_acquire_or_renew()  # renewal changes the resourceVersion: b restarts its expiry timer
    assert not b.try_acquire_or_renew()
    clock.mono += 10
    assert not b.try_acquire_or_renew()  # only 10 s since b saw a change
    clock.mono += 6
    assert b.try_acquire_or_renew()  # a stopped renewing 16 s ago
    assert spec(store)["holderIdentity"] == "b" and spec(store)["leaseTransitions"] == 1
    assert not a.try_acquire_or_renew()  # a sees b's write as new: it waits
    assert spec(store)["holderIdentity"] == "b"


def test_wall_clock_skew_in_the_lease_does_not_matter() -> None:
    """A holder whose renewTime is far in the past (its clock is behind) still counts as live."""
    store, clock = LeaseStore(), Clock()
    a, b = candidate(store, clock, "a"), candidate(store, clock, "b")
    a.wall = lambda: T0 - timedelta(days=1)
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew()
    clock.mono += 14
    assert not b.try_acquire_or_renew()


def test_concurrent_writers_conflict_instead_of_both_winning() -> None:
    store, clock = LeaseStore(), Clock()
    a, b = candidate(store, clock, "a"), candidate(store, clock, "b")
    c = candidate(store, clock, "c")
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew() and not c.try_acquire_or_renew()
    clock.mono += 20  # a is gone: b and c both see it expired; c writes between b's read and b's write
    store.before_write.append(lambda: c.try_acquire_or_renew())
    assert not b.try_acquire_or_renew()
    assert spec(store)["holderIdentity"] == "c" and spec(store)["leaseTransitions"] == 1
    assert not b.try_acquire_or_renew()  # and b now sees c's write as fresh


def test_two_creates_of_a_missing_lease_make_one_leader() -> None:
    store, clock = LeaseStore(), Clock()
    a, b = candidate(store, clock, "a"), candidate(store, clock, "b")
    store.before_write.append(lambda: b.try_acquire_or_renew())
    assert not a.try_acquire_or_renew()  # b created it first: a's create gets 409
    assert spec(store)["holderIdentity"] == "b"


def test_released_lease_is_taken_at_once_and_the_releaser_never_writes_again() -> None:
    store, clock = LeaseStore(), Clock()
    a, b = candidate(store, clock, "a"), candidate(store, clock, "b")
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew()
    a.release()
    assert spec(store)["holderIdentity"] == ""
    writes = store.writes
    assert not a.try_acquire_or_renew()  # a released lock cannot take the Lease back
    assert store.writes == writes
    assert b.try_acquire_or_renew()  # no wait for the lease duration
    assert spec(store)["holderIdentity"] == "b" and spec(store)["leaseTransitions"] == 1
    a.release()  # releasing a Lease held by another replica changes nothing
    assert spec(store)["holderIdentity"] == "b" and store.writes == writes + 1


def test_release_retries_after_a_conflicting_write() -> None:
    store, clock = LeaseStore(), Clock()
    a = candidate(store, clock, "a")
    assert a.try_acquire_or_renew()

    def bump() -> None:  # e.g. a renewal the release did not wait for
        store.objs[PATH] = store._stamp(store.objs[PATH])

    store.before_write.append(bump)
    a.release()
    assert spec(store)["holderIdentity"] == ""


def test_api_errors_are_no_lead_and_change_nothing() -> None:
    store, clock = LeaseStore(), Clock()
    a = candidate(store, clock, "a")
    store.fail = KubeError(503, "ServiceUnavailable", "busy")
    assert not a.try_acquire_or_renew()
    assert store.objs == {}
    store.fail = None
    assert a.try_acquire_or_renew()


def test_loop_leads_then_reports_loss_after_the_renew_deadline() -> None:
    """The thread: acquires, keeps renewing, and calls on_lost once renewals fail for the renew deadline."""
    store = LeaseStore()
    e = LeaderElector(store, "ns", "ctl", "a", lease_duration_s=3, renew_deadline_s=0.4,  # type: ignore[arg-type]
                      retry_period_s=0.05)
    lost = threading.Event()
    leading = e.start(lost.set)
    assert leading.wait(10)
    renewed_to, until = store.rv, time.monotonic() + 10
    while store.rv < renewed_to + 2 and time.monotonic() < until:
        time.sleep(0.01)
    assert store.rv >= renewed_to + 2  # at least two renewals landed
    assert spec(store)["holderIdentity"] == "a"
    store.fail = KubeError(0, "ConnectionRefused", "down")
    assert lost.wait(10)
    assert e._thread is not None
    e._thread.join(5)
    assert not e._thread.is_alive()


def test_loop_stopped_while_waiting_writes_nothing() -> None:
    store, clock = LeaseStore(), Clock()
    holder = candidate(store, clock, "holder")
    assert holder.try_acquire_or_renew()
    standby = LeaderElector(store, "ns", "ctl", "standby", lease_duration_s=3,  # type: ignore[arg-type]
                            renew_deadline_s=0.4, retry_period_s=0.05)
    leading = standby.start(lambda: None)
    writes = store.writes
    standby.release()  # joins the thread: it has stopped when release returns
    assert standby._thread is not None and not standby._thread.is_alive()
    assert not leading.is_set()
    assert store.writes == writes and spec(store)["holderIdentity"] == "holder"
