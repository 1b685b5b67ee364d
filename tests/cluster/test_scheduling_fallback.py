"""Issue 4: prioritized alternatives, topology policies and quota, decided by the real kube-scheduler.

ClaimProfiles are rendered by the controller (a ``topodra controller`` subprocess, which also reports
availability in the profile's status) or by its pure ``render_template``; pods use the resulting
ResourceClaimTemplates on simulated nodes (see ``test_scheduling_topology.py`` for the helpers; the
shipped gpu-first-available example is proven there with the other examples).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from test_scheduling_topology import NUMA, Scenario, one, scenario_maker
from testkit.handle import ClusterHandle, wait_for
from testkit.paths import REPO

from topodra.apipaths import claim_path, event_path, profile_path, slices_path, template_path
from topodra.controller.profile import ClaimProfile
from topodra.controller.render import claim_spec, render_template
from topodra.kube import KubeError

pytestmark = pytest.mark.cluster

LOG_DIR = REPO / ".run" / "scheduling-test-logs"
HETEROGENEOUS = [("h200", "dgx-h200", 2), ("h100", "dgx-h100", 2), ("a100", "dgx-a100-80gb", 2),
                 ("nvl", "h100-nvl", 2)]
QUOTA_KEY = "{}.deviceclass.resource.k8s.io/devices"


@pytest.fixture(scope="module")
def crd(cluster: ClusterHandle) -> ClusterHandle:
    cluster.install_claimprofile_crd()
    return cluster


def create_profile(s: Scenario, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """A ClaimProfile through the API (CRD validation and defaulting), as stored."""
    return s.kube.create(profile_path(s.ns), {"apiVersion": "topodra.io/v1alpha1", "kind": "ClaimProfile",
                                              "metadata": {"name": name}, "spec": spec})


def render_profile(s: Scenario, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Create a profile and its template with the controller's pure render function (no controller)."""
    tmpl = render_template(ClaimProfile.from_api(create_profile(s, name, spec)))
    return s.kube.create(template_path(s.ns), tmpl)


@pytest.fixture
def scenarios(cluster: ClusterHandle) -> Iterator[Callable[..., Scenario]]:
    yield from scenario_maker(cluster)


