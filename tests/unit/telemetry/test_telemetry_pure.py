"""The pure parts of telemetry: the idle rule, attribution of devices to claims and pods, the status apply."""

from __future__ import annotations

from typing import Any

from topodra.claims import ClaimRef
from topodra.telemetry.attribution import ClaimInfo, claim_rows, holders, pods_of
from topodra.telemetry.claimstatus import FIELD_MANAGER, condition, status_apply, written_idle
from topodra.telemetry.idle import GpuLevel, IdleRule, IdleState, below, step

RULE = IdleRule(activity_below=0.05, memory_below=0.1, idle_seconds=60)


def test_below_needs_every_gpu_read_and_under_both_thresholds() -> None:
    quiet = GpuLevel(0.01, 0.02)
    assert below(RULE, [quiet, quiet]) is True
    assert below(RULE, [quiet, GpuLevel(0.05, 0.02)]) is False  # at the threshold is not below
    assert below(RULE, [quiet, GpuLevel(0.0, 0.5)]) is False  # a model held in memory
    assert below(RULE, [quiet, GpuLevel(None, 0.0)]) is None  # unread: unknown, never idle
    assert below(RULE, []) is None


def test_idle_after_the_idle_time_and_reset_by_activity_or_missing_data() -> None:
    s = IdleState()
    s = step(s, True, 100.0)
    assert not s.idle(RULE, 100.0) and s.below_since == 100.0
    s = step(s, True, 159.0)
    assert not s.idle(RULE, 159.0)
    s = step(s, True, 160.0)
    assert s.idle(RULE, 160.0) and s.idle_for(170.0) == 70.0
    assert step(s, False, 170.0) == IdleState()
    assert step(s, None, 170.0) == IdleState()  # a failed read restarts the clock


def test_holders_and_info_rows() -> None:
    held = {"u1": (ClaimRef("ns1", "u1", "a"), frozenset({("n1", "gpu-0", None), ("n1", "gpu-1", None)})),
            "u2": (ClaimRef("ns2", "u2", "b"), frozenset({("n1", "gpu-1", "s1"), ("other", "gpu-2", None)}))}
    infos = {"u1": ClaimInfo("ns1", "a", "u1", ("p0", "p1"))}
    h = holders(held, infos, "n1")
    assert set(h) == {"gpu-0", "gpu-1"}  # another pool's device is not this node's
    assert (h["gpu-0"].namespace, h["gpu-0"].claim, h["gpu-0"].pod) == ("ns1", "a", "p0,p1")
    assert (h["gpu-1"].namespace, h["gpu-1"].claim, h["gpu-1"].claim_uid) == ("ns1,ns2", "a,b", "u1,u2")
    rows = [(d, c.name, p) for d, c, p in claim_rows(held, infos, "n1")]
    assert rows == [("gpu-0", "a", "p0"), ("gpu-0", "a", "p1"), ("gpu-1", "a", "p0"), ("gpu-1", "a", "p1"),
                    ("gpu-1", "b", "")]


def test_pods_of_reads_pods_only() -> None:
    claim = {"status": {"reservedFor": [{"resource": "pods", "name": "z", "uid": "1"},
                                        {"resource": "pods", "name": "a", "uid": "2"},
                                        {"apiGroup": "example.com", "resource": "pods", "name": "x", "uid": "3"}]}}
    assert pods_of(claim) == ("a", "z")
    assert pods_of({}) == ()


def test_status_apply_names_only_this_drivers_devices() -> None:
    cond = condition(True, 0.0, "m")
    assert cond == {"type": "Idle", "status": "True", "reason": "BelowThresholds", "message": "m",
                    "lastTransitionTime": "1970-01-01T00:00:00Z"}
    body = status_apply("ns", "c", "u", "gpu.topodra.io", [("n1", "gpu-1", None), ("n1", "gpu-0", "sh")], cond)
    assert body["metadata"] == {"name": "c", "namespace": "ns", "uid": "u"}
    assert [(d["device"], d.get("shareID")) for d in body["status"]["devices"]] == [("gpu-0", "sh"), ("gpu-1", None)]
    assert all(d["driver"] == "gpu.topodra.io" and d["conditions"] == [cond] for d in body["status"]["devices"])
    assert FIELD_MANAGER == "topodra-telemetry"


def test_written_idle_reads_back_our_condition() -> None:
    def claim(*statuses: str, driver: str = "gpu.topodra.io") -> dict[str, Any]:
        devices = [{"driver": driver, "pool": "n1", "device": f"gpu-{i}",
                    "conditions": [{"type": "Idle", "status": s}]} for i, s in enumerate(statuses)]
        return {"status": {"devices": devices}}

    assert written_idle(claim("True", "True"), "gpu.topodra.io", "n1") is True
    assert written_idle(claim("False"), "gpu.topodra.io", "n1") is False
    assert written_idle(claim("True", "False"), "gpu.topodra.io", "n1") is None  # disagree: write again
    assert written_idle(claim("True", driver="other"), "gpu.topodra.io", "n1") is None
    assert written_idle({}, "gpu.topodra.io", "n1") is None
