"""Issue 13, part 3: ClaimProfile in Kueue mode, rendered by the pure functions of controller/kueue.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

from topodra.controller import kueue as kq
from topodra.controller.profile import ClaimProfile, ProfileError
from topodra.selectors import MATCH_ANNOTATION


def profile(spec: dict[str, Any]) -> ClaimProfile:
    return ClaimProfile.from_api({"metadata": {"name": "train", "namespace": "team-a"},
                                  "spec": {"queueing": "Kueue", "localQueue": "team-a", **spec}})


def alts(*pairs: tuple[str, int]) -> list[dict[str, Any]]:
    return [{"deviceClassName": c, "count": n} for c, n in pairs]


MODELS = kq.catalog_class_models()


def test_fallback_profile_becomes_per_model_flavors_in_order() -> None:
    p = kq.plan(profile({"alternatives": alts(("gpu-h200", 8), ("gpu-h100", 8))}), MODELS)
    assert p.resource == "gpu.topodra.io/gpu" and p.count == 8 and p.local_queue == "team-a"
    assert p.models == ("H200-SXM5-141GB", "H200-NVL-141GB", "H100-SXM5-80GB", "H100-NVL-94GB", "H100-PCIE-80GB")
    assert p.flavors[0] == "gpu-h200-sxm5-141gb" and p.unsupported == ()


def test_nvlink_required_leaves_out_models_where_it_cannot_hold_and_says_so() -> None:
    p = kq.plan(profile({"alternatives": alts(("gpu-h200", 4), ("gpu-h100", 4)),
                         "topology": {"nvlink": "Required"}}), MODELS)
    assert p.models == ("H200-SXM5-141GB", "H100-SXM5-80GB")
    text = " ".join(p.unsupported)
    for left_out in ("H200-NVL-141GB", "H100-NVL-94GB", "H100-PCIE-80GB"):
        assert left_out in text
    assert "gpu-h100-nvl-94gb left out" in text
    # Two GPUs fit an NVLink pair: the NVL boards stay.
    p2 = kq.plan(profile({"alternatives": alts(("gpu-h100", 2)), "topology": {"nvlink": "Required"}}), MODELS)
    assert "H100-NVL-94GB" in p2.models and "H100-PCIE-80GB" not in p2.models


@pytest.mark.parametrize(("spec", "needle"), [
    ({"alternatives": alts(("gpu-h200", 8), ("gpu-h100", 4))}, "different counts"),
    ({"alternatives": alts(("gpu-h100", 2)), "topology": {"nic": "RailAligned"}}, "RailAligned"),
    ({"alternatives": alts(("gpu-h100", 2)), "topology": {"numa": "Required"}}, "numa Required"),
    ({"alternatives": alts(("gpu-l4", 2)), "topology": {"nvlink": "Required"}}, "no GPU model"),
    ({"alternatives": alts(("gpu-mem-80gi", 2))}, "does not name GPU models"),
])
def test_what_kueue_mode_cannot_express_is_refused_with_the_reason(spec: dict[str, Any], needle: str) -> None:
    with pytest.raises(kq.KueueUnsupported, match=needle):
        kq.plan(profile(spec), MODELS)
    status, ok, msg = kq.queueing_status(profile(spec), MODELS)
    assert not ok and needle in msg and status["message"] == msg and status["localQueue"] == "team-a"


def test_preferred_placement_and_non_model_classes_are_reported_not_dropped() -> None:
    p = kq.plan(profile({"alternatives": alts(("gpu-h200", 2), ("gpu-mem-80gi", 2)),
                         "topology": {"nvlink": "Preferred"}}), MODELS)
    assert p.models == ("H200-SXM5-141GB", "H200-NVL-141GB")
    assert any("nvlink Preferred is not honoured" in n for n in p.unsupported)
    assert any("gpu-mem-80gi" in n and "left out" in n for n in p.unsupported)
    status, ok, msg = kq.queueing_status(profile({"alternatives": alts(("gpu-h200", 2)),
                                                  "topology": {"nvlink": "Preferred"}}), MODELS)
    assert ok and "not honoured" in msg and status["unsupported"]
    # One GPU: NUMA and NVLink hold trivially, nothing to report.
    one = kq.plan(profile({"alternatives": alts(("gpu-l4", 1)), "topology": {"numa": "Required",
                                                                             "nvlink": "Required"}}), MODELS)
    assert one.models == ("L4",) and one.unsupported == ()


def test_pod_template_gets_queue_request_and_model_affinity() -> None:
    p = kq.plan(profile({"alternatives": alts(("gpu-h200", 2), ("gpu-h100", 2))}), MODELS)
    base: dict[str, Any] = {"metadata": {"labels": {"app": "x"}},
            "spec": {"containers": [{"name": "main", "image": "busybox"}],
                     "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                         "nodeSelectorTerms": [{"matchExpressions": [
                             {"key": "zone", "operator": "In", "values": ["a"]}]}]}}}}}
    out = p.pod_template(base)
    assert base["metadata"]["labels"] == {"app": "x"}, "input is not modified"
    assert out["metadata"]["labels"] == {"app": "x", kq.QUEUE_LABEL: "team-a"}
    res = out["spec"]["containers"][0]["resources"]
    assert res == {"requests": {"gpu.topodra.io/gpu": "2"}, "limits": {"gpu.topodra.io/gpu": "2"}}
    exprs = out["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"][0]["matchExpressions"]
    assert exprs[0]["key"] == "zone" and exprs[1]["key"] == "topodra.io/gpu-model"
    assert exprs[1]["values"] == list(p.models)
    with pytest.raises(ValueError, match="no container"):
        p.pod_template({"spec": {"containers": []}})


def test_profile_validation_of_queueing_fields() -> None:
    with pytest.raises(ProfileError, match="needs localQueue"):
        ClaimProfile.from_api({"metadata": {"name": "a", "namespace": "b"},
                               "spec": {"alternatives": alts(("gpu-h100", 1)), "queueing": "Kueue"}})
    with pytest.raises(ProfileError, match="needs queueing Kueue"):
        ClaimProfile.from_api({"metadata": {"name": "a", "namespace": "b"},
                               "spec": {"alternatives": alts(("gpu-h100", 1)), "localQueue": "q"}})
    with pytest.raises(ProfileError, match="DNS label"):
        profile({"alternatives": alts(("gpu-h100", 1)), "localQueue": "Team_A"})
    with pytest.raises(kq.KueueUnsupported, match="not Kueue"):
        kq.plan(ClaimProfile.from_api({"metadata": {"name": "a", "namespace": "b"},
                                       "spec": {"alternatives": alts(("gpu-h100", 1))}}), MODELS)


def test_flavors_and_cluster_queue() -> None:
    rf = kq.resource_flavor("H200-SXM5-141GB")
    assert rf["metadata"]["name"] == "gpu-h200-sxm5-141gb"
    assert rf["spec"]["nodeLabels"] == {"topodra.io/gpu-model": "H200-SXM5-141GB"}
    cq = kq.cluster_queue("team-a", ["H200-SXM5-141GB", "H100-SXM5-80GB"], {"H200-SXM5-141GB": 8},
                          cohort="org", borrowing_limits={"H100-SXM5-80GB": 8},
                          preemption={"withinClusterQueue": "LowerPriority"})
    spec = cq["spec"]
    assert spec["cohortName"] == "org" and spec["preemption"] == {"withinClusterQueue": "LowerPriority"}
    flavors = spec["resourceGroups"][0]["flavors"]
    assert [f["name"] for f in flavors] == ["gpu-h200-sxm5-141gb", "gpu-h100-sxm5-80gb"]
    assert flavors[0]["resources"] == [{"name": "gpu.topodra.io/gpu", "nominalQuota": "8"}]
    assert flavors[1]["resources"] == [{"name": "gpu.topodra.io/gpu", "nominalQuota": "0", "borrowingLimit": "8"}]


def test_class_models_from_cluster_classes() -> None:
    def cls(name: str, match: dict[str, Any]) -> dict[str, Any]:
        return {"metadata": {"name": name, "annotations": {MATCH_ANNOTATION: json.dumps(match)}}}

    out = kq.class_models_from([cls("gpu-model-rtx", {"type": "gpu", "models": ["RTX-PRO-6000"]}),
                                cls("big-rtx", {"type": "gpu", "models": ["RTX-PRO-6000"], "minMemory": "90Gi"}),
                                cls("broken", {"type": "gpu", "models": []}),
                                {"metadata": {"name": "foreign"}}])
    assert out["gpu-model-rtx"] == ("RTX-PRO-6000",)
    assert "big-rtx" not in out and "broken" not in out and "foreign" not in out
    assert out["gpu-h100"] == ("H100-SXM5-80GB", "H100-NVL-94GB", "H100-PCIE-80GB")
    assert len(out["gpu.topodra.io"]) > 10


def test_nvlink_domain_sizes() -> None:
    assert kq.nvlink_domain_size("H100-SXM5-80GB") == 8
    assert kq.nvlink_domain_size("GB200") == 8
    assert kq.nvlink_domain_size("H100-NVL-94GB") == 2
    assert kq.nvlink_domain_size("L40S") == 1


def test_cli_render_prints_flavors_and_pod_fields(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    from topodra.cli import main

    prof = tmp_path / "p.yaml"
    prof.write_text(yaml.safe_dump({"apiVersion": "topodra.io/v1alpha1", "kind": "ClaimProfile",
                                    "metadata": {"name": "train"},
                                    "spec": {"queueing": "Kueue", "localQueue": "team-a",
                                             "alternatives": alts(("gpu-h200", 4), ("gpu-h100", 4)),
                                             "topology": {"nvlink": "Required"}}}))
    assert main(["kueue", "render", str(prof)]) == 0
    out, err = capsys.readouterr()
    docs = list(yaml.safe_load_all(out))
    assert [d["metadata"]["name"] for d in docs[:-1]] == ["gpu-h200-sxm5-141gb", "gpu-h100-sxm5-80gb"]
    assert docs[-1]["metadata"]["labels"] == {kq.QUEUE_LABEL: "team-a"}
    assert docs[-1]["spec"]["containers"][0]["resources"]["limits"] == {"gpu.topodra.io/gpu": "4"}
    assert "H100-PCIE-80GB" in err and "left out" in err

    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"metadata": {"name": "x"}, "spec": {
        "queueing": "Kueue", "localQueue": "q", "alternatives": alts(("gpu-h100", 2)),
        "topology": {"nic": "RailAligned"}}}))
    assert main(["kueue", "render", str(bad)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and "RailAligned" in err
