"""Issue 3: the shipped topology examples, scheduled by the real kube-scheduler on simulated nodes.

Every test builds its own kubelet-less nodes (``topodra.simulate``: the real discovery code on mock
profiles, slices published through the apiserver), applies the ResourceClaimTemplate of one file in
``deploy/examples/`` unchanged, and creates pods from that file's pod, pinned by node affinity to the
test's nodes (so nodes left by other tests cannot take part).  The scheduler's DRA allocator decides;
the tests check each allocated device's attributes in the ResourceSlices, and that a claim no node
can satisfy leaves its pod Pending with the scheduler saying so.

The helpers here are shared with ``test_scheduling_fallback.py``.
"""

from __future__ import annotations

import copy
import functools
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml
from testkit.handle import ClusterHandle, wait_for
from testkit.paths import REPO

from topodra.apipaths import claim_path, event_path, namespace_path, node_path, pod_path, slices_path, template_path
from topodra.kube import KubeError
from topodra.simulate import SimulatedCluster, Simulation, fake_node

pytestmark = pytest.mark.cluster

DRIVER = "gpu.topodra.io"
EXAMPLES = REPO / "deploy" / "examples"
RUN_LABEL = "topodra.io/test-run"
NUMA = "resource.kubernetes.io/numaNode"
UNSCHEDULABLE_NEEDLE = "cannot allocate all claims"
CONFIRM_PROBES = 3  # refusals in a row after the first, before a taint counts as seen by the scheduler

Obj = dict[str, Any]


# --- shared helpers -------------------------------------------------------------------------------

