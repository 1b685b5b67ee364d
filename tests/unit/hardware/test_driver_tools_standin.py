"""The driver tree's tools: nvidia-smi and MPS stand-ins (argv, stdio, pid file, shm) and the libcuda stub.

They are what topodra's time-slicing and MPS code and NVIDIA's own drivers run on a GPU node; the forms
checked here are NVIDIA's (docs/real-node.md says which are verified on real hardware and which are not).
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from testkit.standin import clean_env, driver_tree, lib_dir, run_py


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return driver_tree(tmp_path_factory.mktemp("tools"), "dgx-h100")


def smi(tree: Path, *args: str, preload: bool = True) -> subprocess.CompletedProcess[str]:
    env = clean_env({"LD_PRELOAD": str(lib_dir(tree) / "libnvidia-ml.so.1")} if preload else None)
    return subprocess.run([str(tree / "usr/bin/nvidia-smi"), *args], capture_output=True, text=True, env=env,
                          timeout=30, check=False)  # fmt: skip


def test_nvidia_smi_needs_the_library_preloaded_by_path(tree: Path) -> None:
    r = smi(tree, "-L", preload=False)
    assert r.returncode == 12 and "couldn't find libnvidia-ml.so" in r.stderr


def test_nvidia_smi_lists_the_profiles_gpus(tree: Path) -> None:
    uuids = run_py(tree, """
        pynvml.nvmlInit()
        out([pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(8)])
    """)
    r = smi(tree, "-L")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: {u})" for i, u in enumerate(uuids)]
    q = smi(tree, "-q", "-i", "3")
    assert q.returncode == 0 and "Driver Version                            : 580.126.20" in q.stdout
    assert f"GPU UUID                              : {uuids[3]}" in q.stdout and "Attached GPUs" in q.stdout


def test_compute_policy_timeslice_in_nvidias_argv_form(tree: Path) -> None:
    uuid = run_py(tree, "pynvml.nvmlInit()\nout(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(2)))")
    r = smi(tree, "compute-policy", "-i", uuid, "--set-timeslice", "2")
    assert r.returncode == 0 and f"timeslice to 2 for GPU {uuid}" in r.stdout, r.stderr
    listed = smi(tree, "compute-policy", "-i", "2", "-l")
    assert listed.returncode == 0 and listed.stdout.strip() == f"GPU {uuid}: Timeslice: 2"
    # The one-argument spelling is not known to work on the real tool: refused, level unchanged.
    bad = smi(tree, "compute-policy", "-i", uuid, "--set-timeslice=3")
    assert bad.returncode == 2 and "unsupported argument '--set-timeslice=3'" in bad.stderr
    assert smi(tree, "compute-policy", "-i", uuid, "--set-timeslice", "4").returncode == 2
    assert smi(tree, "compute-policy", "-i", uuid, "-l").stdout.strip().endswith("Timeslice: 2")
    unknown = smi(tree, "compute-policy", "-i", "GPU-00000000-0000-0000-0000-000000000000", "--set-timeslice", "1")
    assert unknown.returncode == 6 and "No devices were found" in unknown.stderr


def test_compute_mode_is_gpu_state_nvml_sees(tree: Path) -> None:
    r = smi(tree, "-i", "1", "-c", "EXCLUSIVE_PROCESS")
    assert r.returncode == 0 and "Set compute mode to EXCLUSIVE_PROCESS for GPU 00000000:" in r.stdout, r.stderr
    modes = run_py(tree, """
        pynvml.nvmlInit()
        out([pynvml.nvmlDeviceGetComputeMode(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in (0, 1)])
    """)
    assert modes == [0, 3]
    assert smi(tree, "-i", "1", "-c", "DEFAULT").returncode == 0
    assert smi(tree, "-i", "1", "-c", "BOGUS").returncode == 2


class Mps:
    def __init__(self, tree: Path, base: Path) -> None:
        self.control = str(tree / "usr/bin/nvidia-cuda-mps-control")
        self.pipe, self.log = base / "pipe", base / "log"
        self.env = clean_env({"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe), "CUDA_MPS_LOG_DIRECTORY": str(self.log)})

    def start(self) -> subprocess.CompletedProcess[str]:
        # Captured pipes, as a careless caller would: the daemon must not keep them open.
        return subprocess.run([self.control, "-d"], capture_output=True, text=True, env=self.env, timeout=10,
                              check=False)  # fmt: skip

    def send(self, commands: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([self.control], input=commands, capture_output=True, text=True, env=self.env,
                              timeout=10, check=False)  # fmt: skip

    def pid(self) -> int:
        return int((self.pipe / "nvidia-cuda-mps-control.pid").read_text())


@pytest.fixture
def mps(tree: Path, tmp_path: Path) -> Iterator[Mps]:
    m = Mps(tree, tmp_path)
    yield m
    if (m.pipe / "nvidia-cuda-mps-control.pid").exists():
        m.send("quit\n")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_mps_daemon_detaches_and_answers_through_the_pipe_dir(mps: Mps) -> None:
    t0 = time.monotonic()
    r = mps.start()
    assert r.returncode == 0 and r.stdout == "" and time.monotonic() - t0 < 5, r.stderr
    pid = mps.pid()
    assert _alive(pid) and os.path.exists(f"/dev/shm/cuda.shm.standin.control.{pid}")
    assert (mps.pipe / "control").exists() and "Starting control daemon" in (mps.log / "control.log").read_text()
    assert mps.send("get_server_list\n").stdout == ""
    started = mps.send("start_server -uid 0\n")
    server = int(started.stdout)
    assert mps.send("get_server_list\n").stdout.split() == [str(server)]
    deadline = time.monotonic() + 5
    while not os.path.exists(f"/dev/shm/cuda.shm.standin.{server}") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert os.path.exists(f"/dev/shm/cuda.shm.standin.{server}")  # the server's IPC lives in /dev/shm
    limits = mps.send("set_default_active_thread_percentage 25\nset_default_device_pinned_mem_limit 0 2048M\n"
                      "get_default_active_thread_percentage\nget_default_device_pinned_mem_limit 0\n")  # fmt: skip
    assert limits.stdout.split() == ["25.0", "25.0", "2048M"]
    again = mps.start()
    assert again.returncode == 1 and "already running" in again.stderr
    assert mps.send("quit\n").returncode == 0
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _alive(pid) and not _alive(server)
    assert not (mps.pipe / "nvidia-cuda-mps-control.pid").exists()
    gone = mps.send("get_server_list\n")
    assert gone.returncode == 1 and "Cannot find MPS control daemon process" in gone.stderr


def test_mps_client_without_daemon_says_so(mps: Mps) -> None:
    r = mps.send("get_server_list\n")
    assert r.returncode == 1 and "Cannot find MPS control daemon process" in r.stderr
    assert mps.send("").returncode == 0  # no commands: nothing to say
    bad = subprocess.run([mps.control, "-x"], capture_output=True, text=True, env=mps.env, check=False)
    assert bad.returncode == 2


def _cuda(tree: Path, dev: Path) -> tuple[int, int, list[int]]:
    code = f"""
import ctypes, json
lib = ctypes.CDLL({str(lib_dir(tree) / "libcuda.so.1")!r})
rc = lib.cuInit(0)
n = ctypes.c_int(-1)
lib.cuDeviceGetCount(ctypes.byref(n))
minors = []
for i in range(max(n.value, 0)):
    m = ctypes.c_int()
    lib.topodraStandinDeviceMinor(i, ctypes.byref(m))
    minors.append(m.value)
print(json.dumps([rc, n.value, minors]))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env=clean_env({"TOPODRA_CUDA_STANDIN_DEV": str(dev)}))  # fmt: skip
    rc, n, minors = __import__("json").loads(r.stdout)
    return rc, n, minors


def test_libcuda_stub_counts_the_gpu_nodes_it_may_open(tree: Path, tmp_path: Path) -> None:
    dev = tmp_path / "dev"
    dev.mkdir()
    assert _cuda(tree, dev) == (100, 0, [])  # CUDA_ERROR_NO_DEVICE
    for name in ("nvidia3", "nvidia0", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"):
        (dev / name).write_text("")
    (dev / "nvidia-caps").mkdir()
    os.symlink("nowhere", dev / "nvidia5")  # a node that cannot be opened (ENOENT) is not a GPU
    assert _cuda(tree, dev) == (0, 2, [0, 3])


def test_libcuda_rejects_calls_before_init(tree: Path) -> None:
    lib = ctypes.CDLL(str(lib_dir(tree) / "libcuda.so.1"))
    n = ctypes.c_int(-1)
    assert lib.cuDeviceGetCount(ctypes.byref(n)) == 3 and n.value == -1  # CUDA_ERROR_NOT_INITIALIZED
    assert lib.cuInit(1) == 1  # flags must be 0
