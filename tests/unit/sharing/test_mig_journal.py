"""Finding 10, second half: recovery destroys only the MIG instances topodra made (its intent journal).

Mock hardware (``FakeNvml`` with instances in a file, so they outlive a process as on a GPU).  An
instance made out of band (mig-manager, ``nvidia-smi mig -cgi``: here ``MigInstances.create`` with no
journal entry) survives plugin restarts; one a killed prepare or unprepare left is still destroyed.
"""

from __future__ import annotations

import logging
import textwrap
from pathlib import Path

import pytest
from test_sharing_prepare import claim, hardware, state
from testkit.rigs import run_child

from topodra import checkpoint
from topodra.claims import ClaimRef
from topodra.effects.migjournal import FILE_NAME, MigJournal
from topodra.sharing.instances import MigInstances, placement_key
from topodra.sharing.mig import placement_of
from topodra.state import CRASH_EXIT_CODE

ADMIN = "gpu-4-mig-3g-40gb-0"  # the placement an admin's instance takes on gpu-4


def admin_instance(tmp_path: Path) -> tuple[str, int]:
    """An instance made outside topodra; its (parent UUID, GPU instance id)."""
    devices, nvml = hardware(tmp_path)
    inst = MigInstances(nvml).create(placement_of(next(d for d in devices if d.name == ADMIN)))
    return inst.parent_uuid, inst.gpu_instance


def gis(tmp_path: Path) -> set[tuple[str, int]]:
    _devices, nvml = hardware(tmp_path)
    return {(uuid, g.id) for uuid, gs in nvml.mig_instances().items() for g in gs}


def test_an_admins_instance_survives_a_plugin_restart(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    devices, nvml = hardware(tmp_path)
    st = state(tmp_path, devices, nvml)
    assert st.prepare([claim("mine", "gpu-1-mig-2g-20gb-2")])["mine"].error == ""
    admin = admin_instance(tmp_path)
    before = gis(tmp_path)
    with caplog.at_level(logging.INFO, logger="topodra.sharing.instances"):
        report = state(tmp_path, devices, nvml).last_recovery
    assert report.mig_destroyed == []
    assert gis(tmp_path) == before and admin in before
    assert any("alone: topodra did not make it" in r.getMessage() for r in caplog.records)
    # And it stays through unprepare of topodra's claim and another restart.
    assert st.unprepare([ClaimRef("ns", "mine", "c-mine")]) == {"mine": ""}
    assert state(tmp_path, devices, nvml).last_recovery.mig_destroyed == []
    assert gis(tmp_path) == {admin}


def test_the_journal_holds_a_placement_from_before_create_until_the_destroy(tmp_path: Path) -> None:
    devices, nvml = hardware(tmp_path)
    st = state(tmp_path, devices, nvml)
    journal = MigJournal(tmp_path / "state")
    p = placement_of(next(d for d in devices if d.name == "gpu-2-mig-1g-10gb-0"))
    assert not (tmp_path / "state" / FILE_NAME).exists()
    assert st.prepare([claim("u", "gpu-2-mig-1g-10gb-0")])["u"].error == ""
    assert journal.keys() == {placement_key(p)}
    assert st.unprepare([ClaimRef("ns", "u", "c-u")]) == {"u": ""}
    assert journal.keys() == set() and not (tmp_path / "state" / FILE_NAME).exists()


def test_a_failed_create_leaves_no_intent(tmp_path: Path) -> None:
    """The failing placement is usually held by someone else's instance: an intent kept for it would get
    that instance destroyed at the next restart."""
    devices, nvml = hardware(tmp_path)
    admin = admin_instance(tmp_path)  # 3g.40gb at slice 0 of gpu-4
    st = state(tmp_path, devices, nvml)
    res = st.prepare([claim("b", "gpu-4-mig-1g-10gb-6", "gpu-4-mig-1g-10gb-0")])
    assert "cannot create" in res["b"].error
    assert MigJournal(tmp_path / "state").keys() == set()
    assert state(tmp_path, devices, nvml).last_recovery.mig_destroyed == []
    assert gis(tmp_path) == {admin}


KILLED = textwrap.dedent("""
    from pathlib import Path
    from test_sharing_prepare import claim, hardware, state
    tmp = Path({tmp!r})
    devices, nvml = hardware(tmp)
    st = state(tmp, devices, nvml)
    st.prepare([claim("k", "gpu-3-mig-3g-40gb-0", "gpu-3-mig-1g-10gb-4")])
""")


def test_a_topodra_instance_orphaned_at_after_mig_created_is_destroyed_and_the_admins_is_not(
        tmp_path: Path) -> None:
    admin = admin_instance(tmp_path)
    r = run_child(KILLED.format(tmp=str(tmp_path)), "after-mig-created", cwd=Path(__file__).parent)
    assert r.returncode == CRASH_EXIT_CODE, r.stderr
    assert len(gis(tmp_path)) == 3, "the child created both of its instances"
    devices, nvml = hardware(tmp_path)
    st = state(tmp_path, devices, nvml)
    assert len(st.last_recovery.mig_destroyed) == 2
    assert gis(tmp_path) == {admin}
    assert MigJournal(tmp_path / "state").keys() == set()


def test_a_checkpoint_from_before_the_journal_joins_it_at_start(tmp_path: Path) -> None:
    """Upgrade: instances a checkpoint records but no journal names are topodra's; a crash between a later
    unprepare's checkpoint write and its destroy must still leave nothing."""
    devices, nvml = hardware(tmp_path)
    st = state(tmp_path, devices, nvml)
    assert st.prepare([claim("old", "gpu-5-mig-1g-20gb-6")])["old"].error == ""
    (tmp_path / "state" / FILE_NAME).unlink()  # as a version without the journal leaves it
    state(tmp_path, devices, nvml)
    rec = checkpoint.load(tmp_path / "state" / checkpoint.FILE_NAME).claims["old"].devices[0].mig  # type: ignore[union-attr]
    assert rec is not None and MigJournal(tmp_path / "state").keys() == {rec.placement_key}


def test_an_unreadable_journal_destroys_nothing_and_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    devices, nvml = hardware(tmp_path)
    r = run_child(KILLED.format(tmp=str(tmp_path)), "after-mig-created", cwd=Path(__file__).parent)
    assert r.returncode == CRASH_EXIT_CODE, r.stderr
    (tmp_path / "state" / FILE_NAME).write_text("{not json")
    made = gis(tmp_path)
    with caplog.at_level(logging.ERROR, logger="topodra.effects.migjournal"):
        assert state(tmp_path, devices, nvml).last_recovery.mig_destroyed == []
    assert gis(tmp_path) == made and len(made) == 2
    assert any("is corrupt (unknown instances will be left alone)" in r.getMessage() for r in caplog.records)
