"""The hand-built cluster views serve MIG profiles too (issue 31: ``node_slices`` raised KeyError on the
counter-set slices a MIG GPU publishes, which carry no devices)."""

from __future__ import annotations

from testkit.views import node_slices, state


def test_mig_profile_slices_are_renamed_per_node() -> None:
    slices = node_slices("mig-node", "dgx-h100-mig")
    counter_only = [s for s in slices if "devices" not in s["spec"]]
    assert counter_only, "the MIG profile publishes its counter sets in slices of their own"
    assert all(s["spec"]["nodeName"] == "mig-node" and s["spec"]["pool"]["name"] == "mig-node" for s in slices)
    assert all("template" not in s["metadata"]["name"] for s in slices)
    names = [d["name"] for s in slices for d in s["spec"].get("devices", ())]
    assert any("-mig-" in n for n in names)


def test_a_state_with_a_mig_node_builds() -> None:
    st = state({"mig-node": "dgx-h100-mig", "plain": "dgx-h100"})
    assert {"mig-node", "plain"} <= set(st.nodes)
