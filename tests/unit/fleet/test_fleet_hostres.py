"""Node CPU and memory as NodeResourcesFit computes them (fleet.hostres)."""

from __future__ import annotations

from typing import Any

import pytest

from topodra.fleet.hostres import HostResources, Share, pod_record, pod_requests, stranded_by_host

GI = 1 << 30


def pod(name: str, node: str = "", containers: list[dict[str, str]] | None = None,
        init: list[dict[str, Any]] | None = None, phase: str = "Running", **spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns"},
            "spec": {"nodeName": node, **spec,
                     "containers": [{"name": f"c{i}", "resources": {"requests": r}}
                                    for i, r in enumerate(containers or [])],
                     "initContainers": init or []},
            "status": {"phase": phase}}


def node(name: str, cpu: str, memory: str) -> dict[str, Any]:
    return {"metadata": {"name": name}, "status": {"allocatable": {"cpu": cpu, "memory": memory}}}


def test_containers_sum_and_quantities_round_up() -> None:
    assert pod_requests(pod("p", containers=[{"cpu": "1500m", "memory": "1Gi"}, {"cpu": "0.5", "memory": "512Mi"}])) \
        == (2000, GI + 512 * (1 << 20))
    assert pod_requests(pod("p", containers=[{"cpu": "0.0001"}])) == (1, 0)  # MilliValue rounds up
    assert pod_requests(pod("p", containers=[{}])) == (0, 0)


def test_init_containers_take_the_max_and_sidecars_add() -> None:
    big_init = {"name": "i", "resources": {"requests": {"cpu": "8", "memory": "1Gi"}}}
    assert pod_requests(pod("p", containers=[{"cpu": "2", "memory": "4Gi"}], init=[big_init])) == (8000, 4 * GI)
    sidecar = {"name": "s", "restartPolicy": "Always", "resources": {"requests": {"cpu": "1", "memory": "1Gi"}}}
    later = {"name": "i2", "resources": {"requests": {"cpu": "2"}}}
    # sidecar runs with the app (2 + 1); the init after it needs its own 2 plus the sidecar's 1 = 3
    assert pod_requests(pod("p", containers=[{"cpu": "2", "memory": "4Gi"}], init=[sidecar, later])) \
        == (3000, 5 * GI)
    heavy_later = {"name": "i3", "resources": {"requests": {"cpu": "6"}}}
    assert pod_requests(pod("p", containers=[{"cpu": "2"}], init=[sidecar, heavy_later]))[0] == 7000


def test_pod_level_requests_and_overhead() -> None:
    p = pod("p", containers=[{"cpu": "2", "memory": "4Gi"}], resources={"requests": {"cpu": "10"}},
            overhead={"cpu": "250m", "memory": "64Mi"})
    assert pod_requests(p) == (10250, 4 * GI + 64 * (1 << 20))


def test_record_keeps_node_and_pod_group() -> None:
    r = pod_record(pod("p", "n1", [{"cpu": "1"}], schedulingGroup={"podGroupName": "train"}))
    assert (r.namespace, r.name, r.node, r.cpu_milli, r.pod_group) == ("ns", "p", "n1", 1000, "train")


def test_free_is_allocatable_minus_bound_non_terminal_pods() -> None:
    h = HostResources()
    h.replace_nodes([node("n1", "224", "2Ti"), {"metadata": {"name": "bare"}}])
    h.set_pod(pod("a", "n1", [{"cpu": "100", "memory": "1Ti"}]))
    h.set_pod(pod("b", "", [{"cpu": "100"}]))  # unbound: holds nothing yet
    h.set_pod(pod("c", "n1", [{"cpu": "50"}], phase="Succeeded"))  # terminal: holds nothing
    room = h.room("n1")
    assert room is not None
    assert (room.cpu_free, room.memory_free) == (124_000, 1 << 40)
    assert h.room("bare") is None and h.room("unknown") is None
    h.set_pod(pod("b", "n1", [{"cpu": "100"}]))  # bound now
    assert h.requested("n1") == (200_000, 1 << 40)
    h.set_pod(pod("a", "n1", [{"cpu": "100", "memory": "1Ti"}], phase="Failed"))  # finished
    assert h.requested("n1") == (100_000, 0)
    h.delete_pod("ns", "b")
    assert h.requested("n1") == (0, 0) and not h.pods_on("n1")


def test_stranded_by_cpu_and_by_memory_count_whole_placements() -> None:
    share = Share.of(12_000, 96 * GI, 1)
    assert share is not None
    # 8 free GPUs usable by devices; 30 CPU -> two 1-GPU placements; memory for all 8
    assert stranded_by_host(8, 8, 30_000, 8 * 96 * GI, share, 1) == (6, 0)
    # an 8-GPU class needs 96 CPU at once: 95 free strands all 8
    assert stranded_by_host(8, 8, 95_000, 1 << 50, share, 8) == (8, 0)
    assert stranded_by_host(8, 8, 1 << 50, 100 * GI, share, 8) == (0, 8)
    assert Share.of(1, 1, 0) is None


@pytest.mark.parametrize("bad", ["abc", "1x", ""])
def test_malformed_quantities_count_as_zero(bad: str) -> None:
    assert pod_requests(pod("p", containers=[{"cpu": bad, "memory": bad}])) == (0, 0)