class Scenario:
    """Simulated nodes plus a namespace for one test; ``close()`` removes pods, nodes and slices."""

    def __init__(self, cluster: ClusterHandle, groups: list[tuple[str, str, int]], prefix: str = "sched",
                 cpu_driver: str | None = None, labels: dict[str, dict[str, str]] | None = None) -> None:
        """``groups``: (role, mock profile, count); node names are ``s<run>-<role>-<i>``; ``labels``: per role.

        ``cpu_driver``: the cluster file's ``cpuDriver`` (dra-driver-cpu's slices too, test_numa_cpu_cluster.py).
        """
        self.cluster = cluster
        self.kube = cluster.kube
        self.run = uuid.uuid4().hex[:5]
        spec = SimulatedCluster.model_validate({"cpuDriver": cpu_driver, "groups": [
            {"namePrefix": f"s{self.run}-{role}-", "count": count, "profile": profile,
             "labels": {**(labels or {}).get(role, {}), RUN_LABEL: self.run}} for role, profile, count in groups]})
        self.sim = Simulation(self.kube, spec)
        self.roles = {role: [f"s{self.run}-{role}-{i}" for i in range(count)] for role, _p, count in groups}
        self.ns = ""
        self._retry_nodes: list[str] = []  # see _wait_retried
        try:
            self.sim.setup()
            written = self.sim.reconcile_all()
            pools = sum(c for _r, _p, c in groups) * (2 if cpu_driver else 1)  # a CPU pool per node
            assert written == pools, f"only {written} pools published"
            self.ns = cluster.namespace(prefix)
            self._attrs: dict[tuple[str, str], Obj] = {}
            self.wait_scheduler_sees_all_gpus()
        except BaseException:
            self.close()
            raise

    def wait_scheduler_sees_all_gpus(self, timeout: float = 60) -> None:
        """Block until the scheduler's own view holds every GPU this scenario published.

        The slices are written through the apiserver, but the scheduler learns of them from its
        informers, which may lag behind the first test pod under load; a pod scheduled in that gap
        sees a partial cluster (CI once put a firstAvailable pod on its 2nd choice because the
        1st-choice node's slice had not reached the scheduler yet).  So ask the scheduler itself: per
        node, an admin-access claim (never blocks other claims) for *all* its GPUs, pinned there.  Its
        allocation lists exactly the GPUs the scheduler sees; it must equal what the API holds.
        """
        self.kube.request("PATCH", namespace_path(self.ns),
                          {"metadata": {"labels": {"resource.kubernetes.io/admin-access": "true"}}},
                          content_type="application/merge-patch+json")
        want: dict[str, int] = {}
        for node in self.nodes():
            want[node] = sum(1 for sl in self.kube.list(slices_path(),
                                                        field_selector=f"spec.driver={DRIVER},spec.nodeName={node}")
                             for d in sl["spec"].get("devices") or []
                             if next(iter((d.get("attributes") or {}).get("type", {}).values()), None) == "gpu")
        probes = {node: f"probe-{i}" for i, node in enumerate(sorted(n for n, c in want.items() if c))}
        for node, name in probes.items():
            self.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
                         "spec": {"devices": {"requests": [{"name": "all", "exactly": {
                             "deviceClassName": "gpu.topodra.io", "allocationMode": "All", "adminAccess": True,
                             "tolerations": [{"operator": "Exists"}]}}]}}})
            self.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": {
                "restartPolicy": "Never",
                "resourceClaims": [{"name": "all", "resourceClaimName": name}],
                "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{"matchExpressions": [
                        {"key": "kubernetes.io/hostname", "operator": "In", "values": [node]}]}]}}},
                "containers": [{"name": "main", "image": "localhost/busybox:1.35", "imagePullPolicy": "Never",
                                "command": ["true"], "resources": {"claims": [{"name": "all"}]}}]}})

        def seen(node: str, name: str) -> bool:
            claim = self.kube.get(claim_path(self.ns, name)) or {}
            results = ((claim.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results")
            # Fewer GPUs than published: a partial pool; the allocator retries when the rest arrives.
            assert results is None or len(results) <= want[node], (node, len(results), want[node])
            return results is not None and len(results) == want[node]

        for node, name in probes.items():
            wait_for(functools.partial(seen, node, name), timeout, f"scheduler sees all {want[node]} GPUs of {node}")
        self.kube.request("DELETE", pod_path(self.ns),
                          {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0})
        for name in probes.values():
            self.kube.delete(claim_path(self.ns, name))
        for name in probes.values():
            wait_for(functools.partial(self._gone, claim_path(self.ns, name)), timeout, f"probe claim {name} gone")

    def wait_scheduler_sees_taints(self, node: str, usable: int, timeout: float = 60) -> None:
        """Block until the scheduler's own view of ``node`` leaves only ``usable`` GPUs (taints seen).

        Taints written to a slice or a DeviceTaintRule reach the scheduler through informers, like the
        slices themselves. A probe pod asks for ``usable + 1`` GPUs there: Unschedulable means the
        scheduler sees the taints; allocated means it does not yet, so the probe is removed and asked again.
        """
        name = f"taint-probe-{usable + 1}"
        if self.kube.get(template_path(self.ns, name)) is None:
            self.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                         "metadata": {"name": name}, "spec": {"spec": {"devices": {"requests": [
                             {"name": "gpus", "exactly": {"deviceClassName": DRIVER, "count": usable + 1}}]}}}})
        deadline = time.monotonic() + timeout
        for attempt in range(1000):
            pod_name = f"{name}-{node[-8:]}-{attempt}"
            self.pod(pod_name, name, [node])

            def outcome(pod_name: str = pod_name) -> str | None:
                if any(c.get("type") == "PodScheduled" and c.get("reason") == "Unschedulable"
                       for c in self.conditions(pod_name)):
                    return "unschedulable"
                return "allocated" if self.get_pod(pod_name)["spec"].get("nodeName") else None

            seen = wait_for(outcome, max(1.0, deadline - time.monotonic()), f"probe {pod_name} decided")
            if self.claim_of(pod_name) is not None:
                self.release(pod_name)
            else:
                self.kube.request("DELETE", pod_path(self.ns, pod_name),
                                  {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0})
            if seen == "unschedulable":
                break
            assert time.monotonic() < deadline, f"the scheduler still allocates {usable + 1} GPUs on {node}"
        # Allocations before the first refusal were the scheduler's informer lagging; from the first refusal on
        # its view has the taints, so a scheduler that honours them only some of the time fails here.
        for k in range(CONFIRM_PROBES):
            pod_name = f"{name}-{node[-8:]}-confirm-{k}"
            self.pod(pod_name, name, [node])
            seen = wait_for(lambda n=pod_name: outcome(n), 60, f"probe {pod_name} decided")  # type: ignore[misc]
            if self.claim_of(pod_name) is not None:
                self.release(pod_name)
            else:
                self.kube.request("DELETE", pod_path(self.ns, pod_name),
                                  {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0})
            assert seen == "unschedulable", f"after refusing once, the scheduler allocated {usable + 1} GPUs on {node}"

    def _gone(self, path: str) -> bool:
        return self.kube.get(path) is None

    def nodes(self, *roles: str) -> list[str]:
        """Node names of these roles (all nodes when none are given)."""
        return [n for r in (roles or tuple(self.roles)) for n in self.roles[r]]

    def close(self) -> None:
        try:
            if self.ns:
                # Pods bound to kubelet-less nodes never finish a graceful delete: force them.
                self.kube.request("DELETE", pod_path(self.ns),
                                  {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0})
                self.kube.delete(namespace_path(self.ns))
        finally:
            try:
                for name in self._retry_nodes:
                    self.kube.delete(node_path(name))
            finally:
                self.sim.delete()

    # -- objects

    def create(self, obj: Obj) -> Obj:
        """Create a namespaced object in the test namespace (path derived from apiVersion/kind)."""
        obj = copy.deepcopy(obj)
        obj.setdefault("metadata", {})["namespace"] = self.ns
        plural = {"Pod": "pods", "ResourceClaimTemplate": "resourceclaimtemplates",
                  "ResourceClaim": "resourceclaims", "ResourceQuota": "resourcequotas"}[obj["kind"]]
        base = "/api/v1" if obj["apiVersion"] == "v1" else f"/apis/{obj['apiVersion']}"
        return self.kube.create(f"{base}/namespaces/{self.ns}/{plural}", obj)

    def pod(self, name: str, template: str, nodes: list[str], base: Obj | None = None) -> Obj:
        """A pod using ``template`` as claim ``gpus``, allowed only on ``nodes``; based on an example's pod."""
        pod: Obj = copy.deepcopy(base) if base is not None else {
            "apiVersion": "v1", "kind": "Pod", "metadata": {},
            "spec": {"restartPolicy": "Never",
                     "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": template}],
                     "containers": [{"name": "main", "image": "localhost/busybox:1.35",
                                     "imagePullPolicy": "Never", "command": ["true"],
                                     "resources": {"claims": [{"name": "gpus"}]}}]}}
        pod["metadata"] = {"name": name}
        assert [c["resourceClaimTemplateName"] for c in pod["spec"]["resourceClaims"]] == [template]
        pod["spec"]["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [
                {"key": "kubernetes.io/hostname", "operator": "In", "values": sorted(nodes)}]}]}}}
        return self.create(pod)

    def get_pod(self, name: str) -> Obj:
        pod = self.kube.get(pod_path(self.ns, name))
        assert pod is not None, f"pod {name} vanished"
        return pod

    def claim_of(self, pod_name: str) -> Obj | None:
        """The pod's generated ResourceClaim (claim ``gpus``), once the claim controller made it."""
        statuses = (self.get_pod(pod_name).get("status") or {}).get("resourceClaimStatuses") or []
        name = next((s.get("resourceClaimName") for s in statuses if s.get("name") == "gpus"), None)
        if not name:
            return None
        return self.kube.get(claim_path(self.ns, name))

    def wait_allocated(self, pod_name: str, timeout: float = 60) -> tuple[str, list[Obj]]:
        """Wait until the scheduler allocated the pod's claim and bound it; (node, allocation results)."""
        def done() -> tuple[str, list[Obj]] | None:
            claim = self.claim_of(pod_name)
            alloc = ((claim or {}).get("status") or {}).get("allocation")
            node = self.get_pod(pod_name)["spec"].get("nodeName")
            if alloc and node:
                return node, list(alloc["devices"]["results"])
            return None

        try:
            return wait_for(done, timeout, f"claim of pod {pod_name} allocated and the pod bound")  # type: ignore[no-any-return]
        except AssertionError as e:
            raise AssertionError(f"{e}; pod conditions: {self.conditions(pod_name)}") from None

    def hold_first_gpu(self, node: str, name: str) -> str:
        """Fragment a node: a 1-GPU claim takes its first free GPU (first fit); returns that device."""
        if self.kube.get(template_path(self.ns, "one-gpu")) is None:
            self.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                         "metadata": {"name": "one-gpu"}, "spec": {"spec": {"devices": {"requests": [
                             {"name": "gpus", "exactly": {"deviceClassName": "gpu.topodra.io", "count": 1}}]}}}})
        self.pod(name, "one-gpu", [node])
        _node, results = self.wait_allocated(name)
        return str(results[0]["device"])

    def release(self, pod_name: str) -> None:
        """Force-delete a pod and wait until its generated claim, and so its devices, are gone."""
        claim = self.claim_of(pod_name)
        assert claim is not None
        self.kube.request("DELETE", pod_path(self.ns, pod_name),
                          {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0})
        path = claim_path(self.ns, claim["metadata"]["name"])
        wait_for(lambda: self.kube.get(path) is None, 60, f"claim of {pod_name} deleted")

    def conditions(self, pod_name: str) -> list[Obj]:
        return list((self.get_pod(pod_name).get("status") or {}).get("conditions") or [])

    def wait_unschedulable(self, pod_name: str, timeout: float = 60) -> str:
        """Wait for the scheduler to give up on the pod because of its claim; returns its message.

        Checks the PodScheduled condition and the FailedScheduling event, then makes the scheduler try
        the pod once more and checks that, after that attempt, it is still unbound and its claim still
        unallocated (a fixed wait would pass even if the scheduler never looked again).
        """
        def unschedulable() -> str | None:
            for c in self.conditions(pod_name):
                if c.get("type") == "PodScheduled" and c.get("status") == "False" \
                        and c.get("reason") == "Unschedulable":
                    return str(c.get("message", ""))
            return None

        message: str = wait_for(unschedulable, timeout, f"pod {pod_name} Unschedulable")
        assert UNSCHEDULABLE_NEEDLE in message, message
        # The scheduler's event recorder writes the event from its own goroutine, after (or before) the
        # condition: wait for it rather than read the events once.
        events: list[Obj] = []

        def failed_scheduling_event() -> bool:
            events[:] = [e for e in self.kube.list(event_path(self.ns))
                         if e["involvedObject"].get("name") == pod_name and e.get("reason") == "FailedScheduling"]
            return any(UNSCHEDULABLE_NEEDLE in e.get("message", "") for e in events)

        try:
            wait_for(failed_scheduling_event, 30, f"FailedScheduling event of {pod_name}")
        except AssertionError as e:
            raise AssertionError(f"{e}; events: {events}") from None
        message = self._wait_retried(pod_name)
        assert not self.get_pod(pod_name)["spec"].get("nodeName")
        assert UNSCHEDULABLE_NEEDLE in message, message
        claim = self.claim_of(pod_name)
        assert claim is not None, "the claim controller did not create the pod's claim"
        assert not (claim.get("status") or {}).get("allocation")
        return message

    def _wait_retried(self, pod_name: str, timeout: float = 60) -> str:
        """Make the scheduler try ``pod_name`` (found Unschedulable) once more; its new condition message.

        A new Node is a cluster event for which DynamicResources re-queues every pod it rejected (no
        queueing hint). This one is cordoned, outside every test's node set and has no devices, so the
        retry can only fail again, with one more node in its "0/N nodes are available" count: a new
        condition message. The node stays until ``close()``: deleting it now could be one more event,
        and the message read by the caller would not be the pod's last.
        """
        def scheduled_messages() -> list[str]:
            return [str(c.get("message", "")) for c in self.conditions(pod_name) if c.get("type") == "PodScheduled"]

        before = scheduled_messages()
        marker = f"retry-{self.run}-{uuid.uuid4().hex[:4]}"
        node = fake_node(marker)
        node["spec"]["unschedulable"] = True
        self.kube.create(node_path(), node)
        self._retry_nodes.append(marker)

        def retried() -> bool:
            if self.get_pod(pod_name)["spec"].get("nodeName"):
                return True  # bound after all: the caller's assertion says so
            return scheduled_messages() != before
        wait_for(retried, timeout, f"the scheduler to try {pod_name} again")
        return next(iter(scheduled_messages()), "")

    # -- devices

    def attrs(self, pool: str, device: str) -> Obj:
        """A published device's attributes (``{name: value}``; our own domain unqualified) plus ``memory``."""
        if (pool, device) not in self._attrs:
            for sl in self.kube.list(slices_path(), field_selector=f"spec.driver={DRIVER},spec.nodeName={pool}"):
                for d in sl["spec"].get("devices") or []:
                    flat: Obj = {k: next(iter(v.values())) for k, v in (d.get("attributes") or {}).items()}
                    self._attrs[(pool, d["name"])] = flat
        return self._attrs[(pool, device)]

    def devices(self, results: list[Obj], request: str | None = None) -> list[Obj]:
        """Attributes of the allocated devices (of one request, when given), each with ``_pool``/``_device``."""
        out = []
        for r in results:
            assert r["driver"] == DRIVER, r
            if request is None or r["request"] == request:
                out.append({**self.attrs(r["pool"], r["device"]), "_pool": r["pool"], "_device": r["device"]})
        return out


