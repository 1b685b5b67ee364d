"""The sampler and its /metrics series through the real pynvml binding and the C NVML stand-in.

A child process loads a dgx-h100 driver tree the production way, discovers its devices, and runs sampling rounds
against a claim holding two GPUs and a NIC while the test changes the scenario: series values and labels,
missing series and counted errors for a lost GPU, the NIC's sysfs counters x 4, and the idle decision written
once on each change.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from testkit.standin import driver_tree, run_py

from topodra.hardware.mockprofile import build_tree, load_profile

CHILD = """
import os
from prometheus_client import CollectorRegistry, generate_latest
from topodra.claims import ClaimRef
from topodra.hardware import load_backend
from topodra.inventory import Inventory
from topodra.plugin.telemetry import TelemetryCollector
from topodra.telemetry.idle import IdleRule
from topodra.telemetry.sampler import Sampler

SYSFS = os.environ["SYSFS"]
FAULTS = os.path.join(os.path.dirname(str(LIB)), "nvml-standin-faults.json")
GIB = 1 << 30
BUSY = {"utilGpu": 90, "memoryUsed": 20 * GIB, "smActivity": 70.0, "tensorActivity": 40.0,
        "graphicsActivity": 75.0, "nvlinkTxKiBps": 1000000, "pcieRxKBps": 3000}

def scenario(gpus, events=()):
    with open(FAULTS + ".tmp", "w") as f:
        json.dump({"gpus": gpus, "events": list(events)}, f)
    os.replace(FAULTS + ".tmp", FAULTS)

be = load_backend("nvml", "n1", sysfs_root=SYSFS, nvidia_driver_root=TREE)
inv = Inventory(be.discover())
nic = next(d for d in inv.devices if d.kind == "nic")
rdma = nic.attributes["rdmaDevice"].value
cdir = os.path.join(SYSFS, "sys/class/infiniband", rdma, "ports/1/counters")
os.makedirs(cdir, exist_ok=True)
for name, v in (("port_rcv_data", 1000), ("port_xmit_data", 250)):
    open(os.path.join(cdir, name), "w").write(f"{v}\\n")
held = {"uid-1": (ClaimRef(namespace="team-a", uid="uid-1", name="train"),
                  frozenset({("n1", "gpu-0", None), ("n1", "gpu-1", None), ("n1", nic.name, None)}))}
claim = {"metadata": {"uid": "uid-1"},
         "status": {"reservedFor": [{"resource": "pods", "name": "worker-0", "uid": "p"}]}}
writes = []
class Writer:
    def write(self, ns, name, uid, devices, idle, pods, msg):
        writes.append([ns, name, uid, sorted(d[1] for d in devices), idle, list(pods)])
s = Sampler(inv, be.nvml, be.sysfs, pool="n1", driver="gpu.topodra.io", held=lambda: held,
            get_claim=lambda ns, n: claim, writer=Writer(), interval=1.0, rule=IdleRule(idle_seconds=0.4))
reg = CollectorRegistry()
reg.register(TelemetryCollector("n1", lambda: s.snapshot))
res = {}
scenario({"0": {"telemetry": BUSY}})
s.round(); time.sleep(0.3); s.round()
res["busy"] = generate_latest(reg).decode()
res["writes_busy"] = list(writes)
scenario({})
s.round(); time.sleep(0.5); s.round()
res["writes_idle"] = list(writes)
res["idle"] = generate_latest(reg).decode()
s.round()
res["writes_again"] = list(writes)
xid = {"gpu": 0, "type": "xid", "data": 79}
scenario({"1": {"telemetry": BUSY}, "2": {"lost": True}}, [xid, xid, {**xid, "data": 13}])
s.round()
res["writes_active"] = list(writes)
res["lost"] = generate_latest(reg).decode()
s.stop()
out(res)
"""


def series(text: str, name: str) -> dict[str, float]:
    return {ln.split(" ")[0].removeprefix(name): float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
            if ln.startswith(name + "{")}


def one(text: str, name: str, **labels: str) -> float:
    hits = [v for k, v in series(text, name).items() if all(f'{lk}="{lv}"' in k for lk, lv in labels.items())]
    assert len(hits) == 1, (name, labels, series(text, name))
    return hits[0]


def run_child(base: Path, profile: str, child: str) -> dict[str, Any]:
    """Run ``child`` against the stand-in's driver tree and a sysfs tree of ``profile``; its JSON result."""
    tree = driver_tree(base / "root", profile, node="n1")
    sysfs = base / "sysfs"
    build_tree(load_profile(profile), frozenset()).materialize(str(sysfs))
    got: dict[str, Any] = run_py(tree, child, env={"SYSFS": str(sysfs)}, timeout=120)
    return got


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_child(tmp_path_factory.mktemp("sampler"), "dgx-h100", CHILD)


