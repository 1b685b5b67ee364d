"""Issue 33: a 4 x 8-GPU gang starves behind a steady flow of 1- and 2-GPU pods without a reservation, and
starts within a bound with one; the real kube-scheduler (gang plugin, DRA device taints) and the real controller.

Five simulated 8-GPU nodes in one leaf group. Small pods (2 GPUs, every 4th 1 GPU) fill all 40 GPUs and leave a
backlog of pending ones of both sizes; the test "completes" small pods by deleting the oldest running one, one at a
time, and tops the backlog up after each, so it never empties (a steady flow).

* Without a reservation (``reservation.enabled: false``): after each completion the freed GPUs are taken by
  backlog pods (the positive signal, counted), so no 4 nodes are ever free at once and the gang stays unbound.
* With one (``afterWaiting: 3s``): the controller reserves the 4 nodes with the fewest pods to wait for
  (NoSchedule DeviceTaintRules naming the profile's uid, which only the gang's claims tolerate). Completions
  drain those nodes while the backlog runs on the 5th; the gang binds within the bound, no small claim allocated
  while the rules held is on a reserved node, and once the gang is bound no rule is left.
* A profile deleted while its reservation holds leaves no rule behind, also when it is deleted while the
  controller is down (the restarted controller's first pass collects the rules).
* Backfill: with a hold whose expected start is known, a backfill pod whose runtime bound fits the window lands
  on a held device; a pod without backfill, and a backfill pod whose bound is longer than the window, do not.
"""

from __future__ import annotations

import functools
import time
from datetime import UTC, datetime
from itertools import count
from typing import Any

import pytest
from test_gang_cluster import LEAF, gang_cluster, job_pods, labels  # noqa: F401 - gang_cluster is a fixture
from test_scheduling_topology import Scenario
from testkit.controllerproc import controller_process
from testkit.handle import ClusterHandle, wait_for
from testkit.paths import REPO

from topodra import reservations as vocab
from topodra.apipaths import claim_path, device_taint_rule_path, profile_path, template_path
from topodra.controller.gang import podgroup_path
from topodra.kube import KubeError

pytestmark = pytest.mark.cluster

Obj = dict[str, Any]
LOG_DIR = REPO / ".run" / "reservation-test-logs"
NODES = 5
BACKLOG = 6  # pending small pods kept waiting, half of each size
STARVED_COMPLETIONS = 22  # phase one: completions after which the gang must still be unbound (~38 GPUs freed)
BOUND_S = 90.0


