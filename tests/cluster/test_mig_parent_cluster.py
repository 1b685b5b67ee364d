"""A MIG-enabled GPU is never handed out whole by the GPU classes (issue 19, finding 5), with the real scheduler.

CUDA sees no device on a GPU whose MIG mode is on, so its whole device is published as ``type: gpu-mig-parent``
(sharing/mig.py): ``gpu.topodra.io`` and the model classes (``type == "gpu"``) never select it, while an admin's
own class still can, and its counters still exclude its slices.  Simulated nodes: mock dgx-a100-80gb-mig (MIG on
every GPU) and dgx-a100-80gb (MIG off).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from test_scheduling_topology import Scenario, scenario_maker
from testkit.handle import ClusterHandle
from testkit.paths import REPO

pytestmark = pytest.mark.cluster

D = 'device.attributes["gpu.topodra.io"]'
ADMIN_CLASS_FILE = REPO / "tests/fixtures/deviceclasses/gpu-mig-parent-admin.yaml"
ADMIN_CLASS = "test-gpu-mig-parent"


def mig_parent_class(cluster: ClusterHandle) -> str:
    """Install the admin's class for whole MIG-enabled GPUs (idempotent); its name."""
    cluster.apply_yaml(ADMIN_CLASS_FILE)
    return ADMIN_CLASS


@pytest.fixture
def scenarios(cluster: ClusterHandle) -> Iterator[Callable[..., Scenario]]:
    yield from scenario_maker(cluster)


def template(s: Scenario, name: str, device_class: str, cel: str | None = None) -> str:
    exactly: dict[str, object] = {"deviceClassName": device_class}
    if cel:
        exactly["selectors"] = [{"cel": {"expression": cel}}]
    s.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
              "spec": {"spec": {"devices": {"requests": [{"name": "gpus", "exactly": exactly}]}}}})
    return name


def test_a_plain_gpu_claim_never_gets_a_mig_enabled_gpu(scenarios: Callable[..., Scenario],
                                                       cluster: ClusterHandle) -> None:  # fmt: skip
    s = scenarios([("mig", "dgx-a100-80gb-mig", 1), ("plain", "dgx-a100-80gb", 1)], prefix="migparent")
    mig_node, plain_node = s.nodes("mig")[0], s.nodes("plain")[0]
    assert s.attrs(mig_node, "gpu-0")["type"] == "gpu-mig-parent"
    # Every whole-GPU class a user would pick: nothing on the MIG node fits, though all its slices are free.
    for cls in ("gpu.topodra.io", "gpu-a100-80gb", "gpu-ampere-plus"):
        key = cls.replace(".", "-")
        s.pod(f"only-mig-{key}", template(s, f"t-{key}", cls), [mig_node])
        s.wait_unschedulable(f"only-mig-{key}")
    # The same claim with the MIG-off node allowed too goes there.
    s.pod("either", "t-gpu-topodra-io", [mig_node, plain_node])
    node, results = s.wait_allocated("either")
    assert node == plain_node and results[0]["pool"] == plain_node, results
    # The MIG node still serves slices...
    s.pod("slice", template(s, "one-1g", "gpu-mig-1g", f'{D}.parentDevice == "gpu-0"'), [mig_node])
    assert s.wait_allocated("slice")[1][0]["device"].startswith("gpu-0-mig-1g-10gb-")
    # ... and an admin's own class for the whole device still sees it, excluded by the slice's counters.
    parent = template(s, "parent", mig_parent_class(cluster), f"{D}.minor == 0")
    s.pod("whole-0", parent, [mig_node])
    s.wait_unschedulable("whole-0")
    s.release("slice")
    assert [r["device"] for r in s.wait_allocated("whole-0", timeout=120)[1]] == ["gpu-0"]
