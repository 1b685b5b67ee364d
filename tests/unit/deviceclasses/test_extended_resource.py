"""Issue 13, part 1: DRA-backed extended resources (KEP-5004) on topodra's DeviceClasses.

A pod that asks ``gpu.topodra.io/gpu: 2`` (or ``gpu.topodra.io/h100: 3``) as an ordinary resource gets
real DRA devices: the real kube-scheduler creates a ResourceClaim for it and allocates devices of the
class that names the resource.  Proven here on simulated nodes (allocation, model pinning, ResourceQuota,
the device-plugin rule) and on the real node, where our kubelet plugin prepares the claim and the
container sees exactly what a claim-template pod sees.

Split by tier; the rest: tests/cluster/test_extended_resource_cluster.py, tests/node/test_extended_resource_node.py.
"""

from __future__ import annotations

import re

import yaml
from testkit.paths import REPO

from topodra import classcatalog as dc

GPU = "gpu.topodra.io/gpu"
LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
QUALIFIED = re.compile(rf"^{LABEL}(\.{LABEL})+/{LABEL}$")


# --- the catalog ---------------------------------------------------------------------------------

def test_generic_and_model_classes_name_an_extended_resource() -> None:
    objs = {o["metadata"]["name"]: o for o in (dc.to_device_class(s) for s in dc.catalog())}
    names = {n: o["spec"].get("extendedResourceName") for n, o in objs.items()}
    assert names["gpu.topodra.io"] == GPU
    assert names["gpu-h200"] == "gpu.topodra.io/h200"
    assert names["gpu-a100-80gb"] == "gpu.topodra.io/a100-80gb"
    kinds = {s.name: s.kind for s in dc.catalog()}
    for name, ext in names.items():
        if kinds[name] in ("generic", "model"):
            # A domain-qualified name outside kubernetes.io: what the API accepts for extended resources.
            assert ext and QUALIFIED.match(ext) and "kubernetes.io" not in ext, (name, ext)
        else:
            assert ext is None, (name, ext)
    named = [e for e in names.values() if e]
    assert len(named) == len(set(named)), "two classes must never claim one extended resource"


def test_classes_for_unknown_models_get_a_name_too() -> None:
    objs = dc.classes_for_models(["RTX-PRO-6000"])
    ext = {o["metadata"]["name"]: o["spec"].get("extendedResourceName") for o in objs}
    assert ext["gpu-model-rtx-pro-6000"] == "gpu.topodra.io/model-rtx-pro-6000"
    assert ext["gpu.topodra.io"] == GPU


def test_committed_classes_carry_the_names() -> None:
    for path in sorted((REPO / "deviceclasses").glob("*.yaml")):
        obj = yaml.safe_load(path.read_text())
        kind = obj["metadata"]["labels"]["topodra.io/class-kind"]
        assert ("extendedResourceName" in obj["spec"]) == (kind in ("generic", "model")), path.name


def test_admin_guide_lists_every_name() -> None:
    guide = (REPO / "docs" / "admin-guide.md").read_text()
    for s in dc.catalog():
        ext = dc.extended_resource_name(s)
        if ext:
            assert f"`{ext}`" in guide, ext
