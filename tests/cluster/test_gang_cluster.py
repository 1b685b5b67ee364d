"""Issue 20: a multi-node ClaimProfile, its PodGroup, and the real kube-scheduler's gang and topology plugins.

Each test builds simulated nodes whose fabric labels (``topodra.io/leaf-group``, ``topodra.io/scalable-unit``)
come from the cluster file's per-group ``labels``, runs the real controller process on the test's namespace,
writes one profile (``pods: 4``, 8 GPUs each) and creates the job's pods exactly as docs/multi-node.md says a
user does: each names the profile's ResourceClaimTemplate and its PodGroup.  The pods are also pinned to the
test's nodes (so nodes left by other tests cannot take part).  kube-scheduler (GenericWorkload and
TopologyAwareWorkloadScheduling on) decides; the tests read where the pods were bound and what was allocated.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
from test_scheduling_topology import Scenario
from testkit.controllerproc import controller_process
from testkit.handle import ClusterHandle, wait_for
from testkit.paths import REPO

from topodra.apipaths import profile_path, template_path
from topodra.controller.gang import podgroup_path
from topodra.kube import KubeError

pytestmark = pytest.mark.cluster

Obj = dict[str, Any]
LEAF = "topodra.io/leaf-group"
SU = "topodra.io/scalable-unit"
LOG_DIR = REPO / ".run" / "gang-test-logs"
JOB = "train"


@pytest.fixture(scope="module")
def gang_cluster(workload_cluster: ClusterHandle) -> ClusterHandle:
    workload_cluster.install_claimprofile_crd()
    workload_cluster.apply_yaml(REPO / "deviceclasses")
    return workload_cluster


@contextlib.contextmanager
def controller(sc: Scenario) -> Iterator[None]:
    """The real controller process, watching only the scenario's namespace, refreshing every 2 s."""
    with controller_process(sc.cluster.kubeconfig, sc.ns, "gang", LOG_DIR / f"{sc.ns}.log"):
        yield


def labels(**roles: tuple[str, str]) -> dict[str, dict[str, str]]:
    """role -> (leaf group, scalable unit) as node labels."""
    return {role: {LEAF: leaf, SU: su} for role, (leaf, su) in roles.items()}


def profile(sc: Scenario, name: str, alternatives: list[str], levels: list[str]) -> None:
    sc.kube.create(profile_path(sc.ns), {
        "apiVersion": "topodra.io/v1alpha1", "kind": "ClaimProfile", "metadata": {"name": name},
        "spec": {"alternatives": [{"deviceClassName": c, "count": 8} for c in alternatives],
                 "topology": {"nvlink": "Required"}, "pods": 4, "acrossNodes": {"sameDomain": levels}}})


def gang(sc: Scenario, name: str) -> Obj:
    return dict(((sc.kube.get(profile_path(sc.ns, name)) or {}).get("status") or {}).get("gang") or {})


def wait_gang(sc: Scenario, name: str, what: str, **want: Any) -> Obj:
    """Wait until ``status.gang`` has these values and the template and PodGroup exist."""
    def ok() -> Obj | None:
        g = gang(sc, name)
        if all(g.get(k) == v for k, v in want.items()) and sc.kube.get(template_path(sc.ns, name)) \
                and sc.kube.get(podgroup_path(sc.ns, name)):
            return g
        return None
    try:
        got: Obj = wait_for(ok, 60, what)
    except AssertionError as e:
        raise AssertionError(f"{e}; status.gang: {gang(sc, name)}") from None
    return got


def job_pods(sc: Scenario, name: str, nodes: list[str]) -> list[str]:
    """The job's 4 pods, as a user writes them (template + PodGroup), pinned to the test's nodes."""
    base: Obj = {"apiVersion": "v1", "kind": "Pod", "metadata": {},
                 "spec": {"restartPolicy": "Never", "schedulingGroup": {"podGroupName": name},
                          "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": name}],
                          "containers": [{"name": "main", "image": "localhost/busybox:1.35",
                                          "imagePullPolicy": "Never", "command": ["true"],
                                          "resources": {"claims": [{"name": "gpus"}]}}]}}
    names = [f"{name}-{i}" for i in range(4)]
    for pod in names:
        sc.pod(pod, name, nodes, base=base)
    return names


