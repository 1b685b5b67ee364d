"""The prepare checkpoint: versioned, checksummed, atomic, never silently discarded."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from testkit.paths import REPO

from topodra import checkpoint
from topodra.checkpoint import CheckpointCorrupt, CheckpointData, CheckpointDevice, ClaimEntry


def _data() -> CheckpointData:
    dev = CheckpointDevice(request_names=["gpus"], pool_name="node-a", device_name="gpu-0",
                           cdi_device_ids=["k8s.gpu.topodra.io/claim=u1-gpu-0"], share_id=None)
    shared = CheckpointDevice(request_names=["share"], pool_name="node-a", device_name="gpu-1",
                              cdi_device_ids=["k8s.gpu.topodra.io/claim=u2-gpu-1-s1"], share_id="s1",
                              access="shared")
    return CheckpointData(boot_id="boot-1", claims={
        "u1": ClaimEntry(uid="u1", namespace="ns", name="c1", state="PrepareCompleted", devices=[dev]),
        "u2": ClaimEntry(uid="u2", namespace="ns", name="c2", state="PrepareStarted", devices=[shared]),
    })


def test_roundtrip_and_file_shape(tmp_path: Path) -> None:
    path = tmp_path / checkpoint.FILE_NAME
    checkpoint.save(path, _data())
    assert checkpoint.load(path) == _data()
    doc = json.loads(path.read_text())
    assert doc["version"] == checkpoint.VERSION
    assert doc["checksum"] == checkpoint.checksum(doc["payload"])
    assert doc["payload"]["boot_id"] == "boot-1"
    assert doc["payload"]["claims"]["u2"]["state"] == "PrepareStarted"
    assert path.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir()] == [checkpoint.FILE_NAME]  # no temp file left behind


def test_missing_file_is_none(tmp_path: Path) -> None:
    assert checkpoint.load(tmp_path / "nope.json") is None


def test_checksum_is_independent_of_formatting() -> None:
    payload = _data().model_dump(mode="json")
    reordered = json.loads(json.dumps(payload, sort_keys=False))
    assert checkpoint.checksum(payload) == checkpoint.checksum(reordered)


def _corrupt(path: Path, raw: bytes) -> str:
    """Write ``raw``, check load refuses it with an actionable message and keeps the file; the message."""
    path.write_bytes(raw)
    with pytest.raises(CheckpointCorrupt) as ei:
        checkpoint.load(path)
    assert str(path) in str(ei.value)
    assert "--quarantine-corrupt-checkpoint" in str(ei.value)  # tells the operator what to do
    assert path.read_bytes() == raw  # kept as it was
    return ei.value.problem


def test_bad_json(tmp_path: Path) -> None:
    assert "not valid JSON" in _corrupt(tmp_path / "cp.json", b'{"version": 1, "checks')


def test_checksum_mismatch(tmp_path: Path) -> None:
    path = tmp_path / "cp.json"
    checkpoint.save(path, _data())
    doc = json.loads(path.read_text())
    doc["payload"]["claims"]["u1"]["devices"][0]["device_name"] = "gpu-3"  # bit rot / hand edit
    assert "checksum mismatch" in _corrupt(path, json.dumps(doc).encode())


def test_unknown_version(tmp_path: Path) -> None:
    path = tmp_path / "cp.json"
    payload = _data().model_dump(mode="json")
    newer = checkpoint.VERSION + 1
    raw = json.dumps({"version": newer, "checksum": checkpoint.checksum(payload), "payload": payload}).encode()
    assert f"unknown version {newer}" in _corrupt(path, raw)


def test_schema_mismatch_with_valid_checksum(tmp_path: Path) -> None:
    payload = {"boot_id": "b", "claims": {"u1": {"uid": "u1", "namespace": "n", "name": "c",
                                                  "state": "Prepared", "devices": []}}}
    raw = json.dumps({"version": 1, "checksum": checkpoint.checksum(payload), "payload": payload}).encode()
    assert "schema" in _corrupt(tmp_path / "cp.json", raw)


def test_key_uid_mismatch(tmp_path: Path) -> None:
    payload = _data().model_dump(mode="json")
    payload["claims"]["other"] = payload["claims"].pop("u1")
    raw = json.dumps({"version": 1, "checksum": checkpoint.checksum(payload), "payload": payload}).encode()
    assert "differs from its uid" in _corrupt(tmp_path / "cp.json", raw)


def test_not_an_object(tmp_path: Path) -> None:
    assert "not a JSON object" in _corrupt(tmp_path / "cp.json", b"[1, 2]")


def test_quarantine_renames_and_never_overwrites(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    path.write_bytes(b"garbage-1")
    first = checkpoint.quarantine(path, now=0)
    assert first.name == "checkpoint.json.corrupt-19700101T000000Z"
    assert not path.exists()
    path.write_bytes(b"garbage-2")
    second = checkpoint.quarantine(path, now=0)
    assert second != first
    assert first.read_bytes() == b"garbage-1" and second.read_bytes() == b"garbage-2"


def test_save_replaces_atomically_and_cleans_temps(tmp_path: Path) -> None:
    path = tmp_path / checkpoint.FILE_NAME
    checkpoint.save(path, _data())
    stale = tmp_path / f".{checkpoint.FILE_NAME}.tmp-99999"
    stale.write_bytes(b"half a write")
    unrelated = tmp_path / "serialize.lock"
    unrelated.write_bytes(b"")
    assert checkpoint.clean_temps(tmp_path) == [stale]
    assert unrelated.exists()
    smaller = _data().without_claims({"u2"})
    checkpoint.save(path, smaller)
    assert checkpoint.load(path) == smaller


def test_data_helpers_are_pure() -> None:
    d = _data()
    e = d.claims["u1"].model_copy(update={"uid": "u3"})
    assert set(d.with_claim(e).claims) == {"u1", "u2", "u3"}
    assert set(d.without_claims({"u1"}).claims) == {"u2"}
    assert set(d.claims) == {"u1", "u2"}


def test_save_fsyncs_data_always_and_the_directory_when_durable(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / checkpoint.FILE_NAME
    synced: list[str] = []
    real = os.fsync

    def counting(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", counting)
    checkpoint.save(path, checkpoint.CheckpointData(boot_id="b"), sync="data")
    assert len(synced) == 1 and synced[0] != str(tmp_path)  # the temp file, before the rename
    synced.clear()
    checkpoint.save(path, checkpoint.CheckpointData(boot_id="c"))
    assert len(synced) == 2 and synced[1] == str(tmp_path)  # then the directory
    with pytest.raises(ValueError, match="never written without fsync"):
        checkpoint.save(path, checkpoint.CheckpointData(boot_id="d"), sync="none")
    assert checkpoint.load(path) == checkpoint.CheckpointData(boot_id="c")


FIXTURE_V1 = REPO / "tests" / "fixtures" / "checkpoint-v1.json"


def test_v1_file_written_by_the_old_code_loads_and_serves(tmp_path: Path) -> None:
    """tests/fixtures/checkpoint-v1.json was written by the prepare code before the one-write change."""
    from topodra.devices import Device, string_attr
    from topodra.inventory import Inventory
    from topodra.state import DeviceState

    data = checkpoint.decode(FIXTURE_V1.read_bytes(), FIXTURE_V1)
    assert data.boot_id == "3f1c2a9e-5b7d-4e21-9c0a-7d3e8f1b2c4d"
    assert {e.name: [d.access for d in e.devices] for e in data.claims.values()} == {
        "train": ["exclusive", "exclusive"], "infer": ["shared"], "watch": ["admin"]}
    # An upgraded plugin starts on it (node rebooted: new boot ID, empty CDI dir) and re-creates every spec.
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    (state_dir / checkpoint.FILE_NAME).write_bytes(FIXTURE_V1.read_bytes())
    boot = tmp_path / "boot"
    boot.write_text("00000000-0000-4000-8000-000000000000\n")
    devs = [Device(name=f"gpu-{n}", kind="gpu", attributes={"model": string_attr("H100-SXM5-80GB")},
                   uuid=f"GPU-{n:08d}-1111-2222-3333-444444444444") for n in range(4)]
    devs += [Device(name=f"nic-{n}", kind="nic", uuid=f"mlx5_{n}") for n in range(2)]
    st = DeviceState("gpu.topodra.io", "node-a", Inventory(devs), tmp_path / "cdi", state_dir,
                     boot_id_path=str(boot), nvidia_spec_dirs=[])
    assert st.last_recovery.rebooted and sorted(st.last_recovery.recreated) == sorted(data.claims)
    assert not st.last_recovery.unrecoverable
    assert checkpoint.load(state_dir / checkpoint.FILE_NAME).claims == data.claims  # type: ignore[union-attr]
    refs = st.checkpointed_claims()
    assert all(err == "" for err in st.unprepare(refs).values()) and st.checkpointed_claims() == []
    assert list((tmp_path / "cdi").iterdir()) == []


def test_migration_chain_upgrades_an_older_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The path a format change takes: a v1 file read by a v3 reader through MIGRATIONS[1] and [2], saved as v3."""
    def v2_to_v3(payload: dict[str, object]) -> dict[str, object]:
        return {**payload, "boot_id": f"migrated:{payload['boot_id']}"}

    monkeypatch.setattr(checkpoint, "VERSION", 3)
    with pytest.raises(CheckpointCorrupt, match="reads versions 1 to 3"):  # no migration registered yet
        checkpoint.decode(FIXTURE_V1.read_bytes(), FIXTURE_V1)
    monkeypatch.setitem(checkpoint.MIGRATIONS, 2, v2_to_v3)
    data = checkpoint.decode(FIXTURE_V1.read_bytes(), FIXTURE_V1)
    assert data.boot_id == "migrated:3f1c2a9e-5b7d-4e21-9c0a-7d3e8f1b2c4d" and len(data.claims) == 3
    path = tmp_path / checkpoint.FILE_NAME
    checkpoint.save(path, data)
    assert json.loads(path.read_text())["version"] == 3
    assert checkpoint.load(path) == data  # a v3 file is read without migration
    tampered = FIXTURE_V1.read_bytes().replace(b"train", b"trail")
    with pytest.raises(CheckpointCorrupt, match="checksum"):  # checked before migrating
        checkpoint.decode(tampered, FIXTURE_V1)


@pytest.mark.parametrize("version", [0, 3, "1", True, None])
def test_versions_outside_the_readable_range_are_refused(version: object) -> None:
    doc = json.loads(FIXTURE_V1.read_text())
    doc["version"] = version
    with pytest.raises(CheckpointCorrupt, match="unknown version"):
        checkpoint.decode(json.dumps(doc).encode(), FIXTURE_V1)
