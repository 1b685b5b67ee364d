"""ClaimProfile -> ResourceClaimTemplate rendering."""

from __future__ import annotations

from typing import Any

import pytest

from topodra.controller.profile import ClaimProfile, ProfileError
from topodra.controller.render import HASH_ANNOTATION, claim_spec, device_class_names, render_template


def profile(alternatives: list[dict[str, Any]], topology: dict[str, str] | None = None,
            name: str = "train") -> ClaimProfile:
    spec: dict[str, Any] = {"alternatives": alternatives}
    if topology is not None:
        spec["topology"] = topology
    return ClaimProfile.from_api({"metadata": {"name": name, "namespace": "ml", "uid": "uid-1", "generation": 3},
                                  "spec": spec})


H200_H100 = [{"deviceClassName": "gpu-h200", "count": 8}, {"deviceClassName": "gpu-h100", "count": 8}]


def test_single_alternative_is_exact_request() -> None:
    devices = claim_spec(profile([{"deviceClassName": "gpu-h200", "count": 2}]))["devices"]
    assert devices == {"requests": [{"name": "gpus", "exactly": {
        "deviceClassName": "gpu-h200", "allocationMode": "ExactCount", "count": 2}}]}


def test_alternatives_become_first_available_in_order() -> None:
    devices = claim_spec(profile([*H200_H100, {"deviceClassName": "gpu-a100-80gb", "count": 16}]))["devices"]
    (req,) = devices["requests"]
    assert req["name"] == "gpus"
    assert [(s["name"], s["deviceClassName"], s["count"]) for s in req["firstAvailable"]] == [
        ("h200", "gpu-h200", 8), ("h100", "gpu-h100", 8), ("a100-80gb", "gpu-a100-80gb", 16)]
    assert "constraints" not in devices


def test_required_topology_constrains_the_whole_request() -> None:
    devices = claim_spec(profile(H200_H100, {"nvlink": "Required", "numa": "Required"}))["devices"]
    assert devices["constraints"] == [
        {"requests": ["gpus"], "matchAttribute": "gpu.topodra.io/nvlinkDomain"},
        {"requests": ["gpus"], "matchAttribute": "resource.kubernetes.io/numaNode"},
    ]
    assert [s["name"] for s in devices["requests"][0]["firstAvailable"]] == ["h200", "h100"]


def test_preferred_expands_constrained_first_alternatives_first() -> None:
    devices = claim_spec(profile(H200_H100, {"nvlink": "Preferred"}))["devices"]
    names = [s["name"] for s in devices["requests"][0]["firstAvailable"]]
    assert names == ["h200-nvlink", "h200", "h100-nvlink", "h100"]
    assert devices["constraints"] == [{"requests": ["gpus/h200-nvlink", "gpus/h100-nvlink"],
                                       "matchAttribute": "gpu.topodra.io/nvlinkDomain"}]


def test_preferred_topology_first_order() -> None:
    devices = claim_spec(profile(H200_H100, {"nvlink": "Preferred", "order": "TopologyFirst"}))["devices"]
    names = [s["name"] for s in devices["requests"][0]["firstAvailable"]]
    assert names == ["h200-nvlink", "h100-nvlink", "h200", "h100"]


def test_single_alternative_preferred_uses_first_available() -> None:
    devices = claim_spec(profile([{"deviceClassName": "gpu-h200", "count": 4}], {"numa": "Preferred"}))["devices"]
    assert [s["name"] for s in devices["requests"][0]["firstAvailable"]] == ["h200-numa", "h200"]


def test_two_preferred_dimensions_give_four_variants() -> None:
    devices = claim_spec(profile(H200_H100, {"nvlink": "Preferred", "numa": "Preferred"}))["devices"]
    names = [s["name"] for s in devices["requests"][0]["firstAvailable"]]
    assert names == ["h200-nvlink-numa", "h200-nvlink", "h200-numa", "h200",
                     "h100-nvlink-numa", "h100-nvlink", "h100-numa", "h100"]
    by_attr = {c["matchAttribute"]: c["requests"] for c in devices["constraints"]}
    assert by_attr["gpu.topodra.io/nvlinkDomain"] == [
        "gpus/h200-nvlink-numa", "gpus/h200-nvlink", "gpus/h100-nvlink-numa", "gpus/h100-nvlink"]
    assert by_attr["resource.kubernetes.io/numaNode"] == [
        "gpus/h200-nvlink-numa", "gpus/h200-numa", "gpus/h100-nvlink-numa", "gpus/h100-numa"]


