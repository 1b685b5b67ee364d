"""The per-state scorer (``placement.bystate``) gives exactly the per-node scorer's scores.

Property style with fixed seeds: random fleets (six GPU profiles, fabric labels, random allocatable, some
nodes without it), random updates between calls (claims allocated and released, CPU pods bound and
deleted, taint rules, nodes' allocatable changed, slices republished with a taint) and random pods (exactly
and firstAvailable requests, NVLink constraints, several requests and claims, allocationMode All, CEL
selectors, CPU/memory requests, gang members with a PodGroup and bound siblings). Each call goes to two
``Placement``s over the same state: ``by_state=True`` (the fast path) and ``by_state=False`` (the per-node
path, the scorer before issue 22); their answers must be equal, with CPU/memory-aware scoring on and off.
"""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest
from testkit.views import claim, device_classes, node_slices

from topodra import DEFAULT_DRIVER_NAME as DRIVER
from topodra.fleet.allocator import place
from topodra.fleet.demand import parse_demand, pod_tolerance
from topodra.fleet.domains import LEAF_GROUP, SCALABLE_UNIT
from topodra.fleet.fgd import DEFAULT_PRIOR
from topodra.fleet.nodestates import NodeStates
from topodra.fleet.shares import ObservedShares
from topodra.fleet.state import ClusterState
from topodra.kube import Kube
from topodra.placement.cache import Cache, apply_event
from topodra.placement.server import Placement
from topodra.reservations import HINT_EFFECT, HOLD_EFFECT, RESERVATION_TAINT_KEY, toleration
from topodra.simulate import fake_node, fake_node_status

Obj = dict[str, Any]
PROFILES = ("dgx-h100", "dgx-a100-80gb", "hgx-b200", "dgx-h200", "h100-nvl", "l40s")
CLASSES = ("gpu.topodra.io", "gpu-h100", "gpu-a100-80gb", "gpu-b200", "gpu-h200", "gpu-hopper-plus", "gpu-l40s")
NVLINK = f"{DRIVER}/nvlinkDomain"
NS = "ns"


def random_request(rng: random.Random, name: str) -> Obj:
    count = rng.choice((1, 1, 2, 4, 8))
    if rng.random() < 0.3:
        subs = rng.sample(CLASSES, rng.randint(2, 3))
        return {"name": name, "firstAvailable": [{"name": f"s{k}", "deviceClassName": c, "count": count}
                                                 for k, c in enumerate(subs)]}
    body: Obj = {"deviceClassName": rng.choice(CLASSES)}
    if rng.random() < 0.05:
        body["allocationMode"] = "All"
    else:
        body["count"] = count
    if rng.random() < 0.08:  # a CEL selector on attribute values: the per-node path in both
        body["selectors"] = [{"cel": {"expression": f'device.attributes["{DRIVER}"].index == {rng.randint(0, 7)}'}}]
    return {"name": name, "exactly": body}


def random_spec(rng: random.Random) -> Obj:
    requests = [random_request(rng, f"r{k}") for k in range(1 if rng.random() < 0.8 else 2)]
    devices: Obj = {"requests": requests}
    if rng.random() < 0.6:
        devices["constraints"] = [{"requests": [r["name"] for r in requests] if rng.random() < 0.7
                                   else [requests[0]["name"]], "matchAttribute": NVLINK}]
    return {"devices": devices}


def node_obj(rng: random.Random, name: str, labels: dict[str, str]) -> Obj:
    obj = fake_node(name, labels)
    if rng.random() < 0.85:  # the rest report no allocatable: GPU-only scoring there
        obj.update(fake_node_status(name, str(rng.choice((64, 128, 224))), f"{rng.choice((512, 1024, 2048))}Gi"))
    return obj


def cpu_pod(rng: random.Random, name: str, node: str, group: str = "") -> Obj:
    spec: Obj = {"nodeName": node, "containers": [{"name": "c", "resources": {"requests": {
        "cpu": str(rng.choice((1, 4, 16, 48))), "memory": f"{rng.choice((8, 64, 256))}Gi"}}}]}
    if group:
        spec["schedulingGroup"] = {"podGroupName": group}
    return {"metadata": {"name": name, "namespace": NS}, "spec": spec, "status": {"phase": "Running"}}