def example(name: str) -> tuple[Obj, Obj]:
    """(ResourceClaimTemplate, Pod) of ``deploy/examples/<name>.yaml``, as shipped."""
    docs = [d for d in yaml.safe_load_all((EXAMPLES / f"{name}.yaml").read_text()) if d]
    kinds = {d["kind"]: d for d in docs}
    assert set(kinds) == {"ResourceClaimTemplate", "Pod"}, list(kinds)
    return kinds["ResourceClaimTemplate"], kinds["Pod"]


def one(values: Any) -> Any:
    """The single distinct value of ``values``; fails when there are several."""
    distinct = set(values)
    assert len(distinct) == 1, f"expected one value, got {sorted(map(str, distinct))}"
    return distinct.pop()


def scenario_maker(cluster: ClusterHandle) -> Iterator[Callable[..., Scenario]]:
    """Body of the ``scenarios`` fixture: ``make(groups, prefix)`` -> Scenario, all closed at teardown."""
    cluster.apply_yaml(REPO / "deviceclasses")
    made: list[Scenario] = []

    def make(groups: list[tuple[str, str, int]], prefix: str = "sched", cpu_driver: str | None = None) -> Scenario:
        s = Scenario(cluster, groups, prefix, cpu_driver)
        made.append(s)
        return s

    yield make
    errors = []
    for s in made:
        try:
            s.close()
        except KubeError as e:
            errors.append(e)
    assert not errors, errors


