"""ClaimProfile "a 1g.10gb slice, else 10Gi of a shared GPU": rendering, and the real scheduler taking the
shared alternative once the MIG node is full (simulated nodes: mock dgx-a100-80gb-mig + a memory-shared A100).

Split by tier; the rest: tests/unit/sharing/test_sharing_profile.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_mig_parent_cluster import mig_parent_class
from test_scheduling_topology import Scenario, scenario_maker
from testkit.handle import ClusterHandle
from testkit.paths import REPO

from topodra.controller.profile import ClaimProfile
from topodra.controller.render import claim_spec

SLICE_ELSE_SHARED: dict[str, Any] = {"alternatives": [
    {"name": "slice", "deviceClassName": "gpu-mig-1g"},
    {"name": "shared", "deviceClassName": "gpu-shared-memory", "capacity": {"memory": "10Gi"}}]}


def profile(spec: dict[str, Any], name: str = "infer") -> ClaimProfile:
    return ClaimProfile.from_api({"metadata": {"name": name, "namespace": "ns"}, "spec": spec})


@pytest.fixture
def scenarios(cluster: ClusterHandle) -> Iterator[Callable[..., Scenario]]:
    yield from scenario_maker(cluster)


def shared_profile_file(tmp_path: Path) -> str:
    """A hardware profile of an A100 node opted in to memory sharing (as test_sharing_memory does)."""
    p = yaml.safe_load((REPO / "driver/topodra/hardware/profiles/dgx-a100-80gb.yaml").read_text())
    p.update(name="dgx-a100-80gb-shared", discovery={**p.get("discovery", {}), "shareGpuMemory": True})
    path = tmp_path / "dgx-a100-80gb-shared.yaml"
    path.write_text(yaml.safe_dump(p))
    return str(path)


@pytest.mark.cluster
def test_full_mig_node_sends_the_profile_to_a_shared_gpu(scenarios: Callable[..., Scenario], tmp_path: Path) -> None:
    s = scenarios([("mig", "dgx-a100-80gb-mig", 1), ("shared", shared_profile_file(tmp_path), 1)], prefix="prof")
    mig_node, shared_node = s.nodes("mig")[0], s.nodes("shared")[0]
    s.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": "infer"},
              "spec": {"spec": claim_spec(profile(SLICE_ELSE_SHARED))}})
    # A slice is the first choice wherever one is free.
    s.pod("p-slice", "infer", [mig_node])
    node, results = s.wait_allocated("p-slice")
    assert node == mig_node and results[0]["request"] == "gpus/slice", results
    assert s.attrs(mig_node, results[0]["device"])["profile"].startswith("1g.")
    s.release("p-slice")
    # Every GPU of the MIG node taken whole (an admin's class: no GPU class selects a MIG-enabled GPU): no
    # slice is left anywhere, so the shared alternative is taken.
    s.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": "all8"},
              "spec": {"spec": {"devices": {"requests": [{"name": "gpus", "exactly": {
                  "deviceClassName": mig_parent_class(s.cluster), "allocationMode": "ExactCount", "count": 8}}]}}}})
    s.pod("blocker", "all8", [mig_node])
    assert len(s.wait_allocated("blocker")[1]) == 8
    s.pod("p-shared", "infer", [mig_node, shared_node])
    node, results = s.wait_allocated("p-shared")
    assert node == shared_node and results[0]["request"] == "gpus/shared", results
    assert results[0]["consumedCapacity"] == {"memory": "10Gi"} and results[0].get("shareID"), results
