"""``bench/run schedule_throughput``: kube-scheduler pods/s with DRA claims on 500 simulated nodes x 8 GPUs.

One local private cluster (``hack/testkit/cluster.py``) gets 500 kubelet-less nodes, created Ready, each with
one DGX-H100 pool (8 GPUs + 8 NICs) cloned from one run of the real mock discovery. Every variant (scenario,
with or without the scorer) then runs on it in turn (``Bed``): with kube-scheduler stopped, the previous
variant's claims and pods are deleted, the slices put in the scenario's form, and the ResourceClaims and pods
(1-GPU claims and 8-GPU NVLink claims, interleaved in a seeded order) created; kube-scheduler is started
again and its ``scheduler_schedule_attempts_total{result="scheduled"}`` counter sampled. Throughput is the
slope between 10% and 90% of the pods scheduled (scheduler_perf reports the same kind of number: its DRA
thresholds are 40-120 pods/s on CI hardware with 500 nodes). Until 2026-12-02 each variant started a fresh
cluster; a restarted kube-scheduler (and scorer) lists everything again, so what it sees is the same.

Claims are created up front by the benchmark, so kube-controller-manager's claim creation (about 11
claims/s at its default client QPS) is not measured; kube-scheduler's own client is left at its
defaults.

Scenarios: ``full`` (topodra's slices as published, 1-GPU and 8-GPU-NVLink claims), ``stripped``
(the same claims on slices whose devices carry only type, model, nvlinkDomain and rail: the cost
of our attributes), ``topology`` (ClaimProfile-rendered claims with ``nic: RailAligned`` and
``nvlink: Required``: one GPU+NIC request pair per GPU with a rail constraint each); each without
and with ``topodra placement-scorer`` as the scheduler's extender.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import random
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.paths import REPO, result_file, utc_stamp
from bench.placement import model as pm
from bench.placement.main import (
    INSTANCE,
    RES,
    BenchError,
    Env,
    histogram_quantiles,
    install_classes,
    instance_lock,
    metric_sum,
    parse_metrics,
    wait_untainted,
)
from testkit import cluster as localcluster

from topodra.controller.profile import ClaimProfile
from topodra.controller.render import claim_spec
from topodra.devices import AttributeValue, Device
from topodra.kube import Kube, KubeError, Obj, make_transport
from topodra.simulate import SimNode, discover, fake_node, fake_node_status
from topodra.slices import build_slices

CORE = "/api/v1"
PROFILE = "dgx-h100"
TEMPLATE_NODE = "tmpl-node"
GPU_CLASS = "gpu-h100"
STRIPPED_KEEP = ("type", "model", "nvlinkDomain", "rail")
SCENARIOS = {
    "full": "topodra's full slices; 1-GPU and 8-GPU nvlink-Required claims",
    "stripped": "the same claims on slices stripped to 4 attributes (type, model, nvlinkDomain, rail)",
    "topology": "ClaimProfile claims with nic RailAligned + nvlink Required (GPU+NIC pairs, rail constraints)",
}


def log(msg: str) -> None:
    print(f"[throughput {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- pure parts


def clone_devices(devices: Sequence[Device], template: str, node: str) -> list[Device]:
    """The template node's devices as another node's: node-derived strings (the NVLink domain) and
    UUIDs made unique, so every node has its own NVLink domain as real servers do."""
    out = []
    for d in devices:
        attrs: dict[str, AttributeValue] = {}
        for k, v in d.attributes.items():
            if v.string is not None and template in v.string:
                v = AttributeValue(string=v.string.replace(template, node))
            elif k == "uuid" and v.string is not None:
                v = AttributeValue(string=f"GPU-{uuid.uuid5(uuid.NAMESPACE_DNS, f'{node}/{d.name}')}")
            attrs[k] = v
        out.append(d.model_copy(update={"attributes": attrs}))
    return out


def strip_devices(devices: Sequence[Device], keep: Sequence[str] = STRIPPED_KEEP) -> list[Device]:
    """Only the attributes in ``keep`` (those present); capacity stays."""
    return [d.model_copy(update={"attributes": {k: v for k, v in d.attributes.items() if k in keep}})
            for d in devices]


def claim_specs(scenario: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(1-GPU claim spec, 8-GPU claim spec) of a scenario."""
    if scenario in ("full", "stripped"):
        one = {"devices": {"requests": [{"name": "gpus", "exactly": {
            "deviceClassName": GPU_CLASS, "allocationMode": "ExactCount", "count": 1}}]}}
        eight = {"devices": {"requests": [{"name": "gpus", "exactly": {
            "deviceClassName": GPU_CLASS, "allocationMode": "ExactCount", "count": 8}}],
            "constraints": [{"requests": ["gpus"], "matchAttribute": pm.NVLINK_ATTR}]}}
        return one, eight
    if scenario == "topology":
        def rendered(count: int) -> dict[str, Any]:
            return claim_spec(ClaimProfile.from_api({
                "metadata": {"name": "p", "namespace": "bench"},
                "spec": {"alternatives": [{"deviceClassName": GPU_CLASS, "count": count}],
                         "topology": {"nvlink": "Required", "nic": "RailAligned"}}}), driver=pm.DRIVER)
        return rendered(1), rendered(8)
    raise ValueError(f"unknown scenario {scenario!r}; known: {sorted(SCENARIOS)}")


