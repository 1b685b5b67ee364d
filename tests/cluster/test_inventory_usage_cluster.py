"""``topodra inventory``'s usage figures on the real local cluster (docs/telemetry.md, docs/inventory.md).

Two simulated DGX H100 nodes; the real kube-scheduler allocates a 4-GPU claim (``busy``) and a 2-GPU claim
(``notebook``). Their status is then written the way the kubelet plugin writes it, through its own effect owner
(``ClaimStatusWriter``): the per-device summary by server-side apply under ``topodra-telemetry-summary`` and, for
the notebook, the Idle condition under ``topodra-telemetry``. The real apiserver must accept the summary in
``status.devices[].data`` and keep both managers' fields when either applies again. The CLI's JSON, table and
exporter, and the PNG's pixels, must show the idle claim, the idle GPUs and the per-namespace GPU-hours.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import matplotlib.image as mpimg
import pytest
from test_clusterview_cluster import inventory, scrape_exporter, template
from test_scheduling_topology import RUN_LABEL, Scenario, scenario_maker
from testkit.handle import ClusterHandle

from topodra.apipaths import claim_path
from topodra.clusterview.fetch import fetch
from topodra.clusterview.model import build_view
from topodra.clusterview.picture import IDLE_COLOUR, render_png
from topodra.telemetry.claimstatus import FIELD_MANAGER, SUMMARY_FIELD_MANAGER, ClaimStatusWriter
from topodra.telemetry.summary import ClaimSummary, DeviceFigures, summary_apply

pytestmark = pytest.mark.cluster

DRIVER = "gpu.topodra.io"
H = 3600.0
Obj = dict[str, Any]


@pytest.fixture
def scenarios(cluster: ClusterHandle) -> Iterator[Callable[..., Scenario]]:
    yield from scenario_maker(cluster)


def managers(claim: Obj) -> set[str]:
    return {m["manager"] for m in claim["metadata"].get("managedFields") or [] if m.get("subresource") == "status"}


def test_inventory_shows_idle_claims_and_namespace_gpu_hours(cluster: ClusterHandle,
                                                              scenarios: Callable[..., Scenario],
                                                              tmp_path: Path) -> None:
    s = scenarios([("h100", "dgx-h100", 2)], "invuse")
    n0, n1 = s.nodes("h100")
    kube = cluster.kube
    template(s, "four", 4)
    template(s, "two", 2)
    s.pod("busy", "four", [n0])
    s.pod("notebook", "two", [n1])
    node_busy, _ = s.wait_allocated("busy")
    node_nb, res_nb = s.wait_allocated("notebook")
    assert (node_busy, node_nb) == (n0, n1)
    busy, nb = s.claim_of("busy"), s.claim_of("notebook")
    assert busy is not None and nb is not None
    gpus_busy = sorted(r["device"] for r in busy["status"]["allocation"]["devices"]["results"])
    gpus_nb = sorted(r["device"] for r in res_nb)

    now = time.time()
    idle_since = now - 2 * H
    w0, w1 = ClaimStatusWriter(kube, DRIVER, n0), ClaimStatusWriter(kube, DRIVER, n1)
    sb = ClaimSummary(now, False, None, {g: DeviceFigures(0.8, 0.5, 10 * H, 8 * H) for g in gpus_busy})
    sn = ClaimSummary(now, True, idle_since, {g: DeviceFigures(0.0, 0.02, 3 * H, 1 * H) for g in gpus_nb})
    w0.apply_summary(s.ns, busy["metadata"]["name"], summary_apply(s.ns, busy["metadata"]["name"],
                                                                   busy["metadata"]["uid"], DRIVER, n0, sb, 60))
    # The notebook: the Idle condition first (its own manager), then the summary (the other), then the condition
    # again: each apply keeps the other manager's fields.
    name, uid = nb["metadata"]["name"], nb["metadata"]["uid"]
    held = [(n1, g, None) for g in gpus_nb]
    w1.write(s.ns, name, uid, held, True, ["notebook"], "idle")
    w1.apply_summary(s.ns, name, summary_apply(s.ns, name, uid, DRIVER, n1, sn, 60))
    w1.write(s.ns, name, uid, held, True, ["notebook"], "still idle")
    stored = kube.get(claim_path(s.ns, name)) or {}
    for d in stored["status"]["devices"]:
        assert [c["type"] for c in d["conditions"]] == ["Idle"], d
        assert (d.get("data") or {}).get("kind") == "GPUTelemetrySummary", d  # kept by the condition's apply
        assert d["data"]["idle"] is True and d["data"]["allocatedSeconds"] == 3 * H
        assert len(json.dumps(d["data"])) < 1024
    assert {FIELD_MANAGER, SUMMARY_FIELD_MANAGER} <= managers(stored)

    selector = f"{RUN_LABEL}={s.run}"
    r = inventory(cluster, "-o", "json", "-l", selector)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["idle_claims"] == [{"namespace": s.ns, "claim": name, "pods": ["notebook"], "gpus": 2,
                                    "idle_seconds": pytest.approx(2 * H, abs=120), "nodes": [n1]}]
    [ns_row] = data["namespaces"]
    assert (ns_row["namespace"], ns_row["gpus"], ns_row["gpus_reporting"]) == (s.ns, 6, 6)
    assert (ns_row["gpu_hours_allocated"], ns_row["gpu_hours_active"]) == (46.0, 34.0)
    by_node = {n["name"]: n for n in data["nodes"]}
    assert (by_node[n0]["activity"], by_node[n0]["memory_used"], by_node[n0]["gpus_idle"]) == (0.8, 0.5, 0)
    assert (by_node[n1]["activity"], by_node[n1]["gpus_idle"]) == (0.0, 2)
    assert {g["name"] for g in by_node[n1]["gpus"] if g["idle"]} == set(gpus_nb)
    assert data["summary"]["idle"] == 2 and data["summary"]["idle_claims"] == 1

    table = inventory(cluster, "-l", selector)
    assert table.returncode == 0, table.stderr
    assert "Idle claims (1, 2 GPUs)" in table.stdout, table.stdout
    assert re.search(rf"^\s+{s.ns}\s+{name}\s+notebook\s+2\s+(1h5\dm|2h0\dm)\s+{n1}$", table.stdout, re.M), table.stdout
    assert "GPU-H ALLOCATED" in table.stdout and "46.00" in table.stdout and "34.00" in table.stdout

    gauges = scrape_exporter(cluster, selector)
    assert gauges["topodra_inventory_namespace_gpu_hours_allocated"] == {(s.ns,): 46.0}
    assert gauges["topodra_inventory_namespace_gpu_hours_active"] == {(s.ns,): 34.0}
    idle_gpus = gauges["topodra_inventory_idle_claim_gpus"]  # label values in the exposition's order
    assert {frozenset(k): v for k, v in idle_gpus.items()} == {frozenset((s.ns, name, "notebook")): 2}
    assert gauges["topodra_inventory_gpus_idle"] == {("H100-SXM5-80GB", n0): 0, ("H100-SXM5-80GB", n1): 2}

    # The picture: the idle claim's GPUs in the idle colour, the busy claim's in its namespace colour.
    src = fetch(kube, DRIVER, selector)
    pic = render_png(build_view(src, nodes=[n0, n1]), tmp_path / "usage.png")
    img = mpimg.imread(tmp_path / "usage.png")

    def colour(node: str, dev: str) -> str:
        x, y = pic.cells[(node, dev)]
        return "#" + "".join(f"{round(float(c) * 255):02x}" for c in img[round(y), round(x), :3])

    assert {colour(n1, g) for g in gpus_nb} == {IDLE_COLOUR}
    assert {colour(n0, g) for g in gpus_busy} == {pic.colours[s.ns]} != {IDLE_COLOUR}
