"""ClaimProfile -> ResourceClaimTemplate, as a pure function.

Shape of the result (see docs/user-guide.md for the reasoning):

* One request ``gpus``.  A single alternative without Preferred placement
  becomes ``exactly`` (Kueue admits that); otherwise ``firstAvailable`` with one
  subrequest per (alternative, topology variant), in preference order.
* ``Required`` placement -> a ``matchAttribute`` constraint on ``gpus`` (it
  applies to whichever subrequest the scheduler picks).
* ``Preferred`` placement -> each alternative appears twice (or four times for
  two Preferred dimensions): first constrained, then unconstrained; the
  constraint lists the constrained subrequests as ``gpus/<sub>``.  The API
  allows 8 subrequests; larger expansions are rejected.
* An alternative's ``capacity`` (``{memory: 10Gi}``) -> ``capacity.requests`` on its (sub)request, so "a
  1g.10gb slice, else 10Gi of a shared GPU" is two alternatives: ``gpu-mig-1g`` and ``gpu-shared-memory``.
* ``nic: RailAligned`` -> ``matchAttribute`` on the rail can only say "all
  these devices share one rail", so each GPU gets its own request ``gpu-<i>``
  paired with ``nic-<i>`` and one rail constraint per pair; with several GPUs a
  ``model`` constraint keeps them one model.
* ``alignCpus`` -> CPU requests for dra-driver-cpu and one NUMA ``matchAttribute`` per group of GPUs
  (controller/cpualign.py, which says why groups).
* ``reservation`` (on, and reservations on cluster-wide) -> every request and subrequest tolerates this
  profile's own reservation taint (``reservations.toleration(uid)``), from the start: claims are made from the
  template when a pod is created and are immutable, so the toleration must be there before any DeviceTaintRule
  (controller/reserve.py) holds devices for the job; while none does, it changes nothing. They also tolerate
  any backfill window (``reservations.window_toleration``): the held nodes carry one.
* ``backfill`` (and reservations on cluster-wide) -> every request and subrequest tolerates every held
  reservation, but only where the backfill window is a bucket >= ``maxRuntime``
  (``reservations.backfill_tolerations``); the kubelet plugin refuses to prepare such a claim for a pod without
  ``activeDeadlineSeconds`` <= ``maxRuntime`` (plugin/backfill.py).

The template carries a hash of its spec so the controller can tell when the
(immutable) template must be replaced.
"""

from __future__ import annotations

import hashlib
import json
from itertools import combinations
from typing import Any

from topodra import DEFAULT_DRIVER_NAME, reservations
from topodra.controller import cpualign
from topodra.controller.cpualign import DEFAULT_CPU, CpuOptions
from topodra.controller.profile import (
    API_VERSION,
    KIND,
    MAX_ALTERNATIVES,
    Alternative,
    ClaimProfile,
    ProfileError,
)

REQUEST = "gpus"
HASH_ANNOTATION = "topodra.io/spec-hash"
PROFILE_LABEL = "topodra.io/profile"
MANAGED_BY = ("app.kubernetes.io/managed-by", "topodra-controller")
NUMA_ATTRIBUTE = "resource.kubernetes.io/numaNode"
MAX_SUBREQUESTS = MAX_ALTERNATIVES  # DeviceRequest.firstAvailable: at most 8
DEFAULT_NIC_CLASS = "nic.topodra.io"


def attribute_for(dimension: str, driver: str) -> str:
    """The fully qualified attribute a placement dimension matches on."""
    if dimension == "nvlink":
        return f"{driver}/nvlinkDomain"
    if dimension == "numa":
        return NUMA_ATTRIBUTE
    raise ValueError(f"unknown placement dimension {dimension!r}")


def _variants(preferred: list[str]) -> list[tuple[str, ...]]:
    """All subsets of the Preferred dimensions, most constrained first, stable order."""
    out: list[tuple[str, ...]] = []
    for k in range(len(preferred), -1, -1):
        out.extend(combinations(preferred, k))
    return out


