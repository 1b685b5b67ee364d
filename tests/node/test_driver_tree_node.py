"""hack/driver-tree's device nodes (needs root for mknod, as every node-tier test has): majors and minors as
on a GPU node, idempotent re-runs, and the libcuda stub counting real char nodes it may open."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from testkit.standin import clean_env, driver_tree, lib_dir

pytestmark = pytest.mark.node


def _char(path: Path) -> tuple[int, int, int]:
    st = os.lstat(path)
    assert stat.S_ISCHR(st.st_mode), path
    return os.major(st.st_rdev), os.minor(st.st_rdev), stat.S_IMODE(st.st_mode)


def _majors(tree: Path) -> dict[str, int]:
    lines = (tree / "proc/devices").read_text().split("Block devices:")[0].splitlines()[1:]
    return {name: int(num) for num, name in (ln.split() for ln in lines if ln.strip())}


def _cuda_count(tree: Path) -> int:
    code = (f"import ctypes; lib = ctypes.CDLL({str(lib_dir(tree) / 'libcuda.so.1')!r}); n = ctypes.c_int(-1); "
            "rc = lib.cuInit(0); lib.cuDeviceGetCount(ctypes.byref(n)); print(rc, n.value)")  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env=clean_env({"TOPODRA_CUDA_STANDIN_DEV": str(tree / "dev")}))  # fmt: skip
    rc, n = map(int, r.stdout.split())
    assert rc == (0 if n else 100)
    return n


def test_driver_tree_device_nodes(tmp_path: Path) -> None:
    tree = driver_tree(tmp_path / "root", "dgx-h100", dev_nodes=True)
    majors = _majors(tree)
    uvm, caps = majors["nvidia-uvm"], majors["nvidia-caps"]
    assert majors["nvidia-frontend"] == 195
    assert _char(tree / "dev/nvidiactl")[:2] == (195, 255)
    assert _char(tree / "dev/nvidia-uvm")[:2] == (uvm, 0)
    assert _char(tree / "dev/nvidia-uvm-tools")[:2] == (uvm, 1)
    assert [_char(tree / f"dev/nvidia{i}")[:2] for i in range(8)] == [(195, i) for i in range(8)]
    assert _char(tree / "dev/nvidia-caps/nvidia-cap1") == (caps, 1, 0o400)
    assert _char(tree / "dev/nvidia-caps/nvidia-cap2") == (caps, 2, 0o444)
    # No kernel driver behind major 195 here: open() gets ENXIO/ENODEV, which the stub counts as allowed.
    assert _cuda_count(tree) == 8

    before = {p: os.lstat(p).st_ino for p in (tree / "dev").iterdir()}
    assert driver_tree(tmp_path / "root", "dgx-h100", dev_nodes=True) == tree  # idempotent: nodes kept as they are
    assert {p: os.lstat(p).st_ino for p in (tree / "dev").iterdir()} == before

    driver_tree(tmp_path / "root", "l4", dev_nodes=True)  # a 4-GPU profile: the other GPUs' nodes go
    assert sorted(p.name for p in (tree / "dev").glob("nvidia[0-9]*")) == [f"nvidia{i}" for i in range(4)]
    assert _cuda_count(tree) == 4
    driver_tree(tmp_path / "root", "l4", dev_nodes=True, hide=(1, 2, 3))  # three fell off the bus
    assert _cuda_count(tree) == 1
    os.unlink(tree / "dev/nvidia0")
    assert _cuda_count(tree) == 0
