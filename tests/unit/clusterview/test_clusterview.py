"""``topodra inventory`` without a cluster: the view from hand-built API objects, its table, its PNG
read back pixel by pixel, and the exporter's gauges against docs/metrics.md and the Grafana dashboard.

Slices come from the real discovery code on mock profiles (testkit.views); the expected
numbers are written down by hand from the scenario, never taken from the code under test.
"""

from __future__ import annotations

import io
import itertools
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from testkit.paths import REPO
from testkit.pixels import check_pixels
from testkit.views import claim, device_classes, gpus, node_slices

from topodra import DEFAULT_DRIVER_NAME as DRIVER
from topodra.clusterview.exporter import METRICS, InventoryCollector, families
from topodra.clusterview.main import emit, parse_listen
from topodra.clusterview.model import (
    NO_POD,
    NOT_TRIED,
    ClusterView,
    Sources,
    build_view,
    scheduler_causes,
)
from topodra.clusterview.table import render_table
from topodra.kube import KubeError
from topodra.plugin.telemetry import METRICS as TELEMETRY_METRICS

Obj = dict[str, Any]


def ready_node(name: str, unschedulable: bool = False) -> Obj:
    return {"metadata": {"name": name}, "spec": {"unschedulable": unschedulable},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}}


def alloc(name: str, ns: str, node: str, devices: list[str]) -> Obj:
    return claim(name, gpus(len(devices)), namespace=ns, allocated=[(node, d) for d in devices])


def taint(slices: list[Obj], device: str, effect: str, key: str = "topodra.io/xid") -> None:
    for s in slices:
        for d in s["spec"]["devices"]:
            if d["name"] == device:
                d.setdefault("taints", []).append({"key": key, "value": "79", "effect": effect})
                return
    raise AssertionError(f"no device {device}")


def scenario() -> Sources:
    """Three DGX H100 nodes.

    a: gpu-0..2 held by team-a, gpu-5 tainted NoSchedule in its slice -> 4 free (gpu-3, 4, 6, 7).
    b: gpu-7 tainted NoExecute by a DeviceTaintRule, gpu-6 has an effect-None taint (still free),
       nic-1 and nic-2 held by team-b -> 7 free GPUs, but only 5 with a free NIC on their rail.
    c: cordoned, all 8 free: counts as free, but no claim can be placed there now.
    """
    a, b, c = node_slices("a", "dgx-h100"), node_slices("b", "dgx-h100"), node_slices("c", "dgx-h100")
    taint(a, "gpu-5", "NoSchedule")
    taint(b, "gpu-6", "None")
    rule = {"metadata": {"name": "drain-b-7"}, "spec": {
        "deviceSelector": {"driver": DRIVER, "pool": "b", "device": "gpu-7"},
        "taint": {"key": "topodra.io/maintenance", "effect": "NoExecute"}}}
    other_driver_rule = {"metadata": {"name": "other"}, "spec": {
        "deviceSelector": {"driver": "other.example.com"}, "taint": {"key": "x", "effect": "NoSchedule"}}}
    claims = [alloc("train", "team-a", "a", ["gpu-0", "gpu-1", "gpu-2"]),
              alloc("nics", "team-b", "b", ["nic-1", "nic-2"])]
    return Sources(slices=tuple(a + b + c), claims=tuple(claims), classes=device_classes(),
                   nodes=(ready_node("a"), ready_node("b"), ready_node("c", unschedulable=True)),
                   taint_rules=(rule, other_driver_rule))


EXPECTED = {  # node -> device -> state; everything else free
    "a": {"gpu-0": "allocated", "gpu-1": "allocated", "gpu-2": "allocated", "gpu-5": "tainted"},
    "b": {"gpu-7": "tainted", "nic-1": "allocated", "nic-2": "allocated"},
    "c": {},
}


def expected_state(node: str, device: str) -> str:
    return EXPECTED[node].get(device, "free")


