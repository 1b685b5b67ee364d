"""Temp files of the GPU effects' own files (the MIG intent journal, the time-slice intents) that a kill cut short
are removed at start, as the checkpoint's and the CDI specs' are.  Found by the GPU-effect crash campaign
(bench/reliability/gpueffects.py): a SIGKILL during a journal write left ``.mig-intents.json.tmp-<pid>`` for good."""

from __future__ import annotations

from pathlib import Path

from testkit.rigs import hardware, state


def test_a_restart_removes_the_effect_files_crashed_writes(tmp_path: Path) -> None:
    devices, nvml = hardware(tmp_path, "mock:dgx-a100-80gb-mig")
    st_dir = tmp_path / "state"
    st_dir.mkdir()
    left = [st_dir / ".mig-intents.json.tmp-4242", st_dir / ".timeslice-intents.json.tmp-4243"]
    for p in left:
        p.write_text("{half a write")
    state(tmp_path, devices, nvml)
    assert [p.name for p in left if p.exists()] == []
