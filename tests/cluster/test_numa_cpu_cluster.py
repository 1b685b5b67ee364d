"""Issue 21, deliverable 3: GPUs, their rail NICs and dra-driver-cpu's CPUs on the same NUMA nodes, decided by
the real kube-scheduler on simulated DGX H100 nodes (``topodra simulate`` with ``cpuDriver``).

The controller's own pass (``process``: CPU-driver check, render, status) runs in-process against the real
apiserver; the template it writes is used unchanged.  For both dra-driver-cpu flavours (v0.2.0: only
``dra.net/numaNode``, which topodra's GPUs then carry through ``--numa-alias``; main: the standard
``resource.kubernetes.io/numaNode``) 8 GPUs + 8 NICs + 64 CPUs land as two NUMA groups of 4 + 4 + 32 each; with
too few CPUs left on one NUMA node the pod stays Pending with the scheduler's reason, and is placed once they are
free.  Without the CPU driver the profile is refused, or rendered without CPUs when the admin opted in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from test_scheduling_topology import Scenario, one, scenario_maker
from testkit.handle import ClusterHandle, wait_for
from testkit.paths import REPO

from topodra import cpudriver
from topodra.apipaths import claim_path, device_class_path, pod_path, profile_path, slices_path, template_path
from topodra.controller.cpucheck import MISSING, NO_ATTRIBUTE, CpuSettings
from topodra.controller.operator import ControllerConfig, Outcome, SnapshotCache, process
from topodra.kube import KubeError

pytestmark = pytest.mark.cluster

Obj = dict[str, Any]
RAIL_SPEC: Obj = {"alternatives": [{"deviceClassName": "gpu-h100", "count": 8}], "topology": {"nic": "RailAligned"},
                  "alignCpus": {"cpusPerGpu": 8, "gpusPerNumaNode": 4}}


@pytest.fixture
def scenarios(cluster: ClusterHandle) -> Iterator[Callable[..., Scenario]]:
    cluster.install_claimprofile_crd()
    yield from scenario_maker(cluster)


def run_controller(s: Scenario, name: str, spec: Obj, cpu: CpuSettings) -> tuple[Outcome, Obj]:
    """Create the ClaimProfile and run one controller pass on it; (outcome, stored profile with its status)."""
    cfg = ControllerConfig(cpu=cpu, snapshot_ttl_s=0)
    body = s.kube.create(profile_path(s.ns), {"apiVersion": "topodra.io/v1alpha1", "kind": "ClaimProfile",
                                              "metadata": {"name": name}, "spec": spec})
    outcome = process(s.kube, body, cfg, SnapshotCache(cfg))
    stored = s.kube.get(profile_path(s.ns, name))
    assert stored is not None
    return outcome, stored


def condition(profile: Obj, ctype: str) -> Obj:
    return next(c for c in profile["status"]["conditions"] if c["type"] == ctype)


def pod_base(template: str, cpus: str | None) -> Obj:
    """A pod whose one container uses the claim and, as dra-driver-cpu requires, repeats its CPUs."""
    resources: Obj = {"claims": [{"name": "gpus"}]}
    if cpus is not None:
        resources.update(requests={"cpu": cpus}, limits={"cpu": cpus})
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {}, "spec": {
        "restartPolicy": "Never", "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": template}],
        "containers": [{"name": "main", "image": "localhost/busybox:1.35", "imagePullPolicy": "Never",
                        "command": ["true"], "resources": resources}]}}


def cpu_numa(s: Scenario, node: str) -> dict[str, int]:
    """The published dra.cpu devices of ``node``: name -> NUMA node (dra.cpu/numaNodeID, in both releases)."""
    out = {}
    for sl in s.kube.list(slices_path(), field_selector=f"spec.driver={cpudriver.DRIVER},spec.nodeName={node}"):
        for d in sl["spec"]["devices"]:
            out[d["name"]] = d["attributes"][cpudriver.NUMA_ID]["int"]
    return out


def check_aligned(s: Scenario, node: str, results: list[Obj]) -> None:
    """Each NUMA group's 4 GPUs, their 4 rail NICs and its 32 CPUs share a NUMA node; the groups use both."""
    topodra = [r for r in results if r["driver"] == "gpu.topodra.io"]
    cpus = {r["request"]: r for r in results if r["driver"] == cpudriver.DRIVER}
    assert len(results) == 18 and len(topodra) == 16 and sorted(cpus) == ["cpus-0", "cpus-1"], results
    by_request = {r["request"]: {**s.attrs(r["pool"], r["device"]), "_device": r["device"]} for r in topodra}
    assert len({d["_device"] for d in by_request.values()}) == 16  # 16 distinct devices
    numa_of_cpu = cpu_numa(s, node)
    groups = []
    for g in (0, 1):
        gpus = [by_request[f"gpu-{i}"] for i in range(4 * g, 4 * g + 4)]
        nics = [by_request[f"nic-{i}"] for i in range(4 * g, 4 * g + 4)]
        assert {d["type"] for d in gpus} == {"gpu"} and {d["type"] for d in nics} == {"nic"}
        assert all(gp["rail"] == nic["rail"] for gp, nic in zip(gpus, nics, strict=True))
        cpu = cpus[f"cpus-{g}"]
        assert cpu["pool"] == node and cpu["consumedCapacity"] == {cpudriver.CAPACITY: "32"}, cpu
        numa = one([*(d["resource.kubernetes.io/numaNode"] for d in gpus + nics), numa_of_cpu[cpu["device"]]])
        groups.append(numa)
    assert sorted(groups) == [0, 1]


