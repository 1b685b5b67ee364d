"""What a claim's CDI spec gives a container on a real host (issue 19 findings 2, 3 and 9), against a
driver tree from hack/driver-tree and, for MIG, the C NVML stand-in that writes the capability files.

No root: the tree is built without char nodes; device nodes under a dev root are symlinks to /dev/null and
/dev/zero, which ``stat`` follows, so the numbers in the spec must come from the node, not from a table.
"""

from __future__ import annotations

import argparse
import os
import textwrap
from pathlib import Path
from typing import Any

import pytest
from testkit.standin import LIBDIR, driver_tree, run_py

from topodra import cdi, hostdriver
from topodra.devices import Device, string_attr
from topodra.hardware.mockprofile import build_tree, load_profile
from topodra.plugin import config
from topodra.plugin.main import host_driver

DRIVER = "gpu.topodra.io"
UID = "ab0c2a9e-1b7d-4c8e-9a51-3e2d4b6f7a80"
NODE = "standin-node"


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return driver_tree(tmp_path_factory.mktemp("tree") / "root", "dgx-h100", node=NODE)


def dev_root(tmp_path: Path) -> Path:
    """A dev root whose nvidiactl is /dev/null (1:3) and nvidia-uvm /dev/zero (1:5): real char nodes."""
    (tmp_path / "dev").mkdir()
    os.symlink("/dev/null", tmp_path / "dev/nvidiactl")
    os.symlink("/dev/zero", tmp_path / "dev/nvidia-uvm")
    (tmp_path / "dev/nvidia-notanode").write_text("")  # a plain file is no device node
    return tmp_path


def gpu(n: int, nodes: bool = True) -> Device:
    return Device(name=f"gpu-{n}", kind="gpu", attributes={"model": string_attr("H100-SXM5-80GB")},
                  uuid=f"GPU-0000000{n}-aaaa-bbbb-cccc-dddddddddddd",
                  device_nodes=(f"/dev/nvidia{n}",) if nodes else ())


def env_of(edits: dict[str, Any]) -> dict[str, str]:
    return dict(e.split("=", 1) for e in edits.get("env", []))


def real_file(tree: Path, soname: str) -> Path:
    return Path(os.path.realpath(tree / LIBDIR / soname))


def test_host_driver_reads_majors_nodes_and_libraries_from_the_tree(tree: Path, tmp_path: Path) -> None:
    host = hostdriver.discover(tree, dev_root=dev_root(tmp_path), proc_root=tree / "proc",
                               host_driver_root="/run/nvidia/driver")
    devices = (tree / "proc/devices").read_text()
    assert host.majors["nvidia-caps"] == int(next(ln.split()[0] for ln in devices.splitlines()
                                                  if ln.endswith(" nvidia-caps")))
    assert host.majors["nvidia-frontend"] == 195
    assert host.control_nodes() == [
        {"path": "/dev/nvidiactl", "type": "c", "major": 1, "minor": 3, "fileMode": 0o666},
        {"path": "/dev/nvidia-uvm", "type": "c", "major": 1, "minor": 5, "fileMode": 0o666}]
    assert "/dev/nvidia-notanode" not in host.nodes
    cuda, nvml = real_file(tree, "libcuda.so.1"), real_file(tree, "libnvidia-ml.so.1")
    assert cuda.name != "libcuda.so.1"  # the tree has the versioned file and the soname link, as a host does
    opts = ["ro", "nosuid", "nodev", "rbind", "rprivate"]
    assert host.mounts() == [  # the host's path of each file, mounted at its own name and at its soname
        {"hostPath": f"/run/nvidia/driver/{LIBDIR}/{cuda.name}", "containerPath": f"/{LIBDIR}/{cuda.name}",
         "options": opts},
        {"hostPath": f"/run/nvidia/driver/{LIBDIR}/{cuda.name}", "containerPath": f"/{LIBDIR}/libcuda.so.1",
         "options": opts},
        {"hostPath": f"/run/nvidia/driver/{LIBDIR}/{nvml.name}", "containerPath": f"/{LIBDIR}/{nvml.name}",
         "options": opts},
        {"hostPath": f"/run/nvidia/driver/{LIBDIR}/{nvml.name}", "containerPath": f"/{LIBDIR}/libnvidia-ml.so.1",
         "options": opts}]


