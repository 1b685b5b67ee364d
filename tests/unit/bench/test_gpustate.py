"""The GPU-effect invariants of the crash campaign (bench/reliability/gpustate.py): each kind of state, leaked
(no entry records it) and lost (an entry records it and it is gone), is reported; agreement is not."""

from __future__ import annotations

from pathlib import Path

from bench.reliability import gpustate
from bench.reliability.gpustate import Observed

from topodra.checkpoint import PREPARE_COMPLETED, CheckpointData, CheckpointDevice, ClaimEntry
from topodra.devices import Device
from topodra.effects.migjournal import MigJournal
from topodra.sharing.config import Sharing, TimeSlicing
from topodra.sharing.instances import MigInstance

GPU = Device(name="gpu-0", kind="gpu", uuid="GPU-0")
GPU1 = Device(name="gpu-1", kind="gpu", uuid="GPU-1")
SLICE = Device(name="gpu-1-mig-1g-10gb-0", kind="mig")
DEVICES = {d.name: d for d in (GPU, GPU1, SLICE)}
INST = MigInstance(parent_uuid="GPU-1", gpu_instance=9, compute_instance=0, uuid="MIG-x", profile_id=19, start=0)


def entry(uid: str, dev: str, sharing: Sharing | None = None, mig: MigInstance | None = None) -> ClaimEntry:
    return ClaimEntry(uid=uid, namespace="ns", name=uid, state=PREPARE_COMPLETED, devices=[CheckpointDevice(
        request_names=["gpus"], pool_name="n", device_name=dev, cdi_device_ids=[], mig=mig, sharing=sharing)])


def seen(**kw: object) -> Observed:
    base: dict[str, object] = {"mig": frozenset(), "daemons": {}, "pipes": frozenset(), "mounts": frozenset(),
                               "exclusive": frozenset(), "levels": {}}
    return Observed(**{**base, **kw})  # type: ignore[arg-type]


def kinds(found: list[gpustate.Finding]) -> list[tuple[str, str]]:
    return sorted({(f.effect, f.kind) for f in found})


MPS = Sharing(strategy="MPS")
LONG = Sharing(strategy="TimeSlicing", timeSlicing=TimeSlicing(interval="Long"))


def test_agreement_finds_nothing(tmp_path: Path) -> None:
    data = CheckpointData(claims={"a": entry("a", "gpu-0", MPS), "b": entry("b", SLICE.name, mig=INST),
                                  "c": entry("c", "gpu-1", LONG)})
    journal = MigJournal(tmp_path)
    journal.record([INST.placement_key])
    state = seen(mig=frozenset({("GPU-1", 9, 0)}), daemons={"a": [10]}, pipes=frozenset({"a"}),
                 mounts=frozenset({"a"}), exclusive=frozenset({"GPU-0"}), levels={"GPU-0": 0, "GPU-1": 3})
    assert gpustate.findings(state, data, DEVICES, journal) == []


def test_state_without_an_entry_is_leaked() -> None:
    state = seen(mig=frozenset({("GPU-1", 9, 0)}), daemons={"z": [10]}, pipes=frozenset({"z"}),
                 mounts=frozenset({"z"}), exclusive=frozenset({"GPU-0"}), levels={"GPU-1": 2})
    found = gpustate.findings(state, CheckpointData(), DEVICES)
    assert kinds(found) == [("mig", "leaked"), ("mps", "leaked"), ("timeslice", "leaked")]
    assert len([f for f in found if f.effect == "mps"]) == 4  # process, pipe, mount, compute mode


def test_recorded_state_that_is_gone_is_lost(tmp_path: Path) -> None:
    data = CheckpointData(claims={"a": entry("a", "gpu-0", MPS), "b": entry("b", SLICE.name, mig=INST),
                                  "c": entry("c", "gpu-1", LONG)})
    found = gpustate.findings(seen(), data, DEVICES)
    assert kinds(found) == [("mig", "lost"), ("mps", "lost"), ("timeslice", "lost")]
    assert {f.claim for f in found if f.effect != "timeslice"} >= {"a", "b"}


def test_two_daemons_for_one_claim_and_an_unjournalled_instance_are_leaks(tmp_path: Path) -> None:
    data = CheckpointData(claims={"a": entry("a", "gpu-0", MPS), "b": entry("b", SLICE.name, mig=INST)})
    state = seen(mig=frozenset({("GPU-1", 9, 0)}), daemons={"a": [10, 11]}, pipes=frozenset({"a"}),
                 mounts=frozenset({"a"}), exclusive=frozenset({"GPU-0"}))
    found = gpustate.findings(state, data, DEVICES, MigJournal(tmp_path))
    assert [(f.effect, f.kind, f.claim) for f in found] == [("mig", "leaked", "b"), ("mps", "leaked", "a")]
