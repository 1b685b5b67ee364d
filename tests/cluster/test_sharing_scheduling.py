"""MIG slices allocated by the real kube-scheduler on simulated nodes (mock dgx-a100-80gb-mig).

Every claim is pinned to one GPU of the node by a selector on ``parentDevice`` (slices) or ``minor``
(whole GPU), so each test exercises one A100-80GB: its counter set alone decides what fits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from test_mig_parent_cluster import mig_parent_class
from test_scheduling_topology import Scenario, scenario_maker
from testkit.handle import ClusterHandle

pytestmark = pytest.mark.cluster

D = 'device.attributes["gpu.topodra.io"]'


@pytest.fixture
def scenarios(cluster: ClusterHandle) -> Iterator[Callable[..., Scenario]]:
    yield from scenario_maker(cluster)


def slice_template(s: Scenario, name: str, profile: str, gpu: str) -> str:
    size = profile.split("g.")[0]
    s.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
              "spec": {"spec": {"devices": {"requests": [{"name": "gpus", "exactly": {
                  "deviceClassName": f"gpu-mig-{size}g",
                  "selectors": [{"cel": {"expression":
                                         f'{D}.profile == "{profile}" && {D}.parentDevice == "{gpu}"'}}]}}]}}}})
    return name


def whole_template(s: Scenario, name: str, minor: int) -> str:
    """The whole device of a MIG-enabled GPU: only an admin's class selects it (type gpu-mig-parent)."""
    s.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
              "spec": {"spec": {"devices": {"requests": [{"name": "gpus", "exactly": {
                  "deviceClassName": mig_parent_class(s.cluster),
                  "selectors": [{"cel": {"expression": f"{D}.minor == {minor}"}}]}}]}}}})
    return name


def memory_slices(s: Scenario, pool: str, device: str) -> set[int]:
    a = s.attrs(pool, device)
    return set(range(int(a["placementStart"]), int(a["placementStart"]) + int(a["placementSize"])))


def test_seven_1g_slices_fill_one_a100_and_exclude_the_whole_gpu(scenarios: Callable[..., Scenario]) -> None:
    s = scenarios([("mig", "dgx-a100-80gb-mig", 1)], prefix="mig7")
    node = s.nodes()[0]
    t = slice_template(s, "one-1g", "1g.10gb", "gpu-0")
    for i in range(7):
        s.pod(f"slice-{i}", t, [node])
    got = [s.wait_allocated(f"slice-{i}")[1] for i in range(7)]
    devices = [r[0]["device"] for r in got]
    assert sorted(devices) == [f"gpu-0-mig-1g-10gb-{k}" for k in range(7)], devices
    s.pod("slice-7", t, [node])
    s.wait_unschedulable("slice-7")
    # A whole-GPU claim cannot take a GPU with a slice allocated.
    s.pod("whole-0", whole_template(s, "gpu-0", 0), [node])
    s.wait_unschedulable("whole-0")
    for i in range(8):
        s.release(f"slice-{i}")
    _node, results = s.wait_allocated("whole-0", timeout=120)
    assert [r["device"] for r in results] == ["gpu-0"]
    # ... and the reverse: no slice of a GPU that is allocated whole.
    s.pod("slice-after", t, [node])
    s.wait_unschedulable("slice-after")


def test_3g_and_4g_mix_without_overlap(scenarios: Callable[..., Scenario]) -> None:
    s = scenarios([("mig", "dgx-a100-80gb-mig", 1)], prefix="migmix")
    node = s.nodes()[0]
    four = slice_template(s, "four", "4g.40gb", "gpu-1")
    three = slice_template(s, "three", "3g.40gb", "gpu-1")
    # The allocator is first fit: the first 3g.40gb takes placement 0, which the only 4g.40gb placement overlaps.
    s.pod("three-a", three, [node])
    assert s.wait_allocated("three-a")[1][0]["device"] == "gpu-1-mig-3g-40gb-0"
    s.pod("four-a", four, [node])
    s.wait_unschedulable("four-a")
    s.pod("three-b", three, [node])
    assert s.wait_allocated("three-b")[1][0]["device"] == "gpu-1-mig-3g-40gb-4"
    # Every memory slice is taken: a 1g.10gb (compute would still fit: 3 + 3 + 1 = 7) waits too.
    s.pod("one-a", slice_template(s, "one", "1g.10gb", "gpu-1"), [node])
    s.wait_unschedulable("one-a")
    s.release("one-a")
    # Freeing the 3g.40gb at 0 lets the waiting 4g.40gb in: 4g at 0 + 3g at 4, the valid 7-slice mix.
    s.release("three-a")
    assert s.wait_allocated("four-a", timeout=120)[1][0]["device"] == "gpu-1-mig-4g-40gb-0"
    assert not memory_slices(s, node, "gpu-1-mig-4g-40gb-0") & memory_slices(s, node, "gpu-1-mig-3g-40gb-4")
    s.pod("three-c", three, [node])
    s.wait_unschedulable("three-c")