class Fleet:
    """A random fleet and its random updates (through the cache's event path, as the watch delivers them)."""

    def __init__(self, seed: int) -> None:
        self.rng = rng = random.Random(seed)
        n = rng.randint(6, 24)
        self.names = [f"n{i:02d}" for i in range(n)]
        self.profile = {name: rng.choice(PROFILES) for name in self.names}
        self.labels = {name: {LEAF_GROUP: f"leaf{i // 4}", SCALABLE_UNIT: f"su{i // 8}"}
                       for i, name in enumerate(self.names)}
        self.st = ClusterState(DRIVER, window=rng.choice((0, 10, 200)))
        self.st.replace("classes", device_classes())
        self.st.replace("nodes", [node_obj(rng, name, self.labels[name]) for name in self.names])
        self.st.replace("slices", [s for name in self.names for s in node_slices(name, self.profile[name])])
        self.seq = 0
        for _ in range(rng.randint(0, 3 * n)):
            self.allocate()

    def allocate(self) -> None:
        node = self.rng.choice(self.names)
        view = self.st.node_view(node)
        if view is None:
            return
        spec = random_spec(self.rng)
        if any("selectors" in (r.get("exactly") or {}) for r in spec["devices"]["requests"]):
            return
        used = self.st.unavailable_indices(view)
        after = place(view, used, [parse_demand(spec)])
        if after is None or after == used:
            return
        self.seq += 1
        self.event("claims", "ADDED", claim(f"c{self.seq}", spec, allocated=[view.devices[i].key
                                                                             for i in sorted(after - used)]))

    def event(self, kind: str, event_type: str, obj: Obj) -> None:
        apply_event(self.st, kind, event_type, obj)

    def update(self) -> None:
        rng, st = self.rng, self.st
        what = rng.random()
        if what < 0.35:
            self.allocate()
        elif what < 0.55 and st.claims:
            ns, name = rng.choice(sorted(st.claims))
            self.event("claims", "DELETED", {"metadata": {"namespace": ns, "name": name}})
        elif what < 0.7:
            self.seq += 1
            self.event("pods", "ADDED", cpu_pod(rng, f"cpu{self.seq}", rng.choice(self.names)))
        elif what < 0.78 and st.hosts.pods:
            ns, name = rng.choice(sorted(st.hosts.pods))
            self.event("pods", "DELETED", {"metadata": {"namespace": ns, "name": name}})
        elif what < 0.84:
            name = rng.choice(self.names)
            self.event("nodes", "MODIFIED", node_obj(rng, name, self.labels[name]))
        elif what < 0.9:
            node = rng.choice(self.names)
            rule = {"metadata": {"name": f"rule-{node}"}, "spec": {
                "deviceSelector": {"driver": DRIVER, "pool": node, "device": f"gpu-{rng.randint(0, 7)}"},
                "taint": {"key": "k", "effect": rng.choice(("NoSchedule", "NoExecute", "None"))}}}
            self.event("taintrules", "DELETED" if rng.random() < 0.3 else "ADDED", rule)
        else:  # the node republishes its slices with one device tainted (a new generation of the pool)
            node = rng.choice(self.names)
            slices = node_slices(node, self.profile[node])
            for s in slices:
                s["spec"]["pool"]["generation"] = 1 + self.seq
                if s["spec"]["devices"] and rng.random() < 0.5:
                    dev = rng.choice(s["spec"]["devices"])
                    dev["taints"] = [{"key": "gpu-health", "effect": "NoSchedule"}]
            self.seq += 1
            for s in slices:
                self.event("slices", "MODIFIED", s)

    def decorate(self, spec: Obj) -> None:
        """A pending claim's spec before it is added (``ReservedFleet`` adds tolerations)."""

    def pod(self, k: int) -> tuple[Obj, list[str]]:
        """A pod to score (its claims pending in the state) and the candidate names."""
        rng = self.rng
        refs = []
        for j in range(1 if rng.random() < 0.85 else 2):
            name = f"pending-{k}-{j}"
            claim_spec = random_spec(rng)
            self.decorate(claim_spec)
            self.event("claims", "ADDED", claim(name, claim_spec))
            refs.append({"name": f"c{j}", "resourceClaimName": name})
        spec: Obj = {"resourceClaims": refs if rng.random() < 0.97 else [], "containers": []}
        if rng.random() < 0.7:
            spec["containers"] = [{"name": "c", "resources": {"requests": {
                "cpu": str(rng.choice((1, 8, 24, 96))), "memory": f"{rng.choice((16, 128, 512))}Gi"}}}]
        if rng.random() < 0.25:
            group = f"job{rng.randint(0, 2)}"
            spec["schedulingGroup"] = {"podGroupName": group}
            self.event("podgroups", "ADDED", {"metadata": {"name": group, "namespace": NS}, "spec": {
                "schedulingPolicy": {"gang": {"minCount": rng.randint(2, 4)}}}})
            if rng.random() < 0.3:
                self.seq += 1
                self.event("pods", "ADDED", cpu_pod(rng, f"sib{self.seq}", rng.choice(self.names), group))
        names = rng.sample(self.names, rng.randint(1, len(self.names)))
        if rng.random() < 0.1:
            names.append("no-such-node")
        return {"metadata": {"name": f"pod{k}", "namespace": NS}, "spec": spec, "status": {}}, names


