"""Time-slice levels after a crash on a host whose tool cannot read the level back (``nvidia-smi``: real hosts).

Found by the GPU-effect crash campaign (bench/reliability/gpueffects.py): a plugin killed after setting a
level and before its checkpoint write (prepare), or after its checkpoint write and before setting the level
back (unprepare), left the GPU at that level for good: recovery skipped every GPU whose level it could not
read and that no claim wanted, so nothing set it back, and no later unprepare did either.  Here the kill is
an exception out of the crash point (what ``os._exit`` skips is skipped), the restart a new ``DeviceState``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from testkit.rigs import DRIVER, NODE, claim, hardware, ref

from topodra import effects
from topodra.inventory import Inventory
from topodra.sharing.config import Sharing, TimeSlicing
from topodra.state import DeviceState


class Killed(BaseException):
    """Ends the operation at the crash point as a kill would (no handler of the code under test catches it)."""


class BlindTool:
    """``nvidia-smi compute-policy``: sets a level, cannot read one (``NvidiaSmiTimeSlice``), on a GPU that keeps it."""

    def __init__(self) -> None:
        self.levels: dict[str, int] = {}

    def set_timeslice(self, uuid: str, level: int) -> None:
        self.levels[uuid] = level

    def get_timeslice(self, uuid: str) -> int | None:
        return None

    def non_default(self) -> dict[str, int]:
        return {u: lv for u, lv in self.levels.items() if lv}


def plugin(tmp_path: Path, tool: BlindTool, crash_point: str | None = None) -> DeviceState:
    devices, _nvml = hardware(tmp_path, "mock:dgx-h100")
    boot = tmp_path / "boot_id"
    if not boot.exists():
        boot.write_text("boot-1\n")
    st = DeviceState(DRIVER, NODE, Inventory(devices), tmp_path / "cdi", tmp_path / "state", boot_id_path=str(boot),
                     nvidia_spec_dirs=[], gpu_effects=effects.standard(tmp_path / "state", timeslice=tool))
    if crash_point is not None:
        def die(point: str) -> None:
            if point == crash_point:
                raise Killed(point)
        st._maybe_crash = die  # type: ignore[method-assign]
    return st


def medium() -> Sharing:
    return Sharing(strategy="TimeSlicing", timeSlicing=TimeSlicing(interval="Medium"))


@pytest.mark.parametrize("point", ["prepare-before-write", "prepare-mid-cdi", "after-cdi-written"])
def test_a_level_set_by_a_killed_prepare_goes_back_on_restart(tmp_path: Path, point: str) -> None:
    tool = BlindTool()
    st = plugin(tmp_path, tool, point)
    with pytest.raises(Killed):
        st.prepare([claim("a", "gpu-1", medium()), claim("b", "gpu-2", None)])
    assert list(tool.non_default().values()) == [2], "the level was set before the kill"
    st = plugin(tmp_path, tool)
    assert st.checkpointed_claims() == []
    assert tool.non_default() == {}, "no prepared claim asks for a level: the restart must set Default"
    assert st.prepare([claim("a", "gpu-1", medium())])["a"].error == ""  # the kubelet's retry
    assert list(tool.non_default().values()) == [2]


def test_a_level_a_killed_unprepare_did_not_set_back_goes_back_on_restart(tmp_path: Path) -> None:
    tool = BlindTool()
    assert plugin(tmp_path, tool).prepare([claim("a", "gpu-1", medium())])["a"].error == ""
    st = plugin(tmp_path, tool, "after-unprepare-checkpoint-written")
    with pytest.raises(Killed):
        st.unprepare([ref("a")])
    assert list(tool.non_default().values()) == [2]
    st = plugin(tmp_path, tool)
    assert st.checkpointed_claims() == [] and tool.non_default() == {}
    assert st.unprepare([ref("a")]) == {"a": ""}  # the kubelet's retry


def test_a_recorded_level_stays_and_an_admins_level_on_another_gpu_is_left_alone(tmp_path: Path) -> None:
    """Only GPUs topodra set a level on are set back: one an admin set on a GPU no claim of ours touched stays."""
    tool = BlindTool()
    assert plugin(tmp_path, tool).prepare([claim("a", "gpu-1", medium())])["a"].error == ""
    gpu1 = next(iter(tool.non_default()))
    tool.levels["GPU-admin"] = 3
    plugin(tmp_path, tool)
    assert tool.non_default() == {gpu1: 2, "GPU-admin": 3}
