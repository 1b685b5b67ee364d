"""ClaimProfile validation: clear errors for bad input."""

from __future__ import annotations

from typing import Any

import pytest

from topodra.controller.profile import ClaimProfile, ProfileError


def parse(spec: dict[str, Any]) -> ClaimProfile:
    return ClaimProfile.from_api({"metadata": {"name": "p", "namespace": "ns"}, "spec": spec})


def test_defaults_and_effective_names() -> None:
    p = parse({"alternatives": [{"deviceClassName": "gpu-h200"}, {"deviceClassName": "gpu.topodra.io"},
                                {"name": "big", "deviceClassName": "gpu-mem-140gi", "count": 4}]})
    assert [a.effective_name for a in p.spec.alternatives] == ["h200", "gpu-topodra-io", "big"]
    assert [a.count for a in p.spec.alternatives] == [1, 1, 4]
    t = p.spec.topology
    assert (t.nvlink, t.numa, t.nic, t.order) == ("None", "None", "None", "AlternativesFirst")


@pytest.mark.parametrize(("spec", "message"), [
    ({}, r"spec\.alternatives: Field required"),
    ({"alternatives": []}, r"spec\.alternatives: .*at least 1"),
    ({"alternatives": [{"deviceClassName": "gpu-h200"}] * 9}, r"at most 8"),
    ({"alternatives": [{"deviceClassName": "gpu-h200", "count": 0}]}, r"spec\.alternatives\[0\]\.count"),
    ({"alternatives": [{"deviceClassName": "gpu-h200", "count": 33}]}, r"spec\.alternatives\[0\]\.count"),
    ({"alternatives": [{"count": 2}]}, r"deviceClassName: Field required"),
    ({"alternatives": [{"deviceClassName": "GPU_H200"}]}, r"not a valid DeviceClass name"),
    ({"alternatives": [{"name": "Big", "deviceClassName": "gpu-h200"}]}, r"must be a DNS label"),
    ({"alternatives": [{"deviceClassName": "gpu-h200"}, {"deviceClassName": "gpu-h200"}]},
     r"names must be unique, \['h200'\]"),
    ({"alternatives": [{"deviceClassName": "gpu-h200"}], "topology": {"nvlink": "Always"}},
     r"spec\.topology\.nvlink"),
    ({"alternatives": [{"deviceClassName": "gpu-h200"}], "topology": {"nic": "Preferred"}},
     r"spec\.topology\.nic"),
    ({"alternatives": [{"deviceClassName": "gpu-h200"}], "extra": 1}, r"spec\.extra: Extra inputs"),
    ({"alternatives": [{"deviceClassName": "gpu-h200", "count": 2}, {"deviceClassName": "gpu-h100"}],
      "topology": {"nic": "RailAligned"}}, r"same count in every alternative"),
    ({"alternatives": [{"deviceClassName": "gpu-h200", "count": 17}], "topology": {"nic": "RailAligned"}},
     r"at most 16 GPUs"),
    ({"alternatives": [{"deviceClassName": "gpu-h200"}], "topology": {"nic": "RailAligned", "numa": "Preferred"}},
     r"cannot be combined with a Preferred"),
])
def test_invalid_profiles_are_rejected_with_a_clear_message(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(ProfileError, match=message):
        parse(spec)


def test_explicit_names_resolve_duplicates() -> None:
    p = parse({"alternatives": [{"name": "fast", "deviceClassName": "gpu-h200"},
                                {"name": "slow", "deviceClassName": "gpu-h200", "count": 2}]})
    assert [a.effective_name for a in p.spec.alternatives] == ["fast", "slow"]
