"""MPS from a GpuConfig: one control daemon per claim (the mock-hardware stand-in for nvidia-cuda-mps-control),
its directories and limits in the CDI spec, stopped on unprepare, and reconciled after kill -9 of the plugin."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from testkit import rigs as rig
from testkit.rigs import claim, hardware, ref

from topodra import checkpoint
from topodra.claims import AllocatedClaim, AllocatedDevice, ClaimRef
from topodra.hardware import mockmps
from topodra.sharing import mpsshm
from topodra.sharing.config import Mps, Sharing
from topodra.sharing.mps import CONTAINER_PIPE_DIR, MpsDaemons, claim_env
from topodra.state import CRASH_EXIT_CODE

STAND_IN = str(Path(mockmps.__file__))
# This file's node has MPS, run by the stand-in control daemon (mock hardware).
state = functools.partial(rig.state, mps_binary=STAND_IN)


def mps(pct: int | None = 50, limit: str | None = "10Gi") -> Sharing:
    return Sharing(strategy="MPS", mps=Mps(defaultActiveThreadPercentage=pct, defaultPinnedDeviceMemoryLimit=limit))


def spec(tmp_path: Path, uid: str) -> dict[str, Any]:
    (path,) = (tmp_path / "cdi").glob(f"*_{uid}.json")
    return dict(json.loads(path.read_text()))


@pytest.fixture(autouse=True)
def no_daemon_left(tmp_path: Path) -> Iterator[None]:
    """Whatever a test leaves running is stopped (the daemons outlive the processes that start them)."""
    yield
    for pid_file in (tmp_path / "state" / "mps").glob(f"*/pipe/{mockmps.PID_FILE}"):
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(pid_file.read_text()), signal.SIGTERM)
    for shm in (tmp_path / "state" / "mps").glob("*/shm"):
        mpsshm.unmount(shm)


def test_claim_env_uses_the_config_then_the_share(tmp_path: Path) -> None:
    assert claim_env(Mps(defaultActiveThreadPercentage=30), ["20Gi", None]) == [
        f"CUDA_MPS_PIPE_DIRECTORY={CONTAINER_PIPE_DIR}", "CUDA_MPS_LOG_DIRECTORY=/var/log/nvidia-mps",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=20480M"]
    assert claim_env(Mps(defaultPinnedDeviceMemoryLimit="1Gi"), [None, "20Gi"])[-1] == \
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=1024M,1=1024M"


def test_prepare_starts_a_daemon_for_the_claim_and_unprepare_stops_it(tmp_path: Path) -> None:
    devices, nvml = hardware(tmp_path)
    st = state(tmp_path, devices, nvml)
    res = st.prepare([claim("a", "gpu-0", mps(50, "10Gi"), share="s1"), claim("b", "gpu-0", mps(None, None), "s2")])
    assert {u: r.error for u, r in res.items()} == {"a": "", "b": ""}
    pids = {u: rig.daemons(st).pid(u) for u in ("a", "b")}
    assert all(pids.values()) and pids["a"] != pids["b"], "one daemon per claim"
    pipe, logs = rig.daemons(st).dirs("a")
    gpu0 = next(d for d in devices if d.name == "gpu-0").uuid
    assert f"startup: CUDA_VISIBLE_DEVICES={gpu0}" in (logs / "control.log").read_text()
    edits = spec(tmp_path, "a")["containerEdits"]
    assert {"CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50",
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10240M"} <= set(edits["env"])
    assert {(m["hostPath"], m["containerPath"]) for m in edits["mounts"]} == {
        (str(pipe), "/tmp/nvidia-mps"), (str(logs), "/var/log/nvidia-mps"),
        (str(rig.daemons(st).shm_dir("a")), "/dev/shm")}
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=20480M" in spec(tmp_path, "b")["containerEdits"]["env"]
    entry = checkpoint.load(tmp_path / "state" / checkpoint.FILE_NAME).claims["a"]  # type: ignore[union-attr]
    assert entry.devices[0].sharing == mps(50, "10Gi")
    assert st.unprepare([ref("a")]) == {"a": ""}
    assert rig.daemons(st).pid("a") is None and not pipe.exists() and rig.daemons(st).pid("b") == pids["b"]
    assert "command: quit" not in (rig.daemons(st).dirs("b")[1] / "control.log").read_text()
    assert st.unprepare([ref("b")]) == {"b": ""} and rig.daemons(st).claims() == set()


def test_mps_on_a_mig_slice_serves_the_mig_uuid(tmp_path: Path) -> None:
    devices, nvml = hardware(tmp_path, "mock:dgx-a100-80gb-mig")
    st = state(tmp_path, devices, nvml)
    assert st.prepare([claim("m", "gpu-1-mig-1g-10gb-0", mps())])["m"].error == ""
    inst = checkpoint.load(tmp_path / "state" / checkpoint.FILE_NAME).claims["m"].devices[0].mig  # type: ignore[union-attr]
    assert inst is not None
    assert f"CUDA_VISIBLE_DEVICES={inst.uuid}" in (rig.daemons(st).dirs("m")[1] / "control.log").read_text()
    assert st.unprepare([ref("m")]) == {"m": ""}
    assert rig.daemons(st).pid("m") is None and nvml.mig_instances() == {}


def test_missing_binary_fails_the_claim_and_changes_nothing(tmp_path: Path) -> None:
    devices, nvml = hardware(tmp_path, "mock:dgx-a100-80gb-mig")
    st = state(tmp_path, devices, nvml, mps_binary=str(tmp_path / "no-such-mps-control"))
    err = st.prepare([claim("x", "gpu-2-mig-1g-10gb-0", mps())])["x"].error
    assert "cannot start nvidia-cuda-mps-control" in err, err
    assert st.checkpointed_claims() == [] and not list((tmp_path / "cdi").glob("*"))
    assert rig.daemons(st).claims() == set() and nvml.mig_instances() == {}, "the MIG instance made for it is gone"


def test_claim_with_two_mps_settings_is_refused(tmp_path: Path) -> None:
    devices, nvml = hardware(tmp_path)
    st = state(tmp_path, devices, nvml)
    two = AllocatedClaim(ref=ClaimRef("ns", "t", "c-t"), devices=(
        AllocatedDevice(request="a", device="gpu-1", share_id=None, access="exclusive", sharing=mps(10)),
        AllocatedDevice(request="b", device="gpu-2", share_id=None, access="exclusive", sharing=mps(20))))
    assert "different MPS settings" in st.prepare([two])["t"].error
    assert rig.daemons(st).claims() == set() and st.checkpointed_claims() == []


CHILD = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    from testkit.rigs import claim, hardware
    from test_sharing_mps import mps, state
    tmp = Path({tmp!r})
    st = state(tmp, *hardware(tmp))
    st.prepare([claim({uid!r}, {device!r}, mps())])
    os.kill(os.getpid(), signal.SIGKILL)  # kill -9 of the plugin with the claim prepared
""")


