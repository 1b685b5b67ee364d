"""Finding 23 against the real toolkit: ``nvidia-ctk cdi generate --device-name-strategy=type-index`` (built
from its Go module by hack/build-bins) names GPUs ``gpuN``; the plugin's own discovery through the stand-in
(the real pynvml binding) matches every one of them to its GPU, by device node."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from test_ctk_spec import PROFILE, bin_dir, gpu_count, tree  # noqa: F401  (tree: the module's fixture)
from testkit.standin import run_py

from topodra.hardware.mockprofile import build_tree, load_profile

pytestmark = pytest.mark.node


def test_type_index_names_from_nvidia_ctk_match_every_gpu(tree: Path, tmp_path: Path) -> None:  # noqa: F811
    bins = bin_dir()
    out = tmp_path / "nvidia.yaml"
    r = subprocess.run([str(bins / "nvidia-ctk"), "cdi", "generate", "--mode=nvml", f"--driver-root={tree}",
                        f"--dev-root={tree}", f"--nvidia-cdi-hook-path={bins / 'nvidia-cdi-hook'}",
                        "--device-name-strategy=type-index", f"--output={out}"],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    names = [d["name"] for d in yaml.safe_load(out.read_text())["devices"]]
    n = gpu_count()
    assert sorted(x for x in names if x != "all") == sorted(f"gpu{i}" for i in range(n))
    sysfs = tmp_path / "sysfs"
    build_tree(load_profile(PROFILE), frozenset()).materialize(str(sysfs))
    got = run_py(tree, f"""
        import yaml
        from topodra import cdi
        from topodra.hardware import load_backend
        devices = load_backend("nvml", "n", sysfs_root={str(sysfs)!r}, nvidia_driver_root=TREE).discover()
        specs = [yaml.safe_load(open({str(out)!r}))]
        ids = cdi.nvidia_gpu_ids(specs, devices)
        nodes = {{d.name: d.device_nodes[0] for d in devices if d.kind == "gpu"}}
        out({{"ids": ids, "nodes": nodes, "unmatched": cdi.unmatched_gpus(specs, devices, ids)}})
    """)
    assert got["unmatched"] == [] and len(got["ids"]) == n
    spec = yaml.safe_load(out.read_text())
    by_name = {d["name"]: {x["path"] for x in d["containerEdits"]["deviceNodes"]} for d in spec["devices"]}
    for gpu, cdi_id in got["ids"].items():
        assert got["nodes"][gpu] in by_name[cdi_id.removeprefix("nvidia.com/gpu=")], (gpu, cdi_id)
