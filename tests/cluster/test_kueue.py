"""Issue 13, parts 2-4: real Kueue (hack/localkueue.py) + the real scheduler + simulated nodes.

Kueue v0.17.0 runs against the session's shared cluster for this module only and is removed afterwards
(webhooks, RBAC, CRDs and with them every Kueue object), so other tests never meet it; while it runs it
acts only in namespaces labelled ``topodra.io/kueue=enabled``.

Jobs are rendered from Kueue-mode ClaimProfiles (controller/kueue.py): pods ask for
``gpu.topodra.io/gpu: N``; per-model ResourceFlavors select nodes by ``topodra.io/gpu-model``; Kueue
admits, falls back across flavors, borrows within a cohort and preempts; the scheduler allocates DRA
devices of the admitted flavor's model.  Pods bound to kubelet-less nodes never finish a graceful
delete, so a stand-in for their kubelet (``Reaper``) completes deletions the way a kubelet would.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from test_scheduling_topology import RUN_LABEL, Scenario, one, scenario_maker
from testkit import kueue as localkueue
from testkit.extres import ext_claim
from testkit.handle import ClusterHandle, wait_for
from testkit.paths import REPO
from testkit.ports import free_port

from topodra.apipaths import claim_path, namespace_path, pod_path, profile_path
from topodra.controller import kueue as kq
from topodra.controller.operator import ControllerConfig, SnapshotCache, process
from topodra.controller.profile import ClaimProfile
from topodra.kube import Kube, KubeError

pytestmark = pytest.mark.cluster

Obj = dict[str, Any]
KUEUE = "/apis/kueue.x-k8s.io/v1beta2"
H200, H100 = "H200-SXM5-141GB", "H100-SXM5-80GB"


@pytest.fixture(scope="module")
def kueue(cluster: ClusterHandle) -> Iterator[ClusterHandle]:
    cluster.install_claimprofile_crd()
    localkueue.start(cluster.lc, webhook_port=free_port(), health_port=free_port())
    try:
        for model in (H200, H100):
            cluster.kube.create(f"{KUEUE}/resourceflavors", kq.resource_flavor(model))
        yield cluster
    finally:
        localkueue.stop(cluster.lc)
    # Nothing of Kueue is left for the other tests.
    assert cluster.kube.get("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/workloads.kueue.x-k8s.io") \
        is None
    hooks = cluster.kube.list("/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations")
    assert not [h for h in hooks if h["metadata"]["name"].startswith(localkueue.WEBHOOK_PREFIX)]


class Reaper:
    """What the kubelet of a simulated node would do for a deleted pod: confirm the deletion."""

    def __init__(self, kube: Kube, namespaces: list[str]) -> None:
        self.kube, self.namespaces = kube, namespaces
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(0.3):
            for ns in self.namespaces:
                try:
                    for pod in self.kube.list(pod_path(ns)):
                        if pod["metadata"].get("deletionTimestamp"):
                            self.kube.request("DELETE", pod_path(ns, pod["metadata"]["name"]),
                                              {"apiVersion": "v1", "kind": "DeleteOptions",
                                               "gracePeriodSeconds": 0})
                except KubeError:
                    pass

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)


class Teams:
    """Cluster-scoped Kueue objects of one test (unique names), LocalQueues, a Reaper; all removed at close."""

    def __init__(self, s: Scenario) -> None:
        self.s, self.kube = s, s.kube
        self.tag = uuid.uuid4().hex[:5]
        self.cluster_scoped: list[str] = []
        self.namespaces = [s.ns]
        self.enable(s.ns)
        self.reaper = Reaper(self.kube, self.namespaces)

    def enable(self, ns: str) -> None:
        self.kube.merge_patch(namespace_path(ns), {"metadata": {"labels": {
            localkueue.NAMESPACE_LABEL[0]: localkueue.NAMESPACE_LABEL[1]}}})
        if ns not in self.namespaces:
            self.namespaces.append(ns)

    def create(self, path: str, obj: Obj) -> Obj:
        out = self.kube.create(path, obj)
        self.cluster_scoped.append(f"{path}/{obj['metadata']['name']}")
        return out

    def cluster_queue(self, name: str, quotas: dict[str, int], **kw: Any) -> str:
        full = f"{name}-{self.tag}"
        self.create(f"{KUEUE}/clusterqueues", kq.cluster_queue(full, [H200, H100], quotas, **kw))
        return full

    def local_queue(self, ns: str, name: str, cq: str) -> None:
        self.kube.create(f"{KUEUE}/namespaces/{ns}/localqueues", {
            "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue", "metadata": {"name": name},
            "spec": {"clusterQueue": cq}})

        def active() -> bool:
            lq = self.kube.get(f"{KUEUE}/namespaces/{ns}/localqueues/{name}") or {}
            return any(c.get("type") == "Active" and c.get("status") == "True"
                       for c in (lq.get("status") or {}).get("conditions") or [])

        wait_for(active, 30, f"LocalQueue {ns}/{name} active")

    def priority(self, name: str, value: int) -> str:
        full = f"{name}-{self.tag}"
        self.create(f"{KUEUE}/workloadpriorityclasses", {
            "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "WorkloadPriorityClass",
            "metadata": {"name": full}, "value": value})
        return full

    def job(self, ns: str, name: str, plan: kq.KueuePlan, pods: int = 1, priority: str | None = None) -> Obj:
        """A Job of ``pods`` pods from the plan's pod template, kept on this test's nodes."""
        base: Obj = {"spec": {
            "restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [
                    {"key": RUN_LABEL, "operator": "In", "values": [self.s.run]}]}]}}},
            "containers": [{"name": "main", "image": "localhost/busybox:1.35", "imagePullPolicy": "Never",
                            "command": ["sleep", "3600"]}]}}
        tmpl = plan.pod_template(base)
        labels = dict(tmpl["metadata"]["labels"])
        if priority:
            labels["kueue.x-k8s.io/priority-class"] = priority
        return self.kube.create(f"/apis/batch/v1/namespaces/{ns}/jobs", {
            "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, "labels": labels},
            "spec": {"parallelism": pods, "completions": pods, "backoffLimit": 0, "template": tmpl}})

    def workload(self, ns: str, job: str) -> Obj | None:
        for wl in self.kube.list(f"{KUEUE}/namespaces/{ns}/workloads"):
            refs = wl["metadata"].get("ownerReferences") or []
            if any(r.get("kind") == "Job" and r.get("name") == job for r in refs):
                return wl
        return None

    def condition(self, ns: str, job: str, ctype: str) -> Obj | None:
        wl = self.workload(ns, job) or {}
        return next((c for c in (wl.get("status") or {}).get("conditions") or [] if c.get("type") == ctype), None)

    def wait_admitted(self, ns: str, job: str, timeout: float = 60) -> str:
        """The flavor Kueue admitted the job's single PodSet with."""
        def admitted() -> str | None:
            wl = self.workload(ns, job) or {}
            st = wl.get("status") or {}
            if not any(c.get("type") == "Admitted" and c.get("status") == "True" for c in st.get("conditions") or []):
                return None
            psa = st["admission"]["podSetAssignments"]
            return str(one(f for a in psa for f in a["flavors"].values()))

        flavor: str = wait_for(admitted, timeout, f"job {ns}/{job} admitted")
        return flavor

    def wait_pending(self, ns: str, job: str) -> str:
        """The job is not admitted (and has no pods), with Kueue's reason.

        Waits for two positive signals instead of a settle time: Kueue evaluated the Workload and
        refused it (QuotaReserved False, with its reason), and the Job controller acted on the
        suspension that refusal keeps (the Job's own ``Suspended`` condition True).  Only then is
        "no pods" a fact about a decision, not about a controller that has not run yet."""
        def pending() -> str | None:
            c = self.condition(ns, job, "QuotaReserved")
            if not (c and c.get("status") == "False"):
                return None
            j = self.kube.get(f"/apis/batch/v1/namespaces/{ns}/jobs/{job}") or {}
            suspended = any(c.get("type") == "Suspended" and c.get("status") == "True"
                            for c in (j.get("status") or {}).get("conditions") or [])
            return str(c.get("message")) if suspended and (j.get("spec") or {}).get("suspend") is True else None

        msg: str = wait_for(pending, 60, f"job {ns}/{job} pending in Kueue, suspended by the Job controller")
        assert (self.condition(ns, job, "Admitted") or {}).get("status") != "True"
        assert not self.job_pods(ns, job), "a job Kueue did not admit must have no pods"
        return msg

    def job_pods(self, ns: str, job: str) -> list[Obj]:
        return [p for p in self.kube.list(pod_path(ns), label_selector=f"job-name={job}")
                if not p["metadata"].get("deletionTimestamp")]

    def allocated(self, ns: str, job: str, pods: int = 1, timeout: float = 90) -> list[tuple[str, list[Obj]]]:
        """(node, device attributes) per pod once every pod of the job is bound with devices allocated."""
        def done() -> list[tuple[str, list[Obj]]] | None:
            out = []
            running = self.job_pods(ns, job)
            if len(running) != pods:
                return None
            for p in running:
                claim = ext_claim(self.kube, ns, p["metadata"]["name"])
                if claim is None:
                    return None
                out.append((p["spec"]["nodeName"], self.s.devices(claim["status"]["allocation"]["devices"]["results"])))
            return out

        result: list[tuple[str, list[Obj]]] = wait_for(done, timeout, f"all {pods} pod(s) of {ns}/{job} allocated")
        return result

    def close(self) -> None:
        for ns in self.namespaces:
            for job in self.kube.list(f"/apis/batch/v1/namespaces/{ns}/jobs"):
                self.kube.request("DELETE", f"/apis/batch/v1/namespaces/{ns}/jobs/{job['metadata']['name']}",
                                  {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"})
            self.kube.request("DELETE", pod_path(ns), {"apiVersion": "v1", "kind": "DeleteOptions",
                                                       "gracePeriodSeconds": 0})
            for lq in self.kube.list(f"{KUEUE}/namespaces/{ns}/localqueues"):
                self.kube.delete(f"{KUEUE}/namespaces/{ns}/localqueues/{lq['metadata']['name']}")
        for path in reversed(self.cluster_scoped):
            self.kube.delete(path)
        for ns in self.namespaces[1:]:
            self.kube.delete(namespace_path(ns))
        self.reaper.close()


@pytest.fixture
def teams(kueue: ClusterHandle) -> Iterator[Callable[[list[tuple[str, str, int]]], Teams]]:
    made: list[Teams] = []

    def make(groups: list[tuple[str, str, int]]) -> Teams:
        t = Teams(scenarios(groups, "kq"))
        made.append(t)
        return t

    gen = scenario_maker(kueue)
    scenarios = next(gen)
    yield make
    for t in made:
        t.close()
    next(gen, None)


def kueue_plan(s: Scenario, name: str, spec: Obj) -> kq.KueuePlan:
    """Create a Kueue-mode profile, let the controller's reconcile pass write its status, return the plan."""
    body = s.kube.create(profile_path(s.ns), {"apiVersion": "topodra.io/v1alpha1", "kind": "ClaimProfile",
                                              "metadata": {"name": name}, "spec": spec})
    process(s.kube, body, ControllerConfig(namespaces=(s.ns,)), SnapshotCache(ControllerConfig()))
    status = (s.kube.get(profile_path(s.ns, name)) or {})["status"]
    cond = next(c for c in status["conditions"] if c["type"] == "KueueAdmissible")
    assert cond["status"] == "True", cond
    plan = kq.plan(ClaimProfile.from_api(body), kq.catalog_class_models())
    assert status["queueing"]["flavors"] == list(plan.flavors) and status["queueing"]["count"] == plan.count
    return plan


def test_second_start_is_refused_and_leaves_kueue_running(kueue: ClusterHandle) -> None:
    pid = kueue.lc.running()["kueue"]
    with pytest.raises(localkueue.KueueError, match="already runs"):
        localkueue.start(kueue.lc, webhook_port=free_port(), health_port=free_port())
    assert kueue.lc.running().get("kueue") == pid
    hooks = [h["metadata"]["name"] for h in kueue.kube.list(
        "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations")]
    assert f"{localkueue.WEBHOOK_PREFIX}-validating" in hooks


def test_kueue_leaves_other_tests_jobs_alone(kueue: ClusterHandle) -> None:
    """Other tests' Jobs (no queue label, namespace not opted in) are neither suspended nor queued.

    The positive signal before "no Workload": a Job created after it in an opted-in namespace, with a queue
    label, gets its Workload, so Kueue's Job controller has handled the Job events up to and past ours."""
    ns = kueue.namespace("kq-off")
    opted = kueue.namespace("kq-on")
    try:
        kueue.kube.merge_patch(namespace_path(opted), {"metadata": {"labels": {
            localkueue.NAMESPACE_LABEL[0]: localkueue.NAMESPACE_LABEL[1]}}})
        spec = {"template": {"spec": {
            "restartPolicy": "Never", "nodeSelector": {"topodra.io/no-such-node": "x"},  # stays unbound
            "containers": [{"name": "c", "image": "localhost/busybox:1.35", "command": ["true"]}]}}}
        job = kueue.kube.create(f"/apis/batch/v1/namespaces/{ns}/jobs", {
            "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "j"}, "spec": spec})
        assert not job["spec"].get("suspend"), "Kueue's webhook suspended a Job outside its namespaces"
        wait_for(lambda: list(kueue.kube.list(pod_path(ns), label_selector="job-name=j")), 30, "the Job's pod created")
        later = kueue.kube.create(f"/apis/batch/v1/namespaces/{opted}/jobs", {
            "apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": "queued", "labels": {"kueue.x-k8s.io/queue-name": "no-such-queue"}}, "spec": spec})
        assert later["spec"].get("suspend"), "Kueue's webhook suspends a queued Job in an opted-in namespace"
        wait_for(lambda: list(kueue.kube.list(f"{KUEUE}/namespaces/{opted}/workloads")), 60,
                 "Kueue to make the later, queued Job's Workload")
        assert not list(kueue.kube.list(f"{KUEUE}/namespaces/{ns}/workloads")), "Kueue made a Workload for it"
        got = kueue.kube.get(f"/apis/batch/v1/namespaces/{ns}/jobs/j") or {}
        assert not got["spec"].get("suspend")
    finally:
        kueue.kube.delete(namespace_path(ns))
        kueue.kube.delete(namespace_path(opted))


def test_two_teams_fall_back_h200_to_h100_and_borrow(teams: Callable[..., Teams]) -> None:
    t = teams([("h200", "dgx-h200", 1), ("h100", "dgx-h100", 2)])
    s = t.s
    cohort = f"org-{t.tag}"
    cq_a = t.cluster_queue("team-a", {H200: 8, H100: 8}, cohort=cohort)
    cq_b = t.cluster_queue("team-b", {H100: 8}, cohort=cohort)
    ns_b = s.cluster.namespace("kq-b")
    t.enable(ns_b)
    t.local_queue(s.ns, "team-a", cq_a)
    t.local_queue(ns_b, "team-b", cq_b)
    plan = kueue_plan(s, "train", {"queueing": "Kueue", "localQueue": "team-a",
                                   "alternatives": [{"deviceClassName": "gpu-h200", "count": 8},
                                                    {"deviceClassName": "gpu-h100", "count": 8}]})
    want = [(kq.flavor_name(H200), "h200", H200), (kq.flavor_name(H100), "h100", H100),
            (kq.flavor_name(H100), "h100", H100)]
    nodes = []
    for i, (flavor, role, model) in enumerate(want):
        t.job(s.ns, f"train-{i}", plan)
        assert t.wait_admitted(s.ns, f"train-{i}") == flavor, i
        [(node, devs)] = t.allocated(s.ns, f"train-{i}")
        # The pod runs where the flavor says, on the flavor's model.
        assert node in s.nodes(role) and len(devs) == 8 and one(d["model"] for d in devs) == model, (i, node)
        nodes.append(node)
    assert len(set(nodes)) == 3
    # The third job used team B's idle H100 quota: team A borrows 8.
    # (ClusterQueue status is written after admission, asynchronously: wait for it.)
    def usage() -> dict[str, tuple[str, str]]:
        st = (s.kube.get(f"{KUEUE}/clusterqueues/{cq_a}") or {}).get("status") or {}
        return {f["name"]: (str(f["resources"][0].get("total")), str(f["resources"][0].get("borrowed", "0")))
                for f in st.get("flavorsUsage") or []}

    want_usage = {kq.flavor_name(H200): ("8", "0"), kq.flavor_name(H100): ("16", "8")}
    wait_for(lambda: usage() == want_usage, 30, f"team A's usage {want_usage}")
    # Nothing left anywhere: the next job waits in Kueue, with no pod and no claim.
    t.job(s.ns, "train-3", plan)
    msg = t.wait_pending(s.ns, "train-3")
    assert "insufficient" in msg.lower() or "couldn't assign" in msg.lower(), msg


def test_high_priority_job_preempts_and_gets_the_devices(teams: Callable[..., Teams]) -> None:
    t = teams([("h100", "dgx-h100", 1)])
    s = t.s
    cq = t.cluster_queue("prio", {H100: 8}, preemption={"withinClusterQueue": "LowerPriority"})
    t.local_queue(s.ns, "q", cq)
    low, high = t.priority("low", 100), t.priority("high", 1000)
    plan = kueue_plan(s, "h100x8", {"queueing": "Kueue", "localQueue": "q",
                                    "alternatives": [{"deviceClassName": "gpu-h100", "count": 8}]})
    t.job(s.ns, "low", plan, priority=low)
    t.wait_admitted(s.ns, "low")
    [(node, low_devs)] = t.allocated(s.ns, "low")
    low_claims = {c["metadata"]["name"] for c in s.kube.list(claim_path(s.ns))}
    assert low_claims

    t.job(s.ns, "high", plan, priority=high)
    assert t.wait_admitted(s.ns, "high", timeout=90) == kq.flavor_name(H100)
    evicted = wait_for(lambda: (c := t.condition(s.ns, "low", "Evicted")) and c.get("status") == "True" and c,
                       30, "low job evicted")
    assert evicted["reason"] == "Preempted", evicted
    [(node_h, high_devs)] = t.allocated(s.ns, "high")
    # The low job's claim was released and its 8 GPUs went to the high job.
    assert node_h == node and {d["_device"] for d in high_devs} == {d["_device"] for d in low_devs}
    wait_for(lambda: not ({c["metadata"]["name"] for c in s.kube.list(claim_path(s.ns))} & low_claims), 60,
             "the low job's claim deleted")
    # The low job waits for quota again, without pods.
    t.wait_pending(s.ns, "low")


def test_two_pod_job_is_admitted_all_or_nothing(teams: Callable[..., Teams]) -> None:
    t = teams([("h100", "dgx-h100", 2)])
    s = t.s
    cq = t.cluster_queue("gang", {H100: 12})
    t.local_queue(s.ns, "q", cq)
    big = kueue_plan(s, "eight", {"queueing": "Kueue", "localQueue": "q",
                                  "alternatives": [{"deviceClassName": "gpu-h100", "count": 8}]})
    half = kueue_plan(s, "four", {"queueing": "Kueue", "localQueue": "q",
                                  "alternatives": [{"deviceClassName": "gpu-h100", "count": 4}]})
    t.job(s.ns, "big", big)
    t.wait_admitted(s.ns, "big")
    t.allocated(s.ns, "big")
    # 2 pods x 4 GPUs need 8; 4 are left: not one pod starts.
    t.job(s.ns, "pair", half, pods=2)
    t.wait_pending(s.ns, "pair")
    s.kube.request("DELETE", f"/apis/batch/v1/namespaces/{s.ns}/jobs/big",
                   {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"})
    assert t.wait_admitted(s.ns, "pair", timeout=90) == kq.flavor_name(H100)
    placed = t.allocated(s.ns, "pair", pods=2)
    assert all(len(devs) == 4 and one(d["model"] for d in devs) == H100 for _n, devs in placed)
    assert {n for n, _d in placed} <= set(s.nodes("h100"))


def test_controller_reports_what_kueue_mode_cannot_express(cluster: ClusterHandle) -> None:
    """Through the real API (CRD schema, status subresource): unsupported wishes land in status, not nowhere."""
    cluster.install_claimprofile_crd()
    cluster.apply_yaml(REPO / "deviceclasses")
    ns = cluster.namespace("kq-status")
    cfg = ControllerConfig(namespaces=(ns,))
    try:
        def status_of(name: str, spec: Obj) -> Obj:
            body = cluster.kube.create(profile_path(ns), {"apiVersion": "topodra.io/v1alpha1", "kind": "ClaimProfile",
                                                          "metadata": {"name": name}, "spec": spec})
            process(cluster.kube, body, cfg, SnapshotCache(cfg))
            st: Obj = (cluster.kube.get(profile_path(ns, name)) or {})["status"]
            return st

        st = status_of("rails", {"queueing": "Kueue", "localQueue": "q", "topology": {"nic": "RailAligned"},
                                 "alternatives": [{"deviceClassName": "gpu-h100", "count": 2}]})
        cond = next(c for c in st["conditions"] if c["type"] == "KueueAdmissible")
        assert (cond["status"], cond["reason"]) == ("False", "KueueUnsupported") and "RailAligned" in cond["message"]
        assert "RailAligned" in st["queueing"]["message"]
        # The template is still written: the profile works without Kueue.
        assert next(c for c in st["conditions"] if c["type"] == "Ready")["status"] == "True"

        st = status_of("nvl", {"queueing": "Kueue", "localQueue": "q", "topology": {"nvlink": "Required"},
                               "alternatives": [{"deviceClassName": "gpu-h100", "count": 4}]})
        q = st["queueing"]
        assert q["flavors"] == [kq.flavor_name(H100)] and q["resourceName"] == "gpu.topodra.io/gpu" and q["count"] == 4
        for left_out in ("H100-NVL-94GB", "H100-PCIE-80GB"):
            assert any(left_out in u for u in q["unsupported"]), q
        assert next(c for c in st["conditions"] if c["type"] == "KueueAdmissible")["status"] == "True"

        # Kueue mode without a LocalQueue is refused by the CRD itself.
        with pytest.raises(KubeError) as err:
            cluster.kube.create(profile_path(ns), {"apiVersion": "topodra.io/v1alpha1", "kind": "ClaimProfile",
                                                   "metadata": {"name": "noq"}, "spec": {
                                                       "queueing": "Kueue",
                                                       "alternatives": [{"deviceClassName": "gpu-h100"}]}})
        assert err.value.status == 422 and "localQueue" in str(err.value)
    finally:
        cluster.kube.delete(namespace_path(ns))
