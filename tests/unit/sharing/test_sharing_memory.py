"""GPU memory as consumable capacity: publishing, the real scheduler sharing one GPU, and each share's limit.

Split by tier; the rest: tests/cluster/test_sharing_memory_cluster.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from topodra import checkpoint
from topodra.claims import ClaimRef, allocated_claim
from topodra.hardware import load_backend
from topodra.inventory import Inventory
from topodra.slices import build_slices
from topodra.state import DeviceState

DRIVER = "gpu.topodra.io"


def test_opt_in_publishes_whole_gpus_as_shareable_by_memory() -> None:
    plain = load_backend("mock:dgx-a100-80gb", "n").discover()
    assert not any(d.allow_multiple_allocations for d in plain)
    devs = load_backend("mock:dgx-a100-80gb", "n", overrides={"shareGpuMemory": True}).discover()
    gpus = [d for d in devs if d.kind == "gpu"]
    assert len(gpus) == 8 and all(d.attributes["type"].value == "gpu-shared" for d in gpus)
    api = build_slices(DRIVER, "n", None, devs, 1)[0]["spec"]["devices"][0]
    assert api["allowMultipleAllocations"] is True
    assert api["capacity"]["memory"] == {"value": "80Gi", "requestPolicy": {
        "default": "1Gi", "validRange": {"min": "1Gi", "step": "1Gi"}}}
    # A MIG-enabled GPU stays partitioned: its memory is not also shared.
    mig = load_backend("mock:dgx-a100-80gb-mig", "n", overrides={"shareGpuMemory": True}).discover()
    assert not any(d.allow_multiple_allocations for d in mig)


def shared_result(device: str, share: str, memory: str) -> dict[str, object]:
    return {"request": "gpus", "driver": DRIVER, "pool": "node-a", "device": device, "shareID": share,
            "consumedCapacity": {"memory": memory}}


def claim_obj(uid: str, results: list[dict[str, object]]) -> dict[str, object]:
    return {"metadata": {"uid": uid, "namespace": "ns", "name": f"c-{uid}"},
            "status": {"allocation": {"devices": {"results": results}}}}


def test_each_share_gets_its_limit_and_keeps_it_across_restarts(tmp_path: Path) -> None:
    devs = load_backend("mock:dgx-a100-80gb", "node-a", overrides={"shareGpuMemory": True}).discover()
    boot = tmp_path / "boot"
    boot.write_text("b1\n")

    def state() -> DeviceState:
        return DeviceState(DRIVER, "node-a", Inventory(devs), tmp_path / "cdi", tmp_path / "state",
                           boot_id_path=str(boot), nvidia_spec_dirs=[])

    st = state()
    claims = [allocated_claim(ClaimRef("ns", u, f"c-{u}"), claim_obj(u, [shared_result("gpu-0", s, m)]), DRIVER,
                              "node-a", "node-a")
              for u, s, m in (("u1", "0b6c1c5e-0000-4000-8000-000000000001", "20Gi"),
                              ("u2", "0b6c1c5e-0000-4000-8000-000000000002", "30Gi"))]
    res = st.prepare(claims)
    assert res["u1"].error == "" and res["u2"].error == ""

    def env(uid: str) -> list[str]:
        (p,) = (tmp_path / "cdi").glob(f"*{uid}*")
        spec = json.loads(p.read_text()) if p.suffix == ".json" else yaml.safe_load(p.read_text())
        return [e for d in spec["devices"] for e in d["containerEdits"]["env"]]

    assert "TOPODRA_DEVICE_GPU_0_MEMORY_LIMIT=20Gi" in env("u1")
    assert "TOPODRA_DEVICE_GPU_0_MEMORY_LIMIT=30Gi" in env("u2")
    entry = checkpoint.load(tmp_path / "state" / checkpoint.FILE_NAME).claims["u2"]  # type: ignore[union-attr]
    assert entry.devices[0].consumed_capacity == {"memory": "30Gi"} and entry.devices[0].access == "shared"
    for p in (tmp_path / "cdi").glob("*"):
        p.unlink()
    assert sorted(state().last_recovery.recreated) == ["u1", "u2"]
    assert "TOPODRA_DEVICE_GPU_0_MEMORY_LIMIT=30Gi" in env("u2")
