"""``bench/run kueue_latency``: job creation -> pod's GPUs allocated, with and without Kueue.

A private local cluster (own ports and state, beside the tests' shared cluster) gets the simulated
``enterprise-400`` cluster (50 nodes, 400 GPUs), topodra's DeviceClasses and real Kueue v0.17.0
(hack/testkit/kueue.py) with one ResourceFlavor per GPU model and a ClusterQueue whose quota equals
the cluster's GPUs (so quota never makes a job wait: the cost of Kueue itself is measured).

Each sample: create a batch/v1 Job of one pod asking ``gpu.topodra.io/gpu: 8`` (the DRA-backed
extended resource), then poll (20 ms) until the pod is bound and its scheduler-made ResourceClaim is
allocated; the latency is from just before the create call to that observation.  The job is then
deleted (its pod force-deleted: the nodes have no kubelet) and the next one starts, so jobs never
queue behind each other.  Modes alternate job by job (plain, kueue, plain, ...), so drift in the
machine's load hits both alike.

  bench/run kueue_latency --jobs 60 [--out FILE]   (default bench/results/kueue_latency/<UTC time>.json)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from bench.paths import REPO, result_file
from bench.placement.main import BenchError, install_classes, publish
from testkit import cluster as localcluster
from testkit import kueue as localkueue

from topodra.controller import kueue as kq
from topodra.controller.profile import ClaimProfile
from topodra.kube import Kube, KubeError
from topodra.simulate import load_cluster

INSTANCE = "bench-kueue"
CLUSTER = REPO / "hack" / "clusters" / "enterprise-400.yaml"
KUEUE = "/apis/kueue.x-k8s.io/v1beta2"
GPUS = 8


def log(msg: str) -> None:
    print(f"[kueue-latency {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def models_of(kube: Kube) -> dict[str, int]:
    """GPUs per model label on the simulated nodes."""
    out: dict[str, int] = {}
    for n in kube.list("/api/v1/nodes"):
        labels = n["metadata"].get("labels") or {}
        model = labels.get("topodra.io/gpu-model")
        if model:
            out[model] = out.get(model, 0) + int(labels.get("topodra.io/gpu-count", "0"))
    return out


def setup_kueue(kube: Kube, ns: str, models: dict[str, int]) -> kq.KueuePlan:
    order = sorted(models, key=lambda m: (not m.startswith("H200"), not m.startswith("H100"), m))
    for m in order:
        kube.create(f"{KUEUE}/resourceflavors", kq.resource_flavor(m))
    kube.create(f"{KUEUE}/clusterqueues", kq.cluster_queue("bench", order, models))
    kube.create(f"{KUEUE}/namespaces/{ns}/localqueues", {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue", "metadata": {"name": "bench"},
        "spec": {"clusterQueue": "bench"}})
    profile = ClaimProfile.from_api({"metadata": {"name": "bench", "namespace": ns}, "spec": {
        "queueing": "Kueue", "localQueue": "bench",
        "alternatives": [{"deviceClassName": "gpu.topodra.io", "count": GPUS}]}})
    return kq.plan(profile, {"gpu.topodra.io": tuple(order)})  # the models present, in flavor order


def base_template() -> dict[str, Any]:
    res = {kq.gpu_resource(): str(GPUS)}
    return {"spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 0,
                     "containers": [{"name": "main", "image": "localhost/busybox:1.35", "command": ["true"],
                                     "resources": {"requests": res, "limits": res}}]}}


def one_job(kube: Kube, ns: str, name: str, template: dict[str, Any], labels: dict[str, str],
            timeout: float = 120) -> float:
    """Seconds from create to the pod bound with its extended-resource claim allocated; cleans up."""
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, "labels": labels},
           "spec": {"backoffLimit": 0, "template": template}}
    t0 = time.perf_counter()
    kube.create(f"/apis/batch/v1/namespaces/{ns}/jobs", job)
    deadline = time.monotonic() + timeout
    while True:
        pods = list(kube.list(f"/api/v1/namespaces/{ns}/pods", label_selector=f"job-name={name}"))
        if pods and pods[0]["spec"].get("nodeName"):
            st = (pods[0].get("status") or {}).get("extendedResourceClaimStatus") or {}
            claim_name = st.get("resourceClaimName")
            claim = kube.get(f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims/{claim_name}") \
                if claim_name else None
            if claim and (claim.get("status") or {}).get("allocation"):
                dt = time.perf_counter() - t0
                break
        if time.monotonic() > deadline:
            raise BenchError(f"job {ns}/{name} not allocated after {timeout:.0f}s")
        time.sleep(0.02)
    if labels:  # Kueue mode: prove Kueue admitted it (Workload Admitted, flavor's node selector injected)
        admitted = [w for w in kube.list(f"{KUEUE}/namespaces/{ns}/workloads")
                    if any(r.get("name") == name for r in w["metadata"].get("ownerReferences") or [])
                    and any(c.get("type") == "Admitted" and c.get("status") == "True"
                            for c in (w.get("status") or {}).get("conditions") or [])]
        if len(admitted) != 1 or "topodra.io/gpu-model" not in (pods[0]["spec"].get("nodeSelector") or {}):
            raise BenchError(f"job {ns}/{name} ran without Kueue's admission")
    kube.request("DELETE", f"/apis/batch/v1/namespaces/{ns}/jobs/{name}",
                 {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"})
    for p in pods:
        try:
            kube.request("DELETE", f"/api/v1/namespaces/{ns}/pods/{p['metadata']['name']}",
                         {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0})
        except KubeError as e:
            if e.status != 404:  # the job's deletion may have removed it already
                raise
    # Wait until the pod's claim is gone, so every sample starts from the same free cluster.
    while list(kube.list(f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims")):
        if time.monotonic() > deadline:
            raise BenchError(f"claims of job {ns}/{name} not released")
        time.sleep(0.05)
    return dt


def summary(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    return {"n": len(s), "median_s": statistics.median(s), "p90_s": s[int(0.9 * (len(s) - 1))],
            "min_s": s[0], "max_s": s[-1]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/run kueue_latency", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=60, help="jobs per mode (default 60)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    with localcluster.cluster_lock(3600, localcluster.instance_lock_file(INSTANCE)):
        lc = localcluster.Cluster.private(INSTANCE)
        lc.up(build=False)
        try:
            kube = Kube.from_kubeconfig(str(lc.admin_kubeconfig))
            install_classes(kube)
            publish(kube, load_cluster(CLUSTER))
            localkueue.start(lc, webhook_port=localcluster.free_port(), health_port=localcluster.free_port())
            ns = f"bench-{uuid.uuid4().hex[:5]}"
            kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {
                "name": ns, "labels": {localkueue.NAMESPACE_LABEL[0]: localkueue.NAMESPACE_LABEL[1]}}})
            while kube.get(f"/api/v1/namespaces/{ns}/serviceaccounts/default") is None:
                time.sleep(0.2)
            models = models_of(kube)
            plan = setup_kueue(kube, ns, models)
            plain_t = base_template()
            kueue_t = plan.pod_template(base_template())
            lat: dict[str, list[float]] = {"plain": [], "kueue": []}
            for i in range(-2, args.jobs):  # two warm-up rounds, not recorded
                for mode, tmpl in (("plain", plain_t), ("kueue", kueue_t)):
                    labels = dict(tmpl["metadata"]["labels"]) if mode == "kueue" else {}
                    dt = one_job(kube, ns, f"{mode}-{i + 2}", tmpl, labels)
                    if i >= 0:
                        lat[mode].append(dt)
                if i >= 0 and (i + 1) % 10 == 0:
                    log(f"{i + 1}/{args.jobs}: plain median {statistics.median(lat['plain']) * 1000:.0f} ms, "
                        f"kueue median {statistics.median(lat['kueue']) * 1000:.0f} ms")
        except (KubeError, BenchError, localkueue.KueueError) as e:
            log(f"failed: {e}")
            return 1
        finally:
            localkueue.stop(lc, remove=False)
            lc.down(quiet=True, keep_logs=True)
    doc = {"benchmark": "kueue_latency", "cluster": "enterprise-400", "gpus_per_job": GPUS,
           "kueue": localkueue.KUEUE_VERSION, "models": models, "host": platform.node(),
           "cpus": os.cpu_count(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "summary": {m: summary(v) for m, v in lat.items()}, "samples": lat}
    for m, s in {m: summary(v) for m, v in lat.items()}.items():
        print(f"{m:6s} n={s['n']} median {s['median_s'] * 1000:.0f} ms  p90 {s['p90_s'] * 1000:.0f} ms  "
              f"min {s['min_s'] * 1000:.0f} ms  max {s['max_s'] * 1000:.0f} ms")
    out = args.out or result_file("kueue_latency")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