class ReservedFleet(Fleet):
    """The same, with reservation rules (held and hinted, two profiles' uids) coming and going, and pods whose
    claims tolerate one of them, every taint, or nothing (issue 33)."""

    UIDS = ("uid-one", "uid-two")

    def update(self) -> None:
        rng = self.rng
        if rng.random() < 0.3:
            node = rng.choice(self.names)
            uid = rng.choice(self.UIDS)
            effect = rng.choice((HOLD_EFFECT, HINT_EFFECT))
            rule = {"metadata": {"name": f"rsv-{node}"}, "spec": {"deviceSelector": {"driver": DRIVER, "pool": node},
                                                                  "taint": {"key": RESERVATION_TAINT_KEY,
                                                                            "value": uid, "effect": effect}}}
            self.event("taintrules", "DELETED" if rng.random() < 0.3 else "ADDED", rule)
        else:
            super().update()

    def decorate(self, spec: Obj) -> None:
        what = self.rng.random()
        tols = [toleration(self.rng.choice(self.UIDS))] if what < 0.5 else [{"operator": "Exists"}] if what < 0.6 \
            else []
        if tols:
            for r in spec["devices"]["requests"]:
                for body in [r["exactly"]] if "exactly" in r else r["firstAvailable"]:
                    body["tolerations"] = tols


def placements(st: ClusterState, host_aware: bool, per_class: bool = False) -> tuple[Placement, Placement]:
    cache = Cache(Kube.__new__(Kube), st)  # never started: fed directly
    return (Placement(cache, DEFAULT_PRIOR, 20, host_aware=host_aware, by_state=True, per_class=per_class),
            Placement(cache, DEFAULT_PRIOR, 20, host_aware=host_aware, by_state=False, per_class=per_class))


def bind_gpu_pods(fleet: Fleet) -> None:
    """Bound GPU pods of three sizes with different CPU and memory per GPU, so the state learns shares
    (``fleet.shares``): 1 GPU with 16 CPUs, 2 with 8 each, 8 with 12 each."""
    for j, (k, cpu, mem) in enumerate(((1, 16, 128), (2, 16, 64), (8, 96, 768))):
        name = f"bound-{j}"
        fleet.event("claims", "ADDED", claim(name, {"devices": {"requests": [
            {"name": "r", "exactly": {"deviceClassName": "gpu.topodra.io", "count": k}}]}}))
        fleet.event("pods", "ADDED", {
            "metadata": {"name": f"gpu-pod-{j}", "namespace": NS, "uid": f"uid-gpu-pod-{j}"},
            "spec": {"nodeName": fleet.names[j % len(fleet.names)], "resourceClaims": [
                {"name": "c", "resourceClaimName": name}], "containers": [
                {"name": "c", "resources": {"requests": {"cpu": str(cpu), "memory": f"{mem}Gi"}}}]},
            "status": {"phase": "Running"}})


@pytest.mark.parametrize("host_aware", [True, False])
@pytest.mark.parametrize("seed", range(12))
def test_same_scores_as_the_per_node_path(seed: int, host_aware: bool) -> None:
    fleet = Fleet(1000 * seed + host_aware)
    fast, ref = placements(fleet.st, host_aware)
    varied = 0
    for k in range(40):
        for _ in range(fleet.rng.randint(0, 3)):
            fleet.update()
        pod, names = fleet.pod(k)
        args = {"Pod": pod, "NodeNames": names}
        got = fast.prioritize(copy.deepcopy(args))
        want = ref.prioritize(copy.deepcopy(args))
        assert got == want, (seed, k, pod)
        assert fast.gangs.last == ref.gangs.last
        varied += len({h["Score"] for h in want}) > 2
        if fleet.rng.random() < 0.5:  # the pod binds elsewhere or goes: its claims leave the pending set
            for ref_ in pod["spec"]["resourceClaims"]:
                fleet.event("claims", "DELETED", {"metadata": {"namespace": NS, "name": ref_["resourceClaimName"]}})
    assert varied >= 5  # the comparison saw real rankings, not only all-equal or all-zero answers
    assert fast.states._count > 0  # and the fast path did the work