def indexed_job(sc: Scenario, name: str, nodes: list[str]) -> list[str]:
    """The job as an Indexed Job whose pod template names the PodGroup (docs/multi-node.md); its 4 pods' names.

    A template that sets ``schedulingGroup`` makes the Job controller leave Workload/PodGroup alone and copy the
    field into every pod (``getManagementMode``, pkg/controller/job of v1.37.2).
    """
    sc.kube.create(f"/apis/batch/v1/namespaces/{sc.ns}/jobs", {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name},
        "spec": {"completions": 4, "parallelism": 4, "completionMode": "Indexed", "template": {"spec": {
            "restartPolicy": "Never", "schedulingGroup": {"podGroupName": name},
            "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": name}],
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [
                    {"key": "kubernetes.io/hostname", "operator": "In", "values": sorted(nodes)}]}]}}},
            "containers": [{"name": "main", "image": "localhost/busybox:1.35", "imagePullPolicy": "Never",
                            "command": ["true"], "resources": {"claims": [{"name": "gpus"}]}}]}}}})

    def pods() -> list[str] | None:
        got = [p["metadata"]["name"] for p in sc.kube.list(f"/api/v1/namespaces/{sc.ns}/pods",
                                                           label_selector=f"batch.kubernetes.io/job-name={name}")]
        return sorted(got) if len(got) == 4 else None
    names: list[str] = wait_for(pods, 60, "the Job controller to create 4 pods")
    for pod in names:
        assert sc.get_pod(pod)["spec"]["schedulingGroup"] == {"podGroupName": name}
    return names


def placed(sc: Scenario, pods: list[str]) -> list[tuple[str, list[Obj]]]:
    """Wait until every pod is bound with its claim allocated; (node, devices) per pod."""
    out = []
    for pod in pods:
        node, results = sc.wait_allocated(pod, timeout=90)
        out.append((node, sc.devices(results)))
    return out


def node_label(sc: Scenario, node: str, key: str) -> str:
    return str(((sc.kube.get(f"/api/v1/nodes/{node}") or {}).get("metadata") or {}).get("labels", {}).get(key))


def group_condition(sc: Scenario, name: str) -> Obj | None:
    pg = sc.kube.get(podgroup_path(sc.ns, name)) or {}
    return next((c for c in (pg.get("status") or {}).get("conditions") or []
                 if c.get("type") == "PodGroupInitiallyScheduled"), None)


@contextlib.contextmanager
def bindings(sc: Scenario, since: str) -> Iterator[dict[str, int]]:
    """Pod name -> resourceVersion of the event in which it was first seen bound, for the namespace's pods,
    watched from ``since`` until the block ends (the watch thread then stops within its 5 s timeout)."""
    import threading

    seen: dict[str, int] = {}
    stop = threading.Event()

    def run() -> None:
        rv = since
        while not stop.is_set():
            for event in sc.kube.watch(f"/api/v1/namespaces/{sc.ns}/pods", rv, timeout_seconds=5):
                obj = event.get("object") or {}
                rv = str(obj.get("metadata", {}).get("resourceVersion") or rv)
                name = obj.get("metadata", {}).get("name")
                if event.get("type") != "BOOKMARK" and (obj.get("spec") or {}).get("nodeName") and name not in seen:
                    seen[name] = int(rv)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        yield seen
    finally:
        stop.set()
        t.join(15)
    seen.pop("blocker", None)