def test_device_states_from_claims_slice_taints_and_rules() -> None:
    view = build_view(scenario())
    assert [n.name for n in view.nodes] == ["a", "b", "c"]
    for n in view.nodes:
        for cell in (*n.gpus, *n.nics):
            assert cell.state == expected_state(n.name, cell.name), (n.name, cell.name)
    a, b, c = view.nodes
    assert (a.count("free"), a.count("allocated"), a.count("tainted")) == (4, 3, 1)
    assert a.tainted_devices == ("gpu-5",) and b.tainted_devices == ("gpu-7",)
    assert next(g for g in a.gpus if g.name == "gpu-0").namespace == "team-a"
    assert next(g for g in b.gpus if g.name == "gpu-6").taints == ("topodra.io/xid=79:None",)
    assert [(d.free, d.total) for d in b.domains] == [(7, 8)]
    assert [(r.rail, r.free) for r in b.rails] == [(0, 1), (1, 0), (2, 0), (3, 1), (4, 1), (5, 1), (6, 1), (7, 1)]
    assert (a.schedulable, b.schedulable, c.schedulable) == (True, True, False)


def test_model_summary_and_largest_placeable_claim() -> None:
    view = build_view(scenario())
    [m] = view.models
    assert (m.model, m.nodes, m.total, m.free, m.allocated, m.tainted) == ("H100-SXM5-80GB", 3, 24, 19, 3, 2)
    # c has 8 free but is cordoned; b has 7 free in its one NVLink domain, 5 of them with a free NIC on their rail.
    assert (m.largest.count, m.largest.nvlink, m.largest.rail_aligned) == (7, 7, 5)
    assert (m.nvlink_domains, m.nvlink_domains_free) == (3, 1)  # only c's domain is wholly free
    assert (view.total, view.free, view.allocated, view.tainted) == (24, 19, 3, 2)


@pytest.mark.parametrize(("prior", "fragmented"), [({8: 1.0}, 7), ({4: 1.0}, 3), ({1: 1.0}, 0), ({2: 1.0}, 1)])
def test_fragmentation_is_the_scorer_measure_with_taints_in_use(prior: dict[int, float], fragmented: int) -> None:
    """One node, gpu-0 tainted, no claims: 7 usable GPUs in one NVLink domain; F = 7 mod k (k>1 NVLink-local)."""
    sl = node_slices("solo", "dgx-h100")
    taint(sl, "gpu-0", "NoSchedule")
    view = build_view(Sources(slices=tuple(sl), classes=device_classes()), prior=prior)
    assert view.nodes[0].fragmentation == pytest.approx(fragmented)
    assert view.models[0].fragmentation_ratio == pytest.approx(fragmented / 7)


def test_nodes_filter_limits_rows_and_sums() -> None:
    view = build_view(scenario(), nodes=["b"])
    assert [n.name for n in view.nodes] == ["b"]
    assert (view.models[0].total, view.models[0].free) == (8, 7)


def test_newest_pool_generation_wins() -> None:
    old = node_slices("g", "dgx-h100")
    new = node_slices("g", "dgx-h100")
    for s in new:
        s["metadata"]["name"] += "-gen2"
        s["spec"]["pool"]["generation"] = 2
        s["spec"]["devices"] = [d for d in s["spec"]["devices"] if d["name"] != "gpu-3"]  # fell off the bus
    view = build_view(Sources(slices=tuple(old + new), classes=device_classes()))
    assert [g.name for g in view.nodes[0].gpus] == [f"gpu-{i}" for i in (0, 1, 2, 4, 5, 6, 7)]


UNSCHEDULABLE = ("0/7 nodes are available: 1 node(s) were unschedulable, {n} cannot allocate all claims. "
                 "preemption: 0/7 nodes are available: 7 Preemption is not helpful for scheduling.")


def pod_using(name: str, ns: str, claim_name: str, message: str | None, generated: bool = True) -> Obj:
    conds = [] if message is None else [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                         "message": message}]
    ref = {"name": "gpus", "resourceClaimTemplateName": "t"} if generated else \
        {"name": "gpus", "resourceClaimName": claim_name}
    return {"metadata": {"name": name, "namespace": ns}, "spec": {"resourceClaims": [ref]},
            "status": {"conditions": conds, "resourceClaimStatuses":
                       [{"name": "gpus", "resourceClaimName": claim_name}] if generated else []}}


