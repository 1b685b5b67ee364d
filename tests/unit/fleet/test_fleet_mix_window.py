"""``ClusterState.observed_mix`` kept from an index of the window by demand: the same counts in the same
order (first occurrence in the window) as counting the window claim by claim, through arrivals, the
window sliding, forgotten claims and relists."""

from __future__ import annotations

import random

from testkit.views import claim, gpus

from topodra import DEFAULT_DRIVER_NAME as DRIVER
from topodra.fleet.demand import Demand
from topodra.fleet.state import ClusterState

SPECS = [gpus(k, cls, nvlink=k > 1) for k in (1, 2, 4, 8) for cls in ("gpu.topodra.io", "gpu-h100")]


def recount(st: ClusterState) -> list[tuple[Demand, int]]:
    counts: dict[Demand, int] = {}
    for _created, demand in st.recent.values():
        counts[demand] = counts.get(demand, 0) + 1
    return list(counts.items())


def test_observed_mix_follows_the_window_in_order() -> None:
    rng = random.Random(3)
    st = ClusterState(DRIVER, window=12)
    live: dict[str, dict[str, object]] = {}
    checked = 0
    for k in range(600):
        step = rng.random()
        if step < 0.6 or not live:
            name = f"c{k}"
            obj = claim(name, rng.choice(SPECS), created=f"2026-12-02T00:{k // 60:02d}:{k % 60:02d}Z")
            live[name] = obj
            st.set_claim(obj)
        elif step < 0.85:
            name = rng.choice(sorted(live))
            st.delete_claim("ns", name, forget=rng.random() < 0.5)
            del live[name]
        else:
            st.replace("claims", list(live.values()))  # a relist: deleted claims stay as history
        assert list(st.observed_mix().items()) == recount(st), k
        assert sum(st.observed_mix().values()) == len(st.recent) <= 12
        checked += 1
    assert checked == 600 and len(recount(st)) > 1