@pytest.fixture
def scenarios(cluster: ClusterHandle) -> Iterator[Callable[..., Scenario]]:
    yield from scenario_maker(cluster)


def apply_example(s: Scenario, name: str) -> tuple[str, Obj]:
    """Create the example's template unchanged; returns (template name, example pod)."""
    tmpl, pod = example(name)
    stored = s.create(tmpl)
    assert stored["spec"]["spec"]["devices"].get("constraints") == tmpl["spec"]["spec"]["devices"].get("constraints")
    return tmpl["metadata"]["name"], pod


# --- the examples ----------------------------------------------------------------------------------
# Each shipped example has one proof, registered by its file name; ``test_example`` is parametrized over
# the files in deploy/examples, so an example without a proof fails instead of going unnoticed.

Proof = Callable[[Callable[..., Scenario], str], None]
PROOFS: dict[str, Proof] = {}


def proves(name: str) -> Callable[[Proof], Proof]:
    """Register the decorated function as the scheduling proof of ``deploy/examples/<name>.yaml``."""
    def register(fn: Proof) -> Proof:
        assert name not in PROOFS, f"{name} has two proofs"
        PROOFS[name] = fn
        return fn
    return register


def shipped_examples() -> list[str]:
    return sorted(p.stem for p in EXAMPLES.glob("gpu-*.yaml"))