def test_busy_series_carry_claim_and_dcgm_labels(result: dict[str, Any]) -> None:
    busy = result["busy"]
    labels = dict(dra_device_name="gpu-0", namespace="team-a", pod="worker-0", dra_claim_name="train",
                  dra_claim_uid="uid-1", Hostname="n1", modelName="H100-SXM5-80GB")
    assert one(busy, "topodra_gpu_utilization_ratio", **labels) == pytest.approx(0.9)
    assert one(busy, "topodra_gpu_memory_used_bytes", **labels) == 20 * (1 << 30)
    assert one(busy, "topodra_gpu_sm_active_ratio", **labels) == pytest.approx(0.7, abs=0.01)
    assert one(busy, "topodra_gpu_tensor_active_ratio", **labels) == pytest.approx(0.4, abs=0.01)
    assert one(busy, "topodra_gpu_pcie_rx_bytes_per_second", **labels) == 3_000_000
    assert one(busy, "topodra_gpu_nvlink_tx_bytes_total", **labels) > 0
    uuid_line = next(k for k in series(busy, "topodra_gpu_utilization_ratio") if 'dra_device_name="gpu-0"' in k)
    assert 'UUID="GPU-' in uuid_line and 'pci_bus_id="' in uuid_line and 'gpu="0"' in uuid_line
    # a GPU no claim holds: hardware labels, empty claim labels
    assert one(busy, "topodra_gpu_utilization_ratio", dra_device_name="gpu-5", pod="") == 0.0
    assert one(busy, "topodra_gpu_claim_info", dra_device_name="gpu-1", pod="worker-0", dra_claim_name="train") == 1
    assert len(series(busy, "topodra_gpu_claim_info")) == 2  # GPUs only, one per pod
    assert one(busy, "topodra_nic_port_rcv_bytes_total", namespace="team-a", port="1") == 4000  # 4-byte words
    assert one(busy, "topodra_nic_port_xmit_bytes_total", namespace="team-a", port="1") == 1000
    assert one(busy, "topodra_claim_idle", dra_claim_name="train") == 0
    assert result["writes_busy"] == []  # never flagged: nothing to clear


def test_idle_written_once_and_cleared(result: dict[str, Any]) -> None:
    flagged = [["team-a", "train", "uid-1", ["gpu-0", "gpu-1", "nic-0"], True, ["worker-0"]]]
    assert result["writes_idle"] == flagged
    assert one(result["idle"], "topodra_claim_idle", dra_claim_name="train") == 1
    assert one(result["idle"], "topodra_claim_below_threshold_seconds", dra_claim_name="train") >= 0.4
    assert result["writes_again"] == flagged  # unchanged: no second write
    assert result["writes_active"] == [*flagged, [*flagged[0][:4], False, ["worker-0"]]]


def test_lost_gpu_is_a_missing_series_and_a_counted_error(result: dict[str, Any]) -> None:
    lost = result["lost"]
    assert not [k for k in series(lost, "topodra_gpu_utilization_ratio") if 'dra_device_name="gpu-2"' in k]
    assert not [k for k in series(lost, "topodra_gpu_power_watts") if 'dra_device_name="gpu-2"' in k]
    assert one(lost, "topodra_gpu_power_watts", dra_device_name="gpu-3") == 60.0  # the others still read
    assert one(lost, "topodra_telemetry_errors_total", call="nvmlDeviceGetUtilizationRates") == 1


def test_xid_events_are_counted_per_code(result: dict[str, Any]) -> None:
    text = result["lost"]
    assert one(text, "topodra_gpu_xid_errors_total", dra_device_name="gpu-0", xid="79") == 2
    assert one(text, "topodra_gpu_xid_errors_total", dra_device_name="gpu-0", xid="13") == 1
    assert len(series(text, "topodra_gpu_xid_errors_total")) == 2


def test_a_restart_keeps_the_idle_condition_until_activity_returns(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A new sampler (plugin restart) that finds the claim flagged in the API must not clear it while the GPUs
    stay idle (its own clock starts again), and clears it at the first busy sample."""
    base = tmp_path_factory.mktemp("restart")
    tree = driver_tree(base / "root", "dgx-h100", node="n1")
    sysfs = base / "sysfs"
    build_tree(load_profile("dgx-h100"), frozenset()).materialize(str(sysfs))
    code = CHILD.split("res = {}")[0].replace(
        '"status": {"reservedFor"', '"status": {"devices": [{"driver": "gpu.topodra.io", "pool": "n1", '
        '"device": "gpu-0", "conditions": [{"type": "Idle", "status": "True"}]}], "reservedFor"') + """
scenario({})
s.round(); s.round()
idle_writes = list(writes)
scenario({"0": {"telemetry": BUSY}})
s.round()
out({"idle": idle_writes, "busy": list(writes)})
"""
    got = run_py(tree, code, env={"SYSFS": str(sysfs)}, timeout=120)
    assert got["idle"] == []
    assert got["busy"] == [["team-a", "train", "uid-1", ["gpu-0", "gpu-1", "nic-0"], False, ["worker-0"]]]
