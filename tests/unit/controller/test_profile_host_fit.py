"""Issue 21: a ClaimProfile's nodesFit and gang choice count the nodes' free CPU and memory (pure parts)."""

from __future__ import annotations

from typing import Any

import pytest

from topodra.classcatalog import catalog, to_device_class
from topodra.controller import gang
from topodra.controller.availability import make_snapshot, profile_availability
from topodra.controller.hostfit import PodShape, pod_shape, verdict
from topodra.controller.operator import availability_note
from topodra.controller.profile import ClaimProfile, ProfileError
from topodra.fleet.hostres import HostResources

D = "gpu.topodra.io"
CLASSES = [to_device_class(s) for s in catalog()]
H100 = ("H100-SXM5-80GB", "81559Mi")


def hgx(name: str) -> dict[str, Any]:
    devs = [{"name": f"gpu-{i}",
             "attributes": {"type": {"string": "gpu"}, "model": {"string": H100[0]},
                            "cudaComputeCapability": {"version": "9.0.0"}, "nvlinkDomain": {"string": name},
                            "rail": {"int": i}, "resource.kubernetes.io/numaNode": {"int": i // 4}},
             "capacity": {"memory": {"value": H100[1]}}} for i in range(8)]
    return {"metadata": {"name": name}, "spec": {"driver": D, "nodeName": name,
                                                 "pool": {"name": name, "generation": 1, "resourceSliceCount": 1},
                                                 "devices": devs}}


def node(name: str, cpu: str = "224", memory: str = "2Ti", leaf: str = "l1") -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": {"topodra.io/leaf-group": leaf}},
            "status": {"conditions": [{"type": "Ready", "status": "True"}],
                       "allocatable": {"cpu": cpu, "memory": memory}}}


def pod(name: str, on: str, cpu: str = "0", memory: str = "0", phase: str = "Running") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "other"},
            "spec": {"nodeName": on, "containers": [{"name": "c", "resources": {
                "requests": {"cpu": cpu, "memory": memory}}}]},
            "status": {"phase": phase}}


def prof(spec: dict[str, Any]) -> ClaimProfile:
    return ClaimProfile.from_api({"metadata": {"name": "train", "namespace": "ns", "uid": "u1"}, "spec": spec})


EIGHT = {"alternatives": [{"deviceClassName": "gpu-h100", "count": 8}], "topology": {"nvlink": "Required"}}


def snapshot(pods: list[dict[str, Any]] | None, names: tuple[str, ...] = ("hog", "roomy")) -> Any:
    return make_snapshot([hgx(n) for n in names], [], CLASSES, D, [node(n) for n in names], pods=pods)


# --- the pod's shape ------------------------------------------------------------------------------------------

def test_shape_from_pod_requests_and_from_align_cpus() -> None:
    assert pod_shape(prof(EIGHT)) is None
    assert pod_shape(prof({**EIGHT, "podRequests": {"cpu": "96", "memory": "512Gi"}})) == PodShape(96_000, 512 << 30)
    assert pod_shape(prof({**EIGHT, "podRequests": {"cpu": "500m"}})) == PodShape(500, 0)
    aligned = {**EIGHT, "alignCpus": {"cpusPerGpu": 8, "gpusPerNumaNode": 4}}
    assert pod_shape(prof(aligned)) == PodShape(64_000, 0)  # what status.cpuAlignment.podCpuRequest says
    assert pod_shape(prof({**aligned, "podRequests": {"memory": "1Gi"}})) == PodShape(64_000, 1 << 30)
    assert pod_shape(prof({**aligned, "podRequests": {"cpu": "64"}})) == PodShape(64_000, 0)


@pytest.mark.parametrize(("requests", "needle"), [
    ({"cpu": "lots"}, "podRequests.cpu: 'lots' is not a Kubernetes quantity"),
    ({"memory": "0"}, "podRequests.memory: '0' must be positive"),
    ({"gpu": "1"}, "Extra inputs are not permitted"),
])
def test_bad_pod_requests_are_refused(requests: dict[str, str], needle: str) -> None:
    with pytest.raises(ProfileError) as err:
        prof({**EIGHT, "podRequests": requests})
    assert needle in str(err.value), str(err.value)


def test_pod_requests_cpu_must_match_align_cpus() -> None:
    with pytest.raises(ProfileError) as err:
        prof({**EIGHT, "alignCpus": {"cpusPerGpu": 8, "gpusPerNumaNode": 4}, "podRequests": {"cpu": "32"}})
    assert "podRequests.cpu 32 differs from the 64 CPUs alignCpus puts in each claim" in str(err.value)


def test_verdict_counts_pods_by_each_resource() -> None:
    host = HostResources()
    host.replace_nodes([node("n", cpu="100", memory="100Gi")])
    host.replace_pods([pod("a", "n", cpu="30", memory="10Gi")])
    v = verdict(host, "n", PodShape(20_000, 40 << 30))
    assert (v.known, v.fits, v.pods_by_cpu, v.pods_by_memory, v.pods) == (True, True, 3, 2, 2)
    v = verdict(host, "n", PodShape(71_000, 0))
    assert (v.short_cpu, v.short_memory, v.pods, v.fits) == (True, False, 0, False)
    unknown = verdict(host, "elsewhere", PodShape(1_000_000, 0))
    assert (unknown.known, unknown.fits, unknown.pods) == (False, True, None)