def test_pending_claims_grouped_by_the_scheduler_reason() -> None:
    src = scenario()
    pending = [claim("big-1", gpus(8, "gpu-h100"), namespace="ml"), claim("big-2", gpus(8, "gpu-h100"), namespace="ml"),
               claim("lonely", gpus(1), namespace="ml"), claim("fresh", gpus(2, "gpu-h200"), namespace="ml")]
    pods = (pod_using("p1", "ml", "big-1", UNSCHEDULABLE.format(n=6)),
            pod_using("p2", "ml", "big-2", UNSCHEDULABLE.format(n=5), generated=False),
            pod_using("p3", "ml", "fresh", None))
    view = build_view(Sources(**{**src.__dict__, "claims": src.claims + tuple(pending), "pods": pods}))
    by_name = {p.name: p for p in view.pending}
    assert set(by_name) == {"big-1", "big-2", "lonely", "fresh"}  # allocated claims are not pending
    reason = "Unschedulable: cannot allocate all claims; node(s) were unschedulable"
    assert by_name["big-1"].reason == by_name["big-2"].reason == reason
    assert by_name["big-2"].pod == "p2" and by_name["big-1"].message == UNSCHEDULABLE.format(n=6)
    assert by_name["lonely"].reason == NO_POD and by_name["fresh"].reason == NOT_TRIED
    first = view.pending_groups[0]
    assert (first.reason, first.claims) == (reason, ("ml/big-1", "ml/big-2"))
    counts = view.pending_by_class()
    assert (counts["gpu-h100"], counts["gpu.topodra.io"], counts["gpu-h200"], counts["gpu-l4"]) == (2, 1, 1, 0)


def test_scheduler_causes_drops_counts_and_preemption() -> None:
    assert scheduler_causes(UNSCHEDULABLE.format(n=3)) == \
        "cannot allocate all claims; node(s) were unschedulable"
    assert scheduler_causes("0/2 nodes are available: 2 node(s) had untolerated taint {a: b}.") == \
        "node(s) had untolerated taint {a: b}"
    assert scheduler_causes("something else.") == "something else"


def test_table_and_json_carry_the_same_numbers() -> None:
    view = build_view(scenario())
    text = render_table(view)
    assert re.search(r"^a\s+H100-SXM5-80GB\s+4/8\s+nvl-\w+:4/8\s+11111111\s+gpu-5$", text, re.M), text
    assert re.search(r"^b\s+H100-SXM5-80GB\s+7/8\s+nvl-\w+:7/8\s+10011111\s+gpu-7$", text, re.M), text
    assert re.search(r"^c \(unschedulable\)\s+H100-SXM5-80GB\s+8/8", text, re.M), text
    assert re.search(r"^H100-SXM5-80GB\s+3\s+24\s+19\s+3\s+2\s+7/7/5\s+1/3\s", text, re.M), text
    data = json.loads(json.dumps(view.to_dict()))
    assert data["summary"] == {**data["summary"], "total": 24, "free": 19, "allocated": 3, "tainted": 2}
    assert [n["gpus_free"] for n in data["nodes"]] == [4, 7, 8]
    assert yaml.safe_load(yaml.safe_dump(view.to_dict())) == data
    out = io.StringIO()
    emit(view, "yaml", out)  # libyaml's emitter when present: the very text of the pure-Python one
    assert out.getvalue() == yaml.safe_dump(view.to_dict(), sort_keys=False)


# --------------------------------------------------------------------------- the picture


def test_png_pixel_grid_matches_device_states(tmp_path: Path) -> None:
    view = build_view(scenario())
    ns = {("a", "gpu-0"): "team-a", ("a", "gpu-1"): "team-a", ("a", "gpu-2"): "team-a",
          ("b", "nic-1"): "team-b", ("b", "nic-2"): "team-b"}
    expected = {}
    for node in "abc":
        for dev in [*(f"gpu-{i}" for i in range(8)), *(f"nic-{i}" for i in range(8))]:
            st = expected_state(node, dev)
            expected[(node, dev)] = f"{st}:{ns[(node, dev)]}" if st == "allocated" else st
    pic = check_pixels(view, tmp_path / "inv.png", expected)
    assert pic.colours["team-a"] != pic.colours["team-b"]
    # One row per node, GPUs left to right: same y within a node, rows in order.
    ys = {n: {round(pic.cells[(n, f"gpu-{i}")][1]) for i in range(8)} for n in "abc"}
    assert all(len(v) == 1 for v in ys.values())
    assert min(ys["a"]) < min(ys["b"]) < min(ys["c"])


