"""The operator's availability snapshot lists DeviceTaintRules: a GPU an admin drains is not free in the
ClaimProfile status; where the rules cannot be listed, the slices' own taints still count."""

from __future__ import annotations

from collections.abc import Iterator

from test_controller_operator import CFG, PROFILES, SPEC, FakeKube, add_profile

from topodra.apipaths import device_class_path, device_taint_rule_path, slices_path
from topodra.classcatalog import catalog, to_device_class
from topodra.controller.operator import SnapshotCache, process
from topodra.kube import KubeError, Obj


def cluster(kube: FakeKube) -> FakeKube:
    for spec in catalog():
        kube.create(device_class_path(), to_device_class(spec))
    attrs = {"type": {"string": "gpu"}, "model": {"string": "H200-SXM5-141GB"}, "nvlinkDomain": {"string": "n1"}}
    devs: list[Obj] = [{"name": f"gpu-{i}", "attributes": attrs} for i in range(8)]
    devs[0]["taints"] = [{"key": "topodra.io/xid", "value": "79", "effect": "NoSchedule"}]
    kube.create(slices_path(), {"metadata": {"name": "s1"}, "spec": {
        "driver": "gpu.topodra.io", "nodeName": "n1", "pool": {"name": "n1", "generation": 1}, "devices": devs}})
    return kube


def h200_status(kube: FakeKube) -> tuple[int, int]:
    body = add_profile(kube, SPEC)
    process(kube, body, CFG, SnapshotCache(CFG))  # type: ignore[arg-type]
    alt = kube.objs[f"{PROFILES}/train"]["status"]["alternatives"][0]
    assert alt["name"] == "h200"
    return alt["devicesFree"], alt["nodesFit"]


def test_a_drain_rule_takes_gpus_out_of_devices_free() -> None:
    kube = cluster(FakeKube())
    kube.create(device_taint_rule_path(), {"metadata": {"name": "drain"}, "spec": {
        "deviceSelector": {"driver": "gpu.topodra.io", "pool": "n1"},
        "taint": {"key": "topodra.io/maintenance", "effect": "NoExecute"}}})
    assert h200_status(kube) == (0, 0)
    assert ("LIST", device_taint_rule_path()) in kube.calls


class NoRuleApi(FakeKube):
    def list(self, path: str, label_selector: str | None = None,
             field_selector: str | None = None) -> Iterator[Obj]:
        if path == device_taint_rule_path():
            raise KubeError(404, "NotFound", "the server could not find the requested resource")
        return super().list(path, label_selector, field_selector)


def test_without_the_rule_api_the_slice_taints_still_count() -> None:
    assert h200_status(cluster(NoRuleApi())) == (7, 1)