@pytest.mark.parametrize("name", shipped_examples())
def test_example(scenarios: Callable[..., Scenario], name: str) -> None:
    """Apply the shipped example unchanged and prove what its comment promises, with the real scheduler."""
    proof = PROOFS.get(name)
    assert proof is not None, f"deploy/examples/{name}.yaml has no scheduling proof; register one with @proves"
    proof(scenarios, name)


def test_every_proof_has_its_example() -> None:
    assert sorted(PROOFS) == shipped_examples()


@proves("gpu-8-nvlink")
def proof_8_gpus_on_one_nvlink_domain(scenarios: Callable[..., Scenario], example_name: str) -> None:
    s = scenarios([("hgx", "dgx-h100", 1), ("nvl", "h100-nvl", 1), ("l40s", "l40s", 1)])
    name, base = apply_example(s, example_name)

    s.pod("fits", name, s.nodes(), base)
    node, results = s.wait_allocated("fits")
    assert node == s.nodes("hgx")[0]
    devs = s.devices(results)
    assert len(devs) == 8 and len({d["_device"] for d in devs}) == 8
    assert {d["_pool"] for d in devs} == {node}
    one(d["nvlinkDomain"] for d in devs)
    assert one(d["nvlinkDomainSize"] for d in devs) == 8

    # H100 NVL (four bridged pairs) and L40S (no NVLink) have 16 free GPUs between them, none of them
    # 8 on one NVLink domain.
    s.pod("no-domain", name, s.nodes("nvl", "l40s"), base)
    s.wait_unschedulable("no-domain")