class Flow:
    """The small pods: created in order, completed (deleted) oldest running first; a backlog of pending pods
    of both sizes is kept (``refill``), so freed GPUs always have a taker."""

    def __init__(self, sc: Scenario) -> None:
        self.sc = sc
        self.names: list[str] = []
        self.gpus: dict[str, int] = {}
        self.seq = count()
        for n in (1, 2):
            sc.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                       "metadata": {"name": f"small-{n}"}, "spec": {"spec": {"devices": {"requests": [
                           {"name": "gpus", "exactly": {"deviceClassName": "gpu.topodra.io", "count": n}}]}}}})

    def add(self, n: int) -> str:
        name = f"small-{next(self.seq)}"
        self.sc.pod(name, f"small-{n}", self.sc.nodes())
        self.names.append(name)
        self.gpus[name] = n
        return name

    def pods(self) -> dict[str, Obj]:
        return {p["metadata"]["name"]: p for p in self.sc.kube.list(f"/api/v1/namespaces/{self.sc.ns}/pods")
                if p["metadata"]["name"] in self.gpus}

    def bound(self) -> list[str]:
        pods = self.pods()
        return [n for n in self.names if n in pods and pods[n]["spec"].get("nodeName")]

    def pending(self) -> list[str]:
        pods = self.pods()
        return [n for n in self.names if n in pods and not pods[n]["spec"].get("nodeName")]

    def refill(self) -> None:
        """At least ``BACKLOG // 2`` pending pods of each size."""
        pending = self.pending()
        for n in (1, 2):
            for _ in range(BACKLOG // 2 - sum(1 for p in pending if self.gpus[p] == n)):
                self.add(n)

    def complete_oldest(self) -> tuple[str, str, int]:
        """Delete the oldest bound small pod and wait until its claim is gone; (pod, node, GPUs freed)."""
        name = self.bound()[0]
        node = str(self.sc.get_pod(name)["spec"]["nodeName"])
        self.sc.release(name)
        self.names.remove(name)
        return name, node, self.gpus[name]


def allocations(sc: Scenario) -> dict[str, tuple[str, list[str]]]:
    """Allocated claims of the namespace: claim name -> (owning pod, pools of its devices)."""
    out = {}
    for c in sc.kube.list(claim_path(sc.ns)):
        alloc = (c.get("status") or {}).get("allocation")
        if not alloc:
            continue
        owner = next((r["name"] for r in c["metadata"].get("ownerReferences") or [] if r.get("kind") == "Pod"), "")
        out[c["metadata"]["name"]] = (owner, [r["pool"] for r in alloc["devices"]["results"]])
    return out


def full(sc: Scenario, node: str) -> bool:
    """Every GPU of ``node`` is allocated."""
    return sum(pools.count(node) for _o, pools in allocations(sc).values()) == 8


def our_rules(sc: Scenario) -> list[Obj]:
    return [r for r in sc.kube.list(device_taint_rule_path(), label_selector=f"{vocab.MANAGED_LABEL}="
                                                                           f"{vocab.MANAGED_VALUE}")
            if (r["metadata"].get("labels") or {}).get(vocab.PROFILE_NS_LABEL) == sc.ns]


def hold_rules(sc: Scenario) -> list[Obj]:
    """Our reservation rules (not the backfill windows that come with each held node)."""
    return [r for r in our_rules(sc) if r["spec"]["taint"]["key"] == vocab.RESERVATION_TAINT_KEY]


def window_rules(sc: Scenario) -> dict[str, str]:
    """node -> its backfill window value."""
    return {r["spec"]["deviceSelector"]["pool"]: r["spec"]["taint"]["value"] for r in our_rules(sc)
            if r["spec"]["taint"]["key"] == vocab.BACKFILL_WINDOW_KEY}


def gang_profile(sc: Scenario, name: str, reservation: Obj) -> str:
    """The 4 x 8-GPU profile; waits for its template and PodGroup; returns its uid."""
    made = sc.kube.create(profile_path(sc.ns), {
        "apiVersion": "topodra.io/v1alpha1", "kind": "ClaimProfile", "metadata": {"name": name},
        "spec": {"alternatives": [{"deviceClassName": "gpu-h100", "count": 8}], "pods": 4,
                 "acrossNodes": {"sameDomain": ["leafGroup"]}, "reservation": reservation}})
    wait_for(lambda: sc.kube.get(template_path(sc.ns, name)) and sc.kube.get(podgroup_path(sc.ns, name)), 60,
             f"the controller to render {name}'s template and PodGroup")
    return str(made["metadata"]["uid"])


def unbound(sc: Scenario, pods: list[str]) -> list[str]:
    return [p for p in pods if not sc.get_pod(p)["spec"].get("nodeName")]


def test_reservation_lets_a_starving_gang_start(gang_cluster: ClusterHandle) -> None:  # noqa: F811
    sc = Scenario(gang_cluster, [("n", "dgx-h100", NODES)], prefix="rsv", labels=labels(n=("l1", "su1")))
    try:
        with controller_process(sc.cluster.kubeconfig, sc.ns, "rsv", LOG_DIR / f"{sc.ns}.log"):
            flow = Flow(sc)
            # Fill the 40 GPUs (mostly 2-GPU pods, every 4th a 1-GPU pod), then keep a backlog.
            i = 0
            while sum(flow.gpus[n] for n in flow.names) < NODES * 8:
                sc.wait_allocated(flow.add(1 if i % 4 == 0 else 2))
                i += 1
            flow.refill()
            assert len(flow.pending()) == BACKLOG

            # --- without a reservation: the freed GPUs go to the backlog, the gang starves.
            uid_off = gang_profile(sc, "starved", {"enabled": False})
            tmpl = sc.kube.get(template_path(sc.ns, "starved")) or {}
            assert "tolerations" not in tmpl["spec"]["spec"]["devices"]["requests"][0]["exactly"]
            starved = job_pods(sc, "starved", sc.nodes())
            retaken = 0
            for _ in range(STARVED_COMPLETIONS):
                _pod, node, freed = flow.complete_oldest()
                flow.refill()
                wait_for(functools.partial(full, sc, node), 60,
                         f"backlog pods to take the {freed} GPU(s) freed on {node}")
                retaken += freed
            # More GPUs than the gang needs were freed, and small pods took every one of them.
            assert retaken >= 4 * 8, retaken
            assert unbound(sc, starved) == starved, "the gang bound without a reservation"
            assert our_rules(sc) == [] and uid_off
            for p in starved:
                sc.kube.request("DELETE", f"/api/v1/namespaces/{sc.ns}/pods/{p}",
                                {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0})

            # --- with a reservation: the allocations are stable (nothing completes) until the rules exist.
            before = allocations(sc)
            uid = gang_profile(sc, "big", {"afterWaiting": "3s", "maxHold": "10m"})
            tmpl = sc.kube.get(template_path(sc.ns, "big")) or {}
            assert tmpl["spec"]["spec"]["devices"]["requests"][0]["exactly"]["tolerations"] == [
                vocab.toleration(uid), vocab.window_toleration()]
            gang = job_pods(sc, "big", sc.nodes())
            start = time.monotonic()

            def held() -> list[Obj] | None:
                rules = hold_rules(sc)
                return rules if len(rules) == 4 and all(r["spec"]["taint"]["effect"] == "NoSchedule"
                                                        for r in rules) else None
            rules: list[Obj] = wait_for(held, 60, "the controller to reserve 4 nodes for the waiting gang")
            reserved = sorted(r["spec"]["deviceSelector"]["pool"] for r in rules)
            for r in rules:
                taint = r["spec"]["taint"]
                assert (taint["key"], taint["value"], taint["effect"]) == (vocab.RESERVATION_TAINT_KEY, uid,
                                                                           "NoSchedule"), taint
                assert r["metadata"]["labels"][vocab.UID_LABEL] == uid
            uids = {r["metadata"]["uid"] for r in rules}  # the same rules must hold until the gang binds
            # The 4 nodes with the fewest pods to wait for.
            pods_on = {n: sum(1 for o, pools in before.values() if n in pools and o.startswith("small-"))
                       for n in sc.nodes()}
            assert sorted(pods_on[n] for n in reserved) == sorted(pods_on.values())[:4], (pods_on, reserved)
            def reservation_status() -> Obj | None:
                got = (((sc.kube.get(profile_path(sc.ns, "big")) or {}).get("status") or {}).get("reservation")
                       or {})
                return got if got.get("state") == "Held" else None  # written right after the rules, same pass
            status: Obj = wait_for(reservation_status, 30, "status.reservation Held")
            assert (status["state"], status["domain"], status["nodes"]) == ("Held", "l1", reserved), status
            assert "expectedStart" not in status  # the small pods declare no activeDeadlineSeconds
            assert status["backfillWindow"] == vocab.CLOSED and set(window_rules(sc).values()) == {vocab.CLOSED}
            assert unbound(sc, gang) == gang
            # Completions, oldest first, until no small pod is left on the reserved nodes: at most the small pods
            # that existed when the rules came (later ones can run only on the 5th node, and are newer).
            seen = dict(before)
            completions = 0
            budget = len(flow.names)

            def on_reserved() -> list[str]:
                pods = flow.pods()
                return [n for n in flow.bound() if pods[n]["spec"]["nodeName"] in reserved]
            while on_reserved():
                assert completions < budget, f"small pods still on the reserved nodes after {completions} completions"
                seen.update(allocations(sc))
                current = {r["metadata"]["uid"] for r in hold_rules(sc)}
                assert current == uids, "the reservation's rules changed while it held"
                flow.complete_oldest()
                flow.refill()
                completions += 1
            # The reserved nodes are empty while the backlog still waits: only the gang may take them.
            wait_for(lambda: not unbound(sc, gang), 60, "the gang to bind on the drained, reserved nodes")
            print(f"\nwithout a reservation: {STARVED_COMPLETIONS} completions, {retaken} GPUs freed, all retaken by "
                  f"small pods; with one: bound after {completions} completions (at most {budget}), "
                  f"{time.monotonic() - start:.1f} s after its pods were created")
            assert time.monotonic() - start < BOUND_S
            bound_nodes = sorted(str(sc.get_pod(p)["spec"]["nodeName"]) for p in gang)
            assert bound_nodes == reserved
            seen.update(allocations(sc))
            late = {c: pools for c, (owner, pools) in seen.items()
                    if c not in before and owner.startswith("small-") and set(pools) & set(reserved)}
            assert late == {}, f"small claims allocated on reserved devices while the rules held: {late}"
            assert len(flow.pending()) >= 1  # the flow kept a backlog all along (it ran on the 5th node)
            # Bound: the controller releases every rule and clears the status.
            wait_for(lambda: our_rules(sc) == [], 30, "the rules to be released once the gang is bound")
            wait_for(lambda: ((sc.kube.get(profile_path(sc.ns, "big")) or {}).get("status") or {})
                     .get("reservation") is None, 30, "status.reservation cleared")

            # --- a job deleted while it holds a reservation leaves no rule behind.
            uid_gone = gang_profile(sc, "gone", {"afterWaiting": "0s"})
            job_pods(sc, "gone", sc.nodes())
            wait_for(lambda: len([r for r in our_rules(sc) if r["spec"]["taint"]["value"] == uid_gone
                                  and r["spec"]["taint"]["effect"] == "NoSchedule"]) == 4, 60,
                     "a reservation for the next gang")
            sc.kube.delete(profile_path(sc.ns, "gone"))
            wait_for(lambda: our_rules(sc) == [], 30, "the deleted profile's rules to be gone")

            # --- the same while the controller is down: its first pass after the restart collects the rules.
            uid_down = gang_profile(sc, "down", {"afterWaiting": "0s"})
            job_pods(sc, "down", sc.nodes())
            wait_for(lambda: len([r for r in our_rules(sc) if r["spec"]["taint"]["value"] == uid_down
                                  and r["spec"]["taint"]["effect"] == "NoSchedule"]) == 4, 60,
                     "a reservation for the gang of the profile deleted while the controller is down")
        # The controller has exited (controller_process waited for it): nothing of ours can delete a rule now.
        sc.kube.delete(profile_path(sc.ns, "down"))
        wait_for(lambda: sc.kube.get(profile_path(sc.ns, "down")) is None, 30, "the profile deleted")
        assert len(hold_rules(sc)) == 4, "the rules outlived the controller (no finalizer, nothing else owns them)"
        with controller_process(sc.cluster.kubeconfig, sc.ns, "rsv2", LOG_DIR / f"{sc.ns}-restart.log"):
            # 120 s: the controller's start (imports, informers, the lease) took 30 s on a loaded 2-core machine.
            wait_for(lambda: our_rules(sc) == [], 120, "the restarted controller to collect the gone profile's rules")
    finally:
        sc.close()


def deadline_pod(deadline: int, template: str) -> Obj:
    """A pod using ``template`` as claim ``gpus`` that declares ``activeDeadlineSeconds``."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {},
            "spec": {"restartPolicy": "Never", "activeDeadlineSeconds": deadline,
                     "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": template}],
                     "containers": [{"name": "main", "image": "localhost/busybox:1.35", "imagePullPolicy": "Never",
                                     "command": ["true"], "resources": {"claims": [{"name": "gpus"}]}}]}}


def backfill_profile(sc: Scenario, name: str, max_runtime: str) -> None:
    sc.kube.create(profile_path(sc.ns), {
        "apiVersion": "topodra.io/v1alpha1", "kind": "ClaimProfile", "metadata": {"name": name},
        "spec": {"alternatives": [{"deviceClassName": "gpu-h100", "count": 1}],
                 "backfill": {"maxRuntime": max_runtime}}})
    wait_for(lambda: sc.kube.get(template_path(sc.ns, name)), 60, f"the controller to render {name}'s template")


def test_backfill_takes_held_devices_only_where_its_bound_fits_the_window(gang_cluster: ClusterHandle) -> None:  # noqa: F811
    """A hold whose expected start is known (the pod it waits for declares a 3 h deadline) opens a 2h window on
    its nodes: a backfill pod bounded by 1h lands on a held device; a pod without backfill and a backfill pod
    bounded by 4h do not (the scheduler reports them Unschedulable, and again after a retry)."""
    sc = Scenario(gang_cluster, [("n", "dgx-h100", NODES)], prefix="bf", labels=labels(n=("l1", "su1")))
    try:
        with controller_process(sc.cluster.kubeconfig, sc.ns, "bf", LOG_DIR / f"{sc.ns}.log"):
            sc.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                       "metadata": {"name": "block-8"}, "spec": {"spec": {"devices": {"requests": [
                           {"name": "gpus", "exactly": {"deviceClassName": "gpu.topodra.io", "count": 8}}]}}}})
            sc.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                       "metadata": {"name": "plain-1"}, "spec": {"spec": {"devices": {"requests": [
                           {"name": "gpus", "exactly": {"deviceClassName": "gpu.topodra.io", "count": 1}}]}}}})
            nodes = sc.nodes()
            # Two nodes full, each with one 8-GPU pod that "started" now and declares 3 h: the gang (4 x 8) must
            # wait for one of them, so its expected start is known. No kubelet runs on simulated nodes: the
            # test writes the pod's status.startTime as the kubelet would.
            for i, node in enumerate(nodes[:2]):
                sc.pod(f"block-{i}", "block-8", [node], base=deadline_pod(3 * 3600, "block-8"))
                sc.wait_allocated(f"block-{i}")
                sc.kube.merge_patch(f"/api/v1/namespaces/{sc.ns}/pods/block-{i}/status",
                                    {"status": {"startTime": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}})
            gang_profile(sc, "big", {"afterWaiting": "0s"})
            gang = job_pods(sc, "big", nodes)

            def windows() -> dict[str, str] | None:
                held = sorted(r["spec"]["deviceSelector"]["pool"] for r in hold_rules(sc)
                              if r["spec"]["taint"]["effect"] == "NoSchedule")
                got = window_rules(sc)
                return got if len(held) == 4 and sorted(got) == held else None
            win: dict[str, str] = wait_for(windows, 60, "a hold with its backfill windows")
            # 3 h to the expected start, less the margin (the controller's refresh interval and facts TTL): 2h.
            assert set(win.values()) == {"2h"}, win
            reserved = sorted(win)
            free_held = [n for n in reserved if n not in nodes[:2]]
            assert len(free_held) == 3 and unbound(sc, gang) == gang
            status = ((sc.kube.get(profile_path(sc.ns, "big")) or {}).get("status") or {}).get("reservation") or {}
            assert status.get("backfillWindow") == "2h" and "expectedStart" in status, status
            for node in free_held:  # the scheduler's own view has the holds (an untolerated 1-GPU probe fails)
                sc.wait_scheduler_sees_taints(node, 0)

            backfill_profile(sc, "bf-1h", "1h")
            backfill_profile(sc, "bf-4h", "4h")
            # Nothing but held nodes has a free GPU: a pod without backfill has nowhere to go...
            sc.pod("plain", "plain-1", nodes, base=deadline_pod(600, "plain-1"))
            sc.wait_unschedulable("plain")
            # ... a backfill pod bounded by 4h does not fit the 2h window ...
            sc.pod("long", "bf-4h", nodes, base=deadline_pod(4 * 3600, "bf-4h"))
            sc.wait_unschedulable("long")
            # ... and one bounded by 1h lands on a held device.
            sc.pod("short", "bf-1h", nodes, base=deadline_pod(3600, "bf-1h"))
            node, results = sc.wait_allocated("short")
            assert node in free_held and {r["pool"] for r in results} == {node}
            claim = sc.claim_of("short") or {}
            assert claim["spec"]["devices"]["requests"][0]["exactly"]["tolerations"] == \
                vocab.backfill_tolerations(3600)
            # The two others are still refused after the scheduler tried them again (that allocation was an event).
            for name in ("plain", "long"):
                sc.wait_unschedulable(name)
            assert unbound(sc, gang) == gang
    finally:
        sc.close()


@pytest.mark.parametrize(("spec", "needle"), [
    ({"alternatives": [{"deviceClassName": "gpu-h100", "count": 4}], "reservation": {}},
     "reservation needs pods (a multi-node job) or count 8 (a whole server) in every alternative"),
    ({"alternatives": [{"deviceClassName": "gpu-h100", "count": 8}], "reservation": {"afterWaiting": "15 min"}},
     "a duration in seconds (0 to 604800) or like 15m, 2h, 1h30m, 90s"),
    ({"alternatives": [{"deviceClassName": "gpu-h100", "count": 8}], "reservation": {"maxHold": 700000}},
     "a duration in seconds (0 to 604800)"),
])
def test_crd_refuses_bad_reservations(gang_cluster: ClusterHandle, spec: Obj, needle: str) -> None:  # noqa: F811
    ns = gang_cluster.namespace("rsvbad")
    with pytest.raises(KubeError) as err:
        gang_cluster.kube.create(profile_path(ns), {"apiVersion": "topodra.io/v1alpha1", "kind": "ClaimProfile",
                                                    "metadata": {"name": "bad"}, "spec": spec})
    assert err.value.status == 422
    assert needle in err.value.message, err.value.message


def test_crd_takes_a_reservation_in_seconds_or_as_a_duration(gang_cluster: ClusterHandle) -> None:  # noqa: F811
    ns = gang_cluster.namespace("rsvok")
    made = gang_cluster.kube.create(profile_path(ns), {
        "apiVersion": "topodra.io/v1alpha1", "kind": "ClaimProfile", "metadata": {"name": "whole"},
        "spec": {"alternatives": [{"deviceClassName": "gpu-h100", "count": 8}],
                 "reservation": {"afterWaiting": 900, "maxHold": "1h30m"}}})
    assert made["spec"]["reservation"] == {"afterWaiting": 900, "maxHold": "1h30m"}
