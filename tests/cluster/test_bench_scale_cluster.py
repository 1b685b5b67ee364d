"""bench/scale works end to end at 64 nodes (issue 22: CI runs a reduced run; no timing is asserted).

Every row but the scheduler's runs on a private cluster of its own (free ports, own lock); the scheduler
row (bench/schedule_throughput's ``Bed``) runs its four variants on one more, in a test of its own. The
assertions are what the run must have seen, not how fast: the published GPU count, one slice per node in
etcd, the inventory's JSON agreeing with it (checked inside the bench), a scorer view with every node, a
publisher that compared every pool at least once, a fit per curve once two sizes exist; every pod of every
scheduler variant scheduled, on the slice form of its scenario, and both ratios computed.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.scale.main import main


def test_bench_scale_at_64_nodes(tmp_path: Path) -> None:
    rc = main(["--sizes", "64", "--rows", "simulate,etcd,inventory,controller,scorer,publisher",
               "--runs", "1", "--scorer-calls", "20", "--publisher-window", "12", "--out-dir", str(tmp_path),
               "--label", "ci"])
    assert rc == 0
    [result] = list(tmp_path.glob("*-ci.json"))
    doc = json.loads(result.read_text())
    [size] = doc["results"]
    assert size["nodes"] == 64
    assert size["simulate"]["gpus"] == 512
    assert size["simulate"]["requests"] > 64  # at least a node and a slice write per node
    assert size["settle"]["left"] == 0 and 0 <= size["settle"]["tainted"] <= 64  # the rows after saw settled Nodes
    assert size["etcd"]["slices"] == 64
    assert size["etcd"]["devices"] == 1024  # 8 GPUs + 8 NICs per node
    assert size["etcd"]["db_bytes"] > 0 and size["etcd"]["slice_bytes"] > 0
    assert size["scorer"]["nodes"] == 64 and size["scorer"]["calls"] == 20
    assert size["scorer"]["view_mib"] > 0
    assert size["controller"]["devices"] >= 512
    assert size["publisher"]["passes"] >= 64  # every pool compared at least once (from the watch, no list)
    assert size["inventory"]["png_bytes"] > 0
    assert {t["target"] for t in doc["targets"]} >= {"simulate <= 20 s", "inventory -o json <= 1.5 s"}
    assert (tmp_path / result.name.replace(".json", ".md")).read_text().startswith("# bench/run scale")
    assert [p for p in tmp_path.glob("inventory-64.png")]


def test_bench_scale_scheduler_row(tmp_path: Path) -> None:
    rc = main(["--sizes", "32", "--rows", "scheduler", "--no-plots", "--out-dir", str(tmp_path), "--label", "ci"])
    assert rc == 0
    [result] = list(tmp_path.glob("*-ci.json"))
    doc = json.loads(result.read_text())
    [size] = doc["results"]
    sched = size["scheduler"]
    assert (sched["one_gpu_pods"], sched["eight_gpu_pods"], sched["pods"]) == (32, 4, 36)
    variants = ("stripped", "full", "full_scorer", "stripped_scorer")
    assert sched["order"] == list(variants)
    for v in variants:
        assert sched[f"{v}_scheduled"] == 36, v  # the previous variant's claims released every device again
        assert sched[f"{v}_pods_per_s"] > 0, v
    # The slices were switched between variants: 4 attributes when stripped, topodra's full set otherwise.
    assert sched["stripped_gpu_attributes"] == sched["stripped_scorer_gpu_attributes"] == 4
    assert sched["full_gpu_attributes"] == sched["full_scorer_gpu_attributes"] > 20
    assert sched["full_scorer_prioritize_p99_ms"] is not None and sched["full_prioritize_p99_ms"] is None
    assert sched["stripped_ratio"] > 0 and sched["scorer_ratio"] > 0
    assert {t["target"] for t in doc["targets"]} == {"topodra's slices >= 0.9x of stripped slices",
                                                     "with the scorer >= 0.8x of without"}