@pytest.mark.parametrize("seed", range(8))
def test_per_class_shares_same_scores_as_the_per_node_path(seed: int) -> None:
    """``--host-resources mix`` (issue 34): the per-node path, which pods with CEL selectors and gangs take,
    caps each class with its own learned share (or the node's allocatable per GPU) exactly as the per-state
    path does. Pods without claims are left out: only the per-state path scores them."""
    fleet = Fleet(4000 + seed)
    fleet.st.shares = ObservedShares(10)  # the fleet's random window may be 0 (nothing learned)
    bind_gpu_pods(fleet)
    assert [k for k, _s in fleet.st.shares.shares()] == [1, 2, 8]
    fast, ref = placements(fleet.st, True, per_class=True)
    varied = compared = 0
    for k in range(40):
        for _ in range(fleet.rng.randint(0, 3)):
            fleet.update()
        pod, names = fleet.pod(k)
        if pod["spec"]["resourceClaims"]:
            args = {"Pod": pod, "NodeNames": names}
            got = fast.prioritize(copy.deepcopy(args))
            want = ref.prioritize(copy.deepcopy(args))
            assert got == want, (seed, k, pod)
            compared += 1
            varied += len({h["Score"] for h in want}) > 2
        if fleet.rng.random() < 0.5:
            for ref_ in pod["spec"]["resourceClaims"]:
                fleet.event("claims", "DELETED", {"metadata": {"namespace": NS, "name": ref_["resourceClaimName"]}})
    assert compared >= 30 and varied >= 5


@pytest.mark.parametrize("seed", range(8))
def test_same_scores_with_reservations_and_tolerating_pods(seed: int) -> None:
    """Both paths agree with reservations present, and the long-lived fast path answers as a fresh one: nothing
    a tolerating pod saw is served to the next pod."""
    fleet = ReservedFleet(77 + seed)
    for _ in range(6):
        fleet.update()
    fast, ref = placements(fleet.st, seed % 2 == 0)
    varied = tolerant = 0
    for k in range(30):
        for _ in range(fleet.rng.randint(0, 3)):
            fleet.update()
        pod, names = fleet.pod(k)
        args = {"Pod": pod, "NodeNames": names}
        fresh = placements(fleet.st, seed % 2 == 0)[0]
        fresh.gangs.intents = dict(fast.gangs.intents)  # a gang's remembered domain is state by design
        got = fast.prioritize(copy.deepcopy(args))
        assert got == ref.prioritize(copy.deepcopy(args)), (seed, k, pod)
        assert got == fresh.prioritize(copy.deepcopy(args)), (seed, k, pod)
        varied += len({h["Score"] for h in got}) > 2
        with fast.cache.lock:
            tolerant += bool(fleet.st.tolerated_unavailable(pod_tolerance(fleet.st.pod_demands(pod))))
        if fleet.rng.random() < 0.5:
            for ref_ in pod["spec"]["resourceClaims"]:
                fleet.event("claims", "DELETED", {"metadata": {"namespace": NS, "name": ref_["resourceClaimName"]}})
    assert varied >= 3 and tolerant >= 3  # real rankings, and pods that did meet their own unavailable sets


def test_a_relist_and_a_class_change_rebuild_the_state_table() -> None:
    fleet = Fleet(7)
    fast, ref = placements(fleet.st, True)
    pod, names = fleet.pod(0)
    assert fast.prioritize({"Pod": pod, "NodeNames": names}) == ref.prioritize({"Pod": pod, "NodeNames": names})
    epoch = fast.states.states.epoch
    held = list(fleet.st.claims)
    fleet.st.replace("claims", [claim(n, {"devices": {"requests": []}}) for _ns, n in held[: len(held) // 2]])
    fleet.st.replace("classes", device_classes())
    pod, names = fleet.pod(1)
    assert fast.prioritize({"Pod": pod, "NodeNames": names}) == ref.prioritize({"Pod": pod, "NodeNames": names})
    assert fast.states.states.epoch > epoch


@pytest.mark.parametrize("seed", range(6))
def test_the_state_table_follows_the_journal(seed: int) -> None:
    """After random updates the incrementally kept table says what a fresh one says, node by node."""
    fleet = Fleet(50 + seed)
    kept = NodeStates(fleet.st)
    kept.sync()
    for _ in range(60):
        fleet.update()
        if fleet.rng.random() < 0.3:
            kept.sync()
    kept.sync()
    fresh = NodeStates(fleet.st)
    fresh.sync()

    def content(t: NodeStates) -> dict[str, tuple[int, frozenset[int], tuple[int, int] | None]]:
        return {n: (t.states[s].view.shape, t.states[s].used, t.states[s].room) for n, s in t.of.items()}

    assert content(kept) == content(fresh)
    assert set(kept.of) == set(fleet.st.nodes_with_devices())


def test_journal_reports_the_nodes_an_update_touched() -> None:
    st = ClusterState(DRIVER)
    st.replace("classes", device_classes())
    st.replace("slices", node_slices("a", "dgx-h100") + node_slices("b", "dgx-h100"))
    mark = st.changes
    assert st.changed_since(mark) == []
    view = st.node_view("a")
    assert view is not None
    st.set_claim(claim("x", {"devices": {"requests": []}}, allocated=[view.devices[0].key]))
    assert st.changed_since(mark) == ["a"]
    st.set_pod(cpu_pod(random.Random(1), "p", "b"))
    assert st.changed_since(mark) == ["a", "b"]
    st.set_class(device_classes()[0])
    assert st.changed_since(mark) is None  # every node's view changed