def test_dev_root_defaults_to_the_driver_root_only_when_it_has_nvidiactl(tree: Path, tmp_path: Path) -> None:
    assert hostdriver.default_dev_root(tree) == Path("/")  # built without char nodes
    root = dev_root(tmp_path)
    assert hostdriver.default_dev_root(root) == root


def test_gpu_claim_on_a_real_host_gets_the_driver_and_void(tree: Path, tmp_path: Path) -> None:
    host = hostdriver.discover(tree, dev_root=dev_root(tmp_path), proc_root=tree / "proc")
    spec = cdi.valid_spec(DRIVER, UID, [cdi.SpecDevice(gpu(0)), cdi.SpecDevice(gpu(1))], host=host)
    top = spec["containerEdits"]
    env = env_of(top)
    assert env["NVIDIA_VISIBLE_DEVICES"] == "void"  # finding 9: the nvidia runtime injects nothing by env
    assert env["TOPODRA_VISIBLE_UUIDS"] == f"{gpu(0).uuid},{gpu(1).uuid}"
    assert env["TOPODRA_VISIBLE_DEVICES"] == "gpu-0,gpu-1"
    assert [n["path"] for n in top["deviceNodes"]] == ["/dev/nvidiactl", "/dev/nvidia-uvm"]
    assert all(n["type"] == "c" and "major" in n and "minor" in n for n in top["deviceNodes"])
    assert {m["containerPath"] for m in top["mounts"]} >= {f"/{LIBDIR}/libcuda.so.1", f"/{LIBDIR}/libnvidia-ml.so.1"}
    assert all(m["hostPath"].startswith(str(tree)) and "ro" in m["options"] for m in top["mounts"])
    # Each GPU's own node, by number (this dev root has none: no host stat can fail the container).
    assert [d["containerEdits"]["deviceNodes"] for d in spec["devices"]] == [
        [{"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0, "fileMode": 0o666}],
        [{"path": "/dev/nvidia1", "type": "c", "major": 195, "minor": 1, "fileMode": 0o666}]]
    assert spec["cdiVersion"] == "0.3.0"  # no hostPath on device nodes: nothing newer needed


def test_gpu_node_under_the_dev_root_takes_its_stat(tmp_path: Path) -> None:
    root = dev_root(tmp_path)
    os.symlink("/dev/full", root / "dev/nvidia3")  # 1:7
    host = hostdriver.discover(tmp_path / "no-driver", dev_root=root, proc_root=tmp_path)
    spec = cdi.valid_spec(DRIVER, UID, [cdi.SpecDevice(gpu(3))], host=host)
    assert spec["devices"][0]["containerEdits"]["deviceNodes"] == [
        {"path": "/dev/nvidia3", "type": "c", "major": 1, "minor": 7, "fileMode": 0o666}]
    assert "mounts" not in spec["containerEdits"]  # no libraries under that driver root: none invented


def test_mock_specs_keep_their_shape(tree: Path) -> None:
    """Mock hardware has no HostDriver: env only, as before (save the void value)."""
    nic = Device(name="nic-0", kind="nic", uuid="mlx5_0", device_nodes=("/dev/infiniband/uverbs0",))
    spec = cdi.valid_spec(DRIVER, UID, [cdi.SpecDevice(gpu(0, nodes=False)), cdi.SpecDevice(nic)])
    assert set(spec["containerEdits"]) == {"env"}
    assert spec["devices"][1]["containerEdits"]["deviceNodes"] == [{"path": "/dev/infiniband/uverbs0"}]
    # A NIC-only claim on a real host gets no GPU driver, and a non-NVIDIA node is left to the runtime.
    host = hostdriver.discover(tree, proc_root=tree / "proc")
    nic_only = cdi.valid_spec(DRIVER, UID, [cdi.SpecDevice(nic)], host=host)
    assert set(nic_only["containerEdits"]) == {"env"}
    assert "NVIDIA_VISIBLE_DEVICES" not in env_of(nic_only["containerEdits"])
    assert nic_only["devices"][0]["containerEdits"]["deviceNodes"] == [{"path": "/dev/infiniband/uverbs0"}]


def test_caps_node_without_an_nvidia_caps_major_refuses_the_spec(tmp_path: Path) -> None:
    (tmp_path / "devices").write_text("Character devices:\n195 nvidia-frontend\n\nBlock devices:\n  8 sd\n")
    host = hostdriver.discover(tmp_path, dev_root=tmp_path, proc_root=tmp_path)
    mig = Device(name="gpu-0-mig-1g-10gb-3", kind="mig", uuid="MIG-x",
                 device_nodes=("/dev/nvidia0", "/dev/nvidia-caps/nvidia-cap93"))
    with pytest.raises(cdi.CDISpecInvalid, match="no nvidia-caps line"):
        cdi.valid_spec(DRIVER, UID, [cdi.SpecDevice(mig)], host=host)


def test_mig_claim_gets_caps_nodes_by_number_though_the_host_lacks_them(tmp_path: Path) -> None:
    """Finding 3, the production path: the plugin's DeviceState prepares a MIG claim with instances made
    through the real pynvml against the stand-in, which writes the capability files in the tree's proc."""
    profile = "dgx-a100-80gb-mig"
    tree = driver_tree(tmp_path / "root", profile, node=NODE)
    sysfs = tmp_path / "sysfs"
    build_tree(load_profile(profile), frozenset()).materialize(str(sysfs))
    got = run_py(tree, textwrap.dedent(f"""
        from topodra import effects, hostdriver
        from topodra.claims import AllocatedClaim, AllocatedDevice, ClaimRef
        from topodra.hardware import load_backend
        from topodra.inventory import Inventory
        from topodra.sharing.instances import MigInstances
        from topodra.state import DeviceState
        TMP = {str(tmp_path)!r}
        devices = load_backend("nvml", {NODE!r}, sysfs_root={str(sysfs)!r}, nvidia_driver_root=TREE).discover()
        with open(TMP + "/boot_id", "w") as f:
            f.write("boot-1\\n")
        mig = MigInstances(pynvml, proc_root=TREE + "/proc")
        st = DeviceState({DRIVER!r}, {NODE!r}, Inventory(devices), TMP + "/cdi", TMP + "/state",
                         boot_id_path=TMP + "/boot_id", nvidia_spec_dirs=[],
                         gpu_effects=effects.standard(TMP + "/state", mig=mig),
                         host_driver=hostdriver.discover(TREE, proc_root=TREE + "/proc"))
        name = next(d.name for d in devices if d.kind == "mig" and d.name.startswith("gpu-0-mig-1g"))
        ref = ClaimRef(namespace="ns", uid="u1", name="c")
        res = st.prepare([AllocatedClaim(ref=ref, devices=(AllocatedDevice(request="gpus", device=name,
                                                                           share_id=None, access="exclusive"),))])
        (path,) = __import__("pathlib").Path(TMP + "/cdi").glob("*u1*")
        out({{"error": res["u1"].error, "spec": json.load(open(path)), "name": name}})
    """))
    assert got["error"] == ""
    spec = got["spec"]
    (dev,) = spec["devices"]
    nodes = dev["containerEdits"]["deviceNodes"]
    caps_major = hostdriver.read_majors(tree / "proc")["nvidia-caps"]
    assert nodes[0] == {"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0, "fileMode": 0o666}
    caps = nodes[1:]
    assert len(caps) == 2 and all(n["path"].startswith("/dev/nvidia-caps/nvidia-cap") for n in caps)
    for n in caps:  # numbers from the driver's capability files; the host path is never consulted
        assert n == {"path": n["path"], "type": "c", "major": caps_major,
                     "minor": int(n["path"].removeprefix("/dev/nvidia-caps/nvidia-cap")), "fileMode": 0o444}
        assert not os.path.exists(n["path"])
    env = env_of(spec["containerEdits"])
    assert env["NVIDIA_VISIBLE_DEVICES"] == "void" and env["TOPODRA_VISIBLE_UUIDS"].startswith("MIG-")
    assert {m["containerPath"] for m in spec["containerEdits"]["mounts"]} >= {f"/{LIBDIR}/libcuda.so.1"}


def _cfg(*argv: str) -> config.PluginConfig:
    parser = argparse.ArgumentParser()
    config.configure(parser)
    return config.from_args(parser.parse_args(["--node-name", "n", *argv]), {})


def test_plugin_builds_a_host_driver_for_nvml_only(tree: Path) -> None:
    assert host_driver(_cfg("--hardware", "mock:dgx-h100")) is None
    host = host_driver(_cfg("--hardware", "nvml", "--nvidia-driver-root", str(tree), "--nvidia-proc-root",
                            str(tree / "proc"), "--nvidia-host-driver-root", "/host-root"))
    assert host is not None and host.majors["nvidia-caps"] > 0
    assert all(m["hostPath"].startswith(f"/host-root/{LIBDIR}/") for m in host.mounts())
