"""Issue 34 (``--host-resources mix``): pods without GPU claims are scored by the GPUs their CPU and memory
strand, and each request class is judged with the CPU and memory per GPU the cluster's pods of its size ask
for (``fleet.shares``), so breaking a whole free server costs what it should."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from testkit.scripted import ScriptedKube
from testkit.views import claim, gpus, hold, state

from topodra.fleet.fgd import DEFAULT_PRIOR
from topodra.fleet.hostres import Share
from topodra.fleet.shares import CPU_STEP, ObservedShares, rounded, share_for, stranded_by_shares
from topodra.fleet.state import ClusterState
from topodra.placement.cache import Cache
from topodra.placement.server import Placement
from topodra.simulate import fake_node, fake_node_status

REPO = Path(__file__).resolve().parents[3]
GI = 1 << 30
Obj = dict[str, Any]


def trace_state(gpu_nodes: dict[str, str], cpu_nodes: tuple[str, ...] = (), window: int = 200) -> ClusterState:
    """Nodes with the trace's server allocatable (96 CPUs, 384Gi), plus nodes without GPUs."""
    st = state(gpu_nodes, window=window)
    st.replace("nodes", [{**fake_node(n), **fake_node_status(n, "96", "384Gi")} for n in (*gpu_nodes, *cpu_nodes)])
    return st


def bound(name: str, node: str, cpu: str, memory: str, claim_name: str | None = None) -> Obj:
    spec: Obj = {"nodeName": node, "containers": [{"name": "c", "resources": {
        "requests": {"cpu": cpu, "memory": memory}}}]}
    if claim_name:
        spec["resourceClaims"] = [{"name": "gpus", "resourceClaimName": claim_name}]
    return {"metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}"}, "spec": spec,
            "status": {"phase": "Running"}}


def pending(cpu: str, memory: str, claim_name: str | None = None) -> Obj:
    pod = bound("p", "", cpu, memory, claim_name)
    del pod["spec"]["nodeName"]
    return pod


def scores(p: Placement, pod: Obj, names: list[str]) -> dict[str, int]:
    return {h["Host"]: h["Score"] for h in p.prioritize({"Pod": pod, "NodeNames": names})}


def placements(st: ClusterState, prior: dict[int, float] = DEFAULT_PRIOR) -> tuple[Placement, Placement]:
    cache = Cache(ScriptedKube({}), st)
    return (Placement(cache, prior, 20, per_class=True), Placement(cache, prior, 20))


def test_cpu_only_pod_goes_where_it_strands_no_gpu() -> None:
    """a: 8 free GPUs; full: every GPU allocated; cpu: no GPUs. A 32-CPU pod strands GPUs only on a."""
    st = trace_state({"a": "dgx-h100", "full": "dgx-h100"}, ("cpu",))
    hold(st, "full", [f"gpu-{i}" for i in range(8)])
    mix, dr = placements(st)
    pod = pending("32", "64Gi")
    got = scores(mix, pod, ["a", "full", "cpu"])
    assert got["cpu"] == 10 and got["a"] == 1 and got["full"] > got["a"], got
    assert set(scores(dr, pod, ["a", "full", "cpu"]).values()) == {0}  # (d'): no opinion, as before
    # Where the pod cannot fit by CPU in the scorer's view it scores 0 (the scheduler's filter decides).
    assert scores(mix, pending("97", "1Gi"), ["a", "cpu"]) == {"a": 0, "cpu": 0}


def test_cpu_only_pod_prefers_gpus_already_stranded_by_cpu() -> None:
    """b's free GPUs have no CPU left for any GPU pod: a CPU-only pod there strands nothing new."""
    st = trace_state({"a": "dgx-h100", "b": "dgx-h100"})
    hold(st, "b", ["gpu-0", "gpu-1", "gpu-2", "gpu-3"], name="b4")
    st.set_claim(claim("one", gpus(1)))
    st.set_pod(bound("hog", "b", "80", "100Gi"))  # 6 CPUs left: less than one GPU pod needs
    st.set_pod(bound("g1", "b", "10", "40Gi", "one"))  # teaches the 1-GPU share: 10 CPUs, 40Gi per GPU
    mix, _dr = placements(st)
    got = scores(mix, pending("4", "8Gi"), ["a", "b"])
    assert got == {"a": 1, "b": 10}, got


