"""MIG claims in the sampler, through the real pynvml binding and the C NVML stand-in (a dgx-h100-mig tree).

A child discovers the node the production way, creates two MIG instances with topodra's own ``MigInstances`` (as
prepare does), and samples a claim on each while the test drives the per-instance scenario: the series carry the
MIG device's labels (dcgm-exporter's ``GPU_I_ID``/``GPU_I_PROFILE``, the parent's ``UUID``, the MIG device's own
UUID), hold only the figures NVML gives per instance, and the idle rule judges each claim on its own instance.
"""

from __future__ import annotations

from typing import Any

import pytest
from test_sampler_standin import one, run_child, series

CHILD = """
import os
from prometheus_client import CollectorRegistry, generate_latest
from topodra.claims import ClaimRef
from topodra.hardware import load_backend
from topodra.inventory import Inventory
from topodra.plugin.telemetry import TelemetryCollector
from topodra.sharing.instances import MigInstances
from topodra.sharing.mig import placement_of
from topodra.telemetry.idle import IdleRule
from topodra.telemetry.sampler import Sampler

FAULTS = os.path.join(os.path.dirname(str(LIB)), "nvml-standin-faults.json")
GIB = 1 << 30

def scenario(gpus):
    with open(FAULTS + ".tmp", "w") as f:
        json.dump({"gpus": gpus}, f)
    os.replace(FAULTS + ".tmp", FAULTS)

be = load_backend("nvml", "n1", sysfs_root=os.environ["SYSFS"], nvidia_driver_root=TREE)
inv = Inventory(be.discover())
gpu0 = next(d for d in inv.devices if d.name == "gpu-0")
migs = [d for d in inv.devices if d.kind == "mig" and d.attributes["parentDevice"].value == "gpu-0"]
def at(profile, start):
    return next(d for d in migs if d.attributes["profile"].value == profile
                and d.attributes["placementStart"].value == start)
small, big = at("1g.10gb", 4), at("3g.40gb", 0)
made = MigInstances(be.nvml)
a, b = made.create(placement_of(small)), made.create(placement_of(big))
made.close()
held = {"uid-a": (ClaimRef(namespace="team-a", uid="uid-a", name="infer"), frozenset({("n1", small.name, None)})),
        "uid-b": (ClaimRef(namespace="team-b", uid="uid-b", name="train"), frozenset({("n1", big.name, None)}))}
claims = {"infer": {"metadata": {"uid": "uid-a"}, "status": {"reservedFor": [{"resource": "pods", "name": "p-a"}]}},
          "train": {"metadata": {"uid": "uid-b"}, "status": {"reservedFor": [{"resource": "pods", "name": "p-b"}]}}}
writes = []
class Writer:
    def write(self, ns, name, uid, devices, idle, pods, msg):
        writes.append([name, sorted(d[1] for d in devices), idle, list(pods)])
s = Sampler(inv, be.nvml, be.sysfs, pool="n1", driver="gpu.topodra.io", held=lambda: held,
            held_mig=lambda: {small.name: a, big.name: b}, get_claim=lambda ns, n: claims[n], writer=Writer(),
            interval=1.0, rule=IdleRule(idle_seconds=0.4))
reg = CollectorRegistry()
reg.register(TelemetryCollector("n1", lambda: s.snapshot))
busy = {"memoryUsed": 30 * GIB, "smActivity": 80.0, "tensorActivity": 50.0, "graphicsActivity": 85.0}
scenario({"0": {"telemetry": {"mig": {str(a.gpu_instance): {"memoryUsed": 256 << 20},
                                      str(b.gpu_instance): busy}}}})
s.round(); time.sleep(0.3); s.round(); time.sleep(0.5); s.round()
res = {"a": a.model_dump(), "b": b.model_dump(), "parent_uuid": gpu0.attributes["uuid"].value,
       "small": small.name, "big": big.name, "text": generate_latest(reg).decode(), "writes": list(writes)}
scenario({"0": {"telemetry": {"mig": {str(a.gpu_instance): busy}}}})
s.round(); time.sleep(0.3); s.round()
res["swapped"] = generate_latest(reg).decode()
res["writes_swapped"] = list(writes)
s.stop()
out(res)
"""


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_child(tmp_path_factory.mktemp("migsampler"), "dgx-h100-mig", CHILD)


def test_mig_series_carry_instance_and_claim_labels(result: dict[str, Any]) -> None:
    text, b = result["text"], result["b"]
    labels = dict(dra_device_name=result["big"], namespace="team-b", pod="p-b", dra_claim_name="train",
                  UUID=result["parent_uuid"], gpu="0", GPU_I_ID=str(b["gpu_instance"]), GPU_I_PROFILE="3g.40gb",
                  dra_mig_device_uuid=b["uuid"])
    assert b["uuid"].startswith("MIG-")
    assert one(text, "topodra_gpu_memory_used_bytes", **labels) == 30 * (1 << 30)
    assert one(text, "topodra_gpu_memory_total_bytes", **labels) < 80 * (1 << 30)  # the instance's, not the GPU's
    assert one(text, "topodra_gpu_sm_active_ratio", **labels) == pytest.approx(0.8, abs=0.01)
    assert one(text, "topodra_gpu_tensor_active_ratio", **labels) == pytest.approx(0.5, abs=0.01)
    assert one(text, "topodra_gpu_claim_info", **{k: v for k, v in labels.items() if k != "gpu"}) == 1
    # per parent only: no utilisation (NOT_SUPPORTED with MIG on), and power/PCIe stay on the parent's series
    for name in ("topodra_gpu_utilization_ratio", "topodra_gpu_power_watts", "topodra_gpu_pcie_tx_bytes_per_second"):
        assert not [k for k in series(text, name) if 'GPU_I_ID="' + str(b["gpu_instance"]) in k], name
    assert one(text, "topodra_gpu_power_watts", dra_device_name="gpu-0", GPU_I_ID="") > 0
    assert series(text, "topodra_gpu_utilization_ratio") == {}
    # the parent's memory is the aggregate of its instances
    assert one(text, "topodra_gpu_memory_used_bytes", dra_device_name="gpu-0", GPU_I_ID="") == 30 * (1 << 30) + (
        256 << 20)
    assert series(text, "topodra_telemetry_errors_total") == {}  # NOT_SUPPORTED is a capability, not an error


def test_idle_rule_judges_each_mig_claim_on_its_instance(result: dict[str, Any]) -> None:
    text = result["text"]
    assert one(text, "topodra_claim_idle", dra_claim_name="infer") == 1  # 256 MiB of 10 GB, no SM activity
    assert one(text, "topodra_claim_idle", dra_claim_name="train") == 0
    assert result["writes"] == [["infer", [result["small"]], True, ["p-a"]]]
    # the scenario swaps: the small instance busy, the big one idle
    assert result["writes_swapped"][1:] == [["infer", [result["small"]], False, ["p-a"]]]
    assert one(result["swapped"], "topodra_claim_below_threshold_seconds", dra_claim_name="train") > 0