@pytest.fixture
def controller(crd: ClusterHandle) -> Iterator[Any]:
    """Start ``topodra controller`` for a namespace: ``start(ns)``; stopped at teardown."""
    procs: list[subprocess.Popen[str]] = []

    def start(ns: str) -> subprocess.Popen[str]:
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        log = open(LOG_DIR / f"{ns}.log", "w")  # noqa: SIM115 - the child holds it
        proc = subprocess.Popen(
            [sys.executable, "-m", "topodra.cli", "controller", "--kubeconfig", crd.kubeconfig,
             "--namespace", ns, "--refresh-interval", "2", "--lease-namespace", ns],
            stdout=log, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        procs.append(proc)
        return proc

    yield start
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


# --- prioritized alternatives -----------------------------------------------------------------------

THREE = {"alternatives": [{"deviceClassName": "gpu-h200", "count": 8}, {"deviceClassName": "gpu-h100", "count": 8},
                          {"deviceClassName": "gpu-a100-80gb", "count": 8}],
         "topology": {"nvlink": "Required"}}


def only_scenario_devices(s: Scenario) -> None:
    """Profile status counts the whole cluster: remove topodra slices other tests left on other nodes.

    Tests share one cluster; a stopped plugin keeps its slices (on purpose), so the real node may still
    publish 8 free H100s here. Nothing runs beside this test, so no live publisher loses anything.
    """
    mine = set(s.nodes())
    for sl in s.kube.list(slices_path(), field_selector="spec.driver=gpu.topodra.io"):
        if sl["spec"].get("nodeName") not in mine:
            print(f"removing leftover slice {sl['metadata']['name']} of node {sl['spec'].get('nodeName')}")
            s.kube.delete(slices_path(sl["metadata"]["name"]))


def test_three_alternatives_fill_h200_then_h100_then_a100(crd: ClusterHandle, scenarios: Callable[..., Scenario],
                                                          controller: Any) -> None:
    s = scenarios(HETEROGENEOUS, "fallback")
    only_scenario_devices(s)
    proc = controller(s.ns)
    prof = create_profile(s, "train", THREE)
    tmpl = wait_for(lambda: s.kube.get(template_path(s.ns, "train")), 60, "template written by the controller")
    assert tmpl["spec"]["spec"] == claim_spec(ClaimProfile.from_api(prof))
    assert [r["name"] for r in tmpl["spec"]["spec"]["devices"]["requests"][0]["firstAvailable"]] == \
        ["h200", "h100", "a100-80gb"]

    # One by one: the scheduler prefers nodes where an earlier alternative fits.  gpu-h100 also
    # selects the H100 NVL GPUs, but their NVLink domains hold 2 GPUs, so those nodes never fit.
    want = [("h200", "h200"), ("h200", "h200"), ("h100", "h100"), ("h100", "h100"),
            ("a100", "a100-80gb"), ("a100", "a100-80gb")]
    used: list[str] = []
    for i, (role, sub) in enumerate(want):
        s.pod(f"train-{i}", "train", s.nodes())
        node, results = s.wait_allocated(f"train-{i}")
        assert node in s.nodes(role), (i, node)
        assert {r["request"] for r in results} == {f"gpus/{sub}"}
        devs = s.devices(results)
        assert len(devs) == 8 and {d["_pool"] for d in devs} == {node}
        one(d["nvlinkDomain"] for d in devs)
        used.append(node)
    assert len(set(used)) == 6

    s.pod("train-6", "train", s.nodes())
    s.wait_unschedulable("train-6")

    # The profile's status says why: no alternative fits on any node, and for each, what is missing.
    def exhausted() -> dict[str, Any] | None:
        st = (s.kube.get(profile_path(s.ns, "train")) or {}).get("status") or {}
        alts = {a["name"]: a for a in st.get("alternatives") or []}
        if alts and all(a.get("nodesFit") == 0 for a in alts.values()):
            return st
        return None

    last: list[Any] = []

    def exhausted_or_record() -> dict[str, Any] | None:
        last[:] = [(s.kube.get(profile_path(s.ns, "train")) or {}).get("status")]
        return exhausted()

    try:
        st = wait_for(exhausted_or_record, 60, "profile status: no alternative fits")
    except AssertionError as e:
        raise AssertionError(f"{e}; last status: {last}") from None
    alts = {a["name"]: a for a in st["alternatives"]}
    assert {n: (a["devicesTotal"], a["devicesFree"], a["nodesFit"]) for n, a in alts.items()} == {
        "h200": (16, 0, 0), "h100": (32, 16, 0), "a100-80gb": (16, 0, 0)}
    assert st["message"] == ("fits now: none (h200: 0 of 16 devices free, 8 needed; "
                             "h100: 16 of 32 devices free, but no node has 8 free in one NVLink domain; "
                             "a100-80gb: 0 of 16 devices free, 8 needed)")
    ready = next(c for c in st["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True"  # the template is fine; the cluster is full
    assert proc.poll() is None


# --- topology policies ------------------------------------------------------------------------------

def test_nvlink_required_pairs_land_on_nvl_bridges(crd: ClusterHandle, scenarios: Callable[..., Scenario]) -> None:
    s = scenarios([("nvl", "h100-nvl", 2)])
    render_profile(s, "pair", {"alternatives": [{"deviceClassName": "gpu-h100", "count": 2}],
                               "topology": {"nvlink": "Required"}})
    # Fragment both nodes (gpu-0 held): first fit without the constraint would pair gpu-1 with gpu-2.
    for k, node in enumerate(s.nodes()):
        assert s.hold_first_gpu(node, f"holder-{k}") == "gpu-0"
    per_node: dict[str, list[str]] = {n: [] for n in s.nodes()}

    def check(pod: str) -> None:
        node, results = s.wait_allocated(pod)
        assert {r["request"] for r in results} == {"gpus"}  # one alternative, nothing Preferred: exactly
        devs = s.devices(results)
        assert len(devs) == 2
        assert one(d["nvlinkDomainSize"] for d in devs) == 2
        per_node[node].append(one(d["nvlinkDomain"] for d in devs))

    for i in range(6):
        s.pod(f"pair-{i}", "pair", s.nodes())
        check(f"pair-{i}")
    s.pod("pair-6", "pair", s.nodes())
    s.wait_unschedulable("pair-6")  # 2 free GPUs, on different nodes
    s.release("holder-0")
    s.release("holder-1")
    check("pair-6")
    s.pod("pair-7", "pair", s.nodes())
    check("pair-7")
    assert {n: len(set(d)) for n, d in per_node.items()} == {n: 4 for n in s.nodes()}  # 4 pods, 4 bridges each
    s.pod("pair-8", "pair", s.nodes())
    s.wait_unschedulable("pair-8")


def test_numa_preferred_aligns_while_possible_then_not(crd: ClusterHandle, scenarios: Callable[..., Scenario]) -> None:
    s = scenarios([("h100", "dgx-h100", 1)])
    node = s.nodes()[0]
    # Leave 3 free GPUs on each NUMA node: a filler claim takes one GPU from each.
    s.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": "spread"},
              "spec": {"spec": {"devices": {
                  "requests": [{"name": "gpus", "exactly": {"deviceClassName": "gpu-h100", "count": 2}}],
                  "constraints": [{"requests": ["gpus"], "distinctAttribute": NUMA}]}}}})
    s.pod("filler", "spread", [node])
    _n, filler = s.wait_allocated("filler")
    assert len({d[NUMA] for d in s.devices(filler)}) == 2

    tmpl = render_profile(s, "near", {"alternatives": [{"deviceClassName": "gpu-h100", "count": 2}],
                                      "topology": {"numa": "Preferred"}})
    assert [r["name"] for r in tmpl["spec"]["spec"]["devices"]["requests"][0]["firstAvailable"]] == \
        ["h100-numa", "h100"]

    held = {d["_device"] for d in s.devices(filler)}
    for i in range(2):  # 3 + 3 free: one aligned pair per NUMA node
        s.pod(f"near-{i}", "near", [node])
        _n, results = s.wait_allocated(f"near-{i}")
        assert {r["request"] for r in results} == {"gpus/h100-numa"}
        one(d[NUMA] for d in s.devices(results))
        held |= {d["_device"] for d in s.devices(results)}
    free = [f"gpu-{k}" for k in range(8) if f"gpu-{k}" not in held]
    assert sorted(s.attrs(node, g)[NUMA] for g in free) == [0, 1]  # aligned placement has run out

    s.pod("near-2", "near", [node])
    _n, results = s.wait_allocated("near-2")
    assert {r["request"] for r in results} == {"gpus/h100"}
    assert sorted(d[NUMA] for d in s.devices(results)) == [0, 1]
    s.pod("near-3", "near", [node])
    s.wait_unschedulable("near-3")


def test_rail_aligned_gives_each_gpu_its_rail_nic(crd: ClusterHandle, scenarios: Callable[..., Scenario]) -> None:
    # DGX H100: one NIC per GPU.  H100 NVL: one NIC per bridged pair, so only 2 pairs of 2 GPUs fit.
    s = scenarios([("hgx", "dgx-h100", 1), ("nvl", "h100-nvl", 1)])
    render_profile(s, "railed", {"alternatives": [{"deviceClassName": "gpu-h100", "count": 2}],
                                 "topology": {"nic": "RailAligned"}})
    per_node: dict[str, int] = {n: 0 for n in s.nodes()}
    nics: set[tuple[str, str]] = set()
    for i in range(6):
        s.pod(f"railed-{i}", "railed", s.nodes())
        node, results = s.wait_allocated(f"railed-{i}")
        per_node[node] += 1
        assert sorted(r["request"] for r in results) == ["gpu-0", "gpu-1", "nic-0", "nic-1"]
        for k in range(2):
            (gpu,) = s.devices(results, f"gpu-{k}")
            (nic,) = s.devices(results, f"nic-{k}")
            assert (gpu["type"], nic["type"]) == ("gpu", "nic")
            assert gpu["rail"] == nic["rail"]
            assert gpu["nicName"] == nic["rdmaDevice"]
            assert gpu["_pool"] == nic["_pool"] == node
            nics.add((node, nic["_device"]))
        gpus = s.devices(results, "gpu-0") + s.devices(results, "gpu-1")
        assert len({d["rail"] for d in gpus}) == 2
        one(d["model"] for d in gpus)
    assert per_node == {s.nodes("hgx")[0]: 4, s.nodes("nvl")[0]: 2}
    assert len(nics) == 12
    s.pod("railed-6", "railed", s.nodes())  # 4 NVL GPUs are still free, but no NIC
    s.wait_unschedulable("railed-6")


# --- quota ------------------------------------------------------------------------------------------

def _claim(name: str, requests: list[dict[str, Any]]) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
            "spec": {"devices": {"requests": requests}}}


