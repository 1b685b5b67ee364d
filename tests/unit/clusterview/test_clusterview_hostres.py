"""The inventory's CPU and memory columns: free CPU/memory per node beside the free GPUs, and the GPUs they
strand (table, JSON, PNG, gauges)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from test_clusterview import scenario
from testkit.pixels import check_pixels

from topodra.clusterview.exporter import families
from topodra.clusterview.model import Sources, build_view
from topodra.clusterview.picture import render_png
from topodra.clusterview.table import HOST_NOTE, render_table

GI = 1 << 30


def hog(name: str, node: str, cpu: str, memory: str, phase: str = "Running") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "jobs"},
            "spec": {"nodeName": node, "containers": [{"name": "c", "resources": {"requests": {
                "cpu": cpu, "memory": memory}}}]}, "status": {"phase": phase}}


def with_hosts() -> Sources:
    """The scenario's nodes with DGX H100 allocatable; a: 200 CPUs taken (4 free GPUs, 24 CPUs: by the
    node's 28-CPU share per GPU, all 4 stranded); b: 1.9Ti of memory taken (7 free GPUs, 100Gi: all
    stranded by memory, 256Gi each); c: a finished pod, which holds nothing."""
    src = scenario()
    nodes = tuple({**n, "status": {**n["status"], "allocatable": {"cpu": "224", "memory": "2Ti"}}} for n in src.nodes)
    pods = (hog("cpu", "a", "200", "1Gi"), hog("mem", "b", "1", "1948Gi"), hog("done", "c", "224", "2Ti", "Succeeded"))
    return Sources(**{**src.__dict__, "nodes": nodes, "pods": pods})


def test_table_and_json_show_free_cpu_memory_and_stranded_gpus() -> None:
    view = build_view(with_hosts())
    rows = {n.name: n.host for n in view.nodes}
    assert rows["a"] is not None and rows["b"] is not None and rows["c"] is not None
    assert (rows["a"].cpu_free_milli, rows["a"].gpus_stranded_cpu, rows["a"].gpus_stranded_memory) == (24_000, 4, 0)
    assert (rows["b"].memory_free_bytes, rows["b"].gpus_stranded_cpu, rows["b"].gpus_stranded_memory) == \
        (100 * GI, 0, 7)
    assert (rows["c"].cpu_free_milli, rows["c"].memory_free_bytes, rows["c"].stranded) == (224_000, 2048 * GI, False)
    text = render_table(view)
    assert re.search(r"^a\s+H100-SXM5-80GB\s+4/8.*gpu-5\s+24/224\s+2047/2048Gi\s+4/0$", text, re.M), text
    assert re.search(r"^b\s.*\s223/224\s+100/2048Gi\s+0/7$", text, re.M), text
    assert re.search(r"^c \(unschedulable\)\s.*\s224/224\s+2048/2048Gi\s+-$", text, re.M), text
    assert "stranded by CPU 4, by memory 7" in text and HOST_NOTE in text
    data = json.loads(json.dumps(view.to_dict()))
    assert data["nodes"][0]["host"]["gpus_stranded_cpu"] == 4
    assert (data["summary"]["gpus_stranded_cpu"], data["summary"]["gpus_stranded_memory"]) == (4, 7)


def test_stranded_columns_use_the_shares_bound_gpu_pods_asked_for() -> None:
    """Issue 34, one model: once GPU pods are bound, the inventory judges free GPUs with the CPU and memory per
    GPU those pods asked for (``fleet.shares``, what the scorer learns), not the node's own share. A 3-GPU pod
    on a asks 12 CPUs and 96Gi (4 CPUs, 32Gi per GPU): a keeps 12 free CPUs, enough for one more 3-GPU pod of
    that shape (3 of its 4 free GPUs usable; the 4th is left by the devices, not the CPU): none stranded,
    where the node's 28-CPU share strands all 4; b's 100Gi hold one 3-GPU pod (96Gi) of the 6 GPUs two
    would take: 3 stranded by memory, where the node's 256Gi share strands all 7."""
    src = with_hosts()
    trainer = {**hog("trainer", "a", "12", "96Gi"), "metadata": {"name": "trainer", "namespace": "team-a",
                                                               "uid": "uid-trainer"}}
    trainer["spec"]["resourceClaims"] = [{"name": "gpus", "resourceClaimName": "train"}]
    view = build_view(Sources(**{**src.__dict__, "pods": (*src.pods, trainer)}))
    rows = {n.name: n.host for n in view.nodes}
    assert rows["a"] is not None and rows["b"] is not None
    assert (rows["a"].cpu_free_milli, rows["a"].gpus_stranded_cpu, rows["a"].gpus_stranded_memory) == (12_000, 0, 0)
    assert (rows["b"].gpus_stranded_cpu, rows["b"].gpus_stranded_memory) == (0, 3)
    # the same pod without its claim is a CPU pod: nothing learned, the node's own share judges (a: all 4)
    plain = {**trainer, "spec": {k: v for k, v in trainer["spec"].items() if k != "resourceClaims"}}
    rows = {n.name: n.host for n in build_view(Sources(**{**src.__dict__, "pods": (*src.pods, plain)})).nodes}
    assert rows["a"] is not None and (rows["a"].gpus_stranded_cpu, rows["a"].gpus_stranded_memory) == (4, 0)


def test_without_allocatable_no_columns_are_added() -> None:
    view = build_view(scenario())
    assert all(n.host is None for n in view.nodes)
    assert "CPU FREE" not in render_table(view) and HOST_NOTE not in render_table(view)


def test_gauges_per_node() -> None:
    fams = {f.name: f for f in families(build_view(with_hosts()))}
    stranded = {tuple(s.labels.values()): s.value for s in fams["topodra_inventory_gpus_stranded"].samples}
    assert stranded[("a", "cpu")] == 4 and stranded[("b", "memory")] == 7 and stranded[("c", "cpu")] == 0
    free = {s.labels["node"]: s.value for s in fams["topodra_inventory_node_cpu_free_cores"].samples}
    assert free == {"a": 24.0, "b": 223.0, "c": 224.0}


def test_png_writes_each_nodes_cpu_and_memory(tmp_path: Path) -> None:
    view = build_view(with_hosts())
    pic = render_png(view, tmp_path / "inv.png")
    assert pic.host_labels["a"] == "CPU 24/224  mem 2047/2048Gi  stranded: 4 by CPU"
    assert pic.host_labels["b"].endswith("stranded: 7 by memory")
    assert pic.host_labels["c"] == "CPU 224/224  mem 2048/2048Gi"
    # the cells are still where the grid says (the text sits right of the NICs)
    expected = {(n.name, c.name): c.state if c.state != "allocated" else f"allocated:{c.namespace}"
                for n in view.nodes for c in (*n.gpus, *n.nics)}
    check_pixels(view, tmp_path / "inv2.png", expected)
