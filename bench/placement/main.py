"""``bench/run placement``: replay GPU jobs through the real kube-scheduler and measure placement quality.

What runs (all loopback, all real except the kubelets):

* ``hack/testkit/cluster.py``: etcd, kube-apiserver, kube-controller-manager, kube-scheduler, with a
  KubeSchedulerConfiguration per policy (``model.scheduler_config``); for policy (d) also
  ``topodra placement-scorer`` configured as the scheduler's extender.
* The nodes of a SimulatedCluster file (default ``hack/clusters/enterprise-400.yaml``: 50 kubelet-less
  nodes, 400 GPUs) with their ResourceSlices published by ``topodra.simulate`` (the real discovery
  code on mock profiles). Pods are bound but never run: the claim is allocated at binding, which
  is all placement needs.

Virtual clock (``model.VirtualClock``): at the next event time t, delete the pods (grace 0)
and claims of the jobs that complete, wait until their claims are gone, create the claims and pods
of the jobs that arrive, wait until the scheduler is idle (``scheduler_pending_pods`` active and
backoff 0, no binding goroutine, and its attempt/queue counters unchanged for ``--settle``
seconds, and every new pod either bound or marked unschedulable), read pods and claims, mark the
jobs whose pods are all placed as started (end = t + duration), take a snapshot, repeat. Runtime
depends on the number of events, not on the durations.

Claims are created by the benchmark (one named ResourceClaim per pod, the spec a
ResourceClaimTemplate would carry), not by kube-controller-manager from templates: the controller
manager creates claims at ~11/s with its default client QPS, which would make the benchmark
measure it instead of the scheduler. Policy (a) uses no claim object of ours: the scheduler makes
the extended-resource claim itself (KEP-5004).

The pure parts (workloads, objects, metrics, clock) are in ``model.py``; plots in ``plots.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.paths import REPO, result_file
from bench.placement import gang, reserve, shapes
from bench.placement import model as pm
from testkit import cluster as localcluster

from topodra.apipaths import device_taint_rule_path
from topodra.classcatalog import catalog, to_device_class
from topodra.controller.reserve import apply_order
from topodra.kube import Kube, KubeError, make_transport
from topodra.reservations import HOLD_EFFECT, PROFILE_NS_LABEL
from topodra.simulate import SimulatedCluster, Simulation, ensure_node, load_cluster

# Placement benchmarks run on a private cluster (own state, ports, lock): they never hold the shared
# fixed-port cluster's lock that test sessions wait for. Runs of this instance still queue behind each
# other (two replays at once on 2 cores would measure each other).
INSTANCE = "bench-placement"
LOCK_FILE = localcluster.instance_lock_file(INSTANCE)
DEFAULT_CLUSTER = REPO / "hack" / "clusters" / "enterprise-400.yaml"
CORE = "/api/v1"
RES = "/apis/resource.k8s.io/v1"
NODE_LABEL = "bench.topodra.io/nodes"
API_TIMEOUT = 60.0


class BenchError(RuntimeError):
    """The benchmark cannot continue; the message says why."""


def log(msg: str) -> None:
    print(f"[placement {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def instance_lock(timeout: float, instance: str = INSTANCE) -> Iterator[None]:
    """The private instance's lock (``LOCK_FILE`` for the default instance), not the shared cluster's."""
    with localcluster.cluster_lock(timeout, localcluster.instance_lock_file(instance)):
        yield


# --------------------------------------------------------------------------- scheduler metrics

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})?\s+(\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
WATCHED = ("scheduler_pending_pods", "scheduler_schedule_attempts_total", "scheduler_queue_incoming_pods_total",
           "scheduler_goroutines", "scheduler_scheduling_attempt_duration_seconds_sum",
           "scheduler_scheduling_attempt_duration_seconds_count")


def parse_metrics(text: str, names: Sequence[str] = WATCHED) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The samples of the named metrics in Prometheus text: name -> [(labels, value)]."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {n: [] for n in names}
    for line in text.splitlines():
        if not line or line[0] == "#" or not line.startswith(tuple(names)):
            continue
        m = _SAMPLE.match(line)
        if m and m.group(1) in out:
            out[m.group(1)].append((dict(_LABEL.findall(m.group(2) or "")), float(m.group(3))))
    return out


def metric_sum(samples: Mapping[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    return sum(v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))


@dataclass
class SchedulerState:
    busy: bool  # something in the active/backoff queues or a binding in flight
    signature: tuple[float, float]  # attempt and queue-move counters: change = the scheduler did work

    @classmethod
    def of(cls, text: str, gangs: bool = False) -> SchedulerState:
        """``gangs``: a PodGroup that does not fit goes back to the backoff queue after every attempt
        (1.37.2), so its pods are retried every backoff period forever; then only the active queue,
        bindings and the count of scheduled pods say whether the scheduler still has work."""
        s = parse_metrics(text)
        queued = metric_sum(s, "scheduler_pending_pods", queue="active") + \
            (0 if gangs else metric_sum(s, "scheduler_pending_pods", queue="backoff"))
        binding = metric_sum(s, "scheduler_goroutines", operation="binding")
        if gangs:
            return cls(busy=queued > 0 or binding > 0,
                       signature=(metric_sum(s, "scheduler_schedule_attempts_total", result="scheduled"), 0.0))
        return cls(busy=queued > 0 or binding > 0,
                   signature=(metric_sum(s, "scheduler_schedule_attempts_total"),
                              metric_sum(s, "scheduler_queue_incoming_pods_total")))


def histogram_buckets(text: str, needle: str) -> dict[float, float]:
    """Cumulative bucket counts (le -> count, label sets summed) of the first histogram whose name
    contains ``needle``; empty when there is none."""
    found: dict[str, dict[float, float]] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or needle not in m.group(1) or not m.group(1).endswith("_bucket"):
            continue
        le = dict(_LABEL.findall(m.group(2) or "")).get("le", "+Inf")
        b = found.setdefault(m.group(1), {})
        key = math.inf if le == "+Inf" else float(le)
        b[key] = b.get(key, 0.0) + float(m.group(3))
    return found[sorted(found)[0]] if found else {}


def histogram_quantiles(text: str, needle: str, qs: Sequence[float] = (0.5, 0.99),
                        before: str = "") -> dict[str, float]:
    """Quantiles (ms, linear within a bucket) of a histogram, over the observations made since
    ``before`` (an earlier scrape of the same endpoint); empty when the histogram is absent."""
    now, then = histogram_buckets(text, needle), histogram_buckets(before, needle)
    if not now:
        return {}
    merged = {le: c - then.get(le, 0.0) for le, c in now.items()}
    les = sorted(merged)
    total = merged[les[-1]]
    out: dict[str, float] = {"count": total}
    for q in qs if total > 0 else ():
        target = q * total
        prev_le, prev_c = 0.0, 0.0
        for le in les:
            c = merged[le]
            if c >= target:
                if math.isinf(le):
                    val = prev_le
                else:
                    frac = (target - prev_c) / (c - prev_c) if c > prev_c else 1.0
                    val = prev_le + (le - prev_le) * frac
                out[f"p{round(q * 100)}_ms"] = val * 1000
                break
            prev_le, prev_c = le, c
    return out


# --------------------------------------------------------------------------- the environment


@dataclass
class Env:
    """A running cluster with the benchmark's nodes published."""

    lc: localcluster.Cluster
    kube: Kube
    inv: pm.NodeCapacity
    node_selector: dict[str, str]
    policy: str | None = None
    scorer: subprocess.Popen[bytes] | None = None
    scorer_metrics_url: str | None = None
    logs: Path = field(default_factory=lambda: REPO / ".run" / "placement-logs")
    fabric: dict[str, dict[str, str]] = field(default_factory=dict)  # node -> leaf, su (gang.fabric_of)

    def use_policy(self, policy: str) -> None:
        """Restart kube-scheduler with the policy's configuration (and the scorer for (d))."""
        if policy == self.policy:
            return
        self.stop_scorer()
        extender = None
        if policy in pm.SCORER_POLICIES:
            extender = self.start_scorer(pm.SCORER_POLICIES[policy])
        self.lc.restart_scheduler(pm.scheduler_config(policy), extender)
        self.policy = policy
        log(f"kube-scheduler restarted for policy ({policy}): {pm.POLICIES[policy]}")

    def start_scorer(self, host_resources: str = "off") -> str:
        port = localcluster.free_port()
        self.logs.mkdir(parents=True, exist_ok=True)
        logf = (self.logs / "placement-scorer.log").open("ab")
        self.scorer = subprocess.Popen(
            [sys.executable, "-m", "topodra.cli", "placement-scorer", "--kubeconfig", str(self.lc.admin_kubeconfig),
             "--listen", f"127.0.0.1:{port}", "--host-resources", host_resources],
            stdout=logf, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.scorer.poll() is not None:
                raise BenchError(f"topodra placement-scorer exited ({self.scorer.returncode}); "
                                 f"log: {localcluster.tail(self.logs / 'placement-scorer.log')}")
            # /readyz answers 200 once the scorer's list+watch caches are synced
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/readyz", timeout=2) as r:
                if r.status == 200:
                    break
            time.sleep(0.3)
        else:
            raise BenchError("topodra placement-scorer not ready (/readyz) within 60 s")
        self.scorer_metrics_url = f"{url}/metrics"
        return url

    def stop_scorer(self) -> None:
        if self.scorer is not None and self.scorer.poll() is None:
            self.scorer.terminate()
            try:
                self.scorer.wait(10)
            except subprocess.TimeoutExpired:
                self.scorer.kill()
                self.scorer.wait(5)
        self.scorer = None
        self.scorer_metrics_url = None

    def scorer_metrics(self) -> str:
        if not self.scorer_metrics_url:
            return ""
        with urllib.request.urlopen(self.scorer_metrics_url, timeout=5) as r:
            return str(r.read().decode())


def prefixed(cluster: SimulatedCluster, prefix: str, label_value: str) -> SimulatedCluster:
    """The same cluster with node names prefixed and every node labelled for the benchmark."""
    data = cluster.model_dump(by_alias=True)
    for g in data["groups"]:
        g["namePrefix"] = prefix + g["namePrefix"]
        g["labels"] = {**g.get("labels", {}), NODE_LABEL: label_value}
    return SimulatedCluster.model_validate(data)


def install_classes(kube: Kube) -> dict[str, Any]:
    """topodra's DeviceClass catalog and the count-only class of policy (a); returns class -> match."""
    matches: dict[str, Any] = {}
    for spec in catalog():
        matches[spec.name] = spec.match
        try:
            kube.create(f"{RES}/deviceclasses", to_device_class(spec))
        except KubeError as e:
            if e.status != 409:
                raise
    try:
        kube.create(f"{RES}/deviceclasses", pm.extended_device_class())
    except KubeError as e:
        if e.status != 409:
            raise
    return matches


def publish(kube: Kube, cluster: SimulatedCluster) -> tuple[Simulation, dict[str, str]]:
    t0 = time.monotonic()
    sim = Simulation(kube, cluster)
    sim.setup()
    written = sim.reconcile_all()
    if written != len(sim.nodes):
        raise BenchError(f"only {written} of {len(sim.nodes)} pools published")
    log(f"{len(sim.nodes)} nodes published in {time.monotonic() - t0:.1f}s")
    wait_untainted(kube, [n.name for n in sim.nodes])
    return sim, {n.name: n.labels.get(pm.SU_LABEL, "none") for n in sim.nodes}


def wait_untainted(kube: Kube, names: Sequence[str], timeout: float = 600) -> None:
    """New nodes carry ``node.kubernetes.io/not-ready`` until kube-controller-manager's node
    lifecycle controller sees them Ready and removes it, a few nodes at a time; a replay started
    before that would find part of the cluster unusable."""
    t0 = time.monotonic()
    wanted = set(names)
    while True:
        tainted = sorted(n["metadata"]["name"] for n in kube.list(f"{CORE}/nodes")
                         if n["metadata"]["name"] in wanted and (n.get("spec") or {}).get("taints"))
        if not tainted:
            log(f"all {len(wanted)} nodes untainted after {time.monotonic() - t0:.0f}s")
            return
        if time.monotonic() - t0 > timeout:
            raise BenchError(f"{len(tainted)} nodes still tainted after {timeout:.0f}s: {tainted[:5]}")
        time.sleep(1)


def override_allocatable(kube: Kube, names: Sequence[str], allocatable: tuple[str, str]) -> None:
    """Give every benchmark node the same capacity and allocatable (CPUs, memory) instead of its profile's.

    ``--node-allocatable``: the trace was recorded on servers far smaller than a DGX (``shapes.TRACE_NODE``),
    and CPU/memory stranding only shows on nodes of that shape. Before the inventory is read, so the
    benchmark, kube-scheduler and the scorer all see the same figures."""
    cpu, memory = allocatable
    patch = {"status": {"capacity": {"cpu": cpu, "memory": memory}, "allocatable": {"cpu": cpu, "memory": memory}}}
    for name in names:
        kube.merge_patch(f"{CORE}/nodes/{name}/status", patch)
    log(f"{len(names)} nodes now report allocatable cpu={cpu} memory={memory}")


def add_cpu_nodes(kube: Kube, group: Sequence[tuple[str, str]], label: str) -> list[str]:
    """The CPU-only node group (``--cpu-nodes``): kubelet-less Ready Nodes without devices, labelled for the
    benchmark's pods like the GPU servers (``topodra.simulate.ensure_node``)."""
    names = []
    for i, allocatable in enumerate(group):
        name = f"cpu-{i:03d}"
        ensure_node(kube, name, {NODE_LABEL: label}, allocatable)
        names.append(name)
    wait_untainted(kube, names)
    log(f"{len(names)} CPU-only nodes: " + ", ".join(f"{c}/{m}" for c, m in group))
    return names


def build_inventory(kube: Kube, node_su: Mapping[str, str], matches: Mapping[str, Any]) -> pm.NodeCapacity:
    slices = list(kube.list(f"{RES}/resourceslices", field_selector=f"spec.driver={pm.DRIVER}"))
    inv = pm.inventory_from_slices(slices, node_su, matches)
    inv.host = shapes.node_allocatable(list(kube.list(f"{CORE}/nodes")), list(node_su))
    return inv


# --------------------------------------------------------------------------- one run


@dataclass
class RunResult:
    policy: str
    seed: int
    workload: str
    metrics: dict[str, Any]
    steps: int
    events: int
    wall_s: float
    scheduler: dict[str, float]
    scorer: dict[str, float]
    series: list[dict[str, Any]]
    peak_free_per_node: dict[str, int]
    waits: dict[str, list[float]]
    gpus: int
    phases_s: dict[str, float]
    missed: list[dict[str, Any]]  # waiting jobs that fit somewhere by the model (see Replay.missed)
    # Per job: id, GPUs, preference list, arrival, start (None: never), the models it got (sorted, distinct).
    jobs: list[dict[str, Any]] = field(default_factory=list)
    # Policy (g): per reserving job, what the planner said of it, on change (``reserve.Reserver.timeline``).
    holds: dict[str, list[list[Any]]] = field(default_factory=dict)


def wait_for(fn: Any, timeout: float, what: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        v = fn()
        if v:
            return v
        if time.monotonic() > deadline:
            raise BenchError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


class Replay:
    """One (policy, stream) replay in its own namespace."""

    def __init__(self, env: Env, policy: str, jobs: Sequence[pm.Job], tick: float, settle: float,
                 timeout: float, until_window_end: bool = False,
                 reservation: reserve.Settings | None = None, idle_timeout: float = 120.0) -> None:
        self.env = env
        self.idle_timeout = idle_timeout
        self.until_window_end = until_window_end
        self.kube = env.kube
        self.policy = policy
        self.jobs = list(jobs)
        self.clock = pm.VirtualClock(jobs, tick)
        self.settle = settle
        self.timeout = timeout
        self.run = uuid.uuid4().hex[:6]
        self.ns = f"pb-{policy}-{self.run}"
        self.mix = pm.job_classes(jobs)
        self.jobs_by_pod = {name: j for j in jobs for name in j.pod_names()}
        self.snaps: list[pm.Snapshot] = []
        self.new_pods: set[str] = set()
        self.phases: dict[str, float] = {}
        self.pending_reason: dict[str, str] = {}
        self.missed_log: list[dict[str, Any]] = []
        self.gangs = gang.GangTracker(env.inv, env.fabric)
        self.reserver = (reserve.Reserver(reservation or reserve.Settings(), self.run, self.ns, env.inv, env.fabric)
                         if policy in reserve.RESERVING_POLICIES else None)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Accumulate wall time per phase of a step (where a run's minutes go)."""
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.monotonic() - t0

    # -- API helpers
    def _ns_path(self, plural: str, name: str | None = None) -> str:
        base = CORE if plural == "pods" else RES
        return f"{base}/namespaces/{self.ns}/{plural}" + (f"/{name}" if name else "")

    def setup(self) -> None:
        self.kube.create(f"{CORE}/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                 "metadata": {"name": self.ns}})
        wait_for(lambda: self.kube.get(f"{CORE}/namespaces/{self.ns}/serviceaccounts/default"), 60,
                 "the namespace's default ServiceAccount")

    def _rules(self) -> list[dict[str, Any]]:
        """This replay's reservation DeviceTaintRules (cluster-scoped; labelled with the namespace)."""
        return list(self.kube.list(device_taint_rule_path(), label_selector=f"{PROFILE_NS_LABEL}={self.ns}"))

    def teardown(self) -> None:
        if self.reserver is not None:  # cluster-scoped: they would hold devices in the next run
            for r in self._rules():
                self.kube.delete(device_taint_rule_path(r["metadata"]["name"]))
        self.kube.request("DELETE", self._ns_path("pods"),
                          {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0})
        self.kube.request("DELETE", self._ns_path("resourceclaims"))
        if self.policy in gang.GANG_POLICIES:
            self.kube.request("DELETE", f"{gang.PODGROUPS}/namespaces/{self.ns}/podgroups")
        wait_for(lambda: not list(self.kube.list(self._ns_path("resourceclaims"))), 120,
                 f"claims of namespace {self.ns} released")
        self.kube.delete(f"{CORE}/namespaces/{self.ns}")

    def submit(self, job: pm.Job) -> None:
        group = gang.podgroup_for(job, self.policy, self.run)
        if group is not None:  # before its pods: a gang pod without its PodGroup is not scheduled
            self.kube.create(f"{gang.PODGROUPS}/namespaces/{self.ns}/podgroups", group)
        for k, name in enumerate(job.pod_names()):
            claim = pm.claim_for(job, k, self.policy, self.run)
            pod = gang.gang_pod(pm.pod_for(job, k, self.policy, self.run, self.env.node_selector), job, self.policy)
            if claim is not None and self.reserver is not None and reserve.reserves(job, self.reserver.settings):
                claim["spec"] = reserve.tolerating(claim["spec"], reserve.job_uid(self.run, job.id))
            elif claim is not None and self.reserver is not None and reserve.backfills(job, self.reserver.settings):
                claim["spec"] = reserve.backfilling(claim["spec"], job)
                pod["spec"]["activeDeadlineSeconds"] = reserve.deadline_s(job)
            if claim is not None:
                self.kube.create(self._ns_path("resourceclaims"), claim)
            self.kube.create(self._ns_path("pods"), pod)
            self.new_pods.add(name)

    def complete(self, job: pm.Job) -> list[str]:
        """Delete the job's pods (grace 0) and our claims; returns the pod names."""
        names = job.pod_names()
        for name in names:
            self.kube.request("DELETE", self._ns_path("pods", name),
                              {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0})
            if self.policy != "a":
                self.kube.delete(self._ns_path("resourceclaims", name))
        if gang.podgroup_for(job, self.policy, self.run) is not None:
            self.kube.delete(f"{gang.PODGROUPS}/namespaces/{self.ns}/podgroups/{gang.group_name(job)}")
        return names

    def claims_of_deleted_gone(self, deleted: set[str]) -> bool:
        for c in self.kube.list(self._ns_path("resourceclaims")):
            owner = {o.get("name") for o in c["metadata"].get("ownerReferences") or []}
            if c["metadata"]["name"] in deleted or owner & deleted:
                return False
        return True

    def wait_idle(self) -> None:
        """Until the scheduler has nothing queued or binding and did nothing for ``settle`` seconds,
        and every newly created pod was either bound or reported unschedulable."""
        deadline = time.monotonic() + self.idle_timeout
        last: tuple[float, float] | None = None
        quiet_since = time.monotonic()
        gangs = self.policy in gang.GANG_POLICIES
        settle = max(self.settle, gang.GANG_SETTLE) if gangs else self.settle
        while time.monotonic() < deadline:
            st = SchedulerState.of(self.env.lc.scheduler_metrics(), gangs)
            now = time.monotonic()
            if st.busy or st.signature != last:
                quiet_since = now
            last = st.signature
            if now - quiet_since >= settle and self._new_pods_seen():
                return
            time.sleep(0.03)
        raise BenchError(f"kube-scheduler did not go idle within {self.idle_timeout:.0f} s")

    def _new_pods_seen(self) -> bool:
        if not self.new_pods:
            return True
        for pod in self.kube.list(self._ns_path("pods"), label_selector=f"{pm.RUN_LABEL}={self.run}"):
            name = pod["metadata"]["name"]
            if name not in self.new_pods:
                continue
            conds = (pod.get("status") or {}).get("conditions") or []
            if pod["spec"].get("nodeName") or any(c.get("type") == "PodScheduled" for c in conds):
                self.new_pods.discard(name)
        return not self.new_pods

    def read(self) -> tuple[dict[str, pm.Placement], set[tuple[str, str]]]:
        """Placements of bound pods and every allocated device in the namespace."""
        claims = {c["metadata"]["name"]: c for c in self.kube.list(self._ns_path("resourceclaims"))}
        used = {(r["pool"], r["device"]) for c in claims.values()
                for r in (((c.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results", [])
                if r.get("driver") == pm.DRIVER}
        out: dict[str, pm.Placement] = {}
        for pod in self.kube.list(self._ns_path("pods"), label_selector=f"{pm.RUN_LABEL}={self.run}"):
            if pod["metadata"].get("deletionTimestamp"):
                continue
            if self.policy == "a":
                cname = (((pod.get("status") or {}).get("extendedResourceClaimStatus") or {})
                         .get("resourceClaimName"))
            else:
                cname = pod["metadata"]["name"]
            p = pm.placement_from(pod, claims.get(cname or ""))
            if p is not None:
                out[pod["metadata"]["name"]] = p
            else:
                cond = [c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") == "PodScheduled"]
                self.pending_reason[pod["metadata"]["name"]] = (cond[0].get("message") or cond[0].get("reason", "")
                                                                if cond else "no PodScheduled condition")
        return out, used

    def missed(self, used: set[tuple[str, str]]) -> list[dict[str, Any]]:
        """Waiting single-pod jobs that fit on some node by the model (free GPUs of a type they
        accept): the scheduler did not retry them after the event that made room, or CPU/memory or
        something else the model ignores blocks them. Reported, not hidden."""
        free = pm.free_by_node(self.env.inv, used)
        out = []
        for job in self.clock.waiting():
            if job.pods != 1 or not job.gpus:
                continue
            models = pm.acceptable_models(job, self.policy, self.env.inv)
            if any(n >= job.per_pod and self.env.inv.node_model(node) in models for node, n in free.items()):
                name = job.pod_names()[0]
                out.append({"t": self.clock.now, "job": job.id, "pod": name,
                            "reason": self.pending_reason.get(name, "")[:300]})
        return out

    def execute(self) -> RunResult:
        t_start = time.monotonic()
        sched0 = parse_metrics(self.env.lc.scheduler_metrics())
        scorer0 = self.env.scorer_metrics()
        steps = events = 0
        peak: tuple[int, dict[str, int]] = (-1, {})
        while True:
            t = self.clock.next_time()
            if t is None:
                break
            if time.monotonic() - t_start > self.timeout:
                raise BenchError(f"run exceeded {self.timeout:.0f}s at step {steps}, virtual time {t:.0f}s")
            self.clock.advance(t)
            done = self.clock.due_completions()
            deleted: set[str] = set()
            with self.phase("complete"):
                for job in done:
                    deleted.update(self.complete(job))
            if deleted:
                with self.phase("release"):
                    wait_for(lambda d=deleted: self.claims_of_deleted_gone(d), 120,
                             "claims of completed jobs released")
            arrived = self.clock.due_arrivals()
            with self.phase("submit"):
                for job in arrived:
                    self.submit(job)
            events += len(done) + len(arrived)
            with self.phase("idle"):
                self.wait_idle()
            with self.phase("read"):
                placements, used = self.read()
            self._mark_started(placements)
            if self.reserver is not None:
                with self.phase("reserve"):
                    placements, used = self.reserve_rounds(placements, used)
                self.reserver.observe(self.clock.now, used, self.clock, placements, self.jobs_by_pod)
            self.missed_log += self.missed(used)
            self.gangs.observe(self.clock, arrived, placements, used)
            snap = pm.snapshot(self.clock.now, self.env.inv, used, self.clock, self.mix, self.policy)
            snap = shapes.with_host(snap, self.env.inv, placements, self.jobs_by_pod, self.clock.waiting(),
                                    self.policy)
            self.snaps.append(snap)
            if snap.used > peak[0] and self.clock.now <= self.clock.last_arrival:
                peak = (snap.used, snap.free_per_node)
            steps += 1
            if self.clock.all_started():
                break
            if self.until_window_end and self.clock.all_arrived():
                break  # the metrics' window is over; what still waits is reported as unplaced
            if self.clock.all_arrived() and not self.clock.running() and self.clock.waiting():
                log(f"{len(self.clock.waiting())} jobs can never be placed (nothing runs, nothing arrives)")
                break
        wall = time.monotonic() - t_start
        sched1 = parse_metrics(self.env.lc.scheduler_metrics())
        metrics = pm.run_metrics(self.clock, self.snaps, self.env.inv)
        metrics.update(self.gangs.metrics(self.clock))
        metrics.update(reserve.big_job_metrics(self.clock))
        if self.reserver is not None:
            waiting = {reserve.job_uid(self.run, j.id) for j in self.clock.waiting()}
            self.reserver.rules_leaked = reserve.leaked(self._rules(), self.ns, waiting)
            metrics.update(self.reserver.metrics(self.clock))
        scheduler = self._scheduler_delta(sched0, sched1, wall)
        metrics["scheduler_pods_per_s"] = scheduler["pods_per_busy_s"]
        scorer_text = self.env.scorer_metrics()
        scorer = histogram_quantiles(scorer_text, "prioritize_duration", before=scorer0)
        scorer_cpu = histogram_quantiles(scorer_text, "prioritize_cpu", before=scorer0)
        if self.policy in pm.SCORER_POLICIES and not scorer.get("count"):
            raise BenchError(f"policy ({self.policy}) ran but kube-scheduler never called the placement scorer "
                             "(no prioritize observations on its /metrics)")
        if scorer:
            metrics["scorer_p50_ms"] = scorer.get("p50_ms", math.nan)
            metrics["scorer_p99_ms"] = scorer.get("p99_ms", math.nan)
        if scorer_cpu:  # the scorer's own CPU time per call: wall minus this is waiting
            metrics["scorer_cpu_p50_ms"] = scorer_cpu.get("p50_ms", math.nan)
            metrics["scorer_cpu_p99_ms"] = scorer_cpu.get("p99_ms", math.nan)
        waits: dict[str, list[float]] = {}
        for s in self.clock.states.values():
            if s.start is not None:
                waits.setdefault(str(s.job.gpus), []).append(s.start - s.job.arrival)
        return RunResult(
            policy=self.policy, seed=0, workload="", metrics=metrics, steps=steps, events=events,
            wall_s=wall, scheduler=scheduler, scorer=scorer,
            series=[{"t": s.t, "used": s.used, "stranded": s.stranded, "stranded_cpu": s.stranded_cpu,
                     "stranded_memory": s.stranded_memory, "fgd": round(s.fgd, 3),
                     "goodput": round(s.goodput, 3), "waiting": s.waiting, "whole_free": s.whole_free,
                     "cpu_only_on_gpu_nodes": s.cpu_only_on_gpu_nodes} for s in self.snaps],
            peak_free_per_node=peak[1], waits=waits, gpus=self.env.inv.total(),
            phases_s={k: round(v, 2) for k, v in self.phases.items()}, missed=self.missed_log,
            jobs=self._job_records(),
            holds={str(k): v for k, v in self.reserver.timeline.items()} if self.reserver is not None else {})

    def _job_records(self) -> list[dict[str, Any]]:
        """Every job of the run, for analyses the summary metrics cannot answer (``bench.placement.floor``)."""
        out = []
        for s in self.clock.states.values():
            models = sorted({self.env.inv.gpus[(p.node, d)].model for p in s.placements for d in p.devices
                             if (p.node, d) in self.env.inv.gpus})
            out.append({"id": s.job.id, "gpus": s.job.gpus, "prefs": s.job.prefs, "arrival": s.job.arrival,
                        "duration": s.job.duration, "start": s.start, "models": models})
        return out

    def _mark_started(self, placements: Mapping[str, pm.Placement]) -> None:
        for job in self.clock.waiting():
            ps = [placements.get(n) for n in job.pod_names()]
            if all(p is not None for p in ps):
                self.clock.started(job.id, [p for p in ps if p is not None])

    def reserve_rounds(self, placements: dict[str, pm.Placement], used: set[tuple[str, str]],
                       rounds: int = 3) -> tuple[dict[str, pm.Placement], set[tuple[str, str]]]:
        """Policy (g): plan at the virtual now, make this replay's DeviceTaintRules match the plan. A released
        hold frees devices, so the scheduler is given them (idle again, read again) and the plan made again
        (a bound gang releases its hold), at most ``rounds`` times per step."""
        assert self.reserver is not None
        for _ in range(rounds):
            _plan, want = self.reserver.step(self.clock, placements, used, self.jobs_by_pod)
            have = {r["metadata"]["name"]: r for r in self._rules()}
            changes = apply_order(have, want)
            for op, rule in changes:
                if op == "delete":
                    self.kube.delete(device_taint_rule_path(rule["metadata"]["name"]))
                else:
                    self.kube.create(device_taint_rule_path(), rule)
            freed = [r for op, r in changes if op == "delete"
                     and ((r.get("spec") or {}).get("taint") or {}).get("effect") == HOLD_EFFECT]
            if not freed:
                break
            self.wait_idle()
            placements, used = self.read()
            self._mark_started(placements)
        return placements, used

    @staticmethod
    def _scheduler_delta(m0: Mapping[str, Any], m1: Mapping[str, Any], wall: float) -> dict[str, float]:
        """Attempts, scheduled pods and pods per second of scheduling-attempt time during the run."""
        def d(name: str, **lab: str) -> float:
            return metric_sum(m1, name, **lab) - metric_sum(m0, name, **lab)

        scheduled = d("scheduler_schedule_attempts_total", result="scheduled")
        attempts = d("scheduler_schedule_attempts_total")
        busy = d("scheduler_scheduling_attempt_duration_seconds_sum")
        return {"attempts": attempts, "scheduled": scheduled, "attempt_seconds": busy,
                "mean_attempt_ms": busy / attempts * 1000 if attempts else math.nan,
                "pods_per_busy_s": scheduled / busy if busy else math.nan,
                "pods_per_wall_s": scheduled / wall if wall else math.nan}


# --------------------------------------------------------------------------- the matrix


def workload(args: argparse.Namespace, seed: int, capacity: int) -> tuple[str, list[pm.Job]]:
    if args.trace and args.shapes == "trace":
        skip = args.trace_skip + (seed - args.seed0) * args.jobs
        jobs = shapes.trace_jobs(args.trace, args.jobs, capacity, args.load, skip=skip)
        return f"alibaba-shapes:{Path(args.trace).name}[{skip}:{skip + len(jobs)}]", jobs
    if args.trace:
        # The trace is one stream: seeds offset the window into it, so runs see different jobs.
        skip = args.trace_skip + (seed - args.seed0) * args.jobs
        jobs = pm.alibaba_jobs(args.trace, args.jobs, capacity, args.load, args.fractional, skip=skip)
        return f"alibaba:{Path(args.trace).name}[{skip}:{skip + len(jobs)}]", jobs
    spec = pm.SyntheticSpec(jobs=args.jobs, capacity_gpus=capacity, load=args.load, burst_load=args.burst_load)
    if getattr(args, "adversarial", False):
        return "synthetic-adversarial", gang.adversarial_jobs(spec, seed)
    if args.multinode:
        spec = dataclasses.replace(spec, sizes=gang.SIZES, prefs=gang.PREFS)
        return "synthetic-multinode", pm.synthetic_jobs(spec, seed)
    return "synthetic", pm.synthetic_jobs(spec, seed)


def print_table(summary: Mapping[str, Mapping[str, Mapping[str, float]]]) -> None:
    rows = ["utilisation", "goodput", "stranded_gpus", "stranded_gpus_cpu", "stranded_gpus_memory",
            "cpu_only_pods_on_gpu_nodes", "fgd_fragmentation", "wait_mean_s_all", "waiting_at_end",
            "wait_p50_s.8", "wait_p95_s.8",
            "wait_p95_s.16", "wait_p95_s.1", "type_violations", "choice.1", "choice.2", "choice.3",
            "nvlink_locality", "rail_alignment", "scheduler_pods_per_s", "scorer_p50_ms", "scorer_p99_ms",
            "scorer_cpu_p50_ms", "scorer_cpu_p99_ms"]
    policies = sorted(summary)
    print(f"{'metric':24s}" + "".join(f"{'(' + p + ')':>26s}" for p in policies))
    for row in rows:
        cells = []
        for p in policies:
            iv = summary[p].get(row)
            if not iv or math.isnan(iv["mean"]):
                cells.append(f"{'-':>26s}")
            else:
                cells.append(f"{iv['mean']:>12.3f} [{iv['lo']:.3f}, {iv['hi']:.3f}]".rjust(26))
        print(f"{row:24s}" + "".join(cells))


TABLE_ROWS = [("utilisation", "GPU utilisation", 3), ("goodput", "goodput (model)", 3),
              ("stranded_gpus", "stranded GPUs (mean)", 1),
              ("stranded_gpus_cpu", "stranded by CPU (mean)", 1),
              ("stranded_gpus_memory", "stranded by memory (mean)", 1),
              ("cpu_only_pods_on_gpu_nodes", "CPU-only pods on GPU nodes (mean)", 1),
              ("fgd_fragmentation", "FGD fragmentation", 3),
              ("wait_p50_s.8", "8-GPU wait p50 (s)", 0), ("wait_p95_s.8", "8-GPU wait p95 (s)", 0),
              ("wait_p95_s.16", "16-GPU wait p95 (s)", 0), ("wait_p95_s.4", "4-GPU wait p95 (s)", 0),
              ("wait_p95_s.1", "1-GPU wait p95 (s)", 0), ("wait_p95_s.0", "CPU-only wait p95 (s)", 0),
              ("wait_mean_s_all", "mean wait, GPU jobs, waiting ones so far (s)", 0),
              ("waiting_at_end", "jobs still waiting at the end", 1), ("type_violations", "type violations (jobs)", 1),
              ("choice.1", "got 1st choice (jobs)", 1), ("choice.2", "got 2nd choice", 1),
              ("choice.3", "got 3rd choice", 1), ("nvlink_locality", "NVLink locality", 3),
              ("rail_alignment", "rail alignment (16-GPU)", 3),
              ("scheduler_pods_per_s", "scheduler pods/s (attempt time)", 1),
              ("scorer_p50_ms", "prioritize p50 (ms)", 2), ("scorer_p99_ms", "prioritize p99 (ms)", 2),
              ("scorer_cpu_p50_ms", "prioritize CPU p50 (ms)", 2), ("scorer_cpu_p99_ms", "prioritize CPU p99 (ms)", 2)]


def markdown_table(summary: Mapping[str, Mapping[str, Mapping[str, float]]],
                   rows: Sequence[tuple[str, str, int]] = TABLE_ROWS) -> str:
    """The summary as a Markdown table: mean [95% interval] per policy."""
    policies = sorted(summary)
    n = {p: int(max((iv.get("n", 0) for iv in summary[p].values()), default=0)) for p in policies}
    lines = ["| metric | " + " | ".join(f"({p}) n={n[p]}" for p in policies) + " |",
             "| --- |" + " --- |" * len(policies)]
    for key, label, digits in rows:
        cells = []
        for p in policies:
            iv = summary[p].get(key)
            if not iv or math.isnan(iv["mean"]):
                cells.append("-")
            elif math.isnan(iv["lo"]):
                cells.append(f"{iv['mean']:.{digits}f}")
            else:
                cells.append(f"{iv['mean']:.{digits}f} [{iv['lo']:.{digits}f}, {iv['hi']:.{digits}f}]")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def exit_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so ``run_matrix``'s ``finally`` takes the private cluster down.

    The default action killed the process outright and left etcd, the apiserver, the scheduler
    and the scorer running. For the command-line entry points only (not when imported by tests).
    """
    def handler(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/run placement", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", nargs="?", help="Alibaba openb_pod_list_*.csv (default: the synthetic stream)")
    p.add_argument("--policies", default="a,b,c,d",
                   help="comma-separated subset of a,b,c,d,dr,dh,e,f,g (dr: (d') = (d) counting node CPU and "
                        "memory; dh: per-class shares and CPU-only pods scored; g: (f) + reservations, with "
                        "--multinode)")
    p.add_argument("--paired", action="store_true",
                   help="run every policy of a seed before the next seed (restarts the scheduler between runs)")
    p.add_argument("--shapes", choices=["fixed", "trace"], default="fixed",
                   help="pod CPU/memory: fixed DGX share per GPU (12 CPU, 96Gi), or the trace's own requests "
                        "with its CPU-only tasks as pods without claims (bench/placement/shapes.py)")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--seed0", type=int, default=1)
    p.add_argument("--seed-list", help="comma-separated seeds (instead of --seed0/--seeds), e.g. to complete a matrix")
    p.add_argument("--jobs", type=int, default=500, help="jobs per run (events = 2 x jobs at most)")
    p.add_argument("--load", type=float, default=1.0, help="offered load")
    p.add_argument("--burst-load", type=float, default=1.5, help="offered load of the burst (synthetic)")
    p.add_argument("--fractional", choices=["round-up", "skip"], default="round-up",
                   help="trace tasks with a fraction of a GPU: as 1-GPU jobs, or dropped")
    p.add_argument("--trace-skip", type=int, default=1000,
                   help="trace GPU tasks to skip first (the first ~10%% existed when the trace began and "
                        "run for months); seed k starts (k - seed0) x --jobs tasks further")
    p.add_argument("--cluster", default=str(DEFAULT_CLUSTER), help="SimulatedCluster file")
    p.add_argument("--multinode", action="store_true",
                   help="synthetic stream with 16/32/64-GPU jobs (bench/placement/gang.py SIZES); use a fabric "
                        "cluster (bench/placement/fabric-400.yaml) and policies c,e,f,g")
    p.add_argument("--adversarial", action="store_true",
                   help="with --multinode: a steady flow of 1- and 2-GPU jobs and one 64-GPU job "
                        "(gang.adversarial_jobs)")
    p.add_argument("--reserve-after", type=float, default=reserve.Settings.after_s,
                   help="policy (g): virtual seconds a job waits before it may reserve (afterWaiting; default "
                        "%(default)s, the controller's --reservation-after)")
    p.add_argument("--reserve-max-hold", type=float, default=reserve.Settings.max_hold_s,
                   help="policy (g): virtual seconds a hold lasts at most (maxHold; default %(default)s)")
    p.add_argument("--max-reservations", type=int, default=reserve.Settings.max_reservations,
                   help="policy (g): holds at once (default %(default)s)")
    p.add_argument("--reserve-grace", type=float, default=reserve.Settings.grace_s,
                   help="policy (g): virtual seconds a hold lasts past its expected start (default %(default)s)")
    p.add_argument("--reserve-cooldown", type=float, default=reserve.Settings.cooldown_s,
                   help="policy (g): virtual seconds after an expired hold before the job may reserve again "
                        "(default %(default)s)")
    p.add_argument("--reserve-narrower-within", type=float, default=reserve.Settings.narrower_within_s,
                   help="policy (g): a gang holds a leaf group only if it starts at most this many virtual seconds "
                        "later than the soonest nodes of its scalable unit (default %(default)s, the controller's "
                        "--reservation-narrower-within; inf: a leaf whenever one can hold the job, as in session 10)")
    p.add_argument("--reserve-min-gpus", type=int, default=reserve.Settings.min_gpus,
                   help="policy (g): multi-node jobs of at least this many GPUs reserve (default %(default)s: "
                        "every multi-node job)")
    p.add_argument("--reserve-whole-server", choices=("on", "off"), default="off",
                   help="policy (g): 8-GPU whole-server jobs reserve a node too (off: they backfill like 1-4 GPU "
                        "jobs; default %(default)s)")
    p.add_argument("--backfill", choices=("on", "off"), default="on",
                   help="policy (g): jobs of 1-4 GPUs tolerate held devices whose backfill window fits their "
                        "duration, and declare it as activeDeadlineSeconds (default on)")
    p.add_argument("--reserve-deadlines", choices=reserve.DEADLINES, default=reserve.Settings.deadlines,
                   help="policy (g): 'true': the planner knows every running pod's true end (as if it declared "
                        "activeDeadlineSeconds = its duration: a best case); 'none': no pod declares one")
    p.add_argument("--node-allocatable", metavar="CPUS,MEMORY",
                   help="every node's allocatable instead of its profile's, e.g. 96,384Gi (the trace's own "
                        "8-GPU servers, shapes.TRACE_NODE)")
    p.add_argument("--cpu-nodes", metavar="NODE_LIST.csv",
                   help="add a CPU-only node group: the trace's openb_node_list_all_node.csv gives its size (the "
                        "trace's proportion of CPU-only to GPU nodes) and shapes (shapes.cpu_node_group)")
    p.add_argument("--until-window-end", action="store_true",
                   help="end each run at its last arrival's step (the metrics' window) instead of when every job "
                        "has started; jobs still waiting count as unplaced, their wait so far in wait_mean_s_all")
    p.add_argument("--tick", type=float, default=120.0,
                   help="virtual seconds grouped into one step (0: one step per distinct event time)")
    p.add_argument("--settle", type=float, default=0.1, help="seconds the scheduler must stay idle")
    p.add_argument("--run-timeout", type=float, default=900, help="wall seconds one run may take")
    p.add_argument("--idle-timeout", type=float, default=120.0,
                   help="wall seconds a step waits for kube-scheduler to go idle before the run fails (raise it on "
                        "a loaded machine; default %(default)s)")
    p.add_argument("--out", help="JSON file (default bench/results/placement/<UTC time>[-<label>].json)")
    p.add_argument("--label", default="", help="what the run is for, in the default file name (e.g. alibaba-cd)")
    p.add_argument("--plots", default=str(REPO / "docs" / "placement"),
                   help="directory for the PNG plots ('' for none)")
    p.add_argument("--lock-timeout", type=float, default=3600)
    p.add_argument("--instance", default=INSTANCE,
                   help="private cluster instance (its lock serializes runs of the same name; another name "
                        "runs a second matrix at the same time, on its own cluster)")
    p.add_argument("--merge", nargs="+", metavar="RESULT.json",
                   help="no cluster: combine the runs of earlier result files (e.g. a matrix run in parts; a "
                        "later file's run of the same policy and seed replaces an earlier one), summarize, plot")
    args = p.parse_args(argv)
    try:
        result_file("placement", args.label)
    except ValueError as e:
        p.error(f"--label: {e}")
    if args.merge:
        return merge(args)
    policies = [x for x in args.policies.split(",") if x]
    bad = [x for x in policies if x not in pm.POLICIES]
    if bad or not policies:
        p.error(f"unknown policies {bad}; choose from {sorted(pm.POLICIES)}")
    if args.seeds < 1 or args.jobs < 1:
        p.error("--seeds and --jobs must be >= 1")
    if args.adversarial and not args.multinode:
        p.error("--adversarial needs --multinode (its 64-GPU job is a gang)")
    try:
        reservation_settings(args)
    except ValueError as e:
        p.error(str(e))
    try:
        seeds_of(args)
    except ValueError:
        p.error(f"--seed-list must be comma-separated integers, got {args.seed_list!r}")
    try:
        if args.node_allocatable:
            shapes.parse_allocatable(args.node_allocatable)
        cluster = load_cluster(args.cluster)
        if getattr(args, "cpu_nodes", None):
            shapes.cpu_node_group(args.cpu_nodes, 1)  # fail on a bad file before starting anything
        if args.trace and args.shapes == "trace":
            shapes.trace_jobs(args.trace, 1, 1)  # fail on a bad file before starting anything
        elif args.trace:
            pm.alibaba_jobs(args.trace, 1, 1)  # fail on a bad file before starting anything
    except (ValueError, pm.WorkloadError) as e:
        print(f"bench/run placement: {e}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else result_file("placement", args.label)
    head = {"args": {k: v for k, v in vars(args).items() if k not in ("out", "plots", "merge")},
            "policies": {k: pm.POLICIES[k] for k in policies}}
    partial = out.with_suffix(".partial.json")
    try:
        with instance_lock(args.lock_timeout, args.instance):
            failed: list[dict[str, Any]] = []
            results = run_matrix(args, cluster, policies, failed, checkpoint=(partial, head))
    except (BenchError, localcluster.ClusterError, KubeError, pm.WorkloadError) as e:
        print(f"bench/run placement: {e}", file=sys.stderr)
        return 1
    if not results:
        print(f"bench/run placement: every run failed: {failed}", file=sys.stderr)
        return 1
    rc = finish(args, {**head, "failed_runs": failed}, results_as_dicts(results), out)
    partial.unlink(missing_ok=True)
    if failed:
        print(f"bench/run placement: {len(failed)} run(s) failed and are not in the results: {failed}", file=sys.stderr)
        return 1
    return rc


def results_as_dicts(results: Sequence[RunResult]) -> list[dict[str, Any]]:
    return [dict(r.__dict__) for r in results]


def merge(args: argparse.Namespace) -> int:
    """Combine the runs of several result files (same workload settings) into one document."""
    by_key: dict[tuple[str, int], dict[str, Any]] = {}  # a later file's run of a (policy, seed) wins
    policies: dict[str, str] = {}
    first_args: dict[str, Any] | None = None
    reserving_args: dict[str, Any] | None = None  # of the first file with a reserving policy's runs
    same = ("jobs", "load", "burst_load", "tick", "trace", "cluster", "shapes", "node_allocatable", "cpu_nodes",
            "until_window_end", "multinode", "adversarial")
    # Compared only between files that ran a reserving policy: no other policy reads them.
    reserving = ("reserve_after", "reserve_max_hold", "max_reservations", "reserve_deadlines")
    for f in args.merge:
        try:
            doc = json.loads(Path(f).read_text())
        except (OSError, ValueError) as e:
            print(f"bench/run placement: cannot read {f}: {e}", file=sys.stderr)
            return 2
        if first_args is not None and any(doc["args"].get(k) != first_args.get(k) for k in same):
            print(f"bench/run placement: {f} was run with other workload settings ({same})", file=sys.stderr)
            return 2
        if any(r["policy"] in reserve.RESERVING_POLICIES for r in doc["runs"]):
            if reserving_args is not None and any(doc["args"].get(k) != reserving_args.get(k) for k in reserving):
                print(f"bench/run placement: {f} was run with other reservation settings ({reserving})",
                      file=sys.stderr)
                return 2
            reserving_args = reserving_args or doc["args"]
        first_args = first_args or doc["args"]
        for r in doc["runs"]:
            key = (r["policy"], int(r["seed"]))
            if key in by_key:
                log(f"({key[0]}) seed {key[1]}: the run in {f} replaces an earlier one")
            by_key[key] = r
        policies.update(doc["policies"])
    runs = [by_key[k] for k in sorted(by_key)]
    out = Path(args.out) if args.out else result_file("placement", args.label or "merged")
    if reserving_args is not None and first_args is not None:  # the reservation settings the (g) runs had
        first_args = {**first_args, **{k: reserving_args.get(k) for k in reserving}}
    return finish(args, {"args": first_args, "policies": dict(sorted(policies.items())), "merged_from": args.merge},
                  runs, out)


def finish(args: argparse.Namespace, head: dict[str, Any], runs: list[dict[str, Any]], out: Path) -> int:
    """Summarize runs (intervals per policy), write the JSON, print the table, draw the plots."""
    summary: dict[str, Any] = {}
    for policy in sorted({r["policy"] for r in runs}):
        summary[policy] = pm.aggregate([r["metrics"] for r in runs if r["policy"] == policy])
    doc = {"benchmark": "placement", "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()},
           **head, "summary": summary, "runs": runs}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, default=float))
    log(f"results: {out}")
    print_table(summary)
    rows = gang.TABLE_ROWS if getattr(args, "multinode", False) else TABLE_ROWS
    out.with_suffix(".md").write_text(markdown_table(summary, rows) + "\n")
    if args.plots:
        try:  # matplotlib is the optional [bench] extra
            from bench.placement import plots as placement_plots
        except ImportError as e:
            log(f"no plots ({e}); install the bench extra: pip install -e '.[bench]'")
        else:
            for f in placement_plots.plot_all(doc, Path(args.plots)):
                log(f"plot: {f}")
    return 0


def start_private_cluster(attempts: int = 3, instance: str = INSTANCE,
                          features: Sequence[str] = ()) -> localcluster.Cluster:
    """A private instance on fresh free ports; another process may take a port between the pick and
    the bind (the tests pick from the same range), so a failed start is retried on new ports."""
    for attempt in range(1, attempts + 1):
        lc = localcluster.Cluster.private(instance)
        try:
            lc.up(build=False, features=list(features))
            return lc
        except localcluster.ClusterError as e:
            if attempt == attempts:
                raise
            log(f"private cluster did not start on {lc.ports} ({str(e).splitlines()[0]}); new ports")
    raise AssertionError("unreachable")


def write_checkpoint(path: Path, head: Mapping[str, Any], results: Sequence[RunResult]) -> None:
    """The runs so far as a document ``--merge`` reads: a matrix stopped before its end (deadline, SIGTERM)
    still leaves its finished runs (``<out>.partial.json``, removed once the result is written)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({**head, "runs": results_as_dicts(results)}, default=float))
    tmp.replace(path)


def run_matrix(args: argparse.Namespace, cluster: SimulatedCluster, policies: Sequence[str],
               failed: list[dict[str, Any]],
               checkpoint: tuple[Path, Mapping[str, Any]] | None = None) -> list[RunResult]:
    """Every (policy, seed) run; a run that fails is logged into ``failed`` and the matrix goes on."""
    t0 = time.monotonic()
    # use_policy restarts kube-scheduler with the first policy's configuration
    lc = start_private_cluster(instance=args.instance, features=gang.features(policies))
    env: Env | None = None
    results: list[RunResult] = []
    try:
        # 60 s per API call, not 15: on a loaded 2-core machine a list of 500 pods timed out and lost runs
        kube = Kube(make_transport(str(lc.admin_kubeconfig)), timeout=API_TIMEOUT)
        matches = install_classes(kube)
        label = uuid.uuid4().hex[:6]
        sim, node_su = publish(kube, prefixed(cluster, "", label))
        if args.node_allocatable:
            override_allocatable(kube, list(node_su), shapes.parse_allocatable(args.node_allocatable))
        if getattr(args, "cpu_nodes", None):
            add_cpu_nodes(kube, shapes.cpu_node_group(args.cpu_nodes, len(node_su)), label)
        inv = build_inventory(kube, node_su, matches)
        env = Env(lc=lc, kube=kube, inv=inv, node_selector={NODE_LABEL: label}, fabric=gang.fabric_of(sim.nodes))
        log(f"cluster ready in {time.monotonic() - t0:.0f}s: {len(inv.nodes)} nodes, {inv.total()} GPUs")
        # --paired: seed after seed, every policy per seed (a matrix cut short still has paired runs)
        order = [(p, s) for s in seeds_of(args) for p in policies] if args.paired else \
            [(p, s) for p in policies for s in seeds_of(args)]
        for policy, seed in order:
            env.use_policy(policy)
            try:
                results.append(run_once(env, args, policy, seed))
                if checkpoint is not None:
                    write_checkpoint(checkpoint[0], checkpoint[1], results)
            except (BenchError, KubeError) as e:  # e.g. --run-timeout, an overloaded apiserver: go on
                log(f"({policy}) seed {seed} failed: {e}")
                failed.append({"policy": policy, "seed": seed, "error": str(e)})
    finally:
        if env is not None:
            env.stop_scorer()
        os.environ.setdefault("TOPODRA_LOG_ARCHIVE", str(REPO / ".run" / "placement-logs" / "cluster"))
        lc.down(quiet=True, keep_logs=True)
    return results


def seeds_of(args: argparse.Namespace) -> list[int]:
    if args.seed_list:
        return [int(x) for x in args.seed_list.split(",") if x]
    return list(range(args.seed0, args.seed0 + args.seeds))


def reservation_settings(args: argparse.Namespace) -> reserve.Settings:
    """Policy (g)'s parameters from the command line (defaults: ``reserve.Settings``)."""
    d = reserve.Settings()
    return reserve.Settings(after_s=getattr(args, "reserve_after", d.after_s),
                            max_hold_s=getattr(args, "reserve_max_hold", d.max_hold_s),
                            max_reservations=getattr(args, "max_reservations", d.max_reservations),
                            deadlines=getattr(args, "reserve_deadlines", d.deadlines),
                            grace_s=getattr(args, "reserve_grace", d.grace_s),
                            cooldown_s=getattr(args, "reserve_cooldown", d.cooldown_s),
                            backfill=getattr(args, "backfill", "on") == "on",
                            whole_server=getattr(args, "reserve_whole_server", "off") == "on",
                            narrower_within_s=getattr(args, "reserve_narrower_within", d.narrower_within_s),
                            min_gpus=getattr(args, "reserve_min_gpus", d.min_gpus),
                            window_margin_s=max(float(getattr(args, "tick", 0.0) or 0.0), 1.0))


def run_once(env: Env, args: argparse.Namespace, policy: str, seed: int) -> RunResult:
    name, jobs = workload(args, seed, env.inv.total())
    replay = Replay(env, policy, jobs, args.tick, args.settle, args.run_timeout,
                    until_window_end=getattr(args, "until_window_end", False),
                    reservation=reservation_settings(args), idle_timeout=getattr(args, "idle_timeout", 120.0))
    replay.setup()
    try:
        r = replay.execute()
    finally:
        replay.teardown()
    r.seed, r.workload = seed, name
    m = r.metrics
    log(f"({policy}) seed {seed}: {r.events} events in {r.steps} steps, {r.wall_s:.0f}s wall; "
        f"util {m['utilisation']:.3f} goodput {m['goodput']:.3f} stranded {m['stranded_gpus']:.1f} "
        f"p95 wait 8-GPU {m['wait_p95_s'].get('8', math.nan):.0f}s violations {m['type_violations']} "
        f"unplaced {m['unplaced']}; waiting though they fit: {len(r.missed)} job-steps; phases {r.phases_s}")
    if "reservations_made" in m:
        log(f"({policy}) seed {seed}: {m['reservations_made']} reservations, "
            f"{m['reservation_idle_gpu_hours']:.1f} GPU-hours held idle, {m['reservations_expired']} expired, "
            f"leaked {m['reservations_leaked']}")
    if "big_job_started" in m:
        log(f"({policy}) seed {seed}: the 64-GPU job waited {m['big_job_wait_s']:.0f}s "
            f"(started: {m['big_job_started']}, in the window: {m['big_job_started_in_window']})")
    return r


if __name__ == "__main__":
    exit_on_sigterm()
    sys.exit(main())