def _exactly(cls: str, count: int) -> dict[str, Any]:
    return {"name": "gpus", "exactly": {"deviceClassName": cls, "count": count}}


def _first(*alts: tuple[str, str, int]) -> dict[str, Any]:
    return {"name": "gpus", "firstAvailable": [{"name": n, "deviceClassName": c, "count": k} for n, c, k in alts]}


def test_quota_per_device_class_stops_a_namespace(scenarios: Callable[..., Scenario]) -> None:
    s = scenarios([("h100", "dgx-h100", 1)], "quota")
    h100, h200 = QUOTA_KEY.format("gpu-h100"), QUOTA_KEY.format("gpu-h200")
    s.create({"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "gpus"},
              "spec": {"hard": {h100: "4", h200: "8"}}})
    rq = f"/api/v1/namespaces/{s.ns}/resourcequotas/gpus"

    def used(want: dict[str, str]) -> bool:
        st = (s.kube.get(rq) or {}).get("status") or {}
        return all((st.get("used") or {}).get(k) == v for k, v in want.items())

    wait_for(lambda: used({h100: "0", h200: "0"}), 60, "quota status computed")

    s.create(_claim("a", [_exactly("gpu-h100", 2)]))
    s.create(_claim("b", [_exactly("gpu-h100", 2)]))
    with pytest.raises(KubeError) as err:
        s.create(_claim("c", [_exactly("gpu-h100", 1)]))
    assert err.value.status == 403
    assert "exceeded quota: gpus" in err.value.message
    assert f"requested: {h100}=1, used: {h100}=4, limited: {h100}=4" in err.value.message

    # firstAvailable is charged for every class it lists: H200 quota is free, H100 is not.
    with pytest.raises(KubeError) as err:
        s.create(_claim("d", [_first(("h200", "gpu-h200", 2), ("h100", "gpu-h100", 2))]))
    assert err.value.status == 403
    assert f"requested: {h100}=2, used: {h100}=4, limited: {h100}=4" in err.value.message

    s.kube.delete(claim_path(s.ns, "a"))
    wait_for(lambda: used({h100: "2"}), 60, "quota released by the deleted claim")
    s.create(_claim("d", [_first(("h200", "gpu-h200", 2), ("h100", "gpu-h100", 2))]))
    wait_for(lambda: used({h100: "4", h200: "2"}), 60, "firstAvailable charged for both classes")

    # Through a template: the claim controller cannot create the pod's claim, so the pod waits with
    # the apiserver's quota error as an event; no claim exists for the scheduler to allocate.
    s.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": "one"},
              "spec": {"spec": {"devices": {"requests": [_exactly("gpu-h100", 1)]}}}})
    s.pod("over", "one", s.nodes())

    def quota_event() -> str | None:
        for e in s.kube.list(event_path(s.ns)):
            if e["involvedObject"].get("name") == "over" and "exceeded quota" in e.get("message", ""):
                return f"{e['reason']}: {e['message']}"
        return None

    event = wait_for(quota_event, 60, "quota event on the pod")
    assert event.startswith("FailedResourceClaimCreation: "), event
    assert f"requested: {h100}=1, used: {h100}=4, limited: {h100}=4" in event, event
    pod = s.get_pod("over")
    assert not pod["spec"].get("nodeName")
    assert not (pod.get("status") or {}).get("resourceClaimStatuses")
    claims = [c["metadata"]["name"] for c in s.kube.list(claim_path(s.ns))]
    assert sorted(claims) == ["b", "d"]
