"""GPU memory as consumable capacity: publishing, the real scheduler sharing one GPU, and each share's limit.

Split by tier; the rest: tests/unit/sharing/test_sharing_memory.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml
from test_scheduling_topology import Scenario, scenario_maker
from testkit.handle import ClusterHandle
from testkit.paths import REPO

D = 'device.attributes["gpu.topodra.io"]'


@pytest.fixture
def scenarios(cluster: ClusterHandle) -> Iterator[Callable[..., Scenario]]:
    yield from scenario_maker(cluster)


@pytest.mark.cluster
def test_four_20gi_shares_fill_one_80gb_gpu(scenarios: Callable[..., Scenario], tmp_path: Path) -> None:
    # The node's hardware config opts in; a profile file's discovery defaults stand in for it here.
    profile = yaml.safe_load((REPO / "driver/topodra/hardware/profiles/dgx-a100-80gb.yaml").read_text())
    profile.update(name="dgx-a100-80gb-shared", discovery={**profile.get("discovery", {}), "shareGpuMemory": True})
    path = tmp_path / "dgx-a100-80gb-shared.yaml"
    path.write_text(yaml.safe_dump(profile))
    s = scenarios([("shared", str(path), 1)], prefix="share")
    node = s.nodes()[0]
    s.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": "mem20"},
              "spec": {"spec": {"devices": {"requests": [{"name": "gpus", "exactly": {
                  "deviceClassName": "gpu-shared-memory",
                  "selectors": [{"cel": {"expression": f"{D}.minor == 0"}}],
                  "capacity": {"requests": {"memory": "20Gi"}}}}]}}}})
    for i in range(4):
        s.pod(f"share-{i}", "mem20", [node])
    results = [s.wait_allocated(f"share-{i}")[1] for i in range(4)]
    assert {r[0]["device"] for r in results} == {"gpu-0"}
    assert len({r[0]["shareID"] for r in results}) == 4
    assert all(r[0]["consumedCapacity"] == {"memory": "20Gi"} for r in results), results
    s.pod("share-4", "mem20", [node])
    s.wait_unschedulable("share-4")
    s.release("share-0")
    assert s.wait_allocated("share-4", timeout=120)[1][0]["device"] == "gpu-0"