@proves("gpu-2-nvl-bridge")
def proof_2_gpus_on_the_same_nvl_bridge(scenarios: Callable[..., Scenario], example_name: str) -> None:
    s = scenarios([("nvl", "h100-nvl", 1), ("hgx", "dgx-h100", 1), ("l40s", "l40s", 1)])
    name, base = apply_example(s, example_name)
    nvl = s.nodes("nvl")[0]
    # Take the first GPU of the first pair: first fit without the constraint would now pair gpu-1 with gpu-2.
    assert s.hold_first_gpu(nvl, "holder") == "gpu-0"

    domains = []

    def check(pod: str) -> None:
        node, results = s.wait_allocated(pod)
        assert node == nvl
        devs = s.devices(results)
        assert len(devs) == 2
        assert one(d["model"] for d in devs) == "H100-NVL-94GB"
        assert one(d["nvlinkDomainSize"] for d in devs) == 2
        domains.append(one(d["nvlinkDomain"] for d in devs))

    for i in range(3):
        s.pod(f"pair-{i}", name, s.nodes(), base)
        check(f"pair-{i}")
    # One free NVL GPU without its partner; 8 free H100 SXM GPUs (class gpu-h100, but not NVL) and 8 L40S.
    s.pod("pair-3", name, s.nodes(), base)
    s.wait_unschedulable("pair-3")
    s.release("holder")  # the scheduler retries the waiting pod when the claim goes
    check("pair-3")
    assert len(set(domains)) == 4  # every bridged pair used once

    s.pod("pair-4", name, s.nodes(), base)
    s.wait_unschedulable("pair-4")


@proves("gpu-4-numa")
def proof_4_gpus_on_one_numa_node(scenarios: Callable[..., Scenario], example_name: str) -> None:
    s = scenarios([("h100", "dgx-h100", 1), ("a100", "dgx-a100-80gb", 1)])
    name, base = apply_example(s, example_name)

    numa = []
    for i in range(2):
        s.pod(f"numa-{i}", name, s.nodes(), base)
        node, results = s.wait_allocated(f"numa-{i}")
        assert node == s.nodes("h100")[0]  # DGX H100: 4 GPUs per NUMA node
        devs = s.devices(results)
        assert len(devs) == 4
        numa.append(one(d[NUMA] for d in devs))
        assert one(d["numaNode"] for d in devs) == numa[-1]
    assert sorted(numa) == [0, 1]

    # The DGX A100 has 8 free GPUs, but only 2 per NUMA node.
    a100 = s.nodes("a100")[0]
    per_numa = Counter(s.attrs(a100, f"gpu-{i}")[NUMA] for i in range(8))
    assert max(per_numa.values()) == 2
    s.pod("numa-2", name, s.nodes(), base)
    s.wait_unschedulable("numa-2")