def _sub_name(alt: Alternative, variant: tuple[str, ...]) -> str:
    return "-".join([alt.effective_name, *variant])


def _subrequest(alt: Alternative, name: str, count: int) -> dict[str, Any]:
    return {"name": name, **_exact(alt, count)}


def _exact(alt: Alternative, count: int) -> dict[str, Any]:
    """``count`` devices of the alternative's class, each giving the capacity it asks for (KEP-5075)."""
    out: dict[str, Any] = {"deviceClassName": alt.device_class_name, "allocationMode": "ExactCount", "count": count}
    if alt.capacity:
        out["capacity"] = {"requests": dict(alt.capacity)}
    return out


def _gpu_request(profile: ClaimProfile, driver: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    spec = profile.spec
    topo = spec.topology
    required = [d for d in ("nvlink", "numa") if getattr(topo, d) == "Required"]
    preferred = [d for d in ("nvlink", "numa") if getattr(topo, d) == "Preferred"]
    constraints = [{"requests": [REQUEST], "matchAttribute": attribute_for(d, driver)} for d in required]

    if len(spec.alternatives) == 1 and not preferred:
        alt = spec.alternatives[0]
        return {"name": REQUEST, "exactly": _exact(alt, alt.count)}, constraints

    variants = _variants(preferred)
    pairs: list[tuple[Alternative, tuple[str, ...]]]
    if topo.order == "TopologyFirst":
        pairs = [(a, v) for v in variants for a in spec.alternatives]
    else:
        pairs = [(a, v) for a in spec.alternatives for v in variants]
    if len(pairs) > MAX_SUBREQUESTS:
        raise ProfileError(
            f"profile expands to {len(pairs)} subrequests ({len(spec.alternatives)} alternatives x "
            f"{len(variants)} placement variants for Preferred {'+'.join(preferred)}); a request allows "
            f"{MAX_SUBREQUESTS}: drop alternatives or make a Preferred placement Required or None")
    subs = [_subrequest(a, _sub_name(a, v), a.count) for a, v in pairs]
    for d in preferred:
        refs = [f"{REQUEST}/{_sub_name(a, v)}" for a, v in pairs if d in v]
        constraints.append({"requests": refs, "matchAttribute": attribute_for(d, driver)})
    return {"name": REQUEST, "firstAvailable": subs}, constraints


def _rail_requests(profile: ClaimProfile, driver: str, nic_class: str) -> tuple[list[dict[str, Any]],
                                                                               list[dict[str, Any]]]:
    spec = profile.spec
    n = spec.alternatives[0].count  # validated: equal in every alternative
    requests: list[dict[str, Any]] = []
    constraints: list[dict[str, Any]] = []
    gpu_names = [f"gpu-{i}" for i in range(n)]
    for i, gname in enumerate(gpu_names):
        if len(spec.alternatives) == 1:
            alt = spec.alternatives[0]
            requests.append({"name": gname, "exactly": _exact(alt, 1)})
        else:
            subs = [_subrequest(a, a.effective_name, 1) for a in spec.alternatives]
            requests.append({"name": gname, "firstAvailable": subs})
        requests.append({"name": f"nic-{i}", "exactly": {"deviceClassName": nic_class,
                                                         "allocationMode": "ExactCount", "count": 1}})
        constraints.append({"requests": [gname, f"nic-{i}"], "matchAttribute": f"{driver}/rail"})
    if n > 1:
        constraints.append({"requests": list(gpu_names), "matchAttribute": f"{driver}/model"})
        for d in ("nvlink", "numa"):
            if getattr(spec.topology, d) == "Required":
                constraints.append({"requests": list(gpu_names), "matchAttribute": attribute_for(d, driver)})
    return requests, constraints


def reserves(profile: ClaimProfile, reservations_on: bool = True) -> bool:
    """Whether the profile's claims tolerate its reservation: its ``reservation`` is on, and so is the cluster's."""
    r = profile.spec.reservation
    return reservations_on and r is not None and r.enabled


def tolerating(requests: list[dict[str, Any]], tols: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each request (``exactly``) and each ``firstAvailable`` subrequest with ``tols`` as its tolerations."""
    out: list[dict[str, Any]] = []
    for req in requests:
        req = dict(req)
        if "exactly" in req:
            req["exactly"] = {**req["exactly"], "tolerations": [dict(t) for t in tols]}
        if "firstAvailable" in req:
            req["firstAvailable"] = [{**sub, "tolerations": [dict(t) for t in tols]} for sub in req["firstAvailable"]]
        out.append(req)
    return out


def with_tolerations(requests: list[dict[str, Any]], uid: str) -> list[dict[str, Any]]:
    """Each request and subrequest tolerating the profile's reservation and any backfill window on its nodes."""
    if not uid:
        raise ProfileError("reservation needs the profile's metadata.uid (its taint value)")
    return tolerating(requests, [reservations.toleration(uid), reservations.window_toleration()])


def with_backfill(requests: list[dict[str, Any]], max_runtime_s: float) -> list[dict[str, Any]]:
    """Each request and subrequest of a backfill profile: held devices whose window is >= its runtime bound."""
    return tolerating(requests, reservations.backfill_tolerations(max_runtime_s))


def claim_spec(profile: ClaimProfile, *, driver: str = DEFAULT_DRIVER_NAME,
               nic_class: str = DEFAULT_NIC_CLASS, cpu: CpuOptions | None = DEFAULT_CPU,
               reservations_on: bool = True) -> dict[str, Any]:
    """The ResourceClaimSpec (``{"devices": ...}``) for a profile; ``cpu`` None renders alignCpus without CPUs."""
    if profile.spec.topology.nic == "RailAligned":
        requests, constraints = _rail_requests(profile, driver, nic_class)
    else:
        request, constraints = _gpu_request(profile, driver)
        requests = [request]
    requests, constraints = cpualign.apply(profile, requests, constraints, driver, cpu)
    if reserves(profile, reservations_on):
        requests = with_tolerations(requests, profile.metadata.uid)
    elif profile.spec.backfill is not None and reservations_on:
        requests = with_backfill(requests, profile.spec.backfill.max_runtime_s)
    devices: dict[str, Any] = {"requests": requests}
    if constraints:
        devices["constraints"] = constraints
    return {"devices": devices}


def spec_hash(spec: dict[str, Any]) -> str:
    """Stable digest of a template spec (canonical JSON)."""
    canon = json.dumps(spec, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()[:20]


def render_template(profile: ClaimProfile, *, driver: str = DEFAULT_DRIVER_NAME,
                    nic_class: str = DEFAULT_NIC_CLASS, cpu: CpuOptions | None = DEFAULT_CPU,
                    reservations_on: bool = True) -> dict[str, Any]:
    """The ResourceClaimTemplate for a profile: same name and namespace, owned by it.

    ``reservations_on``: the controller's ``--reservations``; off, no profile's claims tolerate a reservation."""
    meta = profile.metadata
    template_spec = {
        "metadata": {"labels": {PROFILE_LABEL: meta.name}},
        "spec": claim_spec(profile, driver=driver, nic_class=nic_class, cpu=cpu, reservations_on=reservations_on),
    }
    owner = {"apiVersion": API_VERSION, "kind": KIND, "name": meta.name, "uid": meta.uid,
             "controller": True, "blockOwnerDeletion": False}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {
            "name": meta.name,
            "namespace": meta.namespace,
            "labels": {PROFILE_LABEL: meta.name, MANAGED_BY[0]: MANAGED_BY[1]},
            "annotations": {HASH_ANNOTATION: spec_hash(template_spec)},
            "ownerReferences": [owner],
        },
        "spec": template_spec,
    }


def device_class_names(profile: ClaimProfile, nic_class: str = DEFAULT_NIC_CLASS) -> list[str]:
    """Every DeviceClass the rendered template references (to check they exist)."""
    names = [a.device_class_name for a in profile.spec.alternatives]
    if profile.spec.topology.nic == "RailAligned":
        names.append(nic_class)
    return list(dict.fromkeys(names))
