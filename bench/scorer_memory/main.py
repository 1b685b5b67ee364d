"""Memory of the placement scorer's watched view with its Pods watch: 500 nodes x ~20 pods (no cluster).

The view is ``scorer_latency``'s 500-node one (enterprise-400's profile mix ten times over, ~50% of the
GPUs allocated). Pods are built as the API server returns them from a list (metadata with labels, an
owner reference, managed fields; one container with requests and a claim; a status with conditions),
serialised to JSON and parsed back, as the cache's list does. Measured with ``tracemalloc``:

* ``retained``: what the state keeps after the list (the ``PodRecord``s and per-node sums), the parsed
  list freed;
* ``peak``: the list response parsed in full plus the records being built (the cache's relist moment);
* the same two for the rest of the view (slices, claims, classes) for scale.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

from bench.paths import result_file
from bench.scorer_latency.main import build

Obj = dict[str, Any]


def pod(i: int, node: str) -> Obj:
    name = f"job-{i:06d}-worker-0"
    return {
        "metadata": {"name": name, "namespace": f"team-{i % 7}", "uid": f"6f1c2d3e-{i:08d}-4a5b-9c8d-0123456789ab",
                     "resourceVersion": str(100000 + i), "creationTimestamp": "2026-12-01T00:00:00Z",
                     "labels": {"app": "train", "job-name": f"job-{i:06d}",
                                "batch.kubernetes.io/job-completion-index": "0"},
                     "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": f"job-{i:06d}",
                                          "uid": f"7a8b9c0d-{i:08d}-1e2f-3a4b-5c6d7e8f9a0b", "controller": True}],
                     "managedFields": [{"manager": "kube-controller-manager", "operation": "Update",
                                        "apiVersion": "v1", "time": "2026-12-01T00:00:00Z",
                                        "fieldsType": "FieldsV1",
                                        "fieldsV1": {"f:metadata": {"f:labels": {}}, "f:spec": {"f:containers": {}}}}]},
        "spec": {"nodeName": node, "schedulerName": "default-scheduler", "restartPolicy": "Never",
                 "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": "one-gpu"}],
                 "containers": [{"name": "main", "image": "registry.example.com/train:1.0",
                                 "command": ["python", "train.py"],
                                 "resources": {"requests": {"cpu": "12", "memory": "96Gi"},
                                               "claims": [{"name": "gpus"}]}}]},
        "status": {"phase": "Running", "podIP": f"10.1.{i // 250}.{i % 250}",
                   "conditions": [{"type": t, "status": "True", "lastTransitionTime": "2026-12-01T00:00:00Z"}
                                  for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")],
                   "resourceClaimStatuses": [{"name": "gpus", "resourceClaimName": f"{name}-gpus-x1y2z"}]}}


def measure(nodes: int, pods_per_node: int) -> dict[str, Any]:
    tracemalloc.start()
    gc.collect()
    m0 = tracemalloc.get_traced_memory()[0]
    st, _rng = build(nodes, seed=1)
    gc.collect()
    view_bytes = tracemalloc.get_traced_memory()[0] - m0
    names = sorted({str(s["spec"]["nodeName"]) for s in st.slices.values()})
    body = json.dumps({"items": [pod(i, names[i % len(names)]) for i in range(nodes * pods_per_node)]})
    gc.collect()
    tracemalloc.reset_peak()
    before = tracemalloc.get_traced_memory()[0]
    items = json.loads(body)["items"]
    t0 = time.perf_counter()
    st.replace("pods", items)
    replace_s = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1] - before
    del items
    gc.collect()
    retained = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    n = nodes * pods_per_node
    return {"nodes": nodes, "pods": n, "pod_json_bytes": len(body), "pods_retained_bytes": retained,
            "pods_retained_bytes_per_pod": retained / n, "pods_relist_peak_bytes": peak,
            "pods_replace_s": replace_s, "view_without_pods_bytes": view_bytes,
            "records": len(st.hosts.pods)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/run scorer_memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=500)
    p.add_argument("--pods-per-node", type=int, default=20)
    p.add_argument("--label", default="")
    p.add_argument("--json", help="result file (default bench/results/scorer_memory/<UTC>[-<label>].json)")
    args = p.parse_args(argv)
    if args.nodes < 1 or args.pods_per_node < 1:
        p.error("--nodes and --pods-per-node must be >= 1")
    got = measure(args.nodes, args.pods_per_node)
    out = Path(args.json) if args.json else result_file("scorer_memory", args.label)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "scorer_memory", "created": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                      time.gmtime()), **got}, indent=1))
    mib = 1 << 20
    print(f"{got['pods']} pods on {got['nodes']} nodes: retained {got['pods_retained_bytes'] / mib:.1f} MiB "
          f"({got['pods_retained_bytes_per_pod']:.0f} B/pod), "
          f"relist peak {got['pods_relist_peak_bytes'] / mib:.1f} MiB "
          f"(list JSON {got['pod_json_bytes'] / mib:.1f} MiB); "
          f"view without pods {got['view_without_pods_bytes'] / mib:.1f} MiB; "
          f"replace {got['pods_replace_s'] * 1000:.0f} ms; results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