def test_four_pods_bind_all_or_none(gang_cluster: ClusterHandle) -> None:
    sc = Scenario(gang_cluster, [("h100", "dgx-h100", 4)], prefix="gang",
                  labels=labels(h100=("l1", "su1")))
    try:
        with controller(sc):
            # An ordinary 8-GPU pod holds the 4th node: only 3 nodes are free for a 4 x 8-GPU job.
            sc.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                       "metadata": {"name": "eight"}, "spec": {"spec": {"devices": {"requests": [
                           {"name": "gpus", "exactly": {"deviceClassName": "gpu.topodra.io", "count": 8}}]}}}})
            blocker_node = sc.nodes("h100")[3]
            sc.pod("blocker", "eight", [blocker_node])
            sc.wait_allocated("blocker")
            profile(sc, JOB, ["gpu-h100"], ["leafGroup"])
            g = wait_gang(sc, JOB, "the controller to see that 3 free nodes cannot hold the job",
                          fitsNow=False, alternative="h100", level="leafGroup")
            assert "at most 3 of 4" in g["message"], g
            pods = job_pods(sc, JOB, sc.nodes("h100"))
            # The scheduler's verdict on the whole group (a positive signal that it evaluated the gang):
            _items, verdict_rv = sc.kube.list_snapshot(f"/api/v1/namespaces/{sc.ns}/pods")
            cond = wait_for(lambda: (c := group_condition(sc, JOB)) and c.get("status") == "False" and c,
                            90, "kube-scheduler to mark the PodGroup Unschedulable")
            assert cond["reason"] == "Unschedulable", cond
            # The verdict came after all 4 pods were tried together: none of them is bound or holds a device.
            for pod in pods:
                assert not sc.get_pod(pod)["spec"].get("nodeName"), pod
                claim = sc.claim_of(pod)
                assert claim is not None, f"{pod}: the claim controller made no claim (nothing to be unallocated)"
                assert not (claim.get("status") or {}).get("allocation"), (pod, claim)
            # And they stay unbound until the blocker goes: every binding the watch sees from before the verdict
            # on comes after the release (resourceVersions of one etcd are ordered).
            with bindings(sc, since=verdict_rv) as bound:
                _items, release_rv = sc.kube.list_snapshot(f"/api/v1/namespaces/{sc.ns}/pods")
                sc.release("blocker")
                got = placed(sc, pods)
            assert sorted(bound) == sorted(pods), bound
            early = {pod: rv for pod, rv in bound.items() if rv <= int(release_rv)}
            assert not early, f"gang pods bound before the blocker was released: {early} (release at {release_rv})"
            assert sorted(n for n, _d in got) == sorted(sc.nodes("h100"))
            for _node, devs in got:
                assert len(devs) == 8 and len({d["nvlinkDomain"] for d in devs}) == 1
            g = wait_gang(sc, JOB, "status to show the bound domain", podsBound=4)
            assert (g["domain"], g["topologyKey"], g["fixed"]) == ("l1", LEAF, True), g
            assert (group_condition(sc, JOB) or {}).get("status") == "True"
    finally:
        sc.close()


def test_one_leaf_group_when_one_fits_else_one_scalable_unit(gang_cluster: ClusterHandle) -> None:
    # su1: leaf a1 (4 nodes), a2 (2); su2: leaves b1 (2), b2 (2).
    sc = Scenario(gang_cluster, [("a1", "dgx-h100", 4), ("a2", "dgx-h100", 2), ("b1", "dgx-h100", 2),
                                 ("b2", "dgx-h100", 2)], prefix="gang",
                  labels=labels(a1=("a1", "su1"), a2=("a2", "su1"), b1=("b1", "su2"), b2=("b2", "su2")))
    try:
        with controller(sc):
            profile(sc, "first", ["gpu-h100"], ["leafGroup", "scalableUnit"])
            wait_gang(sc, "first", "a leaf group for the first job", fitsNow=True, level="leafGroup")
            first = placed(sc, job_pods(sc, "first", sc.nodes()))
            assert {node_label(sc, n, LEAF) for n, _d in first} == {"a1"}, first
            # Now no leaf group has 4 free nodes; su1 has 2 left (a2), su2 has 4 (b1 + b2).
            profile(sc, "second", ["gpu-h100"], ["leafGroup", "scalableUnit"])
            g = wait_gang(sc, "second", "the scalable-unit level for the second job", fitsNow=True,
                          level="scalableUnit")
            assert "h100 in one leafGroup: at most 2 of 4" in g["message"], g
            second = placed(sc, job_pods(sc, "second", sc.nodes()))
            assert {node_label(sc, n, SU) for n, _d in second} == {"su2"}, second
            assert {node_label(sc, n, LEAF) for n, _d in second} == {"b1", "b2"}
            g = wait_gang(sc, "second", "status to show the bound domain", podsBound=4)
            assert (g["domain"], g["topologyKey"]) == ("su2", SU), g
    finally:
        sc.close()


