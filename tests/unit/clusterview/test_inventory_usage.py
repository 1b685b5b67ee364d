"""``topodra inventory``'s usage figures from the claims' telemetry summaries and Idle conditions: per-node activity
and memory, per-namespace GPU-hours, the idle claims, the PNG's idle colour and the exporter's gauges.

The claims' status is built with the plugin's own apply bodies (``summary_apply``, ``status_apply``) as the API
server would store them; expected numbers are written down by hand from the scenario."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from testkit.pixels import check_pixels
from testkit.views import claim, device_classes, gpus, node_slices

from topodra import DEFAULT_DRIVER_NAME as DRIVER
from topodra.clusterview.exporter import families
from topodra.clusterview.model import Sources, build_view
from topodra.clusterview.table import render_table
from topodra.clusterview.usage import duration_text
from topodra.telemetry.claimstatus import condition, status_apply
from topodra.telemetry.summary import ClaimSummary, DeviceFigures, summary_apply

Obj = dict[str, Any]
NOW = 1_800_000_000.0
H = 3600.0


def with_status(c: Obj, node: str, summary: ClaimSummary | None, idle_at: float | None = None) -> Obj:
    """``c`` with the status entries the plugin applies: the summary (its own manager) and the Idle condition."""
    entries: dict[str, Obj] = {}
    if summary is not None:
        for e in summary_apply(c["metadata"]["namespace"], c["metadata"]["name"], "u", DRIVER, node, summary,
                               60)["status"]["devices"]:
            entries[e["device"]] = e
    if idle_at is not None:
        devs = [(node, d, None) for d in (summary.devices if summary else [])]
        for e in status_apply("ns", "c", "u", DRIVER, devs, condition(True, idle_at, "idle"))["status"]["devices"]:
            entries.setdefault(e["device"], dict(e))["conditions"] = e["conditions"]
    c["status"]["devices"] = list(entries.values())
    c["status"]["reservedFor"] = [{"resource": "pods", "name": f"{c['metadata']['name']}-pod", "uid": "p"}]
    return c


def alloc(name: str, ns: str, node: str, devices: list[str]) -> Obj:
    return claim(name, gpus(len(devices)), namespace=ns, allocated=[(node, d) for d in devices])


def scenario() -> Sources:
    """a: team-a's ``train`` holds gpu-0..3, busy (activity 0.8/0.6, memory 0.5), 10 h held, 8 h active.
    b: team-b's ``notebook`` holds gpu-0..1, idle since NOW - 2 h (flagged at NOW - 1h45), 3 h held, 1 h active;
       team-b's ``fresh`` holds gpu-2 with no summary yet (a plugin without telemetry, or not written yet)."""
    a, b = node_slices("a", "dgx-h100"), node_slices("b", "dgx-h100")
    busy = ClaimSummary(NOW - 60, False, None, {"gpu-0": DeviceFigures(0.8, 0.5, 10 * H, 8 * H),
                                                 "gpu-1": DeviceFigures(0.6, 0.5, 10 * H, 8 * H),
                                                 "gpu-2": DeviceFigures(0.8, 0.5, 10 * H, 8 * H),
                                                 "gpu-3": DeviceFigures(0.6, 0.5, 10 * H, 8 * H)})
    idle = ClaimSummary(NOW - 100, True, NOW - 2 * H, {"gpu-0": DeviceFigures(0.0, 0.02, 3 * H, 1 * H),
                                                        "gpu-1": DeviceFigures(0.01, 0.02, 3 * H, 1 * H)})
    claims = [with_status(alloc("train", "team-a", "a", ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]), "a", busy),
              with_status(alloc("notebook", "team-b", "b", ["gpu-0", "gpu-1"]), "b", idle, NOW - 1.75 * H),
              alloc("fresh", "team-b", "b", ["gpu-2"])]
    return Sources(slices=tuple(a + b), claims=tuple(claims), classes=device_classes())


def test_usage_figures_from_the_claims_status() -> None:
    view = build_view(scenario(), now=NOW)
    a, b = view.nodes
    assert a.activity == pytest.approx(0.7) and a.memory_used == 0.5
    assert (b.activity, b.memory_used) == (0.005, 0.02)  # gpu-2 of ``fresh`` has no summary: not in the mean
    assert [g.idle for g in b.gpus][:3] == [True, True, False] and not any(g.idle for g in a.gpus)
    ns = {n.namespace: n for n in view.namespaces}
    assert (ns["team-a"].gpus, ns["team-a"].gpus_reporting, ns["team-a"].gpu_hours_allocated,
            ns["team-a"].gpu_hours_active) == (4, 4, 40.0, 32.0)
    assert (ns["team-b"].gpus, ns["team-b"].gpus_reporting, ns["team-b"].gpu_hours_allocated,
            ns["team-b"].gpu_hours_active) == (3, 2, 6.0, 2.0)
    [idle] = view.idle_claims
    assert (idle.namespace, idle.claim, idle.pods, idle.gpus, idle.nodes) == ("team-b", "notebook",
                                                                               ("notebook-pod",), 2, ("b",))
    assert idle.idle_seconds == 2 * H  # from the summary's idleSince, not the condition's later flag time


