"""Node labels from discovery (``topodra.nodelabels``) and a multi-pod job placed by them.

The pure part runs the real discovery code on mock profiles. The cluster part publishes enterprise-400 and
an NVL72 rack with ``topodra simulate``'s code, checks the labels on the Node objects, and shows the real
kube-scheduler keeping both pods of a 2 x 8-GPU job in one scalable unit through pod affinity on
``topodra.io/scalable-unit``: with scalable unit 1 full except one node and 25 empty nodes in unit 2, the
second pod can only land on that one node.

Split by tier; the rest: tests/cluster/test_nodelabels_cluster.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from testkit.paths import REPO

from topodra.nodelabels import (
    GPU_COUNT,
    GPU_MODEL,
    NVLINK_CLIQUE,
    SCALABLE_UNIT,
    label_patch,
    label_value,
    node_labels,
)
from topodra.simulate import SimNode, discover, load_cluster, plan

Obj = dict[str, Any]


def devices_of(profile: str, **overrides: Any) -> Any:
    return discover(SimNode(name="n", profile=profile, labels={}, overrides=overrides))


def test_dgx_labels_have_no_clique() -> None:
    assert node_labels(devices_of("dgx-h100")) == {GPU_COUNT: "8", GPU_MODEL: "H100-SXM5-80GB"}
    assert node_labels(devices_of("dgx-h100", hideGpus=[3]))[GPU_COUNT] == "7"
    assert NVLINK_CLIQUE not in node_labels(devices_of("l4"))  # no NVLink at all


def test_nvl72_trays_of_one_rack_share_the_clique_label() -> None:
    nodes = plan(load_cluster(REPO / "hack/clusters/nvl72-rack.yaml"))
    labels = [node_labels(discover(n)) for n in nodes[:3]]
    cliques = {lab[NVLINK_CLIQUE] for lab in labels}
    assert len(cliques) == 1
    uuid, _, clique = cliques.pop().rpartition(".")
    assert len(uuid) == 36 and clique.isdigit()
    assert all(lab[GPU_COUNT] == "4" and lab[GPU_MODEL] == "GB200" for lab in labels)


def test_admin_labels_and_patch() -> None:
    wanted = node_labels(devices_of("dgx-h100"), scalable_unit="su 1", rail_group="rg-a")
    assert wanted[SCALABLE_UNIT] == "su-1" and wanted["topodra.io/rail-group"] == "rg-a"
    current = {"kubernetes.io/hostname": "n", GPU_COUNT: "8", GPU_MODEL: "A100-SXM4-80GB", NVLINK_CLIQUE: "x.1"}
    patch = label_patch(current, {GPU_COUNT: "8", GPU_MODEL: "H100-SXM5-80GB"})
    assert patch == {GPU_MODEL: "H100-SXM5-80GB", NVLINK_CLIQUE: None}  # hostname untouched, count unchanged
    assert label_patch({GPU_COUNT: "8"}, {GPU_COUNT: "8"}) == {}
    with pytest.raises(ValueError, match="not a topodra node label"):
        label_patch({}, {"kubernetes.io/hostname": "other"})


@pytest.mark.parametrize(("text", "value"), [("H100 SXM5/80GB", "H100-SXM5-80GB"), ("-a-", "a"), ("x" * 80, "x" * 63)])
def test_label_value(text: str, value: str) -> None:
    assert label_value(text) == value
