"""Issue 19 finding 4: MPS the way NVIDIA runs it.

A per-claim tmpfs that is ``/dev/shm`` of the daemon and of the claim's containers; liveness through the
control pipe; the limits set on the daemon; EXCLUSIVE_PROCESS on the GPUs the claim holds whole while it runs;
``-d`` started with stdio nobody waits on.  Mock hardware's stand-in daemon (``hardware/mockmps.py``) and the
driver tree's (``hack/nvml-standin/mps.c``, with the stand-in ``nvidia-smi`` and NVML) both speak the protocol.
These tests mount tmpfs and enter mount namespaces: they run as root, as the plugin does.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from testkit import rigs as rig
from testkit.rigs import claim, hardware, ref
from testkit.standin import clean_env, driver_tree, lib_dir, run_py

from topodra.devices import Device
from topodra.hardware import mockmps
from topodra.hardware.mock import FakeNvml
from topodra.sharing import mpsshm
from topodra.sharing.computemode import NvidiaSmiComputeMode
from topodra.sharing.config import Mps, Sharing
from topodra.sharing.mps import PID_FILE, MpsDaemons
from topodra.state import CRASH_EXIT_CODE

STAND_IN = str(Path(mockmps.__file__))
state = functools.partial(rig.state, mps_binary=STAND_IN)


def mps(pct: int | None = 40, limit: str | None = "10Gi") -> Sharing:
    return Sharing(strategy="MPS", mps=Mps(defaultActiveThreadPercentage=pct, defaultPinnedDeviceMemoryLimit=limit))


def mounts_at(path: Path) -> int:
    target = os.path.realpath(path)
    return sum(1 for line in Path("/proc/self/mountinfo").read_text().splitlines() if line.split()[4] == target)


def compute_mode(nvml: FakeNvml, uuid: str) -> int:
    nvml.nvmlInit()
    try:
        return int(nvml.nvmlDeviceGetComputeMode(nvml.nvmlDeviceGetHandleByUUID(uuid)))
    finally:
        nvml.nvmlShutdown()


def uuid_of(devices: list[Device], name: str) -> str:
    return str(next(d for d in devices if d.name == name).uuid)


def spec_mounts(tmp_path: Path, uid: str) -> set[tuple[str, str]]:
    (path,) = (tmp_path / "cdi").glob(f"*_{uid}.json")
    return {(m["hostPath"], m["containerPath"]) for m in json.loads(path.read_text())["containerEdits"]["mounts"]}


@pytest.fixture(autouse=True)
def nothing_left(tmp_path: Path) -> Iterator[None]:
    """Stop what a failing test leaves: daemons (by pid file), helper processes, the claims' tmpfs."""
    yield
    for pid_file in [*tmp_path.rglob(PID_FILE), *tmp_path.rglob("sleeper.pid")]:
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
    for shm in tmp_path.rglob("mps/*/shm"):
        mpsshm.unmount(shm)


def test_the_claims_tmpfs_is_dev_shm_of_its_daemon_and_its_containers(tmp_path: Path) -> None:
    devices, nvml = hardware(tmp_path)
    st = state(tmp_path, devices, nvml)
    assert st.prepare([claim("a", "gpu-1", mps())])["a"].error == ""
    d = rig.daemons(st)
    shm = d.shm_dir("a")
    assert mpsshm.fstype(shm) == "tmpfs" and mounts_at(shm) == 1
    pid = d.pid("a")
    marker = f"{mockmps.SHM_PREFIX}{pid}"
    assert (shm / marker).exists(), "the daemon's /dev/shm is the claim's tmpfs"
    assert not (Path("/dev/shm") / marker).exists(), "not the host's"
    assert (str(shm), "/dev/shm") in spec_mounts(tmp_path, "a"), "every container of the claim mounts it"
    # A retry (the kubelet's, or apply after a crash before the checkpoint) keeps the one mount and daemon.
    assert st.prepare([claim("a", "gpu-1", mps())])["a"].error == ""
    d.start("a", [uuid_of(devices, "gpu-1")])
    assert mounts_at(shm) == 1 and d.pid("a") == pid
    assert st.unprepare([ref("a")]) == {"a": ""}
    assert mounts_at(shm) == 0 and not shm.parent.exists()


