"""Finding 23: the toolkit's CDI device names under every ``--device-name-strategy`` nvidia-ctk v1.20 emits.

``pkg/nvcdi/namer.go``: ``index`` names a GPU ``N`` (MIG ``N:M``), ``type-index`` ``gpuN`` (``migN:M``),
``uuid`` its UUID (``MIG-...``); ``all`` covers every GPU.  N is NVML's index, which need not equal the
minor, so index-style names match through the device node, never through the number.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from test_cdi import gpu, nic

from topodra import cdi
from topodra.inventory import Inventory
from topodra.state import DeviceState


def _spec(names: dict[str, str]) -> dict[str, Any]:
    return {"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu", "devices": [
        {"name": n, "containerEdits": {"deviceNodes": [{"path": p}]}} for n, p in names.items()]}


def test_type_index_names_match_by_device_node_not_by_number() -> None:
    g0, g1 = gpu(0), gpu(1)
    # NVML's index order differs from the minors here: gpu0 is /dev/nvidia1.
    spec = _spec({"gpu0": "/dev/nvidia1", "gpu1": "/dev/nvidia0", "mig1:0": "/dev/nvidia0", "all": "/dev/nvidia0"})
    assert cdi.nvidia_gpu_ids([spec], [g0, g1, nic(0)]) == {"gpu-0": "nvidia.com/gpu=gpu1",
                                                           "gpu-1": "nvidia.com/gpu=gpu0"}


@pytest.mark.parametrize("strategy", ["index", "type-index", "uuid"])
def test_every_strategy_matches_every_gpu(strategy: str) -> None:
    gpus = [gpu(i) for i in range(3)]

    def name(i: int) -> str:
        return {"index": str(i), "type-index": f"gpu{i}", "uuid": gpus[i].uuid}[strategy]

    ids = cdi.nvidia_gpu_ids([_spec({name(i): f"/dev/nvidia{i}" for i in range(3)})], gpus)
    assert ids == {f"gpu-{i}": f"nvidia.com/gpu={name(i)}" for i in range(3)}


def test_names_that_are_not_whole_gpus_never_match() -> None:
    spec = _spec({"mig0:0": "/dev/nvidia0", "0:0": "/dev/nvidia0", "gpu": "/dev/nvidia0", "gpux0": "/dev/nvidia0",
                  "all": "/dev/nvidia0"})
    ids = cdi.nvidia_gpu_ids([spec], [gpu(0)])
    assert ids == {}
    assert cdi.unmatched_gpus([spec], [gpu(0)], ids) == ["gpu-0"]


def test_unmatched_only_when_a_toolkit_spec_exists_and_only_host_gpus() -> None:
    spec = _spec({"gpu0": "/dev/nvidia0"})
    ids = cdi.nvidia_gpu_ids([spec], [gpu(0), gpu(1)])
    assert cdi.unmatched_gpus([spec], [gpu(0), gpu(1), nic(0)], ids) == ["gpu-1"]
    assert cdi.unmatched_gpus([], [gpu(0)], {}) == []
    assert cdi.unmatched_gpus([spec], [gpu(1, nodes=False)], {}) == []  # mock hardware: no nodes, no warning


def test_the_plugin_warns_once_per_gpu_without_a_toolkit_id(tmp_path: Path,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    specs = tmp_path / "nvidia-cdi"
    specs.mkdir()
    (specs / "nvidia.json").write_text(json.dumps(_spec({"gpu7": "/dev/nvidia7"})))
    st = DeviceState("gpu.topodra.io", "node-a", Inventory([gpu(0)]), tmp_path / "cdi", tmp_path / "state",
                     boot_id_path=str(tmp_path / "boot_id"), nvidia_spec_dirs=[specs])
    with caplog.at_level(logging.WARNING, logger="topodra.cdi"):
        assert st._nvidia_ids() == {}
        assert st._nvidia_ids() == {}
    warned = [r.getMessage() for r in caplog.records if "matches no device of the NVIDIA toolkit" in r.getMessage()]
    assert len(warned) == 1 and "GPU gpu-0" in warned[0], warned