@pytest.mark.parametrize(("cluster_file", "nodes", "per_node"), [
    ("enterprise-400.yaml", 50, 8), ("nvl72-rack.yaml", 18, 4)])
def test_png_stays_legible_at_50x8_and_nvl72(tmp_path: Path, cluster_file: str, nodes: int, per_node: int) -> None:
    """Cells at least 16 px apart and inside the image, for the two sizes the issue names."""
    from topodra.simulate import discover, load_cluster, plan
    from topodra.slices import build_slices

    slices = [s for n in plan(load_cluster(REPO / "hack/clusters" / cluster_file))
              for s in build_slices(DRIVER, n.name, None, discover(n), 1)]
    first = slices[0]["spec"]["nodeName"]
    held = [claim("job", gpus(2), namespace="ml", allocated=[(first, "gpu-0"), (first, "gpu-1")])]
    view = build_view(Sources(slices=tuple(slices), claims=tuple(held), classes=device_classes()))
    assert len(view.nodes) == nodes and {len(n.gpus) for n in view.nodes} == {per_node}
    expected = {(n.name, c.name): ("allocated:ml" if (n.name, c.name) in {(first, "gpu-0"), (first, "gpu-1")}
                                   else "free") for n in view.nodes for c in (*n.gpus, *n.nics)}
    pic = check_pixels(view, tmp_path / "big.png", expected)
    xs = sorted({round(x) for x, _y in pic.cells.values()})
    ys = sorted({round(y) for _x, y in pic.cells.values()})
    assert min(b - a for a, b in itertools.pairwise(xs)) >= 16
    assert min(b - a for a, b in itertools.pairwise(ys)) >= 16
    assert len(ys) == nodes
    assert pic.width <= 2000 and pic.height <= 2000


# --------------------------------------------------------------------------- exporter, docs, dashboard


def samples(view: ClusterView) -> dict[str, dict[tuple[str, ...], float]]:
    return {f.name: {tuple(s.labels.values()): s.value for s in f.samples} for f in families(view)}


def test_exporter_gauges_equal_the_view() -> None:
    got = samples(build_view(scenario()))
    m = "H100-SXM5-80GB"
    assert got["topodra_inventory_gpus_free"] == {(m, "a"): 4, (m, "b"): 7, (m, "c"): 8}
    assert got["topodra_inventory_gpus"][(m, "a")] == 8
    assert got["topodra_inventory_gpus_tainted"] == {(m, "a"): 1, (m, "b"): 1, (m, "c"): 0}
    assert got["topodra_inventory_gpus_allocated"][(m, "a")] == 3
    assert got["topodra_inventory_nvlink_domains_free"] == {(m,): 1}
    assert got["topodra_inventory_largest_claim_gpus"] == {(m, "any"): 7, (m, "nvlink"): 7, (m, "rail"): 5}
    assert got["topodra_inventory_pending_claims"][("gpu-h100",)] == 0
    assert set(got) | {"topodra_inventory_up", "topodra_inventory_refresh_seconds",
                       "topodra_inventory_last_refresh_timestamp_seconds"} == set(METRICS)