def pod_mix(n_one: int, n_eight: int, seed: int) -> list[int]:
    """GPU counts of the pods in submission order: a seeded shuffle of the 1- and 8-GPU pods."""
    sizes = [1] * n_one + [8] * n_eight
    random.Random(seed).shuffle(sizes)
    return sizes


def throughput(samples: Sequence[tuple[float, float]], total: int, lo: float = 0.1, hi: float = 0.9) -> float:
    """Pods/s between the moments ``lo`` and ``hi`` of ``total`` pods were scheduled (linear
    interpolation between (time, scheduled count) samples); NaN if ``hi`` was never reached."""
    def when(target: float) -> float | None:
        for (t0, c0), (t1, c1) in itertools.pairwise(samples):
            if c0 < target <= c1:
                return t0 + (t1 - t0) * (target - c0) / (c1 - c0)
        return None

    a, b = when(lo * total), when(hi * total)
    if a is None or b is None or b <= a:
        return math.nan
    return (hi - lo) * total / (b - a)


def cpu_per_pod(samples: Sequence[tuple[float, float]], cpu: Sequence[Sequence[float]], total: int,
                lo: float = 0.1, hi: float = 0.9) -> list[float]:
    """CPU seconds per pod scheduled of each process column of ``cpu`` (one row per sample, taken with
    ``samples``), between the first samples at or past ``lo`` and ``hi`` of ``total``; NaNs when the window
    is not there. Unlike pods/s, a process's CPU per pod hardly moves with the load of a shared machine."""
    a = next((i for i, (_t, c) in enumerate(samples) if c >= lo * total), None)
    b = next((i for i, (_t, c) in enumerate(samples) if c >= hi * total), None)
    width = len(cpu[0]) if cpu else 0
    if a is None or b is None or samples[b][1] <= samples[a][1]:
        return [math.nan] * width
    pods = samples[b][1] - samples[a][1]
    return [(cpu[b][k] - cpu[a][k]) / pods for k in range(width)]


def process_cpu(pid: int | None) -> float:
    """User + system CPU seconds of a live process (0 when there is none)."""
    if not pid:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# --------------------------------------------------------------------------- one scenario


