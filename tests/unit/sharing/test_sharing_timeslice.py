"""Time slicing from a GpuConfig: prepare sets the GPU's level (recorded by the fake NVML), unprepare and crash
recovery set it back, bad or clashing configs change nothing; checkpoints without the field still load."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pynvml
import pytest
from testkit.paths import REPO
from testkit.rigs import claim, hardware, ref, run_child, state

from topodra import checkpoint
from topodra.hardware.mock import FakeNvml
from topodra.sharing.config import Sharing, TimeSlicing
from topodra.sharing.timeslice import TimeSliceControl, control_for, desired_levels
from topodra.state import CRASH_EXIT_CODE

FIXTURE_V2 = REPO / "tests" / "fixtures" / "checkpoint-v2.json"


def ts(interval: str) -> Sharing:
    return Sharing(strategy="TimeSlicing", timeSlicing=TimeSlicing(interval=interval))  # type: ignore[arg-type]


def levels(nvml: FakeNvml) -> dict[int, int]:
    """Non-default time-slice levels by GPU index, as the (fake) hardware holds them."""
    by_uuid = {str(g.uuid): i for i, g in enumerate(nvml.facts.gpus)}
    path = Path(nvml.mig_state_file or "")
    held = json.loads(path.read_text()).get("timeslices", {}) if path.exists() else {}
    return {by_uuid[u]: lv for u, lv in sorted(held.items())}


def test_fake_nvml_is_its_own_time_slice_control(tmp_path: Path) -> None:
    _devices, nvml = hardware(tmp_path)
    assert isinstance(nvml, TimeSliceControl) and control_for(nvml) is nvml
    uuid = str(nvml.facts.gpus[1].uuid)
    assert nvml.get_timeslice(uuid) == 0
    nvml.set_timeslice(uuid, 3)
    assert nvml.get_timeslice(uuid) == 3 and levels(nvml) == {1: 3}
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.set_timeslice(uuid, 7)
    with pytest.raises(pynvml.NVMLError_NotFound):
        nvml.set_timeslice("GPU-nope", 1)


def test_desired_levels_is_default_unless_a_claim_asks() -> None:
    assert desired_levels([("a", 2), ("a", 2)], ["a", "b"]) == {"a": 2, "b": 0}


def test_prepare_sets_the_level_and_unprepare_restores_it_when_no_one_else_needs_it(tmp_path: Path) -> None:
    devices, nvml = hardware(tmp_path)
    st = state(tmp_path, devices, nvml)
    # Two memory shares of gpu-0 with the same interval, one whole GPU with another.
    res = st.prepare([claim("a", "gpu-0", ts("Long"), share="s1"), claim("b", "gpu-0", ts("Long"), share="s2"),
                      claim("c", "gpu-1", ts("Short"))])
    assert {u: r.error for u, r in res.items()} == {"a": "", "b": "", "c": ""}
    assert levels(nvml) == {0: 3, 1: 1}
    entry = checkpoint.load(tmp_path / "state" / checkpoint.FILE_NAME).claims["a"]  # type: ignore[union-attr]
    assert entry.devices[0].sharing == ts("Long")
    (spec,) = (tmp_path / "cdi").glob("*_a.json")
    env = json.loads(spec.read_text())["devices"][0]["containerEdits"]["env"]
    assert "TOPODRA_DEVICE_GPU_0_SHARING=TimeSlicing" in env and "TOPODRA_DEVICE_GPU_0_TIMESLICE_INTERVAL=Long" in env
    assert st.unprepare([ref("a"), ref("c")]) == {"a": "", "c": ""}
    assert levels(nvml) == {0: 3}, "b still runs on gpu-0 with Long; gpu-1 is back to Default"
    assert st.unprepare([ref("b")]) == {"b": ""}
    assert levels(nvml) == {}


def test_clashing_interval_and_unsupported_devices_change_nothing(tmp_path: Path) -> None:
    devices, nvml = hardware(tmp_path)
    st = state(tmp_path, devices, nvml)
    assert st.prepare([claim("a", "gpu-0", ts("Long"), share="s1")])["a"].error == ""
    before = (tmp_path / "state" / checkpoint.FILE_NAME).read_bytes()
    err = st.prepare([claim("b", "gpu-0", ts("Short"), share="s2")])["b"].error
    assert "already runs with time-slice interval Long" in err and "asks for Short" in err
    assert (tmp_path / "state" / checkpoint.FILE_NAME).read_bytes() == before
    assert levels(nvml) == {0: 3} and not list((tmp_path / "cdi").glob("*_b.json"))
    # Without a way to set levels, a non-default interval is refused; Default needs nothing and is fine.
    (tmp_path / "bare").mkdir()
    bare = state(tmp_path / "bare", *hardware(tmp_path / "bare"), timeslice=False)
    assert "cannot set time-slice levels" in bare.prepare([claim("x", "gpu-2", ts("Medium"))])["x"].error
    assert bare.prepare([claim("y", "gpu-2", ts("Default"))])["y"].error == ""


def test_mig_slice_refuses_time_slicing(tmp_path: Path) -> None:
    devices, nvml = hardware(tmp_path, "mock:dgx-a100-80gb-mig")
    st = state(tmp_path, devices, nvml)
    err = st.prepare([claim("m", "gpu-0-mig-1g-10gb-0", ts("Short"))])["m"].error
    assert "is a mig device; time slicing is a property of a whole GPU" in err
    assert nvml.mig_instances() == {} and levels(nvml) == {}


def test_failing_hardware_call_fails_the_claim_and_leaves_nothing(tmp_path: Path) -> None:
    devices, nvml = hardware(tmp_path)
    st = state(tmp_path, devices, nvml)
    calls: list[tuple[str, int]] = []

    def broken(uuid: str, level: int) -> None:
        calls.append((uuid, level))
        raise RuntimeError("nvidia-smi: insufficient permissions")

    nvml.set_timeslice = broken  # type: ignore[method-assign]
    err = st.prepare([claim("a", "gpu-0", ts("Long"))])["a"].error
    assert "insufficient permissions" in err and calls
    assert st.checkpointed_claims() == [] and not list((tmp_path / "cdi").glob("*"))


CHILD = textwrap.dedent("""
    import sys
    from pathlib import Path
    from testkit.rigs import claim, hardware, state
    from test_sharing_timeslice import ts
    tmp = Path({tmp!r})
    st = state(tmp, *hardware(tmp))
    st.prepare([claim("k", "gpu-4", ts("Medium"))])