# --- nodesFit -------------------------------------------------------------------------------------------------

def test_a_node_whose_cpus_are_held_does_not_fit_and_status_says_why() -> None:
    hog = [pod("cpu-hog", "hog", cpu="204", memory="100Gi")]
    p = prof({**EIGHT, "podRequests": {"cpu": "96", "memory": "128Gi"}})
    (alt,) = profile_availability(p, snapshot(hog))
    assert (alt.devices_free, alt.nodes_fit, alt.nodes_short_cpu, alt.nodes_short_memory) == (16, 1, 1, 0)
    assert alt.to_api()["nodesShortOfCpu"] == 1 and alt.to_api()["nodesShortOfMemory"] == 0
    assert alt.host_note == ("1 node(s) have the 8 free device(s) in one NVLink domain but too little free CPU (1) "
                             "for a pod of cpu 96, memory 128Gi")
    assert availability_note([alt], "") == f"fits now: h100; h100: {alt.host_note}"
    # the CPU pod finishes: its requests are free again and the node counts
    (done,) = profile_availability(p, snapshot([pod("cpu-hog", "hog", cpu="204", phase="Succeeded")]))
    assert (done.nodes_fit, done.nodes_short_cpu, done.host_note) == (2, 0, "")


def test_no_node_fits_names_the_resource_in_the_reason() -> None:
    full = [pod("m-hog", "hog", memory="1950Gi"), pod("m-roomy", "roomy", cpu="200", memory="1990Gi")]
    p = prof({**EIGHT, "podRequests": {"cpu": "96", "memory": "128Gi"}})
    (alt,) = profile_availability(p, snapshot(full))
    assert (alt.nodes_fit, alt.nodes_short_cpu, alt.nodes_short_memory) == (0, 1, 2)
    assert alt.message == ("2 node(s) have the 8 free device(s) in one NVLink domain but too little free CPU (1) / "
                           "memory (2) for a pod of cpu 96, memory 128Gi")
    assert availability_note([alt], "") == f"fits now: none (h100: {alt.message})"


def test_without_stated_requests_or_without_pods_nothing_changes() -> None:
    hog = [pod("cpu-hog", "hog", cpu="224", memory="2Ti")]
    (plain,) = profile_availability(prof(EIGHT), snapshot(hog))
    assert (plain.nodes_fit, plain.nodes_short_cpu) == (2, None)
    assert "nodesShortOfCpu" not in plain.to_api()
    # a profile that states requests, but the pods were not read: devices only, as before
    (unread,) = profile_availability(prof({**EIGHT, "podRequests": {"cpu": "96"}}), snapshot(None))
    assert (unread.nodes_fit, unread.nodes_short_cpu) == (2, None)
    assert availability_note([unread], "", "cannot list pods (403); free CPU and memory are not counted") == \
        "fits now: h100; cannot list pods (403); free CPU and memory are not counted"


def test_a_node_of_unknown_allocatable_is_not_judged() -> None:
    snap = make_snapshot([hgx("n")], [], CLASSES, D, [], pods=[pod("x", "n", cpu="1000")])
    (alt,) = profile_availability(prof({**EIGHT, "podRequests": {"cpu": "96"}}), snap)
    assert (alt.nodes_fit, alt.nodes_short_cpu) == (1, 0)


def test_unbound_and_terminal_pods_hold_nothing() -> None:
    pending = pod("p", "", cpu="224")
    failed = pod("f", "hog", cpu="224", phase="Failed")
    (alt,) = profile_availability(prof({**EIGHT, "podRequests": {"cpu": "96"}}), snapshot([pending, failed]))
    assert (alt.nodes_fit, alt.nodes_short_cpu) == (2, 0)


# --- the gang -------------------------------------------------------------------------------------------------

GANG = {"alternatives": [{"deviceClassName": "gpu-h100", "count": 4}], "topology": {"nvlink": "Required"},
        "pods": 4, "acrossNodes": {"sameDomain": ["leafGroup"]}}


def test_the_gang_counts_pods_the_free_cpu_holds() -> None:
    # two nodes, each with two 4-GPU slots: four pods fit by the GPUs alone
    snap = snapshot([])
    choice = gang.choose(prof({**GANG, "podRequests": {"cpu": "100"}}), snap, driver=D, nic_class="nic.topodra.io")
    assert (choice.fits, choice.domains) == (True, 1)
    # 124 free CPUs on hog hold one 100-CPU pod, not two: three pods, the gang does not fit
    snap = snapshot([pod("cpu-hog", "hog", cpu="100")])
    p = prof({**GANG, "podRequests": {"cpu": "100"}})
    cap = gang.capacity(p.spec.alternatives[0], p, snap, D, None)
    assert cap is not None and (cap.per_node, cap.short, cap.short_cpu, cap.short_memory) == (
        {"hog": 1, "roomy": 2}, 1, 1, 0)
    choice = gang.choose(p, snap, driver=D, nic_class="nic.topodra.io")
    assert (choice.fits, choice.domains) == (False, 0)
    assert ("h100 in one leafGroup: at most 3 of 4 (1 node(s) hold fewer pods of cpu 100 than their free devices "
            "would: too little free CPU (1))") in choice.message
    # the same cluster, no stated requests: the GPUs alone decide, as before
    plain = gang.choose(prof(GANG), snap, driver=D, nic_class="nic.topodra.io")
    assert (plain.fits, plain.domains) == (True, 1)
