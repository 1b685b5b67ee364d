"""bench/scale works end to end at 64 nodes (issue 22: CI runs a reduced run; no timing is asserted).

Every row but the scheduler's runs on a private cluster of its own (free ports, own lock); the scheduler
row is bench/schedule_throughput's scenario runner, which starts four clusters of its own and is left to
the full run. The assertions are what the run must have seen, not how fast: the published GPU count, one
slice per node in etcd, the inventory's JSON agreeing with it (checked inside the bench), a scorer view with
every node, a publisher that compared every pool at least once, and a fit per curve once two sizes exist.
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