@dataclass
class Result:
    scenario: str
    scorer: bool
    pods: int
    scheduled: int
    pods_per_s: float
    pods_per_s_overall: float
    seconds: float
    mean_attempt_ms: float
    scorer_latency: dict[str, float]
    samples: list[tuple[float, float]]
    gpu_attributes: int = 0  # attributes of a GPU in the slices the variant ran on (read back from the API)
    # CPU ms per pod scheduled (10-90% window) of kube-scheduler, kube-apiserver, the scorer and this process.
    cpu_ms_per_pod: dict[str, float] = field(default_factory=dict)


WORKERS = 8  # concurrent requests while publishing and creating: the client's pool size (topodra.kube)
SLICE_FORM = {"full": False, "stripped": True, "topology": False}  # scenario -> stripped slices?


def node_slices(devices: Sequence[Device], name: str, uid: str, stripped: bool) -> list[dict[str, Any]]:
    devs = clone_devices(devices, TEMPLATE_NODE, name)
    return build_slices(pm.DRIVER, name, uid, strip_devices(devs) if stripped else devs, 1)


def publish_nodes(kube: Kube, names: Sequence[str], devices: Sequence[Device], stripped: bool) -> dict[str, str]:
    """Nodes created Ready (a Node takes its status on create) and their slices; node -> UID.

    The apiserver's TaintNodesByCondition admission gives every new Node ``node.kubernetes.io/not-ready``
    whatever its status says; kube-controller-manager's node lifecycle controller lifts it from Ready nodes
    a few per second (105 s for 500 nodes, 2026-11-30). The benchmark lifts it itself, one patch per node,
    as that controller would for a Ready node; ``wait_untainted`` then only checks."""
    def one(name: str) -> tuple[str, str]:
        node = kube.create(f"{CORE}/nodes", {**fake_node(name, {"topodra.io/profile": PROFILE}),
                                            **fake_node_status(name)})
        kube.merge_patch(f"{CORE}/nodes/{name}", {"spec": {"taints": None}})
        uid = str(node["metadata"]["uid"])
        for sl in node_slices(devices, name, uid, stripped):
            kube.create(f"{RES}/resourceslices", sl)
        return name, uid

    with ThreadPoolExecutor(WORKERS) as pool:
        return dict(pool.map(one, names))


def replace_slices(kube: Kube, uids: dict[str, str], devices: Sequence[Device], stripped: bool) -> None:
    """Every node's slices in the other form, same names and pool generation, one merge patch each (the
    scheduler is stopped and relists on its restart, so no watcher sees a half-switched cluster)."""
    def one(item: tuple[str, str]) -> None:
        name, uid = item
        for sl in node_slices(devices, name, uid, stripped):
            kube.merge_patch(f"{RES}/resourceslices/{sl['metadata']['name']}", {"spec": sl["spec"]})

    with ThreadPoolExecutor(WORKERS) as pool:
        list(pool.map(one, uids.items()))


def create_workload(kube: Kube, ns: str, sizes: Sequence[int], specs: tuple[dict[str, Any], dict[str, Any]]) -> None:
    """A claim and a pod per entry of ``sizes``, named ``p00000``... in submission order.

    Created while kube-scheduler is stopped: on its start it lists the pods (in name order, etcd's key
    order) and queues them in that order, so creation order does not matter and the requests run
    concurrently."""
    def one(item: tuple[int, int]) -> None:
        i, size = item
        name = f"p{i:05d}"
        kube.create(f"{RES}/namespaces/{ns}/resourceclaims", {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
            "spec": specs[0] if size == 1 else specs[1]})
        kube.create(f"{CORE}/namespaces/{ns}/pods", {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 0,
                     "resourceClaims": [{"name": "gpus", "resourceClaimName": name}],
                     "containers": [{"name": "main", "image": "localhost/busybox:1.35",
                                     "resources": {"claims": [{"name": "gpus"}]}}]}})

    with ThreadPoolExecutor(WORKERS) as pool:
        list(pool.map(one, enumerate(sizes)))