def test_h200_else_h100_for_the_whole_gang(gang_cluster: ClusterHandle) -> None:
    # 3 H200 nodes cannot hold 4 pods; firstAvailable alone would give 3 pods H200 and 1 pod H100.
    sc = Scenario(gang_cluster, [("h200", "dgx-h200", 3), ("h100", "dgx-h100", 4)], prefix="gang",
                  labels=labels(h200=("l1", "su1"), h100=("l2", "su1")))
    try:
        with controller(sc):
            profile(sc, JOB, ["gpu-h200", "gpu-h100"], ["leafGroup", "scalableUnit"])
            g = wait_gang(sc, JOB, "the controller to fall back to H100 for the whole job", fitsNow=True,
                          alternative="h100", level="leafGroup")
            assert g["deviceClassName"] == "gpu-h100"
            tmpl = sc.kube.get(template_path(sc.ns, JOB)) or {}
            (req,) = tmpl["spec"]["spec"]["devices"]["requests"]
            assert req["exactly"]["deviceClassName"] == "gpu-h100", req
            got = placed(sc, indexed_job(sc, JOB, sc.nodes()))
            assert sorted(n for n, _d in got) == sorted(sc.nodes("h100"))
            models = {str(d["model"]) for _n, devs in got for d in devs}
            assert all("H100" in m for m in models), models
    finally:
        sc.close()


@pytest.mark.parametrize(("spec", "needle"), [
    ({"acrossNodes": {"sameDomain": ["leafGroup"]}}, "acrossNodes needs pods"),
    ({"pods": 1}, "should be greater than or equal to 2"),
    ({"pods": 4, "queueing": "Kueue", "localQueue": "q"}, "cannot be combined with queueing Kueue"),
    ({"pods": 4, "acrossNodes": {"sameDomain": []}}, "should have at least 1 items"),
])
def test_crd_refuses_bad_gang_specs(gang_cluster: ClusterHandle, spec: Obj, needle: str) -> None:
    ns = gang_cluster.namespace("gangbad")
    with pytest.raises(KubeError) as err:
        gang_cluster.kube.create(profile_path(ns), {
            "apiVersion": "topodra.io/v1alpha1", "kind": "ClaimProfile", "metadata": {"name": "bad"},
            "spec": {"alternatives": [{"deviceClassName": "gpu-h100", "count": 8}], **spec}})
    assert err.value.status == 422
    assert needle in err.value.message, err.value.message


def test_choice_moves_while_no_pod_exists(gang_cluster: ClusterHandle) -> None:
    """Before the job's pods exist, the controller re-evaluates: a freed H200 node moves the whole job to H200.

    The PodGroup's topology is immutable and the template too, so both are replaced; on the real apiserver the old
    PodGroup carries the PodGroup protection finalizer until kube-controller-manager sees no pod names it.
    """
    sc = Scenario(gang_cluster, [("h200", "dgx-h200", 4), ("h100", "dgx-h100", 4)], prefix="gang",
                  labels=labels(h200=("l1", "su1"), h100=("l2", "su1")))
    try:
        with controller(sc):
            sc.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                       "metadata": {"name": "eight"}, "spec": {"spec": {"devices": {"requests": [
                           {"name": "gpus", "exactly": {"deviceClassName": "gpu.topodra.io", "count": 8}}]}}}})
            sc.pod("blocker", "eight", [sc.nodes("h200")[0]])
            sc.wait_allocated("blocker")
            profile(sc, JOB, ["gpu-h200", "gpu-h100"], ["leafGroup"])
            wait_gang(sc, JOB, "H100 while one H200 node is taken", fitsNow=True, alternative="h100")
            old = sc.kube.get(podgroup_path(sc.ns, JOB)) or {}
            sc.release("blocker")
            wait_gang(sc, JOB, "the whole job to move to H200", fitsNow=True, alternative="h200")

            def replaced() -> Obj | None:
                pg = sc.kube.get(podgroup_path(sc.ns, JOB)) or {}
                meta = pg.get("metadata") or {}
                ok = (meta.get("annotations") or {}).get("topodra.io/gang-alternative") == "h200"
                return pg if ok and not meta.get("deletionTimestamp") else None
            new: Obj = wait_for(replaced, 60, "the PodGroup rendered for H200")
            assert new["metadata"]["uid"] != old["metadata"]["uid"]
            assert new["metadata"]["annotations"]["topodra.io/gang-alternative"] == "h200"
            tmpl = sc.kube.get(template_path(sc.ns, JOB)) or {}
            assert tmpl["spec"]["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] == "gpu-h200"
            got = placed(sc, job_pods(sc, JOB, sc.nodes()))
            assert sorted(n for n, _d in got) == sorted(sc.nodes("h200"))
            g = wait_gang(sc, JOB, "status to show the choice fixed and the pods bound", fixed=True, podsBound=4)
            assert (g["alternative"], g["domain"]) == ("h200", "l1"), g
    finally:
        sc.close()
