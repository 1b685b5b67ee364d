"""ClaimProfile "a 1g.10gb slice, else 10Gi of a shared GPU": rendering, and the real scheduler taking the
shared alternative once the MIG node is full (simulated nodes: mock dgx-a100-80gb-mig + a memory-shared A100).

Split by tier; the rest: tests/cluster/test_sharing_profile_cluster.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from topodra.controller.profile import ClaimProfile, ProfileError
from topodra.controller.render import claim_spec

SLICE_ELSE_SHARED: dict[str, Any] = {"alternatives": [
    {"name": "slice", "deviceClassName": "gpu-mig-1g"},
    {"name": "shared", "deviceClassName": "gpu-shared-memory", "capacity": {"memory": "10Gi"}}]}


def profile(spec: dict[str, Any], name: str = "infer") -> ClaimProfile:
    return ClaimProfile.from_api({"metadata": {"name": name, "namespace": "ns"}, "spec": spec})


def test_slice_else_shared_renders_first_available_with_a_capacity_request() -> None:
    assert claim_spec(profile(SLICE_ELSE_SHARED)) == {"devices": {"requests": [{"name": "gpus", "firstAvailable": [
        {"name": "slice", "deviceClassName": "gpu-mig-1g", "allocationMode": "ExactCount", "count": 1},
        {"name": "shared", "deviceClassName": "gpu-shared-memory", "allocationMode": "ExactCount", "count": 1,
         "capacity": {"requests": {"memory": "10Gi"}}}]}]}}
    only = claim_spec(profile({"alternatives": [SLICE_ELSE_SHARED["alternatives"][1]]}))
    assert only["devices"]["requests"][0]["exactly"]["capacity"] == {"requests": {"memory": "10Gi"}}


@pytest.mark.parametrize(("capacity", "needle"), [
    ({"memory": "ten gigs"}, "is not a Kubernetes quantity"),
    ({"memory": "0"}, "must be positive"),
    ({"Memory!": "1Gi"}, "must be a DNS label"),
])
def test_bad_capacity_is_refused_with_the_field(capacity: dict[str, str], needle: str) -> None:
    with pytest.raises(ProfileError, match=r"spec\.alternatives\[0\]") as e:
        profile({"alternatives": [{"deviceClassName": "gpu-shared-memory", "capacity": capacity}]})
    assert needle in str(e.value)
