"""The checkpoint write is the commit point of the GPU effects: prepare applies them in order before it,
unprepare undoes them in reverse after it.  So the checkpoint never records a MIG instance or MPS daemon
that is gone, and a restart never re-creates the state of a claim that was being unprepared."""

from __future__ import annotations

import contextlib
import os
import signal
import textwrap
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from testkit import rigs as rig
from testkit.rigs import claim, hardware, ref

from topodra import checkpoint
from topodra.checkpoint import CheckpointData, CheckpointDevice, ClaimEntry
from topodra.claims import ClaimError, ClaimRef
from topodra.devices import Device
from topodra.effects.base import Devices, Mount, Recovered
from topodra.hardware import mockmps
from topodra.hardware.mock import FakeNvml
from topodra.inventory import Inventory
from topodra.sharing.config import Mps, Sharing
from topodra.sharing.mps import MpsDaemons
from topodra.state import CRASH_EXIT_CODE, DeviceState

STAND_IN = str(Path(mockmps.__file__))
MIG_PROFILE = "mock:dgx-a100-80gb-mig"
SLICE = "gpu-2-mig-1g-10gb-0"
MPS = Sharing(strategy="MPS", mps=Mps(defaultActiveThreadPercentage=50))


@pytest.fixture(autouse=True)
def no_daemon_left(tmp_path: Path) -> Iterator[None]:
    """MPS daemons outlive the processes that start them: stop whatever a test leaves running."""
    yield
    for pid_file in (tmp_path / "state" / "mps").glob(f"*/pipe/{mockmps.PID_FILE}"):
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(pid_file.read_text()), signal.SIGTERM)


def node_state(tmp_path: Path) -> tuple[DeviceState, FakeNvml]:
    devices, nvml = hardware(tmp_path, MIG_PROFILE)
    return rig.state(tmp_path, devices, nvml, mps_binary=STAND_IN), nvml


def entry_of(tmp_path: Path, uid: str) -> ClaimEntry | None:
    data = checkpoint.load(tmp_path / "state" / checkpoint.FILE_NAME)
    return data.claims.get(uid) if data else None


def gpu_instances(nvml: FakeNvml, parent: str) -> list[int]:
    return sorted(g.id for g in nvml.mig_instances().get(parent, []))


def assert_recorded_state_exists(tmp_path: Path, nvml: FakeNvml, uid: str) -> None:
    """The entry's MIG instance is on the GPU and its MPS daemon runs: the checkpoint tells the truth."""
    entry = entry_of(tmp_path, uid)
    assert entry is not None, "the claim is still prepared"
    (inst,) = entry.mig_instances
    assert inst.gpu_instance in gpu_instances(nvml, inst.parent_uuid), "the recorded MIG instance exists"
    assert MpsDaemons(tmp_path / "state", binary=STAND_IN).pid(uid) is not None, "the recorded MPS daemon runs"