@pytest.mark.parametrize("release", cpudriver.RELEASES)
def test_gpus_nics_and_cpus_land_on_the_numa_nodes_that_hold_them(scenarios: Callable[..., Scenario],
                                                                   release: cpudriver.Release) -> None:
    s = scenarios([("dgx", "dgx-h100", 1)], "numacpu", release)
    (node,) = s.nodes()
    attribute = cpudriver.ALIGN_ATTRIBUTE[release]
    if release == "v0.2.0":  # the standard attribute is on the GPUs but on no CPU device: refused, says why
        outcome, stored = run_controller(s, "wrong-attr", RAIL_SPEC, CpuSettings())
        assert (outcome.ok, outcome.reason) == (False, NO_ATTRIBUTE)
        assert condition(stored, "Ready")["reason"] == NO_ATTRIBUTE
        assert "cpuDriver.release v0.2.0" in condition(stored, "CpusAligned")["message"]
        assert s.kube.get(template_path(s.ns, "wrong-attr")) is None
    outcome, stored = run_controller(s, "aligned", RAIL_SPEC, CpuSettings(numa_attribute=attribute))
    assert outcome.ok and outcome.cpu is not None and outcome.cpu.aligned, outcome
    assert stored["status"]["cpuAlignment"]["podCpuRequest"] == "64"
    assert stored["status"]["cpuAlignment"]["numaAttribute"] == attribute
    assert condition(stored, "CpusAligned")["status"] == "True"
    tmpl = s.kube.get(template_path(s.ns, "aligned"))
    assert tmpl is not None
    numa_constraints = [c for c in tmpl["spec"]["spec"]["devices"]["constraints"] if c["matchAttribute"] == attribute]
    assert len(numa_constraints) == 2

    cpus = stored["status"]["cpuAlignment"]["podCpuRequest"]
    s.pod("aligned-0", "aligned", [node], pod_base("aligned", cpus))
    got, results = s.wait_allocated("aligned-0")
    assert got == node
    check_aligned(s, node, results)
    s.release("aligned-0")

    # 90 of NUMA node 0's 112 CPUs taken: 22 left there, 32 needed by the group of GPUs 0-3. 124 CPUs are free on
    # the node and so are all GPUs and NICs: only the alignment can refuse.
    s.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "numa0-cpus"},
              "spec": {"devices": {"requests": [{"name": "cpus", "exactly": {
                  "deviceClassName": cpudriver.DRIVER, "capacity": {"requests": {cpudriver.CAPACITY: "90"}},
                  "selectors": [{"cel": {"expression": 'device.attributes["dra.cpu"].numaNodeID == 0'}}]}}]}}})
    holder = pod_base("unused", "90")
    holder["metadata"] = {"name": "numa0-holder"}
    holder["spec"]["resourceClaims"] = [{"name": "gpus", "resourceClaimName": "numa0-cpus"}]
    holder["spec"]["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "kubernetes.io/hostname", "operator": "In", "values": [node]}]}]}}}
    s.create(holder)

    def held() -> Obj | None:
        claim = s.kube.get(claim_path(s.ns, "numa0-cpus")) or {}
        return ((claim.get("status") or {}).get("allocation") or {}).get("devices")
    alloc = wait_for(held, 60, "the holder's 90 CPUs allocated")
    (res,) = alloc["results"]
    assert cpu_numa(s, node)[res["device"]] == 0

    s.pod("aligned-1", "aligned", [node], pod_base("aligned", cpus))
    s.wait_unschedulable("aligned-1")  # PodScheduled=False/Unschedulable, "cannot allocate all claims", retried
    # Free NUMA node 0's CPUs: the scheduler places the waiting pod, aligned again.
    s.kube.request("DELETE", pod_path(s.ns, "numa0-holder"),
                   {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0})
    s.kube.delete(claim_path(s.ns, "numa0-cpus"))
    got, results = s.wait_allocated("aligned-1", timeout=90)
    check_aligned(s, got, results)


def _drop_cpu_class(s: Scenario) -> None:
    """No dra-driver-cpu: earlier tests' simulations leave its DeviceClass behind (cluster-scoped), remove it."""
    s.kube.delete(device_class_path(cpudriver.DRIVER))
    wait_for(lambda: s.kube.get(device_class_path(cpudriver.DRIVER)) is None, 30, "DeviceClass dra.cpu gone")
    assert not list(s.kube.list(slices_path(), field_selector=f"spec.driver={cpudriver.DRIVER}"))


def test_without_the_cpu_driver_the_profile_is_refused(scenarios: Callable[..., Scenario]) -> None:
    s = scenarios([("dgx", "dgx-h100", 1)], "nocpu")
    _drop_cpu_class(s)
    outcome, stored = run_controller(s, "aligned", RAIL_SPEC, CpuSettings())
    assert (outcome.ok, outcome.reason) == (False, MISSING)
    ready = condition(stored, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", MISSING)
    assert "DeviceClass dra.cpu does not exist" in ready["message"] and "--allow-unaligned-cpus" in ready["message"]
    assert condition(stored, "Invalid")["status"] == "False"  # the spec is fine; the cluster lacks a driver
    assert condition(stored, "CpusAligned")["status"] == "False"
    assert s.kube.get(template_path(s.ns, "aligned")) is None


def test_without_the_cpu_driver_the_admin_may_allow_unaligned_gpus(scenarios: Callable[..., Scenario]) -> None:
    s = scenarios([("dgx", "dgx-h100", 1)], "unaligned")
    _drop_cpu_class(s)
    outcome, stored = run_controller(s, "aligned", RAIL_SPEC, CpuSettings(allow_unaligned=True))
    assert outcome.ok, outcome
    assert condition(stored, "Ready")["status"] == "True"
    aligned = condition(stored, "CpusAligned")
    assert (aligned["status"], aligned["reason"]) == ("False", MISSING)
    assert "without CPU alignment" in aligned["message"]
    assert stored["status"]["cpuAlignment"]["aligned"] is False
    tmpl = s.kube.get(template_path(s.ns, "aligned"))
    assert tmpl is not None
    requests = tmpl["spec"]["spec"]["devices"]["requests"]
    assert all(r["exactly"]["deviceClassName"] != cpudriver.DRIVER for r in requests)
    s.pod("unaligned-0", "aligned", s.nodes(), pod_base("aligned", None))
    _node, results = s.wait_allocated("unaligned-0")
    assert len(results) == 16 and {r["driver"] for r in results} == {"gpu.topodra.io"}


def test_one_numa_group_for_eight_dgx_gpus_cannot_be_placed(scenarios: Callable[..., Scenario]) -> None:
    """Why gpusPerNumaNode: one matchAttribute over 8 GPUs + NICs + CPUs needs one NUMA node holding all 8 GPUs.

    The real allocator refuses it on a DGX H100 (4 GPUs per NUMA node) although every device is free, and places
    the same request split into two NUMA groups.
    """
    s = scenarios([("dgx", "dgx-h100", 1)], "onegroup", "main")
    one_group = {**RAIL_SPEC, "alignCpus": {"cpusPerGpu": 8}}  # gpusPerNumaNode defaults to count: one group
    outcome, _stored = run_controller(s, "one-group", one_group, CpuSettings())
    assert outcome.ok, outcome
    tmpl = s.kube.get(template_path(s.ns, "one-group"))
    assert tmpl is not None
    (numa,) = [c for c in tmpl["spec"]["spec"]["devices"]["constraints"]
               if c["matchAttribute"] == cpudriver.STANDARD_NUMA]
    assert len(numa["requests"]) == 17  # 8 GPUs, 8 NICs, 1 CPU request
    s.pod("one-group-0", "one-group", s.nodes(), pod_base("one-group", "64"))
    s.wait_unschedulable("one-group-0")
    run_controller(s, "two-groups", RAIL_SPEC, CpuSettings())
    s.pod("two-groups-0", "two-groups", s.nodes(), pod_base("two-groups", "64"))
    node, results = s.wait_allocated("two-groups-0")
    check_aligned(s, node, results)


POD_CPU_POLICY = REPO / "deploy" / "cpu-alignment" / "pod-cpu-requests.yaml"


def test_the_admission_policy_writes_the_pods_cpu_request(cluster: ClusterHandle,
                                                           scenarios: Callable[..., Scenario]) -> None:
    """deploy/cpu-alignment's MutatingAdmissionPolicy: the pod's requests.cpu comes from the profile's status."""
    s = scenarios([("dgx", "dgx-h100", 1)], "podcpu", "main")
    cluster.apply_yaml(POD_CPU_POLICY)
    try:
        run_controller(s, "aligned", RAIL_SPEC, CpuSettings())
        run_controller(s, "plain", {"alternatives": [{"deviceClassName": "gpu-h100", "count": 1}]}, CpuSettings())

        def pod(template: str) -> Obj:
            p = pod_base(template, None)
            p["spec"]["containers"].append({"name": "side", "image": "localhost/busybox:1.35",
                                            "imagePullPolicy": "Never", "command": ["true"]})
            return p

        def dry_run(template: str) -> dict[str, Obj]:
            p = {**pod(template), "metadata": {"name": f"dry-{template}", "namespace": s.ns}}
            out = s.kube.request("POST", pod_path(s.ns), p, query={"dryRun": "All"})
            return {c["name"]: c.get("resources") or {} for c in out["spec"]["containers"]}

        # The policy, its binding and the profile's status reach the apiserver's admission through informers:
        # dry-run creates until the mutation shows (the positive signal), then the real pod.
        mutated = wait_for(lambda: (r := dry_run("aligned"))["main"].get("requests") and r, 60,
                           "the policy writes requests.cpu")
        assert mutated["main"]["requests"] == {"cpu": "64"} and mutated["main"]["limits"] == {"cpu": "64"}
        assert "requests" not in mutated["side"]  # a container without the claim is left alone
        plain = dry_run("plain")  # a profile without alignCpus changes nothing
        assert plain["main"] == {"claims": [{"name": "gpus"}]}, plain

        s.pod("aligned-0", "aligned", s.nodes(), pod("aligned"))
        stored = s.get_pod("aligned-0")["spec"]["containers"][0]["resources"]
        assert stored["requests"] == {"cpu": "64"} and stored["limits"] == {"cpu": "64"}
        node, results = s.wait_allocated("aligned-0")
        check_aligned(s, node, results)
    finally:
        cluster.kubectl("delete", "--ignore-not-found", "-f", str(POD_CPU_POLICY))


@pytest.mark.parametrize(("align", "counts", "needle"), [
    ({"cpusPerGpu": 8}, (8, 4), "alignCpus needs the same count in every alternative"),
    ({"cpusPerGpu": 0}, (8,), "should be greater than or equal to 1"),
    ({"cpusPerGpu": 8, "gpusPerNumaNode": 33}, (8,), "should be less than or equal to 32"),
    ({"gpusPerNumaNode": 4}, (8,), "cpusPerGpu: Required value"),
])
def test_the_crd_rejects_bad_align_cpus(cluster: ClusterHandle, align: Obj, counts: tuple[int, ...],
                                        needle: str) -> None:
    cluster.install_claimprofile_crd()
    ns = cluster.namespace("badcpu")
    body = {"apiVersion": "topodra.io/v1alpha1", "kind": "ClaimProfile", "metadata": {"name": "bad"}, "spec": {
        "alternatives": [{"name": f"a{i}", "deviceClassName": "gpu-h100", "count": c} for i, c in enumerate(counts)],
        "alignCpus": align}}
    with pytest.raises(KubeError) as err:
        cluster.kube.create(profile_path(ns), body)
    assert err.value.status == 422 and needle in str(err.value), err.value
