"""Per-claim CDI specs: content, CDI rule validation, atomic IO, NVIDIA toolkit composition."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from topodra import cdi
from topodra.devices import Device, string_attr

DRIVER = "gpu.topodra.io"
UID_DIGIT = "5f0c2a9e-1b7d-4c8e-9a51-3e2d4b6f7a80"
UID_LETTER = "ab0c2a9e-1b7d-4c8e-9a51-3e2d4b6f7a80"


def gpu(n: int, nodes: bool = True) -> Device:
    return Device(
        name=f"gpu-{n}", kind="gpu", attributes={"model": string_attr("H100-SXM5-80GB")}, capacity={"memory": "80Gi"},
        uuid=f"GPU-0000000{n}-aaaa-bbbb-cccc-dddddddddddd",
        device_nodes=(f"/dev/nvidia{n}", "/dev/nvidiactl", "/dev/nvidia-uvm") if nodes else (),
        env={f"TOPODRA_DEVICE_GPU_{n}_NVLINK_DOMAIN": "clique-1"},
    )


def nic(n: int) -> Device:
    return Device(name=f"nic-{n}", kind="nic", uuid=f"mlx5_{n}",
                  device_nodes=(f"/dev/infiniband/uverbs{n}",))


def env_of(edits: dict[str, Any]) -> dict[str, str]:
    return dict(e.split("=", 1) for e in edits.get("env", []))


def test_build_spec_shape() -> None:
    spec = cdi.build_spec(DRIVER, UID_DIGIT, [cdi.SpecDevice(gpu(0)), cdi.SpecDevice(gpu(1)),
                                               cdi.SpecDevice(nic(0))])
    assert spec["kind"] == "k8s.gpu.topodra.io/claim"
    assert spec["cdiVersion"] == "0.5.0"  # device names start with a digit (claim UID)
    assert [d["name"] for d in spec["devices"]] == [f"{UID_DIGIT}-gpu-0", f"{UID_DIGIT}-gpu-1",
                                                    f"{UID_DIGIT}-nic-0"]
    top = env_of(spec["containerEdits"])
    assert top["TOPODRA_VISIBLE_DEVICES"] == "gpu-0,gpu-1,nic-0"
    assert top["TOPODRA_VISIBLE_UUIDS"] == f"{gpu(0).uuid},{gpu(1).uuid}"  # GPUs only
    assert top["NVIDIA_VISIBLE_DEVICES"] == "void"  # the toolkit's value: no env-driven injection (finding 9)
    g0 = spec["devices"][0]["containerEdits"]
    env0 = env_of(g0)
    assert env0["TOPODRA_DEVICE_GPU_0_UUID"] == gpu(0).uuid
    assert env0["TOPODRA_DEVICE_GPU_0_MODEL"] == "H100-SXM5-80GB"
    assert env0["TOPODRA_DEVICE_GPU_0_CLAIM_UID"] == UID_DIGIT
    assert env0["TOPODRA_DEVICE_GPU_0_NVLINK_DOMAIN"] == "clique-1"  # Device.env passes through
    assert [n["path"] for n in g0["deviceNodes"]] == ["/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm"]
    assert spec["devices"][2]["containerEdits"]["deviceNodes"] == [{"path": "/dev/infiniband/uverbs0"}]
    cdi.validate_spec(spec)


def test_mock_devices_have_no_device_nodes_and_lowest_version() -> None:
    spec = cdi.build_spec(DRIVER, UID_LETTER, [cdi.SpecDevice(gpu(3, nodes=False))])
    assert "deviceNodes" not in spec["devices"][0]["containerEdits"]
    assert spec["cdiVersion"] == "0.3.0"  # nothing newer needed
    cdi.validate_spec(spec)


def test_shared_device_names_carry_share_id() -> None:
    spec = cdi.build_spec(DRIVER, UID_LETTER, [cdi.SpecDevice(gpu(0), "s1"), cdi.SpecDevice(gpu(0), "s2")])
    assert [d["name"] for d in spec["devices"]] == [f"{UID_LETTER}-gpu-0-s1", f"{UID_LETTER}-gpu-0-s2"]
    assert env_of(spec["containerEdits"])["TOPODRA_VISIBLE_DEVICES"] == "gpu-0"
    assert env_of(spec["devices"][1]["containerEdits"])["TOPODRA_DEVICE_GPU_0_SHARE_ID"] == "s2"
    cdi.validate_spec(spec)


def test_build_spec_is_deterministic_and_needs_devices() -> None:
    sds = [cdi.SpecDevice(gpu(1)), cdi.SpecDevice(nic(1))]
    assert cdi.build_spec(DRIVER, UID_DIGIT, sds) == cdi.build_spec(DRIVER, UID_DIGIT, sds)
    with pytest.raises(cdi.CDISpecInvalid):
        cdi.build_spec(DRIVER, UID_DIGIT, [])


def test_minimum_version_rules() -> None:
    base: dict[str, Any] = {"kind": "a.b/c", "devices": [{"name": "x", "containerEdits": {"env": ["A=1"]}}]}
    assert cdi.minimum_version(base) == "0.3.0"
    v = copy.deepcopy(base)
    v["devices"][0]["containerEdits"]["deviceNodes"] = [{"path": "/dev/x", "hostPath": "/dev/y"}]
    assert cdi.minimum_version(v) == "0.5.0"
    v = copy.deepcopy(base)
    v["kind"] = "a.b/c.d"
    assert cdi.minimum_version(v) == "0.6.0"
    v = copy.deepcopy(base)
    v["annotations"] = {"k": "v"}
    assert cdi.minimum_version(v) == "0.6.0"


def _valid() -> dict[str, Any]:
    return cdi.build_spec(DRIVER, UID_DIGIT, [cdi.SpecDevice(gpu(0))])


@pytest.mark.parametrize(("mutate", "needle"), [
    (lambda sp: sp.update(cdiVersion="0.9.9"), "cdiVersion '0.9.9'"),
    (lambda sp: sp.update(cdiVersion="0.3.0"), "too old"),
    (lambda sp: sp.update(kind="nokind"), "kind 'nokind'"),
    (lambda sp: sp.update(kind="1vendor/claim"), "kind '1vendor/claim'"),
    (lambda sp: sp.update(kind="vendor/cla$s"), "kind 'vendor/cla$s'"),
    (lambda sp: sp["devices"][0].update(name="bad/name"), "device name 'bad/name'"),
    (lambda sp: sp["devices"][0].update(name="-lead"), "device name '-lead'"),
    (lambda sp: sp["devices"].append(copy.deepcopy(sp["devices"][0])), "appears twice"),
    (lambda sp: sp["devices"][0]["containerEdits"]["env"].append("NOEQUALS"), "'NOEQUALS' is not KEY=VALUE"),
    (lambda sp: sp["devices"][0]["containerEdits"]["env"].append("1X=2"), "'1X=2'"),
    (lambda sp: sp["devices"][0]["containerEdits"]["deviceNodes"].append({"path": "dev/x"}), "absolute"),
    (lambda sp: sp["devices"][0]["containerEdits"]["deviceNodes"].append({"path": "/dev/x", "type": "z"}),
     "type 'z'"),
    (lambda sp: sp["devices"][0]["containerEdits"]["deviceNodes"].append(
        {"path": "/dev/x", "permissions": "rx"}), "permissions"),
    (lambda sp: sp["devices"][0].update(containerEdits={}), "containerEdits are empty"),
    (lambda sp: sp.update(devices=[]), "non-empty"),
    (lambda sp: sp["containerEdits"].update(intelRdt={}), "unsupported containerEdits"),
    (lambda sp: sp.update(extra=1), "unknown top-level"),
])
def test_validate_rejects(mutate: Any, needle: str) -> None:
    spec = _valid()
    mutate(spec)
    with pytest.raises(cdi.CDISpecInvalid) as ei:
        cdi.validate_spec(spec)
    assert needle in str(ei.value)


def test_valid_spec_builds_and_validates_once() -> None:
    sds = [cdi.SpecDevice(gpu(0))]
    assert cdi.valid_spec(DRIVER, UID_DIGIT, sds) == cdi.build_spec(DRIVER, UID_DIGIT, sds)
    bad = Device(name="gpu-9", kind="gpu", env={"1BAD": "x"})  # not a valid environment variable name
    with pytest.raises(cdi.CDISpecInvalid, match="'1BAD=x' is not KEY=VALUE"):
        cdi.valid_spec(DRIVER, UID_DIGIT, [cdi.SpecDevice(bad)])


def test_write_is_atomic_unsynced_and_removable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "cdi"
    spec = _valid()
    synced: list[int] = []
    monkeypatch.setattr(os, "fsync", synced.append)
    path = cdi.write_spec(root, DRIVER, UID_DIGIT, spec)
    assert synced == []  # re-created from the checkpoint at start, so never fsynced
    assert path.name == f"k8s.gpu.topodra.io-claim_{UID_DIGIT}.json"
    assert json.loads(path.read_text()) == spec
    assert path.stat().st_mode & 0o777 == 0o644  # the runtime must be able to read it
    assert [p.name for p in root.iterdir()] == [path.name]  # no temp file left
    assert cdi.spec_exists(root, DRIVER, UID_DIGIT)
    assert cdi.claim_spec_uids(root, DRIVER) == {UID_DIGIT}

    assert cdi.remove_spec(root, DRIVER, UID_DIGIT) is True
    assert cdi.remove_spec(root, DRIVER, UID_DIGIT) is False
    assert list(root.iterdir()) == []
    assert synced == []


def test_claim_spec_uids_ignores_foreign_and_temp_files(tmp_path: Path) -> None:
    cdi.write_spec(tmp_path, DRIVER, UID_LETTER, cdi.build_spec(DRIVER, UID_LETTER, [cdi.SpecDevice(gpu(0))]))
    (tmp_path / "nvidia.yaml").write_text("kind: nvidia.com/gpu\n")
    (tmp_path / f".k8s.gpu.topodra.io-claim_{UID_DIGIT}.json.tmp-123").write_text("{")
    (tmp_path / f"k8s.other.io-claim_{UID_DIGIT}.json").write_text("{}")
    assert cdi.claim_spec_uids(tmp_path, DRIVER) == {UID_LETTER}
    removed = cdi.clean_temps(tmp_path, DRIVER)
    assert [p.name for p in removed] == [f".k8s.gpu.topodra.io-claim_{UID_DIGIT}.json.tmp-123"]
    assert (tmp_path / "nvidia.yaml").exists()


def test_env_fragment() -> None:
    assert cdi.env_fragment("gpu-10") == "GPU_10"
    assert cdi.env_fragment("nic-0") == "NIC_0"


def _nvidia_spec(names: dict[str, str]) -> dict[str, Any]:
    return {"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu", "devices": [
        {"name": n, "containerEdits": {"deviceNodes": [{"path": p}]}} for n, p in names.items()]}


def test_nvidia_ids_by_uuid_then_index() -> None:
    g0, g1, g2 = gpu(0), gpu(1), gpu(2)
    by_uuid = _nvidia_spec({g0.uuid: "/dev/nvidia0", "0": "/dev/nvidia0", "1": "/dev/nvidia1",
                            "1:0": "/dev/nvidia1", "all": "/dev/nvidia0"})
    other_kind = {"kind": "example.com/gpu", "devices": [{"name": g2.uuid}]}
    ids = cdi.nvidia_gpu_ids([by_uuid, other_kind], [g0, g1, g2, nic(0)])
    assert ids == {"gpu-0": f"nvidia.com/gpu={g0.uuid}", "gpu-1": "nvidia.com/gpu=1"}


def test_nvidia_ids_none_in_mock_mode() -> None:
    spec = _nvidia_spec({"0": "/dev/nvidia0"})
    assert cdi.nvidia_gpu_ids([spec], [gpu(0, nodes=False)]) == {}
    assert cdi.nvidia_gpu_ids([], [gpu(0)]) == {}


def test_load_specs_reads_json_and_yaml_and_skips_broken(tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    a, b = tmp_path / "etc", tmp_path / "run"
    a.mkdir()
    b.mkdir()
    (a / "nvidia.yaml").write_text("cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n- name: '0'\n")
    (b / "other.json").write_text(json.dumps({"kind": "x.io/y", "devices": []}))
    (b / "broken.yaml").write_text("kind: [unclosed\n")
    (b / "README").write_text("not a spec")
    cdi.write_spec(b, DRIVER, UID_LETTER, cdi.build_spec(DRIVER, UID_LETTER, [cdi.SpecDevice(gpu(0))]))
    specs = cdi.load_specs([a, b, tmp_path / "missing"], skip_prefix=cdi.spec_file_prefix(DRIVER))
    assert sorted(sp["kind"] for sp in specs) == ["nvidia.com/gpu", "x.io/y"]
    assert "broken.yaml" in caplog.text


def test_load_specs_cache_parses_a_file_again_only_when_it_changed(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    spec = tmp_path / "nvidia.yaml"
    spec.write_text("kind: nvidia.com/gpu\ndevices: []\n")
    parsed: list[str] = []
    real = yaml.safe_load

    def counting(text: str) -> object:
        parsed.append(text)
        return real(text)

    monkeypatch.setattr(yaml, "safe_load", counting)
    cache: cdi.SpecCache = {}
    for _ in range(3):
        assert [sp["kind"] for sp in cdi.load_specs([tmp_path], cache=cache)] == ["nvidia.com/gpu"]
    assert len(parsed) == 1
    spec.write_text("kind: nvidia.com/gpu\ndevices: [{name: '0'}]\n")
    os.utime(spec, ns=(spec.stat().st_atime_ns, spec.stat().st_mtime_ns + 1_000_000_000))
    assert cdi.load_specs([tmp_path], cache=cache)[0]["devices"] == [{"name": "0"}]
    assert len(parsed) == 2
