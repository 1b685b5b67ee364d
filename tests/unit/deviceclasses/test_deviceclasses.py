"""The DeviceClass catalog, the committed deviceclasses/ files and `topodra deviceclasses generate`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from testkit.paths import REPO

from topodra import classcatalog as cat
from topodra import deviceclasses as dc
from topodra.selectors import MATCH_ANNOTATION, DeviceMatch

CLASS_DIR = REPO / "deviceclasses"


def test_committed_files_equal_the_catalog() -> None:
    expected = {dc.file_name(o): dc.dump(o) for o in (cat.to_device_class(s) for s in cat.catalog())}
    present = {p.name: p.read_text() for p in CLASS_DIR.glob("*.yaml")}
    assert present == expected, "regenerate: topodra deviceclasses generate --all --write-dir deviceclasses"


def test_brief_classes_exist() -> None:
    names = {s.name for s in cat.catalog()}
    assert {"gpu.topodra.io", "gpu-h200", "gpu-h100", "gpu-a100-80gb", "gpu-a100-40gb", "gpu-b200", "gpu-gb200",
            "gpu-l40s", "gpu-l4", "gpu-mem-40gi", "gpu-mem-80gi", "gpu-mem-140gi", "gpu-ampere-plus",
            "gpu-hopper-plus", "nic.topodra.io"} <= names


@pytest.mark.parametrize("path", sorted(CLASS_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_each_file_is_a_v1_device_class_with_typed_cel(path: Path) -> None:
    obj = yaml.safe_load(path.read_text())
    assert (obj["apiVersion"], obj["kind"]) == ("resource.k8s.io/v1", "DeviceClass")
    assert obj["metadata"]["name"] + ".yaml" == path.name
    expr = obj["spec"]["selectors"][0]["cel"]["expression"]
    assert expr.startswith('device.driver == "gpu.topodra.io"')
    match = DeviceMatch.from_annotation(obj["metadata"]["annotations"][MATCH_ANNOTATION])
    assert match.to_cel("gpu.topodra.io") == expr
    if match.min_memory:
        assert f'memory.compareTo(quantity("{match.min_memory}")) >= 0' in expr
    if match.min_compute_capability:
        assert f'cudaComputeCapability.compareTo(semver("{match.min_compute_capability}")) >= 0' in expr
    # typed comparisons only: no string surgery on numbers or versions
    for banned in ("int(", "double(", "split(", "substring(", "matches(", "startsWith("):
        assert banned not in expr


def dev(model: str, memory: str | None, cc: str | None, kind: str = "gpu") -> dict[str, Any]:
    attrs: dict[str, Any] = {"type": {"string": kind}, "model": {"string": model}}
    if cc:
        attrs["cudaComputeCapability"] = {"version": cc}
    d: dict[str, Any] = {"name": "gpu-0", "attributes": attrs}
    if memory:
        d["capacity"] = {"memory": {"value": memory}}
    return d


@pytest.mark.parametrize(("cls", "device", "expected"), [
    ("gpu-h100", dev("H100-SXM5-80GB", "81559Mi", "9.0.0"), True),
    ("gpu-h100", dev("H100-NVL-94GB", "95830Mi", "9.0.0"), True),
    ("gpu-h100", dev("H200-SXM5-141GB", "143771Mi", "9.0.0"), False),
    ("gpu-mem-80gi", dev("H100-SXM5-80GB", "81559Mi", "9.0.0"), True),
    ("gpu-mem-80gi", dev("A100-SXM4-40GB", "40960Mi", "8.0.0"), False),
    ("gpu-mem-140gi", dev("H200-SXM5-141GB", "143771Mi", "9.0.0"), True),
    ("gpu-mem-140gi", dev("H200-SXM5-141GB", None, "9.0.0"), False),
    ("gpu-hopper-plus", dev("L40S", "46068Mi", "8.9.0"), False),
    ("gpu-hopper-plus", dev("B200-SXM6-180GB", "183359Mi", "10.0.0"), True),
    ("gpu-ampere-plus", dev("L4", "23034Mi", "8.9.0"), True),
    ("gpu-ampere-plus", dev("T4", "15360Mi", "7.5.0"), False),
    ("gpu-ampere-plus", dev("L4", "23034Mi", None), False),
    ("gpu.topodra.io", dev("anything", None, None), True),
    ("gpu.topodra.io", dev("nic", None, None, kind="nic"), False),
    ("nic.topodra.io", dev("nic", None, None, kind="nic"), True),
])
def test_match_semantics(cls: str, device: dict[str, Any], expected: bool) -> None:
    spec = next(s for s in cat.catalog() if s.name == cls)
    assert spec.match.matches(device, "gpu.topodra.io") is expected


def test_fully_qualified_attributes_are_understood() -> None:
    d = {"attributes": {"gpu.topodra.io/type": {"string": "gpu"}, "gpu.topodra.io/model": {"string": "L4"}}}
    assert DeviceMatch(type="gpu", models=("L4",)).matches(d, "gpu.topodra.io")
    assert not DeviceMatch(type="gpu", models=("L4",)).matches(d, "gpu.other.io")


def test_invalid_match_is_rejected() -> None:
    with pytest.raises(ValueError, match="quantity"):
        DeviceMatch(type="gpu", minMemory="80GB!")
    with pytest.raises(ValueError, match="semantic version"):
        DeviceMatch(type="gpu", minComputeCapability="9.0")
    with pytest.raises(ValueError, match="not a valid attribute string"):
        DeviceMatch(type="gpu", models=('H100" || true || "',))


def test_classes_for_models() -> None:
    objs = cat.classes_for_models(["H200-SXM5-141GB", "H100-NVL-94GB", "RTX-PRO-6000"], with_nic=True)
    names = [o["metadata"]["name"] for o in objs]
    assert names == ["gpu.topodra.io", "gpu-h200", "gpu-h100", "gpu-mem-40gi", "gpu-mem-80gi", "gpu-mem-140gi",
                     "gpu-ampere-plus", "gpu-hopper-plus", "gpu-blackwell-plus", "nic.topodra.io",
                     "gpu-model-rtx-pro-6000"]
    extra = json.loads(objs[-1]["metadata"]["annotations"][MATCH_ANNOTATION])
    assert extra == {"models": ["RTX-PRO-6000"], "type": "gpu"}
    assert "nic.topodra.io" not in [o["metadata"]["name"] for o in cat.classes_for_models(["L4"])]


def test_inventory_reads_only_our_driver() -> None:
    slices = [
        {"spec": {"driver": "gpu.topodra.io", "devices": [
            {"name": "gpu-0", "attributes": {"type": {"string": "gpu"}, "model": {"string": "L4"}}},
            {"name": "nic-0", "attributes": {"type": {"string": "nic"}}}]}},
        {"spec": {"driver": "other.io", "devices": [
            {"name": "gpu-0", "attributes": {"type": {"string": "gpu"}, "model": {"string": "X"}}}]}},
    ]
    assert cat.inventory(slices, "gpu.topodra.io") == ({"L4"}, True)


def test_generate_all_to_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    dc.configure(parser)
    assert dc.run(parser.parse_args(["generate", "--all"])) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [d["metadata"]["name"] for d in docs] == [s.name for s in cat.catalog()]


def test_generate_without_cluster_fails_cleanly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    dc.configure(parser)
    missing = tmp_path / "nope.kubeconfig"
    assert dc.run(parser.parse_args(["generate", "--kubeconfig", str(missing)])) == 1
    assert "cannot list ResourceSlices" in capsys.readouterr().err


MOCK_FAMILIES = {"dgx-a100-80gb": "gpu-a100-80gb", "dgx-h100": "gpu-h100", "dgx-h200": "gpu-h200",
                 "gb200-nvl72": "gpu-gb200", "h100-nvl": "gpu-h100", "hgx-b200": "gpu-b200", "l4": "gpu-l4",
                 "l40s": "gpu-l40s"}


@pytest.mark.parametrize(("profile", "family"), sorted(MOCK_FAMILIES.items()))
def test_classes_select_the_devices_discovery_publishes(profile: str, family: str) -> None:
    """Cross-check with the discovery helper's attribute names: every GPU of a mock node is in its family."""
    from topodra.hardware import load_backend
    from topodra.slices import build_slices

    devices = load_backend(f"mock:{profile}", "node-a").discover()
    slices = build_slices("gpu.topodra.io", "node-a", "uid-a", devices, 1)
    published = [d for s in slices for d in s["spec"].get("devices") or []]
    specs = {s.name: s for s in cat.catalog()}
    gpus = [d for d in published if specs["gpu.topodra.io"].match.matches(d, "gpu.topodra.io")]
    nics = [d for d in published if specs["nic.topodra.io"].match.matches(d, "gpu.topodra.io")]
    assert gpus and len(gpus) + len(nics) == len(published)
    assert all(specs[family].match.matches(d, "gpu.topodra.io") for d in gpus)
    others = [n for n, s in specs.items() if s.kind == "model" and n != family]
    assert not any(specs[n].match.matches(d, "gpu.topodra.io") for n in others for d in gpus)
    assert all(specs["gpu-ampere-plus"].match.matches(d, "gpu.topodra.io") for d in gpus)
    models, has_nic = cat.inventory(slices, "gpu.topodra.io")
    assert family in [o["metadata"]["name"] for o in cat.classes_for_models(models, with_nic=has_nic)]
