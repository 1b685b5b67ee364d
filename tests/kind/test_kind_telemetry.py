"""Per-claim telemetry on kind, through the chart's nvml branch: the C stand-in read by the real pynvml binding in
the plugin pod (issue 32, "the kind test on the nvml branch shows the same through the C stand-in").

deploy/kind/values.yaml sets the chart's ``plugin.telemetry.interval`` (2 s) and ``idleSeconds`` (20 s) so that
the flag comes in seconds. The test drives each node's stand-in through its faults file in the host driver tree
(what the plugin's NVML reads), reads the plugin's /metrics from inside its pod on loopback (the chart's default
``metricsAddress`` 127.0.0.1), and reads the claim as a user does (``kubectl get resourceclaim -o yaml``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from .conftest import DRIVER, PLUGIN_NS, Kind, wait_until
from .test_kind_suite import claim_pod, gpu_template

LIBDIR = "usr/lib/x86_64-linux-gnu"
GIB = 1 << 30
BUSY = {"utilGpu": 90, "memoryUsed": 20 * GIB, "smActivity": 70.0, "tensorActivity": 30.0, "graphicsActivity": 80.0}
SCRAPE = ("import urllib.request; "
          "print(urllib.request.urlopen('http://127.0.0.1:9416/metrics', timeout=10).read().decode())")
LINE = re.compile(r"^(\w+)\{(.*)\} (\S+)$")


def faults(kind: Kind, node: str, data: dict[str, Any]) -> None:
    """Replace the node's stand-in scenario (a new file: the stand-in re-reads it by mtime and size)."""
    path = kind.tree(node) / LIBDIR / "nvml-standin-faults.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


@pytest.fixture
def scenario(kind: Kind) -> Iterator[list[str]]:
    """Nodes whose scenario the test changed; each is reset to no scenario (idle GPUs) afterwards."""
    touched: list[str] = []
    yield touched
    for node in touched:
        faults(kind, node, {})


def metrics(kind: Kind, node: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample the node's plugin serves on its loopback /metrics."""
    pod = kind.plugin_pod_on(node)
    assert pod is not None, f"no plugin pod on {node}"
    text = kind.k("exec", "-n", PLUGIN_NS, pod["metadata"]["name"], "-c", "plugin", "--", "python3", "-c",
                  SCRAPE).stdout
    out = []
    for line in text.splitlines():
        m = LINE.match(line)
        if m:
            labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2)))
            out.append((m.group(1), labels, float(m.group(3))))
    return out


def series(kind: Kind, node: str, name: str, **want: str) -> list[tuple[dict[str, str], float]]:
    return [(lab, v) for n, lab, v in metrics(kind, node)
            if n == name and all(lab.get(k) == val for k, val in want.items())]


def idle_condition(kind: Kind, ns: str, claim: str) -> dict[str, Any] | None:
    """The Idle condition on the claim's devices of our driver, as `kubectl get resourceclaim -o yaml` shows it."""
    obj = yaml.safe_load(kind.k("get", "resourceclaim", "-n", ns, claim, "-o", "yaml").stdout)
    conds = [c for d in (obj.get("status") or {}).get("devices") or [] if d.get("driver") == DRIVER
             for c in d.get("conditions") or [] if c.get("type") == "Idle"]
    return conds[0] if conds else None


def pod_events(kind: Kind, ns: str, pod: str) -> set[str]:
    items = kind.get("events", "-n", ns, "--field-selector", f"involvedObject.name={pod}")["items"]
    return {e["reason"] for e in items}


def allocated(kind: Kind, pod: Any) -> tuple[str, str, str]:
    """(claim name, claim UID, device name) of a one-device claim."""
    claim = kind.claim_of(pod)
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    return claim["metadata"]["name"], claim["metadata"]["uid"], result["device"]


def device_attrs(kind: Kind, node: str, device: str) -> dict[str, Any]:
    slices = kind.get("resourceslices", "--field-selector", f"spec.driver={DRIVER},spec.nodeName={node}")
    for s in slices["items"]:
        for d in s["spec"].get("devices") or []:
            if d["name"] == device:
                return {k: next(iter(v.values())) for k, v in (d.get("attributes") or {}).items()}
    raise AssertionError(f"{device} not published by {node}")


