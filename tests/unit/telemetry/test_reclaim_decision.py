"""The pure decision of opt-in idle reclaim (driver/topodra/telemetry/reclaim.py): which namespaces opt in, how a
grace period is read and checked, and when a claim's pods are evicted or only reported."""

from __future__ import annotations

from typing import Any

import pytest

from topodra.telemetry.reclaim import GRACE_ANNOTATION, LABEL, Policy, decide, eviction, parse_duration, policy

IDLE = 900.0


def ns(labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": "team", "labels": labels or {}, "annotations": annotations or {}}}


@pytest.mark.parametrize(("text", "seconds"), [("3600", 3600), ("90m", 5400), ("1h30m", 5400), ("45s", 45),
                                               ("2h", 7200), ("1h0m10s", 3610), (" 20m ", 1200)])
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "0", "0s", "1d", "-5", "1.5h", "h", "soon", "10m1h", "3600 s"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)


def test_no_label_is_off_whatever_the_annotation() -> None:
    assert policy(ns(), 3600, IDLE) == Policy("off")
    assert policy(ns(annotations={GRACE_ANNOTATION: "1h"}), 3600, IDLE) == Policy("off")
    assert policy(None, 3600, IDLE) == Policy("off")  # namespace not read: never act on missing data


def test_modes_and_grace() -> None:
    assert policy(ns({LABEL: "enabled"}), 3600, IDLE) == Policy("enabled", 3600)
    assert policy(ns({LABEL: "dry-run"}, {GRACE_ANNOTATION: "2h"}), 3600, IDLE) == Policy("dry-run", 7200)
    assert policy(ns({LABEL: "enabled"}, {GRACE_ANNOTATION: "900"}), 3600, IDLE) == Policy("enabled", 900)


@pytest.mark.parametrize(("labels", "annotations", "says"), [
    ({LABEL: "yes"}, {}, "expected 'enabled' or 'dry-run'"),
    ({LABEL: "Enabled"}, {}, "expected"),
    ({LABEL: "enabled"}, {GRACE_ANNOTATION: "soon"}, "not a duration"),
    ({LABEL: "dry-run"}, {GRACE_ANNOTATION: "0"}, "not a positive duration"),
    ({LABEL: "enabled"}, {GRACE_ANNOTATION: "10m"}, "shorter than this node's idle time (900s)"),
])
def test_bad_settings_are_invalid_with_a_reason(labels: dict[str, str], annotations: dict[str, str],
                                                says: str) -> None:
    p = policy(ns(labels, annotations), 3600, IDLE)
    assert p.mode == "invalid" and says in p.problem, p


def test_decide() -> None:
    on, dry = Policy("enabled", 3600), Policy("dry-run", 3600)
    bad = Policy("invalid", problem="x")
    assert decide(on, idle=False, idle_for=10_000) == "none"  # active claims are never touched
    assert decide(Policy("off"), idle=True, idle_for=10_000) == "none"  # no opt-in: never
    assert decide(on, idle=True, idle_for=3599.9) == "wait"  # idle, inside the grace
    assert decide(on, idle=True, idle_for=3600) == "evict"
    assert decide(dry, idle=True, idle_for=3600) == "dry-run"
    assert decide(dry, idle=True, idle_for=10) == "wait"
    assert decide(bad, idle=True, idle_for=10) == "invalid"  # reported as soon as the claim is idle
    assert decide(bad, idle=False, idle_for=0) == "none"


def test_eviction_body() -> None:
    assert eviction("team", "p") == {"apiVersion": "policy/v1", "kind": "Eviction",
                                     "metadata": {"name": "p", "namespace": "team"}}
