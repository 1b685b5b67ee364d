"""GpuConfig parsing and per-request resolution from a claim's allocation (pure; no cluster)."""

from __future__ import annotations

from typing import Any

import pytest

from topodra.claims import ClaimError, ClaimRef, allocated_claim
from topodra.sharing.config import API_VERSION, ConfigError, Mps, Sharing, TimeSlicing, parse, resolve

DRIVER = "gpu.topodra.io"


def opaque(params: Any, source: str = "FromClaim", requests: list[str] | None = None,
           driver: str = DRIVER) -> dict[str, Any]:
    entry: dict[str, Any] = {"source": source, "opaque": {"driver": driver, "parameters": params}}
    if requests is not None:
        entry["requests"] = requests
    return entry


def ts(interval: str) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": "GpuConfig",
            "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": interval}}}


def mps(pct: int = 50, limit: str = "10Gi") -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": "GpuConfig",
            "sharing": {"strategy": "MPS", "mps": {"defaultActiveThreadPercentage": pct,
                                                   "defaultPinnedDeviceMemoryLimit": limit}}}


def test_parse_time_slicing_and_mps() -> None:
    assert parse(ts("Long")).sharing == Sharing(strategy="TimeSlicing", timeSlicing=TimeSlicing(interval="Long"))
    m = parse(mps(25, "10Gi")).sharing
    assert m is not None and m.mps == Mps(defaultActiveThreadPercentage=25, defaultPinnedDeviceMemoryLimit="10Gi")
    assert m.mps.pinned_limit_bytes() == 10 * 2**30
    assert parse({"apiVersion": API_VERSION, "kind": "GpuConfig",
                  "sharing": {"strategy": "TimeSlicing"}}).sharing.interval == "Default"  # type: ignore[union-attr]


@pytest.mark.parametrize(("params", "needle"), [
    ({"apiVersion": "gpu.topodra.io/v2", "kind": "GpuConfig"}, "apiVersion"),
    ({"apiVersion": API_VERSION, "kind": "NicConfig"}, "kind"),
    (ts("Sometimes"), "interval"),
    (mps(0), "defaultActiveThreadPercentage"),
    (mps(101), "defaultActiveThreadPercentage"),
    (mps(50, "ten gigs"), "defaultPinnedDeviceMemoryLimit"),
    (mps(50, "0"), "defaultPinnedDeviceMemoryLimit"),
    ({"apiVersion": API_VERSION, "kind": "GpuConfig", "sharing": {"strategy": "Magic"}}, "strategy"),
    ({"apiVersion": API_VERSION, "kind": "GpuConfig",
      "sharing": {"strategy": "TimeSlicing", "mps": {}}}, "not mps"),
    ({"apiVersion": API_VERSION, "kind": "GpuConfig", "shraing": {}}, "shraing"),
    ("not an object", "must be an object"),
])
def test_bad_config_names_the_problem(params: Any, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        parse(params)


def test_claim_overrides_class_and_requests_scope() -> None:
    configs = [opaque(ts("Long"), source="FromClaim", requests=["a"]),
               opaque(ts("Short"), source="FromClass"),
               opaque(mps(), source="FromClaim", requests=["b"])]
    got = resolve(configs, DRIVER, ["a", "b/x", "c"])
    assert got["a"] is not None and got["a"].interval == "Long"  # claim beats class, though listed first
    assert got["b/x"] is not None and got["b/x"].strategy == "MPS"  # main request name scopes subrequests
    assert got["c"] is not None and got["c"].interval == "Short"  # only the class config applies


def test_other_drivers_configs_are_ignored_even_when_not_ours() -> None:
    configs = [opaque({"apiVersion": "other.example/v1", "kind": "Whatever"}, driver="other.example"),
               {"source": "FromClass", "opaque": {"driver": "x", "parameters": "junk"}}]
    assert resolve(configs, DRIVER, ["a"]) == {"a": None}


def claim_obj(configs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"metadata": {"uid": "u1"}, "status": {"allocation": {"devices": {
        "results": [{"driver": DRIVER, "pool": "n1", "device": "gpu-0", "request": "gpus"}],
        "config": configs}}}}


def test_allocated_claim_carries_sharing_or_a_clear_error() -> None:
    ref = ClaimRef("ns", "u1", "c")
    got = allocated_claim(ref, claim_obj([opaque(ts("Medium"))]), DRIVER, "n1", "n1")
    assert got.devices[0].sharing is not None and got.devices[0].sharing.interval == "Medium"
    assert allocated_claim(ref, claim_obj([]), DRIVER, "n1", "n1").devices[0].sharing is None
    with pytest.raises(ClaimError, match=r"claim ns/c \(u1\): config entry 0 \(FromClaim\): invalid GpuConfig: "
                                         r"sharing.timeSlicing.interval"):
        allocated_claim(ref, claim_obj([opaque(ts("Forever"))]), DRIVER, "n1", "n1")