def test_gpu_claim_series_and_idle_condition(kind: Kind, ns: str, scenario: list[str]) -> None:
    """A pod's GPU claim: its activity and memory series name the pod, namespace, claim and GPU UUID; driven idle,
    the claim gets Idle=True in status.devices and the pod a GPUClaimIdle Event; busy again, Idle=False."""
    node = kind.nodes_by_profile()["dgx-h100"]
    scenario.append(node)
    faults(kind, node, {"gpus": {str(i): {"telemetry": BUSY} for i in range(8)}})
    kind.apply(ns, gpu_template("one", 1))
    kind.apply(ns, claim_pod("tele", template="one", node=node, command="sleep 3600"))
    pod = kind.wait_pod_phase(ns, "tele", ("Running",))
    claim, uid, device = allocated(kind, pod)
    uuid = device_attrs(kind, node, device)["uuid"]
    labels = dict(namespace=ns, pod="tele", dra_claim_name=claim, dra_claim_uid=uid, UUID=uuid, dra_device_name=device)

    def busy_series() -> dict[str, float] | None:
        got = {name: vals[0][1] for name in ("topodra_gpu_utilization_ratio", "topodra_gpu_memory_used_bytes",
                                              "topodra_gpu_sm_active_ratio")
               if len(vals := series(kind, node, name, **labels)) == 1}
        return got if len(got) == 3 else None
    got = wait_until("the claim's labelled activity and memory series", busy_series, timeout=120, interval=2)
    assert got["topodra_gpu_utilization_ratio"] == pytest.approx(0.9)
    assert got["topodra_gpu_memory_used_bytes"] == 20 * GIB
    assert got["topodra_gpu_sm_active_ratio"] == pytest.approx(0.7, abs=0.02)
    assert [v for _, v in series(kind, node, "topodra_gpu_claim_info", **labels)] == [1.0]
    assert idle_condition(kind, ns, claim) is None  # busy: never flagged, nothing to clear

    faults(kind, node, {})  # the claim's GPU goes idle
    cond = wait_until("Idle=True on the claim", lambda: (c := idle_condition(kind, ns, claim)) and
                      c["status"] == "True" and c, timeout=180, interval=2)
    assert cond["reason"] == "BelowThresholds", cond
    assert [v for _, v in series(kind, node, "topodra_claim_idle", namespace=ns, dra_claim_name=claim)] == [1.0]
    wait_until("the GPUClaimIdle Event on the pod", lambda: "GPUClaimIdle" in pod_events(kind, ns, "tele"),
               timeout=60, interval=2)

    faults(kind, node, {"gpus": {str(i): {"telemetry": BUSY} for i in range(8)}})  # activity returns
    cond = wait_until("Idle=False on the claim", lambda: (c := idle_condition(kind, ns, claim)) and
                      c["status"] == "False" and c, timeout=120, interval=2)
    assert cond["reason"] == "Active", cond


def test_mig_claim_series_are_per_instance(kind: Kind, ns: str, scenario: list[str]) -> None:
    """A 1g MIG claim on the MIG-mode worker: its series carry the parent's UUID, dcgm-exporter's GPU_I_ID and
    GPU_I_PROFILE and the MIG device's UUID, with the instance's own memory as the scenario sets it."""
    node = kind.nodes_by_profile()["dgx-h100-mig"]
    scenario.append(node)
    kind.apply(ns, gpu_template("mig", 1, device_class="gpu-mig-1g"))
    kind.apply(ns, claim_pod("migtele", template="mig", node=node, command="sleep 3600"))
    pod = kind.wait_pod_phase(ns, "migtele", ("Running",))
    claim, _uid, device = allocated(kind, pod)
    attrs = device_attrs(kind, node, device)
    labels = dict(namespace=ns, pod="migtele", dra_claim_name=claim, dra_device_name=device,
                  UUID=attrs["parentUUID"], GPU_I_PROFILE=attrs["profile"])
    found = wait_until("the MIG claim's memory series", lambda: series(
        kind, node, "topodra_gpu_memory_used_bytes", **labels) or None, timeout=120, interval=2)
    ((lab, _v),) = found
    assert lab["dra_mig_device_uuid"].startswith("MIG-") and lab["GPU_I_ID"].isdigit(), lab
    mig = {lab["GPU_I_ID"]: {"memoryUsed": 3 * GIB}}  # the scenario names the GPU by UUID, the instance by id
    faults(kind, node, {"gpus": {attrs["parentUUID"]: {"telemetry": {"mig": mig}}}})
    wait_until("the instance's memory from the scenario", lambda: [v for _, v in series(
        kind, node, "topodra_gpu_memory_used_bytes", **labels, GPU_I_ID=lab["GPU_I_ID"])] == [3.0 * GIB],
        timeout=60, interval=2)
    total = [v for _, v in series(kind, node, "topodra_gpu_memory_total_bytes", **labels)]
    assert len(total) == 1 and total[0] < 20 * GIB, total  # the 1g instance's memory, not the 80 GB GPU's
    assert series(kind, node, "topodra_gpu_utilization_ratio", **labels) == []  # NOT_SUPPORTED with MIG on
