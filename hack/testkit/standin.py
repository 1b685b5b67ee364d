"""The NVML stand-in rig: driver trees from hack/driver-tree, and Python children that load the stand-in.

Each child is a fresh interpreter because a process holds one NVML library, loaded once: the child loads
the tree's ``libnvidia-ml.so.1`` the production way (``topodra.hardware.nvmllib``, absolute path, no
``LD_LIBRARY_PATH``), runs the test's code against the real pynvml binding and prints one JSON line back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from testkit.paths import REPO

DRIVER_TREE = REPO / "hack" / "driver-tree"
LIBDIR = "usr/lib/x86_64-linux-gnu"

PRELUDE = """
import ctypes, json, sys, time
import pynvml
from topodra.hardware import nvmllib
TREE = sys.argv[1]
LIB = nvmllib.load(TREE, pynvml)
def out(value):
    print("RESULT " + json.dumps(value))
def place(start, size):  # a GPU-instance placement, passed by pointer as nvml.h declares
    return ctypes.byref(pynvml.c_nvmlGpuInstancePlacement_t(start, size))
XID, DBE = pynvml.nvmlEventTypeXidCriticalError, pynvml.nvmlEventTypeDoubleBitEccError
CI_1, CI_2 = pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE
def err(call, *args):
    try:
        call(*args)
    except pynvml.NVMLError as e:
        return type(e).__name__.removeprefix("NVMLError_")
    return "ok"
"""


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment without any loader variables, so only an absolute-path load can find the library."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "LD_PRELOAD")}
    env.update(extra or {})
    return env


def driver_tree(dest: Path, profile: str, *, node: str = "standin-node", dev_nodes: bool = False,
                hide: tuple[int, ...] = ()) -> Path:  # fmt: skip
    args = [str(DRIVER_TREE), "--profile", profile, str(dest), "--node", node]
    for slot in hide:
        args += ["--hide", str(slot)]
    if not dev_nodes:
        args.append("--no-dev-nodes")
    r = subprocess.run(args, capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(dest.resolve()), r.stdout
    return dest.resolve()


def lib_dir(tree: Path) -> Path:
    return tree / LIBDIR


def write_faults(tree: Path, faults: dict[str, Any]) -> None:
    """Replace the tree's faults file (a new file: the stand-in sees the change by mtime and size)."""
    path = lib_dir(tree) / "nvml-standin-faults.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(faults))
    os.replace(tmp, path)


def run_py(tree: Path, code: str, *, env: dict[str, str] | None = None, timeout: float = 60) -> Any:
    """Run ``code`` (after PRELUDE) in a child that loaded the tree's NVML; the value it passed to out()."""
    src = PRELUDE + textwrap.dedent(code)
    r = subprocess.run([sys.executable, "-c", src, str(tree)], capture_output=True, text=True, timeout=timeout,
                       env=clean_env(env), check=False)  # fmt: skip
    assert r.returncode == 0, f"child failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"child printed no result:\n{r.stdout}\n{r.stderr}"
    return json.loads(lines[-1].removeprefix("RESULT "))