def run_child(tmp_path: Path, uid: str, device: str, point: str | None) -> int:
    return rig.run_child(CHILD.format(tmp=str(tmp_path), uid=uid, device=device), point,
                         cwd=Path(__file__).parent).returncode


@pytest.mark.parametrize("point", ["prepare-before-write", "after-cdi-written"])
def test_kill_9_stops_unrecorded_daemons_and_keeps_recorded_ones(tmp_path: Path, point: str) -> None:
    assert run_child(tmp_path, "keep", "gpu-3", None) == -signal.SIGKILL
    assert run_child(tmp_path, "lost", "gpu-4", point) == CRASH_EXIT_CODE
    daemons = MpsDaemons(tmp_path / "state", binary=STAND_IN)
    keep_pid, lost_pid = daemons.pid("keep"), daemons.pid("lost")
    assert keep_pid and lost_pid, "both daemons outlived the killed plugin"
    st = state(tmp_path, *hardware(tmp_path))  # the plugin restarts
    assert rig.daemons(st).pid("keep") == keep_pid, "a recorded claim's daemon is left running"
    assert rig.daemons(st).pid("lost") is None and rig.daemons(st).claims() == {"keep"}
    assert [c.uid for c in st.checkpointed_claims()] == ["keep"]
    assert st.prepare([claim("lost", "gpu-4", mps())])["lost"].error == ""  # the kubelet's retry
    assert st.unprepare([ref("keep"), ref("lost")]) == {"keep": "", "lost": ""} and rig.daemons(st).claims() == set()
