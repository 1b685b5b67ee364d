"""alignCpus rendering: CPU requests for dra-driver-cpu, one NUMA matchAttribute per GPU group."""

from __future__ import annotations

from typing import Any

import pytest

from topodra.controller.cpualign import LEGACY_NUMA, CpuOptions, cpus_per_claim, group_sizes
from topodra.controller.profile import ClaimProfile, ProfileError
from topodra.controller.render import claim_spec, render_template

NUMA = "resource.kubernetes.io/numaNode"


def profile(spec: dict[str, Any]) -> ClaimProfile:
    return ClaimProfile.from_api({"metadata": {"name": "train", "namespace": "ml", "uid": "u"}, "spec": spec})


def h100(count: int = 8) -> list[dict[str, Any]]:
    return [{"deviceClassName": "gpu-h100", "count": count}]


def cpu_request(name: str, cpus: str, cls: str = "dra.cpu") -> dict[str, Any]:
    return {"name": name, "exactly": {"deviceClassName": cls, "allocationMode": "ExactCount", "count": 1,
                                      "capacity": {"requests": {"dra.cpu/cpu": cpus}}}}


def test_one_group_adds_one_cpu_request_matched_with_the_gpus() -> None:
    devices = claim_spec(profile({"alternatives": h100(4), "alignCpus": {"cpusPerGpu": 8}}))["devices"]
    assert devices["requests"] == [
        {"name": "gpus", "exactly": {"deviceClassName": "gpu-h100", "allocationMode": "ExactCount", "count": 4}},
        cpu_request("cpus", "32")]
    assert devices["constraints"] == [{"requests": ["gpus", "cpus"], "matchAttribute": NUMA}]


def test_eight_gpus_split_into_two_numa_groups_each_with_its_cpus() -> None:
    p = profile({"alternatives": h100(8), "topology": {"nvlink": "Required"},
                 "alignCpus": {"cpusPerGpu": 8, "gpusPerNumaNode": 4}})
    assert group_sizes(p) == (2, 4) and cpus_per_claim(p) == 64
    devices = claim_spec(p)["devices"]
    gpu = {"deviceClassName": "gpu-h100", "allocationMode": "ExactCount", "count": 4}
    assert devices["requests"] == [{"name": "gpus-0", "exactly": gpu}, {"name": "gpus-1", "exactly": gpu},
                                   cpu_request("cpus-0", "32"), cpu_request("cpus-1", "32")]
    assert devices["constraints"] == [
        # the Required nvlink constraint of the single request now covers both groups
        {"requests": ["gpus-0", "gpus-1"], "matchAttribute": "gpu.topodra.io/nvlinkDomain"},
        {"requests": ["gpus-0", "gpus-1"], "matchAttribute": "gpu.topodra.io/model"},
        {"requests": ["gpus-0", "cpus-0"], "matchAttribute": NUMA},
        {"requests": ["gpus-1", "cpus-1"], "matchAttribute": NUMA}]


def test_alternatives_stay_first_available_in_every_group() -> None:
    alts = [{"deviceClassName": "gpu-h200", "count": 8}, {"deviceClassName": "gpu-h100", "count": 8}]
    devices = claim_spec(profile({"alternatives": alts, "alignCpus": {"cpusPerGpu": 4, "gpusPerNumaNode": 4}}))[
        "devices"]
    for g in (0, 1):
        req = devices["requests"][g]
        assert req["name"] == f"gpus-{g}"
        assert [(s["name"], s["deviceClassName"], s["count"]) for s in req["firstAvailable"]] == [
            ("h200", "gpu-h200", 4), ("h100", "gpu-h100", 4)]
    assert {"requests": ["gpus-0", "gpus-1"], "matchAttribute": "gpu.topodra.io/model"} in devices["constraints"]


