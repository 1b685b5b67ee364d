"""discover_all: every simulated node's devices equal what the real discovery finds on that node.

Only the first two nodes of a kind are discovered for real; the rest are derived (issue 22: 2,048 nodes
in ≤ 20 s). Whatever the derivation does, the result must be exactly node-by-node discovery's.
"""

from __future__ import annotations

import pytest

from topodra.simulate import SimulatedCluster, discover, discover_all, plan


@pytest.mark.parametrize("groups", [
    [{"namePrefix": "h100-", "count": 5, "profile": "dgx-h100"},
     {"namePrefix": "b200-", "count": 3, "profile": "hgx-b200"},
     {"namePrefix": "a100-", "count": 1, "profile": "dgx-a100-80gb"}],
    [{"namePrefix": "nvl72-", "count": 6, "profile": "gb200-nvl72", "nodesPerRack": 3}],  # fabric domains
    [{"namePrefix": "mig-", "count": 4, "profile": "dgx-h100-mig"},
     {"namePrefix": "pairs-", "count": 3, "profile": "h100-nvl"},  # four NVLink-bridged pairs per node
     {"namePrefix": "l4-", "count": 3, "profile": "l4"},  # no NVLink
     {"namePrefix": "hidden-", "count": 3, "profile": "dgx-h100", "overrides": {"hideGpus": [3]}}],
])
def test_derived_devices_equal_real_discovery(groups: list[dict[str, object]]) -> None:
    nodes = plan(SimulatedCluster.model_validate({"groups": groups}))
    got = discover_all(nodes)
    assert list(got) == [n.name for n in nodes]
    for n in nodes:
        assert got[n.name] == discover(n), n.name
    # Node-specific values really differ between nodes of a kind (the test would pass vacuously otherwise).
    first, third = nodes[0].name, nodes[2].name
    assert {d.uuid for d in got[first] if d.kind == "gpu"}.isdisjoint({d.uuid for d in got[third] if d.kind == "gpu"})