""")


@pytest.mark.parametrize("point", ["prepare-before-write", "after-cdi-written"])
def test_kill_after_setting_the_level_sets_it_back_on_restart(tmp_path: Path, point: str) -> None:
    """The process dies (exit 137, as from kill -9) with the level set and no checkpoint entry; restart resets it."""
    r = run_child(CHILD.format(tmp=str(tmp_path)), point, cwd=Path(__file__).parent)
    assert r.returncode == CRASH_EXIT_CODE, r.stderr
    devices, nvml = hardware(tmp_path)
    assert levels(nvml) == {4: 2}, "the child set the level before dying"
    st = state(tmp_path, devices, nvml)
    assert levels(nvml) == {} and st.checkpointed_claims() == []
    assert st.prepare([claim("k", "gpu-4", ts("Medium"))])["k"].error == ""  # the kubelet's retry
    assert levels(nvml) == {4: 2}
    # A restart with the claim recorded keeps its level.
    state(tmp_path, devices, nvml)
    assert levels(nvml) == {4: 2}


def test_v2_checkpoint_without_sharing_loads_and_unprepares(tmp_path: Path) -> None:
    """tests/fixtures/checkpoint-v2.json was written before GpuConfig existed (MIG + memory share entries)."""
    data = checkpoint.decode(FIXTURE_V2.read_bytes(), FIXTURE_V2)
    assert set(data.claims) == {"uid-slice", "uid-share"}
    assert all(d.sharing is None for e in data.claims.values() for d in e.devices)
    path = tmp_path / checkpoint.FILE_NAME
    checkpoint.save(path, data.with_claim(data.claims["uid-share"].model_copy(update={"devices": [
        data.claims["uid-share"].devices[0].model_copy(update={"sharing": ts("Short")})]})))
    again = checkpoint.load(path)
    assert again is not None and again.claims["uid-share"].devices[0].sharing == ts("Short")