def test_collector_refreshes_at_most_once_per_interval_and_hides_stale_numbers() -> None:
    now = [0.0]
    calls = []
    view = build_view(scenario())

    def load() -> ClusterView:
        calls.append(now[0])
        if len(calls) == 3:
            raise KubeError(0, "ConnectionRefused", "apiserver down")
        return view

    col = InventoryCollector(load, min_interval=10, clock=lambda: now[0])
    names = [f.name for f in col.describe()]
    assert names == list(METRICS) and calls == []  # registering reads nothing
    assert {f.name for f in col.collect()} == set(METRICS)
    now[0] = 5.0
    list(col.collect())
    assert calls == [0.0]
    now[0] = 11.0
    list(col.collect())
    now[0] = 22.0
    down = {f.name: f for f in col.collect()}
    assert calls == [0.0, 11.0, 22.0]
    assert set(down) == {"topodra_inventory_up", "topodra_inventory_refresh_seconds",
                         "topodra_inventory_last_refresh_timestamp_seconds"}
    assert down["topodra_inventory_up"].samples[0].value == 0


def test_metrics_doc_lists_exactly_the_exported_names() -> None:
    doc = (REPO / "docs" / "metrics.md").read_text()
    documented = set(re.findall(r"`(topodra_inventory_\w+)`", doc))
    assert documented == set(METRICS)
    for name, (_help, labels) in METRICS.items():
        row = next(line for line in doc.splitlines() if line.startswith(f"| `{name}`"))
        assert all(f"`{label}`" in row for label in labels), (name, labels, row)


PROMQL_WORDS = {
    "sum", "min", "max", "avg", "count", "by", "without", "on", "ignoring", "group_left", "group_right", "and",
    "or", "unless", "topk", "bottomk", "rate", "increase", "time", "clamp_min", "clamp_max", "max_over_time",
    "min_over_time", "avg_over_time", "bool", "offset", "label_replace", "sort_desc", "sort", "vector", "scalar",
    "absent", "changes", "e",
}


def dashboard_exprs() -> list[str]:
    dash = json.loads((REPO / "deploy" / "grafana" / "topodra-inventory.json").read_text())
    exprs: list[str] = []

    def walk(panels: list[Obj]) -> None:
        for p in panels:
            exprs.extend(t["expr"] for t in p.get("targets") or [])
            walk(p.get("panels") or [])

    walk(dash["panels"])
    for var in (dash.get("templating") or {}).get("list") or []:
        if var.get("type") == "query":
            q = var["query"]
            exprs.append(q["query"] if isinstance(q, dict) else q)
    return exprs


def test_dashboard_uses_only_exported_metrics_and_labels() -> None:
    """Every name a dashboard query uses is one the inventory exporter or the plugin's telemetry exports
    (tests/node/test_dashboard_node.py evaluates each query in real Prometheus)."""
    exprs = dashboard_exprs()
    assert len(exprs) >= 8
    exported = set(METRICS) | set(TELEMETRY_METRICS)
    labels = {label for _help, ls in METRICS.values() for label in ls}
    labels |= {label for _kind, ls in TELEMETRY_METRICS.values() for label in ls}
    used: set[str] = set()
    for expr in exprs:
        text = re.sub(r'"[^"]*"', "", expr)  # label values and regexes
        text = re.sub(r"\$\{?\w+\}?", "", text)  # dashboard variables
        text = re.sub(r"\[[^\]]*\]", "", text)  # range selectors
        names = set(re.findall(r"\b[A-Za-z_:][A-Za-z0-9_:]*\b", text))
        metrics = {n for n in names if n.startswith("topodra_")}
        assert metrics, f"no topodra metric in {expr!r}"
        assert metrics <= exported, (expr, metrics - exported)
        unknown = names - metrics - labels - PROMQL_WORDS - {"label_values"}
        assert not unknown, (expr, unknown)
        used |= metrics
    # Every view gauge the issue asks for is on the dashboard.
    assert {"topodra_inventory_gpus", "topodra_inventory_gpus_free", "topodra_inventory_nvlink_domains_free",
            "topodra_inventory_fragmented_gpus", "topodra_inventory_pending_claims"} <= used
    # ... and issue 32's per-namespace activity and idle GPUs.
    assert {"topodra_gpu_sm_active_ratio", "topodra_gpu_claim_info", "topodra_claim_idle"} <= used


@pytest.mark.parametrize("text", ["9418", "host:", "h:99999", ":0"])
def test_serve_address_is_checked(text: str) -> None:
    with pytest.raises(ValueError):
        parse_listen(text)
    assert parse_listen(":9418") == ("0.0.0.0", 9418)
