"""Shared parts of the reliability campaign: a node's devices, API objects, and the invariants.

The invariants are what "nothing lost or leaked" means for one node's prepare state
(checked on the files, the way a restarted plugin and the container runtime see them):

* the checkpoint loads (valid JSON, checksum, schema) and holds only ``PrepareCompleted`` claims;
* every checkpointed claim has its CDI spec, and every spec of ours has a checkpointed claim;
* each spec names exactly the CDI devices its checkpoint entry returned to the kubelet;
* no exclusive device is in two claims;
* no temp file of a crashed write is left.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from topodra import cdi, checkpoint
from topodra.checkpoint import PREPARE_COMPLETED, CheckpointCorrupt
from topodra.devices import Device, string_attr
from topodra.inventory import Inventory
from topodra.state import DeviceState

DRIVER = "gpu.topodra.io"
NODE = "node-r"
OTHER_DRIVER = "other.example.com"


def devices() -> list[Device]:
    """An 8-GPU, 8-NIC node (mock hardware: no device nodes)."""
    gpus = [Device(name=f"gpu-{n}", kind="gpu", attributes={"model": string_attr("H100-SXM5-80GB")},
                   capacity={"memory": "80Gi"}, uuid=f"GPU-{n:08d}-1111-2222-3333-444444444444") for n in range(8)]
    nics = [Device(name=f"nic-{n}", kind="nic", uuid=f"mlx5_{n}") for n in range(8)]
    return gpus + nics


def claim_obj(ns: str, name: str, uid: str, devs: list[str], driver: str = DRIVER,
              pool: str = NODE) -> dict[str, Any]:
    """A ResourceClaim as the API server returns it, allocated on ``pool``."""
    results = [{"request": "gpus" if d.startswith("gpu") else "nics", "driver": driver, "pool": pool, "device": d}
               for d in devs]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": ns, "uid": uid},
            "spec": {"devices": {"requests": []}},
            "status": {"allocation": {"devices": {"results": results}}}}


@dataclass(frozen=True)
class Node:
    """One node's plugin directories."""

    root: Path

    @property
    def cdi_root(self) -> Path:
        return self.root / "cdi"

    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    @property
    def boot(self) -> Path:
        return self.root / "boot_id"

    def setup(self) -> Node:
        self.root.mkdir(parents=True, exist_ok=True)
        if not self.boot.exists():
            self.boot.write_text("7d0c5f3e-1a2b-4c3d-8e9f-000000000001\n")
        return self

    def state(self, crash_point: str | None = None) -> DeviceState:
        """A plugin (re)start: a fresh DeviceState, which runs recovery."""
        return DeviceState(DRIVER, NODE, Inventory(devices()), self.cdi_root, self.state_dir,
                           boot_id_path=str(self.boot), crash_point=crash_point, nvidia_spec_dirs=[])

    def snapshot(self) -> dict[str, bytes]:
        """Every file in the CDI and state directories (the lock file aside), byte for byte."""
        out: dict[str, bytes] = {}
        for d in (self.cdi_root, self.state_dir):
            if d.is_dir():
                for p in sorted(d.iterdir()):
                    if p.is_file() and p.name != "serialize.lock":
                        out[f"{d.name}/{p.name}"] = p.read_bytes()
        return out

    def checkpoint(self) -> checkpoint.CheckpointData:
        return checkpoint.load(self.state_dir / checkpoint.FILE_NAME) or checkpoint.CheckpointData()


def violations(node: Node) -> list[str]:
    """Every broken invariant of the node's files (empty: consistent)."""
    problems: list[str] = []
    try:
        data = node.checkpoint()
    except CheckpointCorrupt as e:
        return [f"checkpoint corrupt: {e.problem}"]
    for entry in data.claims.values():
        if entry.state != PREPARE_COMPLETED:
            problems.append(f"claim {entry.uid} left in {entry.state}")
    specs = cdi.claim_spec_uids(node.cdi_root, DRIVER)
    for uid in sorted(specs - set(data.claims)):
        problems.append(f"CDI spec without a prepared claim: {uid}")
    for uid in sorted(set(data.claims) - specs):
        problems.append(f"prepared claim without its CDI spec: {uid}")
    holders: dict[str, list[str]] = {}
    for entry in data.claims.values():
        for d in entry.devices:
            if d.access == "exclusive":
                holders.setdefault(d.device_name, []).append(entry.uid)
        if entry.uid in specs:
            try:
                spec = json.loads(cdi.spec_path(node.cdi_root, DRIVER, entry.uid).read_bytes())
            except (OSError, ValueError) as e:
                problems.append(f"CDI spec of {entry.uid} unreadable: {e}")
                continue
            want = sorted(i for d in entry.devices for i in d.cdi_device_ids)
            got = sorted(cdi.qualified_id(DRIVER, d["name"]) for d in spec.get("devices", []))
            if want != got:
                problems.append(f"CDI spec of {entry.uid} has devices {got}, the checkpoint returned {want}")
    for dev, uids in sorted(holders.items()):
        if len(uids) > 1:
            problems.append(f"device {dev} in claims {uids}")
    for directory in (node.cdi_root, node.state_dir):
        if directory.is_dir():
            problems.extend(f"temp file left: {p}" for p in directory.iterdir() if ".tmp-" in p.name)
    return problems


def quiet() -> None:
    """The campaign provokes thousands of logged errors on purpose; keep only the unexpected."""
    logging.disable(logging.CRITICAL)
