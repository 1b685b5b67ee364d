"""The operator's gang hook against an in-memory API: PodGroup written, replaced while no pod names it, then fixed."""

from __future__ import annotations

from typing import Any

from test_controller_operator import CFG, PROFILES, FakeKube, add_profile, kube  # noqa: F401 - kube is a fixture
from test_gang_profile import H200, hgx, node

from topodra.apipaths import node_path, pod_path, slices_path, template_path
from topodra.controller.gang import ALT_ANNOTATION, podgroup_path
from topodra.controller.operator import SnapshotCache, process

Obj = dict[str, Any]
SPEC: Obj = {"alternatives": [{"deviceClassName": "gpu-h200", "count": 8}, {"deviceClassName": "gpu-h100", "count": 8}],
             "topology": {"nvlink": "Required"}, "pods": 4,
             "acrossNodes": {"sameDomain": ["leafGroup", "scalableUnit"]}}
PG = podgroup_path("ml", "train")


def add_node(k: FakeKube, name: str, leaf: str, h200: bool = False) -> None:
    k.create(slices_path(), hgx(name, H200) if h200 else hgx(name))
    k.create(node_path(), node(name, leaf_group=leaf, scalable_unit="su1"))


def run(k: FakeKube) -> Obj:
    body = k.get(f"{PROFILES}/train")
    assert body is not None
    out = process(k, body, CFG, SnapshotCache(CFG))  # type: ignore[arg-type]
    assert out.ok, out
    return dict(k.objs[f"{PROFILES}/train"]["status"])


def template_class(k: FakeKube) -> str:
    (req,) = k.objs[template_path("ml", "train")]["spec"]["spec"]["devices"]["requests"]
    return str(req["exactly"]["deviceClassName"])


def test_choice_follows_the_fleet_until_a_pod_exists(kube: FakeKube) -> None:  # noqa: F811 - the fixture
    for i in range(3):
        add_node(kube, f"h200-{i}", "l1", h200=True)
    for i in range(4):
        add_node(kube, f"h100-{i}", "l2")
    add_profile(kube, SPEC)
    st = run(kube)
    assert (st["gang"]["alternative"], st["gang"]["level"], st["gang"]["fitsNow"]) == ("h100", "leafGroup", True)
    assert template_class(kube) == "gpu-h100"
    pg = kube.objs[PG]
    assert pg["spec"]["schedulingPolicy"] == {"gang": {"minCount": 4}}
    assert pg["spec"]["schedulingConstraints"] == {"topology": [{"key": "topodra.io/leaf-group"}]}

    # A 4th H200 node frees before any pod exists: the whole job moves to H200 (PodGroup and template replaced).
    add_node(kube, "h200-3", "l1", h200=True)
    old_uid = kube.objs[PG]["metadata"]["uid"]
    st = run(kube)
    assert st["gang"]["alternative"] == "h200" and template_class(kube) == "gpu-h200"
    assert kube.objs[PG]["metadata"]["uid"] != old_uid
    assert kube.objs[PG]["metadata"]["annotations"][ALT_ANNOTATION] == "h200"

    # The first pod of the job exists: its claim came from this template, so the choice stays even when the
    # H200 nodes go (here: one of them is cordoned).
    kube.create(pod_path("ml"), {"metadata": {"name": "train-0"},
                                 "spec": {"schedulingGroup": {"podGroupName": "train"}, "nodeName": "h200-0"},
                                 "status": {"phase": "Pending"}})
    kube.objs[node_path("h200-1")]["spec"] = {"unschedulable": True}
    kube.calls.clear()
    st = run(kube)
    assert (st["gang"]["alternative"], st["gang"]["fixed"], st["gang"]["podsBound"]) == ("h200", True, 1)
    assert st["gang"]["domain"] == "l1"
    assert [c for c in kube.writes() if c[1].startswith(podgroup_path("ml"))] == []
    assert template_class(kube) == "gpu-h200"


def test_profile_without_pods_has_no_podgroup(kube: FakeKube) -> None:  # noqa: F811 - the fixture
    add_profile(kube, {"alternatives": SPEC["alternatives"]})
    st = run(kube)
    assert st.get("gang") is None
    assert PG not in kube.objs


def test_a_foreign_podgroup_is_left_alone(kube: FakeKube) -> None:  # noqa: F811 - the fixture
    add_node(kube, "h100-0", "l2")
    kube.create(podgroup_path("ml"), {"metadata": {"name": "train"}, "spec": {"schedulingPolicy": {"basic": {}}}})
    add_profile(kube, SPEC)
    st = run(kube)
    assert "not managed by this profile" in st["gang"]["message"]
    assert kube.objs[PG]["spec"] == {"schedulingPolicy": {"basic": {}}}
