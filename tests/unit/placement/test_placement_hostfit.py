"""CPU/memory-aware FGD in the scorer: GPUs a class cannot use for lack of CPU or memory are fragments,
and a node without room for the pod's own requests scores 0."""

from __future__ import annotations

from testkit.views import gpus, hold, state

from topodra import DEFAULT_DRIVER_NAME as DRIVER
from topodra.fleet.demand import parse_demand
from topodra.fleet.fgd import DEFAULT_PRIOR, Mix, make_mix
from topodra.fleet.hostfrag import HostFit, capped_unusable, class_gpus, host_fragmentation
from topodra.fleet.hostres import Share
from topodra.fleet.state import ClusterState, NodeView
from topodra.placement.hostaware import host_fits
from topodra.placement.score import Scorer

GI = 1 << 30
SHARE = Share(12_000, 96 * GI)  # a DGX share per GPU


def cands(st: ClusterState, names: list[str]) -> list[tuple[str, NodeView | None, frozenset[int]]]:
    out = []
    for n in names:
        v = st.node_view(n)
        out.append((n, v, st.unavailable_indices(v) if v else frozenset()))
    return out


def fit(cpu_free: int, mem_free: int, pod_cpu: int = 12_000, pod_mem: int = 96 * GI) -> HostFit:
    return HostFit(cpu_free=cpu_free, memory_free=mem_free, pod_cpu=pod_cpu, pod_memory=pod_mem, share=SHARE)


def test_class_gpus() -> None:
    assert class_gpus(parse_demand(gpus(8, nvlink=True))) == 8
    assert class_gpus(parse_demand({"devices": {"requests": [{"name": "g", "exactly": {
        "deviceClassName": "c", "allocationMode": "All"}}]}})) == 0


def test_capped_unusable() -> None:
    assert capped_unusable(8, 0, 8, 95_000, 1 << 50, SHARE) == 8  # 96 CPU needed, 95 free
    assert capped_unusable(8, 0, 1, 30_000, 1 << 50, SHARE) == 6
    assert capped_unusable(8, 4, 4, 1 << 50, 1 << 50, SHARE) == 4  # devices decide
    assert capped_unusable(8, 0, 8, 0, 0, None) == 0  # no share: plain FGD


def test_node_without_cpu_for_the_pod_scores_zero_and_the_fitting_node_wins() -> None:
    st = state({"a": "dgx-h100", "b": "dgx-h100"})
    pod_demand = [parse_demand(gpus(8, nvlink=True))]
    mix = make_mix(DEFAULT_PRIOR, 20, {}, DRIVER)
    plain = dict(Scorer().score(cands(st, ["a", "b"]), pod_demand, mix))
    assert plain == {"a": 10, "b": 10}  # GPUs alone cannot tell them apart
    hosts = [fit(40_000, 2048 * GI, 96_000, 768 * GI), fit(224_000, 2048 * GI, 96_000, 768 * GI)]
    got = dict(Scorer().score(cands(st, ["a", "b"]), pod_demand, mix, hosts))
    assert got["a"] == 0 and got["b"] == 10


def test_cpu_starved_gpus_are_fragments_so_small_jobs_use_them_first() -> None:
    """Node a has 8 free GPUs but CPU for only two more DGX-shaped GPUs: its other GPUs are stranded for
    every class; a 1-GPU pod placed there strands nothing new, on b it breaks a whole free server."""
    st = state({"a": "dgx-h100", "b": "dgx-h100"})
    mix = make_mix(DEFAULT_PRIOR, 20, {}, DRIVER)
    one = [parse_demand(gpus(1))]
    hosts = [fit(24_000, 2048 * GI), fit(224_000, 2048 * GI)]
    got = dict(Scorer().score(cands(st, ["a", "b"]), one, mix, hosts))
    assert got["a"] > got["b"]
    sc = Scorer()
    view = st.node_view("a")
    assert view is not None
    classes = sc._classes(mix)
    f_starved = host_fragmentation(sc, view, frozenset(), classes, 24_000, 2048 * GI, [SHARE] * len(classes))
    f_roomy = host_fragmentation(sc, view, frozenset(), classes, 224_000, 2048 * GI, [SHARE] * len(classes))
    assert f_roomy == 0 and f_starved > 6  # 8-GPU class: all 8; 1-GPU class: 6 of 8


def test_memory_counts_like_cpu() -> None:
    st = state({"a": "dgx-h100", "b": "dgx-h100"})
    hold(st, "a", ["gpu-0", "gpu-1", "gpu-2", "gpu-3"])
    hold(st, "b", ["gpu-0", "gpu-1", "gpu-2", "gpu-3"])
    four = [parse_demand(gpus(4, nvlink=True))]
    only4 = Mix(classes=((parse_demand(gpus(4, nvlink=True)), 1.0),))
    # a has memory for one more 4-GPU job only (the pod itself), b for two: a pod landing on a leaves
    # no memory-stranded GPUs behind it; on b, a's 4 GPUs stay stranded and b's are used.
    hosts = [fit(1 << 40, 4 * 96 * GI, 48_000, 4 * 96 * GI), fit(1 << 40, 8 * 96 * GI, 48_000, 4 * 96 * GI)]
    got = dict(Scorer().score(cands(st, ["a", "b"]), four, only4, hosts))
    assert got == {"a": 10, "b": 10}  # both fill the last 4-slot: equal cost
    hosts = [fit(1 << 40, 3 * 96 * GI, 48_000, 3 * 96 * GI), fit(1 << 40, 8 * 96 * GI, 48_000, 3 * 96 * GI)]
    got = dict(Scorer().score(cands(st, ["a", "b"]), four, only4, hosts))
    assert got["a"] > got["b"]


def test_host_fits_reads_the_state_and_the_pods_share() -> None:
    st = state({"a": "dgx-h100"})
    st.replace("nodes", [{"metadata": {"name": "a"}, "status": {"allocatable": {"cpu": "224", "memory": "2Ti"}}}])
    st.set_pod({"metadata": {"name": "hog", "namespace": "ns"},
                "spec": {"nodeName": "a", "containers": [{"name": "c", "resources": {"requests": {"cpu": "200"}}}]},
                "status": {"phase": "Running"}})
    p = {"metadata": {"name": "p", "namespace": "ns"},
         "spec": {"containers": [{"name": "c", "resources": {"requests": {"cpu": "24", "memory": "192Gi"}}}]}}
    (h, missing) = host_fits(st, p, [parse_demand(gpus(2))], ["a", "nowhere"])
    assert missing is None and h is not None
    assert (h.cpu_free, h.pod_cpu, h.share) == (24_000, 24_000, Share(12_000, 96 * GI))
    assert h.fits()