def test_cpu_heavy_one_gpu_pod_keeps_a_whole_server_whole() -> None:
    """The (d') flaw of issue 34: judged with a 24-CPU-per-GPU pod's own share, an 8-GPU class fits no
    96-CPU server, so breaking the empty one costs the same as filling a started one, and only the best-fit
    tie-break separates them. With the share 8-GPU pods really ask for (10 CPUs per GPU, learned from a bound
    one) breaking the empty server costs its 8-GPU slot, and a started server wins by a wide margin."""
    st = trace_state({"empty": "dgx-h100", "half": "dgx-h100", "seven": "dgx-h100", "big": "dgx-h100"})
    for i in range(4):
        hold(st, "half", [f"gpu-{i}"], name=f"half{i}")
    hold(st, "seven", ["gpu-0"], name="seven0")
    st.set_pod(bound("h4", "half", "48", "96Gi"))
    st.set_pod(bound("s1", "seven", "12", "48Gi"))
    st.set_claim(claim("eight", gpus(8, nvlink=True), allocated=[("big", f"gpu-{i}") for i in range(8)]))
    st.set_pod(bound("g8", "big", "80", "320Gi", "eight"))
    assert st.shares.shares() == ((8, Share(10_000, 40 * GI)),)
    st.set_claim(claim("heavy", gpus(1)))
    mix, dr = placements(st, {1: 0.8, 8: 0.2})  # the trace's mix: 1-GPU and whole-server jobs
    pod = pending("24", "48Gi", "heavy")
    names = ["empty", "half", "seven"]
    got = scores(mix, pod, names)
    assert got["empty"] == 1 and got["half"] == 10 and got["seven"] >= 9, got
    old = scores(dr, pod, names)
    assert old["seven"] <= 3, old  # (d'): equal fragments, the best fit alone ranks them


def test_observed_shares_window_and_rounding() -> None:
    obs = ObservedShares(window=2)
    assert obs.add("u1", 1, 9_100, 40 * GI) and not obs.add("u1", 1, 1, 1) and not obs.add("u0", 0, 1, 1)
    assert obs.shares() == ((1, Share(9_000, 40 * GI)),)
    obs.add("u2", 8, 80_000, 320 * GI)
    obs.add("u3", 1, 20_000, 40 * GI)  # u1 leaves the window
    assert obs.shares() == ((1, Share(20_000, 40 * GI)), (8, Share(10_000, 40 * GI)))
    assert rounded(CPU_STEP * 1.4, 0) == Share(CPU_STEP, 0)
    own = Share(24_000, 48 * GI)
    assert share_for(1, 1, own, obs.shares()) == own  # the pod's own size: its own share
    assert share_for(8, 1, own, obs.shares()) == Share(10_000, 40 * GI)
    fair = Share(12_000, 48 * GI)  # a 96-CPU, 384Gi server's allocatable per GPU
    assert share_for(4, 1, own, obs.shares(), fair) == fair  # size not seen: what the server was built for
    assert share_for(8, 1, own, (), None) == own  # nothing learned, allocatable unknown: (d')'s rule
    assert share_for(8, 0, None, (), None) is None  # ... and for a pod without GPUs: GPUs only
    with pytest.raises(ValueError):
        ObservedShares(window=-1)


def test_shares_learn_from_bound_gpu_pods_only_once() -> None:
    st = trace_state({"a": "dgx-h100"})
    st.set_claim(claim("two", gpus(2)))
    st.set_pod(pending("20", "80Gi", "two"))  # not bound yet: not counted
    assert st.shares.shares() == ()
    st.set_pod(bound("p", "a", "20", "80Gi", "two"))
    st.set_pod(bound("p", "a", "20", "80Gi", "two"))
    st.set_pod(bound("cpu", "a", "30", "1Gi"))  # no claims: not a GPU pod
    st.set_pod(bound("lost", "a", "30", "1Gi", "unknown-claim"))  # claim not seen: not counted
    assert st.shares.shares() == ((2, Share(10_000, 40 * GI)),) and len(st.shares) == 1


def test_a_relist_learns_the_shares_of_bound_gpu_pods() -> None:
    """The first list (and every relist) counts bound GPU pods as their watch events would, newest kept: the
    scorer starting on a busy cluster, and the inventory's one-shot read, judge with the learned shares."""
    st = trace_state({"a": "dgx-h100"}, window=2)
    st.replace("claims", [claim("one", gpus(1)), claim("two", gpus(2))])
    old, new, newer = bound("old", "a", "30", "8Gi", "one"), bound("new", "a", "20", "80Gi", "two"), \
        bound("newer", "a", "4", "8Gi", "one")
    for pod, t in ((old, "01"), (new, "02"), (newer, "03")):
        pod["metadata"]["creationTimestamp"] = f"2026-12-{t}T00:00:00Z"
    done = {**bound("done", "a", "90", "8Gi", "one"), "status": {"phase": "Succeeded"}}
    st.replace("pods", [newer, done, pending("50", "1Gi", "one"), new, old])  # listed in any order
    assert st.shares.shares() == ((1, Share(4_000, 8 * GI)), (2, Share(10_000, 40 * GI)))