@proves("gpu-1-rail-nic")
def proof_1_gpu_with_the_nic_of_its_rail(scenarios: Callable[..., Scenario], example_name: str) -> None:
    # H100 NVL: 8 GPUs but one NIC per bridged pair (2 GPUs per rail); L4: GPUs without NICs or rails.
    s = scenarios([("nvl", "h100-nvl", 1), ("l4", "l4", 1)])
    name, base = apply_example(s, example_name)

    nics = []
    for i in range(4):
        s.pod(f"rail-{i}", name, s.nodes(), base)
        node, results = s.wait_allocated(f"rail-{i}")
        assert node == s.nodes("nvl")[0]
        (gpu,) = s.devices(results, "gpu")
        (nic,) = s.devices(results, "nic")
        assert (gpu["type"], nic["type"]) == ("gpu", "nic")
        assert gpu["rail"] == nic["rail"]
        assert gpu["nicName"] == nic["rdmaDevice"]  # the GPU's own NIC, not just any NIC on the rail
        nics.append(nic["_device"])
    assert len(set(nics)) == 4

    # 4 NVL GPUs and 4 L4 GPUs are free, but every NIC is taken.
    s.pod("rail-4", name, s.nodes(), base)
    s.wait_unschedulable("rail-4")


@proves("gpu-2-distinct-rails")
def proof_2_gpus_on_distinct_rails(scenarios: Callable[..., Scenario], example_name: str) -> None:
    s = scenarios([("hgx", "dgx-h100", 1), ("nvl", "h100-nvl", 1), ("l40s", "l40s", 1)])
    name, base = apply_example(s, example_name)

    # On the H100 NVL the two GPUs of a bridge share one rail; the L40S has no NVLink domain.
    s.pod("no-rails", name, s.nodes("nvl", "l40s"), base)
    s.wait_unschedulable("no-rails")

    s.pod("rails", name, s.nodes(), base)
    node, results = s.wait_allocated("rails")
    assert node == s.nodes("hgx")[0]
    devs = s.devices(results)
    assert len(devs) == 2
    assert len({d["rail"] for d in devs}) == 2
    one(d["nvlinkDomain"] for d in devs)


@proves("gpu-2-basic")
def proof_2_gpus_of_any_model(scenarios: Callable[..., Scenario], example_name: str) -> None:
    s = scenarios([("l4", "l4", 1)])
    name, base = apply_example(s, example_name)
    used: set[str] = set()
    for i in range(2):
        s.pod(f"basic-{i}", name, s.nodes(), base)
        node, results = s.wait_allocated(f"basic-{i}")
        devs = s.devices(results)
        assert len(devs) == 2 and {d["_pool"] for d in devs} == {node}
        assert {d["type"] for d in devs} == {"gpu"}
        used |= {d["_device"] for d in devs}
    assert len(used) == 4
    s.pod("basic-2", name, s.nodes(), base)
    s.wait_unschedulable("basic-2")


@proves("gpu-first-available")
def proof_first_available_falls_back(scenarios: Callable[..., Scenario], example_name: str) -> None:
    """deploy/examples/gpu-first-available: 2 H200, else 2 H100 (here: NVL bridges), else 2 A100 80GB."""
    s = scenarios([("h200", "dgx-h200", 1), ("nvl", "h100-nvl", 1), ("a100", "dgx-a100-80gb", 1)])
    name, base = apply_example(s, example_name)
    for i in range(12):
        role, sub = [("h200", "h200"), ("nvl", "h100"), ("a100", "a100-80gb")][i // 4]
        s.pod(f"fa-{i}", name, s.nodes(), base)
        node, results = s.wait_allocated(f"fa-{i}")
        assert node in s.nodes(role), (i, node)
        assert {r["request"] for r in results} == {f"gpus/{sub}"}
        one(d["nvlinkDomain"] for d in s.devices(results))
    s.pod("fa-12", name, s.nodes(), base)
    s.wait_unschedulable("fa-12")