def test_expansion_beyond_eight_subrequests_is_rejected() -> None:
    alts = [*H200_H100, {"deviceClassName": "gpu-a100-80gb", "count": 8}]
    with pytest.raises(ProfileError, match=r"12 subrequests .* allows 8"):
        claim_spec(profile(alts, {"nvlink": "Preferred", "numa": "Preferred"}))
    # 5 alternatives x 2 variants = 10 > 8 as well
    five = [{"deviceClassName": f"gpu-{m}", "count": 1} for m in ("h200", "h100", "b200", "l40s", "l4")]
    with pytest.raises(ProfileError, match="10 subrequests"):
        claim_spec(profile(five, {"numa": "Preferred"}))


def test_rail_aligned_pairs_each_gpu_with_a_nic() -> None:
    p = profile([{"deviceClassName": "gpu-h200", "count": 2}, {"deviceClassName": "gpu-h100", "count": 2}],
                {"nic": "RailAligned", "nvlink": "Required"})
    devices = claim_spec(p)["devices"]
    assert [r["name"] for r in devices["requests"]] == ["gpu-0", "nic-0", "gpu-1", "nic-1"]
    assert [s["name"] for s in devices["requests"][0]["firstAvailable"]] == ["h200", "h100"]
    assert devices["requests"][1]["exactly"]["deviceClassName"] == "nic.topodra.io"
    assert devices["constraints"] == [
        {"requests": ["gpu-0", "nic-0"], "matchAttribute": "gpu.topodra.io/rail"},
        {"requests": ["gpu-1", "nic-1"], "matchAttribute": "gpu.topodra.io/rail"},
        {"requests": ["gpu-0", "gpu-1"], "matchAttribute": "gpu.topodra.io/model"},
        {"requests": ["gpu-0", "gpu-1"], "matchAttribute": "gpu.topodra.io/nvlinkDomain"},
    ]
    assert device_class_names(p) == ["gpu-h200", "gpu-h100", "nic.topodra.io"]


def test_rail_aligned_single_gpu() -> None:
    devices = claim_spec(profile([{"deviceClassName": "gpu.topodra.io"}], {"nic": "RailAligned"}))["devices"]
    assert devices["requests"] == [
        {"name": "gpu-0", "exactly": {"deviceClassName": "gpu.topodra.io", "allocationMode": "ExactCount",
                                      "count": 1}},
        {"name": "nic-0", "exactly": {"deviceClassName": "nic.topodra.io", "allocationMode": "ExactCount",
                                      "count": 1}},
    ]
    assert devices["constraints"] == [{"requests": ["gpu-0", "nic-0"], "matchAttribute": "gpu.topodra.io/rail"}]


def test_template_metadata_owner_and_hash() -> None:
    tmpl = render_template(profile(H200_H100, {"nvlink": "Required"}))
    meta = tmpl["metadata"]
    assert (tmpl["apiVersion"], tmpl["kind"]) == ("resource.k8s.io/v1", "ResourceClaimTemplate")
    assert (meta["name"], meta["namespace"]) == ("train", "ml")
    assert meta["ownerReferences"] == [{"apiVersion": "topodra.io/v1alpha1", "kind": "ClaimProfile",
                                        "name": "train", "uid": "uid-1", "controller": True,
                                        "blockOwnerDeletion": False}]
    assert tmpl["spec"]["metadata"]["labels"] == {"topodra.io/profile": "train"}
    assert len(meta["annotations"][HASH_ANNOTATION]) == 20


def test_hash_is_deterministic_and_tracks_the_spec() -> None:
    a = render_template(profile(H200_H100, {"nvlink": "Required"}))
    b = render_template(profile(H200_H100, {"nvlink": "Required"}))
    assert a == b
    h = a["metadata"]["annotations"][HASH_ANNOTATION]
    c = render_template(profile(H200_H100, {"nvlink": "Preferred"}))
    assert c["metadata"]["annotations"][HASH_ANNOTATION] != h
    d = render_template(profile(list(reversed(H200_H100)), {"nvlink": "Required"}))
    assert d["metadata"]["annotations"][HASH_ANNOTATION] != h
    # generation and uid are not part of the spec: an unrelated metadata change keeps the hash
    e = ClaimProfile.from_api({"metadata": {"name": "train", "namespace": "ml", "uid": "uid-2", "generation": 9},
                               "spec": {"alternatives": H200_H100, "topology": {"nvlink": "Required"}}})
    assert render_template(e)["metadata"]["annotations"][HASH_ANNOTATION] == h


def test_custom_driver_name_and_nic_class() -> None:
    p = profile([{"deviceClassName": "gpu-h200"}], {"nic": "RailAligned"})
    devices = claim_spec(p, driver="gpu.example.com", nic_class="rdma")["devices"]
    assert devices["requests"][1]["exactly"]["deviceClassName"] == "rdma"
    assert devices["constraints"][0]["matchAttribute"] == "gpu.example.com/rail"