def test_tmpfs_has_the_set_size(tmp_path: Path) -> None:
    devices, nvml = hardware(tmp_path)
    d = MpsDaemons(tmp_path / "state", binary=STAND_IN, compute_mode=nvml, shm_size=64 * 2**20)
    d.start("s", [uuid_of(devices, "gpu-2")])
    try:
        assert os.statvfs(d.shm_dir("s")).f_blocks * os.statvfs(d.shm_dir("s")).f_frsize == 64 * 2**20
    finally:
        d.stop("s")


CHILD = textwrap.dedent("""
    import os, signal
    from pathlib import Path
    from testkit.rigs import claim, hardware
    from test_mps_nvidia_way import mps, state
    tmp = Path({tmp!r})
    st = state(tmp, *hardware(tmp))
    st.prepare([claim({uid!r}, {device!r}, mps())])
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_a_crash_between_mount_and_checkpoint_is_recovered(tmp_path: Path) -> None:
    code = CHILD.format(tmp=str(tmp_path), uid="lost", device="gpu-4")
    assert rig.run_child(code, "prepare-before-write", cwd=Path(__file__).parent).returncode == CRASH_EXIT_CODE
    devices, nvml = hardware(tmp_path)
    gpu4 = uuid_of(devices, "gpu-4")
    shm = MpsDaemons(tmp_path / "state", binary=STAND_IN).shm_dir("lost")
    assert mpsshm.fstype(shm) == "tmpfs" and compute_mode(nvml, gpu4) == 3, "the crash left mount and mode"
    st = state(tmp_path, devices, nvml)  # the plugin restarts: recovery stops what no entry records
    assert rig.daemons(st).claims() == set() and mounts_at(shm) == 0 and compute_mode(nvml, gpu4) == 0
    assert st.prepare([claim("lost", "gpu-4", mps())])["lost"].error == ""  # the kubelet's retry
    assert mounts_at(shm) == 1 and compute_mode(nvml, gpu4) == 3
    assert st.unprepare([ref("lost")]) == {"lost": ""} and mounts_at(shm) == 0


def test_liveness_is_the_control_pipe_answering_never_a_pid(tmp_path: Path) -> None:
    devices, nvml = hardware(tmp_path)
    st = state(tmp_path, devices, nvml)
    assert st.prepare([claim("a", "gpu-1", mps())])["a"].error == ""
    d = rig.daemons(st)
    pipe, logs = d.dirs("a")
    real = int((pipe / PID_FILE).read_text())
    # The pid as another PID namespace wrote it: meaningless here, yet the daemon answers.
    (pipe / PID_FILE).write_text("4194303\n")
    assert d.alive("a")
    st = state(tmp_path, devices, nvml)  # a plugin restart keeps it, starting no second daemon
    assert (logs / "control.log").read_text().count("startup:") == 1
    # The daemon is gone, and its pid file names a live process that is no daemon (ours).
    os.kill(real, signal.SIGKILL)
    (pipe / PID_FILE).write_text(f"{os.getpid()}\n")
    assert not d.alive("a") and d.pid("a") is None
    st = state(tmp_path, devices, nvml)  # recovery starts the recorded claim's daemon again
    assert (logs / "control.log").read_text().count("startup:") == 2 and rig.daemons(st).alive("a")
    assert st.unprepare([ref("a")]) == {"a": ""}


def test_limits_are_set_on_the_daemon(tmp_path: Path) -> None:
    devices, nvml = hardware(tmp_path)
    st = state(tmp_path, devices, nvml)
    res = st.prepare([claim("a", "gpu-1", mps(40, "10Gi")), claim("b", "gpu-0", mps(None, None), share="s")])
    assert {u: r.error for u, r in res.items()} == {"a": "", "b": ""}
    d = rig.daemons(st)
    gpu1, gpu0 = uuid_of(devices, "gpu-1"), uuid_of(devices, "gpu-0")
    assert d.control("a", ["get_default_active_thread_percentage"]).strip() == "40.0"
    assert d.control("a", [f"get_default_device_pinned_mem_limit {gpu1}"]).strip() == "10240M"
    # No limit in the config: the share's consumed memory (20Gi) is the cap, and threads stay at 100 %.
    assert d.control("b", [f"get_default_device_pinned_mem_limit {gpu0}"]).strip() == "20480M"
    assert d.control("b", ["get_default_active_thread_percentage"]).strip() == "100.0"
    assert st.unprepare([ref("a"), ref("b")]) == {"a": "", "b": ""}


def test_exclusive_process_while_the_daemon_runs_on_gpus_held_whole(tmp_path: Path) -> None:
    devices, nvml = hardware(tmp_path)
    st = state(tmp_path, devices, nvml)
    res = st.prepare([claim("whole", "gpu-1", mps()), claim("share", "gpu-0", mps(), share="s")])
    assert {u: r.error for u, r in res.items()} == {"whole": "", "share": ""}
    gpu1, gpu0 = uuid_of(devices, "gpu-1"), uuid_of(devices, "gpu-0")
    assert compute_mode(nvml, gpu1) == 3, "EXCLUSIVE_PROCESS: only the claim's MPS server may open it"
    assert compute_mode(nvml, gpu0) == 0, "a GPU shared by memory takes other claims' servers too"
    assert st.unprepare([ref("whole")]) == {"whole": ""}
    assert compute_mode(nvml, gpu1) == 0
    assert st.unprepare([ref("share")]) == {"share": ""}


SLOW_DAEMON = """#!/bin/sh
# Like a daemon that keeps the stdio it inherited: a child holds stdout and stderr open for long.
if [ "$1" = "-d" ]; then
    sleep 600 &
    echo $! > "$(dirname "$0")/sleeper.pid"
fi
exec {python} {stand_in} "$@"
"""


def test_d_is_started_with_stdio_nobody_waits_on(tmp_path: Path) -> None:
    script = tmp_path / "bin" / "nvidia-cuda-mps-control"
    script.parent.mkdir()
    script.write_text(SLOW_DAEMON.format(python="/usr/bin/python3", stand_in=STAND_IN))
    script.chmod(0o755)
    devices, nvml = hardware(tmp_path)
    d = MpsDaemons(tmp_path / "state", binary=str(script), compute_mode=nvml)
    t0 = time.monotonic()
    d.start("a", [uuid_of(devices, "gpu-1")])
    took = time.monotonic() - t0
    try:
        assert d.alive("a") and took < 15, f"{took:.1f} s: waited on the daemon's stdio"
    finally:
        d.stop("a")


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return driver_tree(tmp_path_factory.mktemp("bins"), "dgx-h100")


def smi_mode(tree: Path, uuid: str) -> str:
    env = clean_env({"LD_PRELOAD": str(lib_dir(tree) / "libnvidia-ml.so.1")})
    r = subprocess.run([str(tree / "usr/bin/nvidia-smi"), "-q", "-i", uuid], capture_output=True, text=True,
                       env=env, timeout=30, check=True)
    return next(line.split(":")[1].strip() for line in r.stdout.splitlines() if "Compute Mode" in line)


def test_driver_tree_daemon_shm_limits_and_compute_mode(tree: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The C stand-ins (NVIDIA's argv and stdio) under a driver root, PATH empty as in the plugin pod."""
    monkeypatch.setenv("PATH", "")
    for k in ("LD_PRELOAD", "LD_LIBRARY_PATH", "TOPODRA_MPS_CONTROL"):
        monkeypatch.delenv(k, raising=False)
    uuid = str(run_py(tree, "pynvml.nvmlInit()\nout(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(0)))"))
    smi = NvidiaSmiComputeMode(driver_root=tree)
    assert smi.command(uuid, "EXCLUSIVE_PROCESS")[0] == [str(tree / "usr/bin/nvidia-smi"), "-i", uuid, "-c",
                                                         "EXCLUSIVE_PROCESS"]
    d = MpsDaemons(tmp_path / "state", driver_root=tree, compute_mode=smi)
    d.start("c1", [uuid], limits=["set_default_active_thread_percentage 25",
                                  f"set_default_device_pinned_mem_limit {uuid} 2048M"], exclusive=[uuid])
    try:
        assert smi_mode(tree, uuid) == "Exclusive_Process"
        assert d.control("c1", [f"get_default_device_pinned_mem_limit {uuid}"]).strip() == "2048M"
        assert d.control("c1", ["get_default_active_thread_percentage"]).strip() == "25.0"
        pid = d.pid("c1")
        assert (d.shm_dir("c1") / f"cuda.shm.standin.control.{pid}").exists()
    finally:
        assert d.stop("c1")
    assert smi_mode(tree, uuid) == "Default" and mounts_at(d.shm_dir("c1")) == 0 and d.claims() == set()