def test_rail_aligned_pairs_join_their_groups_numa_constraint() -> None:
    p = profile({"alternatives": h100(8), "topology": {"nic": "RailAligned"},
                 "alignCpus": {"cpusPerGpu": 8, "gpusPerNumaNode": 4}})
    devices = claim_spec(p)["devices"]
    names = [r["name"] for r in devices["requests"]]
    assert names == [n for i in range(8) for n in (f"gpu-{i}", f"nic-{i}")] + ["cpus-0", "cpus-1"]
    numa = [c for c in devices["constraints"] if c["matchAttribute"] == NUMA]
    assert numa == [
        {"requests": ["gpu-0", "nic-0", "gpu-1", "nic-1", "gpu-2", "nic-2", "gpu-3", "nic-3", "cpus-0"],
         "matchAttribute": NUMA},
        {"requests": ["gpu-4", "nic-4", "gpu-5", "nic-5", "gpu-6", "nic-6", "gpu-7", "nic-7", "cpus-1"],
         "matchAttribute": NUMA}]
    # the rail pairs and the model constraint are kept as without alignCpus
    rails = [c for c in devices["constraints"] if c["matchAttribute"] == "gpu.topodra.io/rail"]
    assert len(rails) == 8
    assert len(devices["requests"]) <= 32 and len(devices["constraints"]) <= 32


def test_cluster_options_choose_class_and_attribute() -> None:
    opts = CpuOptions(device_class="cpus.example.com", numa_attribute=LEGACY_NUMA)
    devices = claim_spec(profile({"alternatives": h100(2), "alignCpus": {"cpusPerGpu": 16}}), cpu=opts)["devices"]
    assert devices["requests"][-1] == cpu_request("cpus", "32", "cpus.example.com")
    assert devices["constraints"] == [{"requests": ["gpus", "cpus"], "matchAttribute": LEGACY_NUMA}]


def test_fallback_renders_the_profile_as_without_align_cpus() -> None:
    aligned = profile({"alternatives": h100(8), "topology": {"nvlink": "Required"},
                       "alignCpus": {"cpusPerGpu": 8, "gpusPerNumaNode": 4}})
    plain = profile({"alternatives": h100(8), "topology": {"nvlink": "Required"}})
    assert claim_spec(aligned, cpu=None) == claim_spec(plain)
    assert render_template(aligned, cpu=None)["spec"] == render_template(plain)["spec"]
    # and the aligned template differs (its hash changes, so the controller replaces the template)
    assert render_template(aligned)["metadata"]["annotations"] != render_template(plain)["metadata"]["annotations"]


@pytest.mark.parametrize(("spec", "needle"), [
    ({"alternatives": [{"deviceClassName": "gpu-h200", "count": 8}, {"deviceClassName": "gpu-h100", "count": 4}],
      "alignCpus": {"cpusPerGpu": 8}}, "same count in every alternative"),
    ({"alternatives": h100(8), "alignCpus": {"cpusPerGpu": 8, "gpusPerNumaNode": 3}}, "must divide the GPU count 8"),
    ({"alternatives": h100(8), "topology": {"numa": "Required"},
      "alignCpus": {"cpusPerGpu": 8, "gpusPerNumaNode": 4}}, "topology.numa Required"),
    ({"alternatives": h100(8), "topology": {"nvlink": "Preferred"}, "alignCpus": {"cpusPerGpu": 8}},
     "Preferred"),
    ({"alternatives": h100(16), "topology": {"nic": "RailAligned"}, "alignCpus": {"cpusPerGpu": 8}},
     "needs 33 requests"),
    ({"alternatives": h100(8), "queueing": "Kueue", "localQueue": "q", "alignCpus": {"cpusPerGpu": 8}},
     "queueing Kueue"),
    ({"alternatives": h100(8), "alignCpus": {"cpusPerGpu": 0}}, "alignCpus.cpusPerGpu"),
    ({"alternatives": h100(8), "alignCpus": {"cpusPerGpu": 8, "cores": 2}}, "alignCpus.cores"),
])
def test_bad_align_cpus_is_refused_with_the_reason(spec: dict[str, Any], needle: str) -> None:
    with pytest.raises(ProfileError, match=needle.replace(".", r"\.")):
        profile(spec)