def test_idle_since_falls_back_to_the_condition_without_a_summary() -> None:
    src = scenario()
    c = src.claims[1]
    for d in c["status"]["devices"]:
        d.pop("data")
    view = build_view(src, now=NOW)
    assert view.idle_claims[0].idle_seconds == 1.75 * H
    assert {n.namespace: n.gpus_reporting for n in view.namespaces} == {"team-a": 4, "team-b": 0}


def test_table_json_and_exporter_carry_the_figures() -> None:
    view = build_view(scenario(), now=NOW)
    text = render_table(view)
    assert re.search(r"^a\s+H100-SXM5-80GB\s+4/8\s.*\s70%\s+50%\s+0$", text, re.M), text
    assert re.search(r"^b\s+H100-SXM5-80GB\s+5/8\s.*\s0%\s+2%\s+2$", text, re.M), text
    assert re.search(r"^team-a\s+4\s+4\s+40\.00\s+32\.00\s+80%$", text, re.M), text
    assert re.search(r"^team-b\s+3\s+2\s+6\.00\s+2\.00\s+33%$", text, re.M), text
    assert re.search(r"^Idle claims \(1, 2 GPUs\)", text, re.M), text
    assert re.search(r"^\s+team-b\s+notebook\s+notebook-pod\s+2\s+2h00m\s+b$", text, re.M), text
    data = json.loads(json.dumps(view.to_dict()))
    assert data["summary"]["idle"] == 2 and data["summary"]["idle_claims"] == 1
    assert (data["summary"]["gpu_hours_allocated"], data["summary"]["gpu_hours_active"]) == (46.0, 34.0)
    assert [n["gpus_idle"] for n in data["nodes"]] == [0, 2]
    assert data["nodes"][0]["activity"] == 0.7 and data["nodes"][0]["gpus"][0]["activity"] == 0.8
    assert data["idle_claims"] == [{"namespace": "team-b", "claim": "notebook", "pods": ["notebook-pod"],
                                    "gpus": 2, "idle_seconds": 7200, "nodes": ["b"]}]
    assert {n["namespace"]: n["active_share"] for n in data["namespaces"]} == {"team-a": 0.8, "team-b": 0.3333}
    got = {f.name: {tuple(s.labels.values()): s.value for s in f.samples} for f in families(view)}
    m = "H100-SXM5-80GB"
    assert got["topodra_inventory_gpus_idle"] == {(m, "a"): 0, (m, "b"): 2}
    assert got["topodra_inventory_node_gpu_activity_ratio"] == {("a",): pytest.approx(0.7), ("b",): 0.005}
    assert got["topodra_inventory_namespace_gpu_hours_allocated"] == {("team-a",): 40.0, ("team-b",): 6.0}
    assert got["topodra_inventory_namespace_gpu_hours_active"] == {("team-a",): 32.0, ("team-b",): 2.0}
    assert got["topodra_inventory_namespace_gpus"][("team-b", "false")] == 1
    assert got["topodra_inventory_idle_claim_seconds"] == {("team-b", "notebook", "notebook-pod"): 7200}
    assert got["topodra_inventory_idle_claim_gpus"] == {("team-b", "notebook", "notebook-pod"): 2}


def test_no_usage_columns_without_summaries() -> None:
    src = scenario()
    src = Sources(slices=src.slices, claims=(alloc("fresh", "team-b", "b", ["gpu-2"]),), classes=src.classes)
    text = render_table(build_view(src, now=NOW))
    assert "ACTIVITY" not in text and "Idle claims" not in text and "GPU-H" not in text


def test_png_marks_idle_gpus_in_their_own_colour(tmp_path: Path) -> None:
    view = build_view(scenario(), now=NOW)
    expected = {}
    for node in "ab":
        for dev in [*(f"gpu-{i}" for i in range(8)), *(f"nic-{i}" for i in range(8))]:
            expected[(node, dev)] = "free"
    for i in range(4):
        expected[("a", f"gpu-{i}")] = "allocated:team-a"
    expected[("b", "gpu-0")] = expected[("b", "gpu-1")] = "idle"
    expected[("b", "gpu-2")] = "allocated:team-b"
    pic = check_pixels(view, tmp_path / "idle.png", expected)
    assert pic.colours["idle"] not in {pic.colours["team-a"], pic.colours["team-b"], pic.colours["free"]}


def test_duration_text() -> None:
    assert [duration_text(s) for s in (59, 420, 3900, 2 * 86400 + 3 * H + 59)] == ["0m", "7m", "1h05m", "2d03h"]