def test_stranded_by_shares_judges_each_size_with_its_own_share() -> None:
    """The inventory's count (``clusterview.hostcols``): free GPUs no pod size the cluster runs can use."""
    fair = Share(12_000, 48 * GI)  # a 96-CPU, 384Gi server per GPU
    assert stranded_by_shares(8, 30_000, 384 * GI, (), fair) == (6, 0)  # nothing learned: the server's share
    assert stranded_by_shares(8, 30_000, 384 * GI, (), None) == (0, 0)  # nor that: GPUs only
    shares = ((1, Share(4_000, 16 * GI)), (8, Share(12_000, 48 * GI)))
    assert stranded_by_shares(8, 30_000, 384 * GI, shares, fair) == (1, 0)  # seven 4-CPU 1-GPU pods fit
    assert stranded_by_shares(8, 96_000, 384 * GI, shares, fair) == (0, 0)  # the whole server an 8-GPU pod takes
    assert stranded_by_shares(8, 96_000, 40 * GI, shares, fair) == (0, 6)  # two 16Gi 1-GPU pods
    only_big = ((8, Share(12_000, 48 * GI)),)
    assert stranded_by_shares(8, 90_000, 384 * GI, only_big, fair) == (8, 0)  # one CPU short of the 8-GPU pod
    assert stranded_by_shares(5, 0, 0, only_big, fair) == (5, 5)  # no size fits 5 GPUs: the server's share


@pytest.mark.parametrize("path", ["deploy/placement/scheduler-config.yaml", "deploy/placement/second-scheduler.yaml"])
def test_shipped_extender_is_asked_about_every_pod(path: str) -> None:
    """kube-scheduler asks an extender about a pod only when the pod requests one of its ``managedResources``,
    and about every pod when it lists none (k8s.io/kubernetes@v1.37.2 pkg/scheduler/extender.go:429-440,
    ``IsInterested``; schedule_one.go:996 skips prioritize otherwise). Pods without GPU claims are scored
    only if the shipped configuration lists none; it never filters and is ignorable."""
    docs = [d for d in yaml.safe_load_all((REPO / path).read_text()) if d]
    configs = [d for d in docs if d.get("kind") == "KubeSchedulerConfiguration"]
    configs += [yaml.safe_load(v) for d in docs if d.get("kind") == "ConfigMap"
                for v in (d.get("data") or {}).values()]
    extenders = [e for c in configs for e in c.get("extenders") or []]
    assert extenders, path
    for e in extenders:
        assert not e.get("managedResources") and not e.get("filterVerb"), e
        assert e["ignorable"] is True and e["nodeCacheCapable"] is True and e["prioritizeVerb"] == "prioritize"


def test_shipped_scorer_scores_pods_without_claims() -> None:
    """The shipped Deployment runs the rule above (``--host-resources mix``); its args parse with the CLI's."""
    import argparse

    from topodra.placement.main import configure

    docs = [d for d in yaml.safe_load_all((REPO / "deploy/placement/deployment.yaml").read_text()) if d]
    dep = next(d for d in docs if d["kind"] == "Deployment")
    container = dep["spec"]["template"]["spec"]["containers"][0]
    parser = argparse.ArgumentParser()
    configure(parser)
    assert parser.parse_args(container["args"]).host_resources == "mix"


def test_grouped_caps_equal_the_per_class_caps() -> None:
    """``capped_by_plan`` (what the per-state scorer runs) is ``capped_by_class`` with the host limits grouped."""
    import random

    from topodra.fleet.hostfrag import capped_by_class, capped_by_plan, share_plan

    rng = random.Random(34)
    pool = [None, Share(9_000, 40 * GI), Share(10_000, 40 * GI), Share(24_000, 48 * GI), Share(0, 8 * GI)]
    for _ in range(500):
        n = rng.randint(1, 8)
        ks = [rng.choice((0, 1, 2, 4, 8)) for _ in range(n)]
        shares = [rng.choice(pool) for _ in range(n)]
        free = rng.randint(0, 8)
        unusable = [rng.randint(0, free) for _ in range(n)]
        cpu, mem = rng.randint(-4_000, 100_000), rng.randint(0, 400) * GI
        assert capped_by_plan(free, unusable, cpu, mem, share_plan(ks, shares)) == \
            capped_by_class(free, unusable, ks, cpu, mem, shares)