def test_failed_unprepare_write_keeps_instance_and_daemon_the_entry_records(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st, nvml = node_state(tmp_path)
    assert st.prepare([claim("m", SLICE, MPS)])["m"].error == ""
    pid = rig.daemons(st).pid("m")
    (inst,) = entry_of(tmp_path, "m").mig_instances  # type: ignore[union-attr]

    def disk_full(*_a: Any, **_k: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "save", disk_full)
    assert "cannot write checkpoint" in st.unprepare([ref("m")])["m"]
    monkeypatch.undo()
    assert_recorded_state_exists(tmp_path, nvml, "m")
    assert rig.daemons(st).pid("m") == pid, "the daemon was not stopped"
    assert list((tmp_path / "cdi").glob("*_m.json")), "the spec is back"

    st, nvml = node_state(tmp_path)  # the plugin restarts: nothing is re-made, nothing was lost
    assert st.last_recovery.mig_recreated == [] and st.last_recovery.remade == {}
    assert gpu_instances(nvml, inst.parent_uuid) == [inst.gpu_instance]
    assert rig.daemons(st).pid("m") == pid
    assert st.unprepare([ref("m")]) == {"m": ""}  # the kubelet's retry
    assert nvml.mig_instances() == {} and rig.daemons(st).claims() == set() and entry_of(tmp_path, "m") is None


def test_failed_prepare_write_undoes_every_effect(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st, nvml = node_state(tmp_path)

    def disk_full(*_a: Any, **_k: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "save", disk_full)
    assert "cannot write checkpoint" in st.prepare([claim("m", SLICE, MPS)])["m"].error
    monkeypatch.undo()
    assert nvml.mig_instances() == {} and rig.daemons(st).claims() == set(), "daemon stopped, instance destroyed"
    assert entry_of(tmp_path, "m") is None and not list((tmp_path / "cdi").glob("*"))


CHILD = textwrap.dedent("""
    from pathlib import Path
    from topodra import effects
    from topodra.claims import AllocatedClaim, AllocatedDevice, ClaimRef
    from topodra.hardware import load_backend
    from topodra.inventory import Inventory
    from topodra.sharing.config import Mps, Sharing
    from topodra.sharing.instances import MigInstances
    from topodra.sharing.mps import MpsDaemons
    from topodra.state import DeviceState
    tmp = Path({tmp!r})
    backend = load_backend({profile!r}, "sharing-node", overrides={{"migStateFile": str(tmp / "gpu-state.json"),
                                                                   "shareGpuMemory": False}})
    st = DeviceState("gpu.topodra.io", "sharing-node", Inventory(backend.discover()), tmp / "cdi", tmp / "state",
                     boot_id_path=str(tmp / "boot_id"), nvidia_spec_dirs=[], gpu_effects=effects.standard(
                         tmp / "state", mig=MigInstances(backend.nvml), mps=MpsDaemons(tmp / "state", {binary!r})))
    sharing = Sharing(strategy="MPS", mps=Mps(defaultActiveThreadPercentage=50))
    ref = ClaimRef(namespace="ns", uid="m", name="c-m")
    c = AllocatedClaim(ref=ref, devices=(AllocatedDevice(request="gpus", device={slice!r}, share_id=None,
                                                         access="exclusive", sharing=sharing),))
    assert st.prepare([c])["m"].error == ""
    st.unprepare([ref])
""")


def kill_during_unprepare(tmp_path: Path, point: str) -> None:
    (tmp_path / "boot_id").write_text("boot-1\n")
    code = CHILD.format(tmp=str(tmp_path), profile=MIG_PROFILE, binary=STAND_IN, slice=SLICE)
    r = rig.run_child(code, point)
    assert r.returncode == CRASH_EXIT_CODE, r.stderr


def test_kill_before_the_unprepare_write_leaves_the_entry_true(tmp_path: Path) -> None:
    """Killed with the spec removed and the checkpoint not yet written: the entry still records the
    instance and daemon, and they exist, so the restart keeps them rather than making them again."""
    kill_during_unprepare(tmp_path, "after-unprepare-cdi-removed")
    _devices, nvml = hardware(tmp_path, MIG_PROFILE)
    assert_recorded_state_exists(tmp_path, nvml, "m")
    before = entry_of(tmp_path, "m")
    assert before is not None
    (inst,) = before.mig_instances
    st, nvml = node_state(tmp_path)
    assert st.last_recovery.mig_recreated == [] and st.last_recovery.mig_destroyed == []
    assert st.last_recovery.recreated == ["m"], "only the missing spec is written again"
    assert entry_of(tmp_path, "m") == before and gpu_instances(nvml, inst.parent_uuid) == [inst.gpu_instance]
    assert st.unprepare([ref("m")]) == {"m": ""}  # the kubelet's retry
    assert nvml.mig_instances() == {} and rig.daemons(st).claims() == set()


def test_kill_after_the_unprepare_write_leaves_nothing_past_the_restart(tmp_path: Path) -> None:
    """Killed with the checkpoint written and the effects not yet undone: the instance and daemon no entry
    records are removed at restart; nothing outlives its claim."""
    kill_during_unprepare(tmp_path, "after-unprepare-checkpoint-written")
    assert entry_of(tmp_path, "m") is None
    st, nvml = node_state(tmp_path)
    assert len(st.last_recovery.mig_destroyed) == 1 and st.last_recovery.stray.get("mps") == ["m"]
    assert nvml.mig_instances() == {} and rig.daemons(st).claims() == set()


class Recording:
    """A GPU effect that only records what the skeleton asks of it (which effect, which claim, and whether
    the checkpoint on disk held the claim at that moment)."""

    crash_point: str | None = None

    def __init__(self, name: str, log: list[tuple[str, str, str, bool]], path: Path, fail: str = "") -> None:
        self.name, self.log, self.path, self.fail = name, log, path, fail

    def _note(self, op: str, uid: str) -> None:
        data = checkpoint.load(self.path)
        self.log.append((self.name, op, uid, bool(data and uid in data.claims)))

    def check(self, ref: ClaimRef, dev: Device, sharing: Sharing | None, working: CheckpointData,
              devices: Devices, node: str) -> None:
        return

    def device_edits(self, d: CheckpointDevice, dev: Device) -> tuple[Device, tuple[str, ...]]:
        return dev, (f"EFFECT_{self.name.upper()}=1",)

    def claim_edits(self, entry: ClaimEntry) -> tuple[list[str], list[Mount]]:
        return [], []

    def used_by(self, entry: ClaimEntry, devices: Devices) -> bool:
        return True

    def apply(self, entry: ClaimEntry, applied: CheckpointData, devices: Devices) -> ClaimEntry:
        self._note("apply", entry.uid)
        if entry.uid == self.fail:
            raise ClaimError(f"claim {entry.ref}: {self.name} failed")
        return entry

    def undo(self, entries: Sequence[ClaimEntry], final: CheckpointData, devices: Devices) -> None:
        for e in entries:
            self._note("undo", e.uid)

    def release_blocker(self, entry: ClaimEntry) -> str | None:
        return None

    def remove_strays(self, data: CheckpointData, devices: Devices) -> list[str]:
        return []

    def recover(self, data: CheckpointData, devices: Devices) -> Recovered:
        return Recovered(data)


def test_effects_apply_in_order_and_undo_in_reverse_around_the_commit(tmp_path: Path) -> None:
    devices, _nvml = hardware(tmp_path)
    calls: list[tuple[str, str, str, bool]] = []
    path = tmp_path / "state" / checkpoint.FILE_NAME
    effects = (Recording("a", calls, path), Recording("b", calls, path), Recording("c", calls, path, fail="bad"))
    st = DeviceState(rig.DRIVER, rig.NODE, Inventory(devices), tmp_path / "cdi", tmp_path / "state",
                     boot_id_path=str(tmp_path / "boot_id"), nvidia_spec_dirs=[], gpu_effects=effects)
    res = st.prepare([claim("ok", "gpu-0", None), claim("bad", "gpu-1", None)])
    assert res["ok"].error == "" and res["bad"].error == "claim ns/c-bad (bad): c failed"
    assert calls == [("a", "apply", "ok", False), ("a", "apply", "bad", False),
                     ("b", "apply", "ok", False), ("b", "apply", "bad", False),
                     ("c", "apply", "ok", False), ("c", "apply", "bad", False),
                     ("b", "undo", "bad", False), ("a", "undo", "bad", False)], "before the commit; reverse undo"
    assert [c.uid for c in st.checkpointed_claims()] == ["ok"]
    (spec,) = (tmp_path / "cdi").glob("*_ok.json")
    assert all(f"EFFECT_{n}=1" in spec.read_text() for n in "ABC"), "each effect contributes its CDI edits"
    calls.clear()
    assert st.unprepare([ref("ok")]) == {"ok": ""}
    assert calls == [("c", "undo", "ok", False), ("b", "undo", "ok", False), ("a", "undo", "ok", False)], \
        "undone in reverse, after the checkpoint dropped the claim"


def test_recovery_tears_strays_down_in_reverse_then_remakes_in_order() -> None:
    """As unprepare undoes in reverse: a later effect's stray (an MPS server) may hold an earlier one's (its MIG
    compute instance, which NVML then refuses to destroy with IN_USE), so strays go last effect first; re-making
    goes first effect first (MPS serves the re-made MIG UUID).  Each effect's report holds its strays."""
    from topodra import recovery

    order: list[tuple[str, str]] = []

    class Step:
        def __init__(self, name: str) -> None:
            self.name = name

        def remove_strays(self, data: CheckpointData, devices: Devices) -> list[str]:
            order.append((self.name, "strays"))
            return [f"{self.name}-stray"]

        def recover(self, data: CheckpointData, devices: Devices) -> Recovered:
            order.append((self.name, "recover"))
            return Recovered(data, remade=[f"{self.name}-remade"])

    steps: list[Any] = [Step("mig"), Step("timeslice"), Step("mps")]
    _data, done = recovery.reconcile(steps, CheckpointData(), {})
    assert order == [("mps", "strays"), ("timeslice", "strays"), ("mig", "strays"),
                     ("mig", "recover"), ("timeslice", "recover"), ("mps", "recover")]
    assert {n: (r.stray, r.remade) for n, r in done.items()} == {
        n: ([f"{n}-stray"], [f"{n}-remade"]) for n in ("mig", "timeslice", "mps")}