def clear_workload(kube: Kube, slow: Kube, ns: str, timeout: float = 300) -> int:
    """Delete every claim and pod of ``ns`` with kube-scheduler stopped; returns the claims deleted.

    Claims go first, their delete-protection finalizer (the scheduler's, on allocation) removed by us:
    left to kube-controller-manager (20 requests/s), releasing thousands of claims would take minutes and
    its writes would run into the next variant's measurement. Pods have no kubelet and a grace period of 0,
    so one delete-collection removes them at once. ``slow``: a client whose timeout outlasts a
    delete-collection of thousands of objects (the apiserver deletes them one by one)."""
    claims = list(kube.list(f"{RES}/namespaces/{ns}/resourceclaims"))

    def unprotect(c: Obj) -> None:
        if c["metadata"].get("finalizers"):
            kube.merge_patch(f"{RES}/namespaces/{ns}/resourceclaims/{c['metadata']['name']}",
                             {"metadata": {"finalizers": None}})

    with ThreadPoolExecutor(WORKERS) as pool:
        list(pool.map(unprotect, claims))
    slow.request("DELETE", f"{RES}/namespaces/{ns}/resourceclaims")
    slow.request("DELETE", f"{CORE}/namespaces/{ns}/pods", body={
        "apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0})
    deadline = time.monotonic() + timeout
    while True:
        left = (sum(1 for _ in kube.list(f"{RES}/namespaces/{ns}/resourceclaims"))
                + sum(1 for _ in kube.list(f"{CORE}/namespaces/{ns}/pods")))
        if not left:
            return len(claims)
        if time.monotonic() > deadline:
            raise BenchError(f"{left} claims and pods of namespace {ns} still there {timeout:.0f}s after deletion")
        time.sleep(0.5)


class Bed:
    """One private cluster of ``args.nodes`` kubelet-less DGX-H100 nodes, reused for every variant.

    Each ``run`` measures one (scenario, scorer) variant from the same state a fresh cluster had: the
    previous variant's claims and pods deleted, the slices in the scenario's form (``SLICE_FORM``), a new
    kube-scheduler (and scorer) that lists everything on its start. Publishing 2,048 nodes and waiting for
    their untaint once instead of four times is what lets bench/scale run this row at every size."""

    NS = "tp"

    def __init__(self, args: argparse.Namespace, devices: Sequence[Device], stripped_first: bool = False) -> None:
        self.args = args
        self.stripped_first = stripped_first  # the form the slices are published in
        self.devices = devices
        self.lc = localcluster.Cluster.private(INSTANCE)
        # Stock scoring, the queue settings of bench/placement; the client QPS of --scheduler-qps.
        self.cfg = pm.scheduler_config("b", client={"qps": args.scheduler_qps, "burst": 2 * args.scheduler_qps})
        self.pprof_dir = Path(args.pprof_dir) if getattr(args, "pprof_dir", None) else None
        if self.pprof_dir is not None:
            self.cfg["enableProfiling"] = True  # /debug/pprof on the secure port, for the admin
        self.uids: dict[str, str] = {}
        self.stripped: bool | None = None
        self.setup_s = math.nan

    def __enter__(self) -> Bed:
        t0 = time.monotonic()
        self.lc.up(build=False, scheduler_config=self.cfg)
        try:
            self.kube = Kube.from_kubeconfig(str(self.lc.admin_kubeconfig))
            self.slow = Kube(make_transport(str(self.lc.admin_kubeconfig)), timeout=300)
            pid = self.lc.running().get("kube-scheduler")
            if pid:
                self.lc._stop("kube-scheduler", pid)  # scheduling is held until a variant starts it
            install_classes(self.kube)
            names = [f"tp-{i:04d}" for i in range(self.args.nodes)]
            t1 = time.monotonic()
            self.uids = publish_nodes(self.kube, names, self.devices, stripped=self.stripped_first)
            self.stripped = self.stripped_first
            log(f"{self.args.nodes} nodes and slices published in {time.monotonic() - t1:.0f}s")
            wait_untainted(self.kube, names, timeout=120)
            self.kube.create(f"{CORE}/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                    "metadata": {"name": self.NS}})
            deadline = time.monotonic() + 60
            while self.kube.get(f"{CORE}/namespaces/{self.NS}/serviceaccounts/default") is None:
                if time.monotonic() > deadline:
                    raise BenchError("no default ServiceAccount in the benchmark namespace after 60 s")
                time.sleep(0.2)
        except BaseException:
            self.__exit__()
            raise
        self.setup_s = time.monotonic() - t0
        return self

    def __exit__(self, *_exc: object) -> None:
        for client in (getattr(self, "kube", None), getattr(self, "slow", None)):
            if client is not None:
                client.close()
        os.environ.setdefault("TOPODRA_LOG_ARCHIVE", str(REPO / ".run" / "throughput-logs"))
        self.lc.down(quiet=True, keep_logs=True)

    def use_slices(self, stripped: bool) -> None:
        if stripped != self.stripped:
            t0 = time.monotonic()
            replace_slices(self.kube, self.uids, self.devices, stripped)
            self.stripped = stripped
            log(f"slices of {len(self.uids)} nodes made {'stripped' if stripped else 'full'} "
                f"in {time.monotonic() - t0:.0f}s")

    def start_profile(self, name: str) -> threading.Thread | None:
        """With ``args.pprof_dir``: kube-scheduler's CPU profile of the first ``args.pprof_seconds`` of
        scheduling (Go's pprof format; ``go tool pprof -top FILE``), fetched in the background."""
        if self.pprof_dir is None:
            return None
        out = self.pprof_dir / f"{self.args.nodes}-{name}.pprof"
        url = f"https://127.0.0.1:{self.lc.ports.scheduler}/debug/pprof/profile?seconds={self.args.pprof_seconds}"

        def fetch() -> None:
            try:
                with urllib.request.urlopen(url, context=self.lc._scheduler_ssl(),
                                            timeout=self.args.pprof_seconds + 60) as r:
                    out.write_bytes(r.read())
                log(f"scheduler CPU profile: {out}")
            except OSError as e:
                log(f"scheduler CPU profile failed: {e}")

        self.pprof_dir.mkdir(parents=True, exist_ok=True)
        t = threading.Thread(target=fetch, daemon=True)
        t.start()
        return t

    def gpu_attributes(self) -> int:
        """How many attributes the first node's first GPU has as stored: the slice form really in effect."""
        node = next(iter(self.uids))
        for sl in self.kube.list(f"{RES}/resourceslices", field_selector=f"spec.nodeName={node}"):
            for d in sl["spec"].get("devices") or []:
                if (d.get("attributes") or {}).get("type", {}).get("string") == "gpu":
                    return len(d["attributes"])
        raise BenchError(f"no GPU in the slices of node {node}")

    def run(self, scenario: str, scorer: bool) -> Result:
        args, kube, lc = self.args, self.kube, self.lc
        specs = claim_specs(scenario)  # an unknown scenario fails before the cluster changes
        t0 = time.monotonic()
        cleared = clear_workload(kube, self.slow, self.NS)
        if cleared:
            log(f"previous variant's {cleared} claims and pods deleted in {time.monotonic() - t0:.0f}s")
        self.use_slices(SLICE_FORM[scenario])
        gpu_attributes = self.gpu_attributes()
        sizes = pod_mix(args.one_gpu_pods, args.eight_gpu_pods, args.seed)
        t0 = time.monotonic()
        create_workload(kube, self.NS, sizes, specs)
        log(f"{len(sizes)} claims + pods created in {time.monotonic() - t0:.0f}s (scheduler stopped)")
        env = Env(lc=lc, kube=kube, inv=pm.NodeCapacity({}, {}, {}, {}), node_selector={})
        try:
            extender = env.start_scorer() if scorer else None
            scorer0 = env.scorer_metrics()
            t_start = time.monotonic()
            samples: list[tuple[float, float]] = [(0.0, 0.0)]  # nothing is scheduled before the start
            lc.restart_scheduler(self.cfg, extender)
            running = lc.running()
            pids = {"scheduler": running.get("kube-scheduler"), "apiserver": running.get("kube-apiserver"),
                    "scorer": env.scorer.pid if env.scorer is not None else None,
                    "bench": os.getpid()}  # this sampling loop's own share of the 2 cores
            cpu: list[list[float]] = [[process_cpu(p) for p in pids.values()]]
            profiler = self.start_profile(f"{scenario}{'-scorer' if scorer else ''}")
            last_change, last = time.monotonic(), -1.0
            while True:
                try:
                    text = lc.scheduler_metrics()
                except urllib.error.HTTPError as e:
                    # Healthy before its delegated authentication has read the client CA: 401/403 for a moment.
                    if e.code not in (401, 403) or time.monotonic() - t_start > 60:
                        raise
                    time.sleep(0.1)
                    continue
                m = parse_metrics(text)
                done = metric_sum(m, "scheduler_schedule_attempts_total", result="scheduled")
                now = time.monotonic()
                samples.append((now - t_start, done))
                cpu.append([process_cpu(p) for p in pids.values()])
                if done != last:
                    last_change, last = now, done
                if done >= len(sizes) or now - last_change > args.stall or now - t_start > args.timeout:
                    break
                time.sleep(0.25)
            if profiler is not None:
                profiler.join()
            pid = lc.running().get("kube-scheduler")
            if pid:
                lc._stop("kube-scheduler", pid)
            latency = histogram_quantiles(env.scorer_metrics(), "prioritize", before=scorer0)
        finally:
            env.stop_scorer()
        busy = metric_sum(m, "scheduler_scheduling_attempt_duration_seconds_sum")
        attempts = metric_sum(m, "scheduler_schedule_attempts_total")
        first = next((t0 for (t0, _c0), (_t1, c1) in itertools.pairwise(samples) if c1 > 0), 0.0)
        overall = done / (samples[-1][0] - first) if samples[-1][0] > first else math.nan
        r = Result(scenario=scenario, scorer=scorer, pods=len(sizes), scheduled=int(done),
                   pods_per_s=throughput(samples, len(sizes)), pods_per_s_overall=overall,
                   seconds=samples[-1][0], mean_attempt_ms=busy / attempts * 1000 if attempts else math.nan,
                   scorer_latency=latency, samples=samples, gpu_attributes=gpu_attributes,
                   cpu_ms_per_pod={k: v * 1000 for k, v in zip(pids, cpu_per_pod(samples, cpu, len(sizes)),
                                                               strict=True) if pids[k]})
        log(f"{scenario}{' + scorer' if scorer else ''}: {r.scheduled}/{r.pods} scheduled, "
            f"{r.pods_per_s:.1f} pods/s (10-90%), {overall:.1f} overall, attempt {r.mean_attempt_ms:.1f} ms, "
            "CPU ms/pod "
            + ", ".join(f"{k} {v:.1f}" for k, v in r.cpu_ms_per_pod.items())
            + (f", prioritize p50 {r.scorer_latency.get('p50_ms', math.nan):.1f} ms "
               f"p99 {r.scorer_latency.get('p99_ms', math.nan):.1f} ms" if scorer else ""))
        return r


def run_scenario(args: argparse.Namespace, scenario: str, scorer: bool, devices: Sequence[Device]) -> Result:
    """One variant on a cluster of its own."""
    with Bed(args, devices, stripped_first=SLICE_FORM[scenario]) as bed:
        return bed.run(scenario, scorer)


def run_variants(args: argparse.Namespace, variants: Sequence[tuple[str, bool]],
                 devices: Sequence[Device]) -> list[Result]:
    """Every (scenario, scorer) variant in order on one cluster (``Bed``)."""
    with Bed(args, devices, stripped_first=bool(variants) and SLICE_FORM[variants[0][0]]) as bed:
        return [bed.run(sc, scorer) for sc, scorer in variants]


def template_devices() -> list[Device]:
    return discover(SimNode(name=TEMPLATE_NODE, profile=PROFILE, labels={}, overrides={}))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/run schedule_throughput", description=__doc__.split("\n\n")[0])
    p.add_argument("--scenarios", default="full,stripped,topology")
    p.add_argument("--scorer", choices=["both", "off", "on"], default="both")
    p.add_argument("--nodes", type=int, default=500)
    p.add_argument("--one-gpu-pods", type=int, default=1000)
    p.add_argument("--eight-gpu-pods", type=int, default=125)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--scheduler-qps", type=int, default=pm.SCHEDULER_CLIENT["qps"],
                   help="kube-scheduler's client QPS (burst twice that); Kubernetes' default is 50")
    p.add_argument("--stall", type=float, default=30, help="stop when nothing was scheduled for this long")
    p.add_argument("--timeout", type=float, default=600, help="seconds one scenario may schedule")
    p.add_argument("--pprof-dir", help="write kube-scheduler's CPU profile of each variant here")
    p.add_argument("--pprof-seconds", type=int, default=20, help="how long each profile samples")
    p.add_argument("--out", help="JSON file (default bench/results/schedule_throughput/<UTC time>.json)")
    p.add_argument("--lock-timeout", type=float, default=3600)
    args = p.parse_args(argv)
    scenarios = [s for s in args.scenarios.split(",") if s]
    bad = [s for s in scenarios if s not in SCENARIOS]
    if bad or not scenarios:
        p.error(f"unknown scenarios {bad}; choose from {sorted(SCENARIOS)}")
    if args.one_gpu_pods + 8 * args.eight_gpu_pods > 8 * args.nodes:
        p.error("the pods ask for more GPUs than the nodes have")
    scorers = {"both": [False, True], "off": [False], "on": [True]}[args.scorer]
    devices = template_devices()
    results: list[Result] = []
    try:
        with instance_lock(args.lock_timeout):
            results = run_variants(args, [(sc, on) for sc in scenarios for on in scorers], devices)
    except (BenchError, localcluster.ClusterError, KubeError) as e:
        print(f"bench/run schedule_throughput: {e}", file=sys.stderr)
        return 1
    now = time.time()
    stamp = utc_stamp(now)
    out = Path(args.out) if args.out else result_file("schedule_throughput", when=now)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "schedule-throughput", "created": stamp,
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "args": vars(args), "scenarios": {s: SCENARIOS[s] for s in scenarios},
        "results": [r.__dict__ for r in results]}, indent=1, default=float))
    print(f"{'scenario':10s} {'scorer':7s} {'pods':>6s} {'sched':>6s} {'pods/s':>8s} {'overall':>8s} "
          f"{'attempt ms':>10s} {'prio p50':>9s} {'prio p99':>9s}")
    for r in results:
        lat = r.scorer_latency
        print(f"{r.scenario:10s} {'on' if r.scorer else 'off':7s} {r.pods:6d} {r.scheduled:6d} {r.pods_per_s:8.1f} "
              f"{r.pods_per_s_overall:8.1f} {r.mean_attempt_ms:10.1f} {lat.get('p50_ms', math.nan):9.2f} "
              f"{lat.get('p99_ms', math.nan):9.2f}")
    for sc in scenarios:
        off = next((r for r in results if r.scenario == sc and not r.scorer), None)
        on = next((r for r in results if r.scenario == sc and r.scorer), None)
        if off and on and off.pods_per_s > 0:
            print(f"{sc}: the scorer costs {100 * (1 - on.pods_per_s / off.pods_per_s):.0f}% of throughput "
                  "(target <= 20%)")
    log(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
