"""``bench/run schedule_throughput``: kube-scheduler pods/s with DRA claims on 500 simulated nodes x 8 GPUs.

Per scenario a fresh local cluster (``hack/testkit/cluster.py``) gets 500 kubelet-less nodes, each with
one DGX-H100 pool (8 GPUs + 8 NICs) cloned from one run of the real mock discovery. Then, with
kube-scheduler stopped, the benchmark creates the ResourceClaims and pods (1-GPU claims and
8-GPU NVLink claims, interleaved in a seeded order), starts kube-scheduler again and samples its
``scheduler_schedule_attempts_total{result="scheduled"}`` counter. Throughput is the slope
between 10% and 90% of the pods scheduled (scheduler_perf reports the same kind of number: its
DRA thresholds are 40-120 pods/s on CI hardware with 500 nodes).

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
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
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
from topodra.kube import Kube, KubeError
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


def publish_nodes(kube: Kube, names: Sequence[str], devices: Sequence[Device], stripped: bool) -> None:
    def one(name: str) -> None:
        node = kube.create(f"{CORE}/nodes", fake_node(name, {"topodra.io/profile": PROFILE}))
        kube.merge_patch(f"{CORE}/nodes/{name}/status", fake_node_status(name))
        devs = clone_devices(devices, TEMPLATE_NODE, name)
        if stripped:
            devs = strip_devices(devs)
        for sl in build_slices(pm.DRIVER, name, node["metadata"]["uid"], devs, 1):
            kube.create(f"{RES}/resourceslices", sl)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, names))


def create_workload(kube: Kube, ns: str, sizes: Sequence[int], specs: tuple[dict[str, Any], dict[str, Any]]) -> None:
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

    # Submission order matters to the queue (FIFO by creation): create in order, 4 at a time.
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, enumerate(sizes)))


def run_scenario(args: argparse.Namespace, scenario: str, scorer: bool, devices: Sequence[Device]) -> Result:
    lc = localcluster.Cluster.private(INSTANCE)
    # Stock scoring, the queue settings of bench/placement; the client QPS of --scheduler-qps.
    cfg = pm.scheduler_config("b", client={"qps": args.scheduler_qps, "burst": 2 * args.scheduler_qps})
    lc.up(build=False, scheduler_config=cfg)
    env: Env | None = None
    try:
        kube = Kube.from_kubeconfig(str(lc.admin_kubeconfig))
        install_classes(kube)
        t0 = time.monotonic()
        names = [f"tp-{i:03d}" for i in range(args.nodes)]
        publish_nodes(kube, names, devices, stripped=scenario == "stripped")
        log(f"{args.nodes} nodes and slices published in {time.monotonic() - t0:.0f}s")
        wait_untainted(kube, names)
        pid = lc.running().get("kube-scheduler")
        if pid:
            lc._stop("kube-scheduler", pid)  # hold scheduling while the workload is created
        ns = "tp"
        kube.create(f"{CORE}/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
        deadline = time.monotonic() + 60
        while kube.get(f"{CORE}/namespaces/{ns}/serviceaccounts/default") is None:
            if time.monotonic() > deadline:
                raise BenchError("no default ServiceAccount in the benchmark namespace after 60 s")
            time.sleep(0.2)
        sizes = pod_mix(args.one_gpu_pods, args.eight_gpu_pods, args.seed)
        t0 = time.monotonic()
        create_workload(kube, ns, sizes, claim_specs(scenario))
        log(f"{len(sizes)} claims + pods created in {time.monotonic() - t0:.0f}s (scheduler stopped)")
        env = Env(lc=lc, kube=kube, inv=pm.NodeCapacity({}, {}, {}, {}), node_selector={})
        extender = env.start_scorer() if scorer else None
        scorer0 = env.scorer_metrics()
        t_start = time.monotonic()
        samples: list[tuple[float, float]] = [(0.0, 0.0)]  # nothing is scheduled before the restart
        lc.restart_scheduler(cfg, extender)
        last_change, last = time.monotonic(), -1.0
        while True:
            m = parse_metrics(lc.scheduler_metrics())
            done = metric_sum(m, "scheduler_schedule_attempts_total", result="scheduled")
            now = time.monotonic()
            samples.append((now - t_start, done))
            if done != last:
                last_change, last = now, done
            if done >= len(sizes) or now - last_change > args.stall or now - t_start > args.timeout:
                break
            time.sleep(0.25)
        busy = metric_sum(m, "scheduler_scheduling_attempt_duration_seconds_sum")
        attempts = metric_sum(m, "scheduler_schedule_attempts_total")
        first = next((t0 for (t0, _c0), (_t1, c1) in itertools.pairwise(samples) if c1 > 0), 0.0)
        overall = done / (samples[-1][0] - first) if samples[-1][0] > first else math.nan
        r = Result(scenario=scenario, scorer=scorer, pods=len(sizes), scheduled=int(done),
                   pods_per_s=throughput(samples, len(sizes)), pods_per_s_overall=overall,
                   seconds=samples[-1][0], mean_attempt_ms=busy / attempts * 1000 if attempts else math.nan,
                   scorer_latency=histogram_quantiles(env.scorer_metrics(), "prioritize", before=scorer0),
                   samples=samples)
        log(f"{scenario}{' + scorer' if scorer else ''}: {r.scheduled}/{r.pods} scheduled, "
            f"{r.pods_per_s:.1f} pods/s (10-90%), {overall:.1f} overall, attempt {r.mean_attempt_ms:.1f} ms"
            + (f", prioritize p50 {r.scorer_latency.get('p50_ms', math.nan):.1f} ms "
               f"p99 {r.scorer_latency.get('p99_ms', math.nan):.1f} ms" if scorer else ""))
        return r
    finally:
        if env is not None:
            env.stop_scorer()
        os.environ.setdefault("TOPODRA_LOG_ARCHIVE", str(REPO / ".run" / "throughput-logs"))
        lc.down(quiet=True, keep_logs=True)


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
            for sc in scenarios:
                for with_scorer in scorers:
                    results.append(run_scenario(args, sc, with_scorer, devices))
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
