"""nvidia-ctk, built from its Go module by hack/build-bins, generates a CDI spec from a host driver tree.

The tree (hack/driver-tree) holds the C stand-in libnvidia-ml.so.1, which nvidia-ctk loads through go-nvml
by absolute path from --driver-root, plus libcuda, the driver binaries and the /dev char nodes (mknod: root).
The spec is checked structurally against the tree, and topodra.cdidiff compares a container's edits under
the toolkit's spec with what topodra's claim spec (with the same nvidia-cdi-hook) gives it.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from testkit.paths import REPO

from topodra import cdi, hostdriver
from topodra.cdidiff import diff, resolve
from topodra.devices import Device
from topodra.hardware.mockprofile import load_profile

pytestmark = pytest.mark.node

PROFILE = "dgx-h100"
LIBDIR = "/usr/lib/x86_64-linux-gnu"


def bin_dir() -> Path:
    out = subprocess.run([str(REPO / "hack/build-bins"), "--print"], capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if os.geteuid() != 0:
        pytest.fail("the driver tree has /dev char nodes: run as root")
    dest = tmp_path_factory.mktemp("driver-root")
    r = subprocess.run([str(REPO / "hack/driver-tree"), "--profile", PROFILE, str(dest)],
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, f"hack/driver-tree failed:\n{r.stdout}\n{r.stderr}"
    return dest


@pytest.fixture(scope="module")
def spec(tree: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    bins = bin_dir()
    ctk = bins / "nvidia-ctk"
    assert ctk.is_file(), f"{ctk} missing: run hack/build-bins"
    out = tmp_path_factory.mktemp("cdi") / "nvidia.yaml"
    r = subprocess.run([str(ctk), "cdi", "generate", "--mode=nvml", f"--driver-root={tree}", f"--dev-root={tree}",
                        f"--nvidia-cdi-hook-path={bins / 'nvidia-cdi-hook'}", f"--output={out}"],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, f"nvidia-ctk cdi generate failed:\n{r.stderr}"
    loaded = yaml.safe_load(out.read_text())
    assert isinstance(loaded, dict), r.stderr
    return loaded


def uuid_of(spec: dict[str, Any], index: int) -> str:
    """The UUID-named device with the same edits as the index-named one."""
    edits = {d["name"]: d["containerEdits"] for d in spec["devices"]}
    (uuid,) = [n for n, e in edits.items() if n.startswith("GPU-") and e == edits[str(index)]]
    return str(uuid)


def gpu_count() -> int:
    return len(load_profile(PROFILE).gpus)


def test_one_device_per_gpu_by_index_and_uuid_with_its_own_node(spec: dict[str, Any], tree: Path) -> None:
    """The stand-in answered go-nvml: count, UUIDs and minor numbers all came from libnvidia-ml.so.1."""
    names = [d["name"] for d in spec["devices"]]
    n = gpu_count()
    assert spec["kind"] == "nvidia.com/gpu"
    assert [x for x in names if x.isdigit()] == [str(i) for i in range(n)]
    uuids = [x for x in names if x.startswith("GPU-")]
    assert len(uuids) == n and len(set(uuids)) == n
    assert "all" in names
    by_name = {d["name"]: d["containerEdits"] for d in spec["devices"]}
    for i in range(n):
        nodes = by_name[str(i)]["deviceNodes"]
        paths = [d["path"] for d in nodes]
        assert f"/dev/nvidia{i}" in paths, paths
        node = next(d for d in nodes if d["path"] == f"/dev/nvidia{i}")
        assert node.get("hostPath", node["path"]) == f"{tree}/dev/nvidia{i}"


def test_spec_level_edits_carry_control_nodes_libraries_hooks_and_void(spec: dict[str, Any], tree: Path) -> None:
    edits = spec["containerEdits"]
    nodes = {d["path"]: d for d in edits["deviceNodes"]}
    for ctl in ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"):
        assert ctl in nodes, sorted(nodes)
        assert nodes[ctl].get("hostPath", ctl) == f"{tree}{ctl}"
    mounts = {m["containerPath"]: m for m in edits["mounts"]}
    libs = {Path(p).name for p in mounts if p.startswith(LIBDIR)}
    assert any(re.fullmatch(r"libcuda\.so\.\d+\.\d+(\.\d+)?", x) for x in libs), sorted(libs)
    assert any(re.fullmatch(r"libnvidia-ml\.so\.\d+\.\d+(\.\d+)?", x) for x in libs), sorted(libs)
    driver_files = {p: m for p, m in mounts.items() if p.startswith("/usr/")}
    for path, m in driver_files.items():
        assert m["hostPath"] == f"{tree}{path}", m  # host side under the tree, container side without it
        assert "ro" in m["options"]
    for binary in ("nvidia-smi", "nvidia-cuda-mps-control", "nvidia-cuda-mps-server"):
        assert f"/usr/bin/{binary}" in driver_files, sorted(driver_files)
    # The .so.1 names are symlinks the create-symlinks hook makes in the container, not mounts.
    links = next(h["args"] for h in edits["hooks"] if h["args"][1] == "create-symlinks")
    assert any(a.endswith(f"::{LIBDIR}/libcuda.so.1") for a in links), links
    hooks = [(h["hookName"], h["args"][1]) for h in edits["hooks"]]
    assert ("createContainer", "update-ldcache") in hooks, hooks
    assert ("createContainer", "create-symlinks") in hooks, hooks
    ldcache = next(h for h in edits["hooks"] if h["args"][1] == "update-ldcache")
    assert ldcache["path"] == str(bin_dir() / "nvidia-cdi-hook")
    assert LIBDIR in ldcache["args"]
    assert "NVIDIA_VISIBLE_DEVICES=void" in edits["env"]


def test_cdidiff_on_toolkit_output(spec: dict[str, Any]) -> None:
    """GPU 1 by UUID is GPU 1 by index; GPU 0 differs from it by exactly its device node."""
    uuid = uuid_of(spec, 1)
    assert diff(resolve(spec, [uuid]), resolve(spec, ["1"])).same
    d = diff(resolve(spec, ["0"]), resolve(spec, ["1"]))
    assert d.missing == ["device node /dev/nvidia1"] and d.extra == ["device node /dev/nvidia0"], d.lines()


def topodra_gpu_spec(spec: dict[str, Any], tree: Path, index: int) -> dict[str, Any]:
    """The claim spec topodra's prepare writes for one whole GPU on this driver tree (UUID and node as
    discovery finds them, the host driver as the plugin reads it at start)."""
    gpu = Device(name=f"gpu-{index}", kind="gpu", uuid=uuid_of(spec, index), device_nodes=(f"/dev/nvidia{index}",))
    host = hostdriver.discover(tree, dev_root=tree, proc_root=tree / "proc",
                               cdi_hook=str(bin_dir() / "nvidia-cdi-hook"))
    assert host.cdi_hook is not None
    return cdi.build_spec("gpu.topodra.io", "uid", [cdi.SpecDevice(gpu)], host=host)


# What the toolkit's spec gives a container that topodra's does not, on purpose (docs/prepare.md, "What a
# container gets on a real host"): /var/run/nvidia-container-devices/void (the legacy runtime hook's marker),
# and the driver's utility binaries and non-compute libraries (topodra mounts the compute subset only).
KNOWN_GAP = re.compile(r"^(mount /var/run/nvidia-container-devices/|mount .*/usr/bin/"
                       r"|mount .*/lib(?!cuda\.so|nvidia-ml\.so|nvidia-ptxjitcompiler|nvidia-nvvm))")


def test_topodra_claim_spec_gives_a_container_what_the_toolkit_does(spec: dict[str, Any], tree: Path) -> None:
    """Issue 19, finding 2: every device node, the compute libraries, every nvidia-cdi-hook hook (by name,
    program and arguments: create-symlinks' links, the ldcache folders, the driver version, the GPU's memory
    limit hook) and the env the toolkit's spec gives GPU 1; what is left is the named gap above, nothing else."""
    ours = topodra_gpu_spec(spec, tree, 1)
    d = diff(resolve(ours, [ours["devices"][0]["name"]]), resolve(spec, ["1"]))
    unexplained = [m for m in d.missing if not KNOWN_GAP.match(m)]
    assert not unexplained, "\n".join(d.lines())
    assert not [m for m in d.missing if m.startswith("device node")], d.lines()
    assert not [x for x in d.differing if x.startswith("env ")], d.lines()  # NVIDIA_VISIBLE_DEVICES=void too
    assert not [x for x in d.lines() if " hook " in x], d.lines()  # none missing, extra or different
    assert resolve(ours, [ours["devices"][0]["name"]]).hooks == resolve(spec, ["1"]).hooks
    assert not [x for x in d.extra if x.startswith("mount ")], d.lines()  # sonames are the hook's links now
