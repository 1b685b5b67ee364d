"""ClaimProfile in Kueue mode -> what Kueue can admit, as pure functions.

Kueue counts plain resources, so a Kueue-mode profile is asked for with the generic DRA-backed
extended resource (``gpu.topodra.io/gpu: N``, see deviceclasses.py) instead of a claim.  The model
choice moves from ``firstAvailable`` to Kueue's ResourceFlavors: one flavor per GPU model, selecting
nodes by the ``topodra.io/gpu-model`` label; the ClusterQueue lists the flavors in preference order and
Kueue's flavor fungibility falls back (H200 quota used -> H100) at admission.  Kueue injects the chosen
flavor's node labels into the pods, so the scheduler allocates that model's GPUs.

What such a request cannot say is reported, never dropped silently:

* ``nvlink: Required`` holds by itself where all GPUs of a node share one NVLink domain (SXM boards on
  NVSwitch, GB200 trays) and the count fits; on NVLink-pair boards (``-NVL-``) only up to 2 GPUs; on
  boards without NVLink only 1.  Models where it cannot hold are left out of the profile's flavors.
* ``numa: Required`` and ``nic: RailAligned`` need claim constraints: not available for N > 1.
* Preferred placements cannot be expressed at all (the scheduler picks any free GPUs of the node).
* Alternatives with different counts cannot share one request.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from topodra import DEFAULT_DRIVER_NAME
from topodra.controller.profile import ClaimProfile
from topodra.nodelabels import GPU_MODEL, label_value

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
FLAVOR_LABEL = "topodra.io/flavor-of"
MAX_NODE_GPUS = 8  # an NVSwitch node's NVLink domain (HGX/DGX); GB200 trays hold 4


def nvlink_domain_size(model: str) -> int:
    """GPUs per NVLink domain on a node with this model (from the normalized model name)."""
    if "-SXM" in model or model.startswith("GB"):
        return MAX_NODE_GPUS
    if "-NVL-" in model:
        return 2
    return 1


def flavor_name(model: str) -> str:
    """ResourceFlavor name of a model: ``H200-SXM5-141GB`` -> ``gpu-h200-sxm5-141gb``."""
    slug = re.sub(r"[^a-z0-9]+", "-", model.lower()).strip("-")
    return f"gpu-{slug}"[:63].rstrip("-")


def resource_flavor(model: str) -> dict[str, Any]:
    """The ResourceFlavor for one GPU model: nodes whose topodra.io/gpu-model label is the model."""
    return {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor",
            "metadata": {"name": flavor_name(model), "labels": {FLAVOR_LABEL: "gpu-model"}},
            "spec": {"nodeLabels": {GPU_MODEL: label_value(model)}}}


def gpu_resource(driver: str = DEFAULT_DRIVER_NAME) -> str:
    """The generic class's extended resource (deviceclasses.extended_resource_name of the generic class)."""
    return f"{driver}/gpu"


@dataclass(frozen=True)
class KueuePlan:
    """A Kueue-mode profile, rendered: what its pods request and where Kueue may put them."""

    local_queue: str
    resource: str
    count: int
    models: tuple[str, ...]  # in the profile's preference order
    unsupported: tuple[str, ...]  # what this mode cannot honour, one sentence each

    @property
    def flavors(self) -> tuple[str, ...]:
        return tuple(flavor_name(m) for m in self.models)

    def pod_template(self, template: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """``template`` (a pod template) with the queue label, the request and the model restriction.

        Requests go on the first container (requests == limits, as extended resources require);
        required node affinity keeps Kueue off flavors of other models (Kueue skips a flavor whose
        node labels the pod's affinity excludes).
        """
        import copy

        out: dict[str, Any] = copy.deepcopy(dict(template or {}))
        meta = out.setdefault("metadata", {})
        meta.setdefault("labels", {})[QUEUE_LABEL] = self.local_queue
        spec = out.setdefault("spec", {})
        containers = spec.setdefault("containers", [])
        if not containers:
            raise ValueError("pod template has no container to put the GPU request on")
        res = containers[0].setdefault("resources", {})
        for key in ("requests", "limits"):
            res.setdefault(key, {})[self.resource] = str(self.count)
        term = {"matchExpressions": [{"key": GPU_MODEL, "operator": "In",
                                      "values": [label_value(m) for m in self.models]}]}
        node_aff = spec.setdefault("affinity", {}).setdefault("nodeAffinity", {})
        req = node_aff.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {"nodeSelectorTerms": []})
        terms = req.setdefault("nodeSelectorTerms", [])
        if terms:  # terms are ORed: add the restriction to each
            for t in terms:
                t.setdefault("matchExpressions", []).extend(term["matchExpressions"])
        else:
            terms.append(term)
        return out

    def to_status(self) -> dict[str, Any]:
        return {"mode": "Kueue", "localQueue": self.local_queue, "resourceName": self.resource,
                "count": self.count, "flavors": list(self.flavors), "models": list(self.models),
                "unsupported": list(self.unsupported)}


class KueueUnsupported(ValueError):
    """No part of the profile can be admitted through Kueue; the message says why."""


def plan(profile: ClaimProfile, class_models: Mapping[str, tuple[str, ...]],
         driver: str = DEFAULT_DRIVER_NAME) -> KueuePlan:
    """Render a Kueue-mode profile.  ``class_models``: the GPU models each DeviceClass selects.

    Raises ``KueueUnsupported`` when nothing is left; otherwise the plan lists, in
    ``unsupported``, every wish it could not carry and every model it left out because of one.
    """
    spec = profile.spec
    if spec.queueing != "Kueue" or not spec.local_queue:
        raise KueueUnsupported("spec.queueing is not Kueue (or spec.localQueue is missing)")
    topo = spec.topology
    notes: list[str] = []
    counts = sorted({a.count for a in spec.alternatives})
    if len(counts) > 1:
        raise KueueUnsupported(f"alternatives ask for different counts {counts}: a pod requests one number of "
                               f"{gpu_resource(driver)}; use one count, or plain mode (firstAvailable)")
    count = counts[0]
    if topo.nic == "RailAligned":
        raise KueueUnsupported("nic RailAligned pairs each GPU with a NIC by claim constraints; an extended-"
                               "resource request has none: use plain mode")
    if topo.numa == "Required" and count > 1:
        raise KueueUnsupported(f"numa Required for {count} GPUs needs a claim constraint; an extended-resource "
                               "request has none: use plain mode, or numa Preferred/None")
    for dim in ("nvlink", "numa"):
        if getattr(topo, dim) == "Preferred" and count > 1:
            notes.append(f"{dim} Preferred is not honoured in Kueue mode (the scheduler takes any free GPUs "
                         "of the node)")
    models: list[str] = []
    for alt in spec.alternatives:
        known = class_models.get(alt.device_class_name)
        if not known:
            notes.append(f"alternative {alt.effective_name}: class {alt.device_class_name} does not name GPU "
                         "models (Kueue mode needs model classes or the generic class); left out")
            continue
        for m in known:
            if m in models:
                continue
            if topo.nvlink == "Required" and count > nvlink_domain_size(m):
                notes.append(f"nvlink Required for {count} GPUs cannot hold on {m} (NVLink domains of "
                             f"{nvlink_domain_size(m)} GPU(s)); flavor {flavor_name(m)} left out")
                continue
            models.append(m)
    if not models:
        raise KueueUnsupported("no GPU model of the alternatives can satisfy the profile in Kueue mode: "
                               + "; ".join(notes))
    return KueuePlan(spec.local_queue, gpu_resource(driver), count, tuple(models), tuple(notes))


def catalog_class_models() -> dict[str, tuple[str, ...]]:
    """Models per catalog class: the generic class selects every model; model classes their family."""
    from topodra.classcatalog import GENERIC_CLASS, MODEL_FAMILIES

    everything = tuple(m for ms in MODEL_FAMILIES.values() for m in ms)
    return {GENERIC_CLASS: everything, **MODEL_FAMILIES}


def cluster_queue(name: str, models: list[str], quotas: Mapping[str, int], *, cohort: str | None = None,
                  borrowing_limits: Mapping[str, int] | None = None, resource: str = gpu_resource(),
                  preemption: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A ClusterQueue with one flavor per model, in the order given (Kueue tries them in this order).

    ``quotas``: nominal GPUs per model; models without quota get 0 (borrowing still possible).
    """
    flavors = []
    for m in models:
        q: dict[str, Any] = {"name": resource, "nominalQuota": str(quotas.get(m, 0))}
        if borrowing_limits is not None and m in borrowing_limits:
            q["borrowingLimit"] = str(borrowing_limits[m])
        flavors.append({"name": flavor_name(m), "resources": [q]})
    spec: dict[str, Any] = {
        "namespaceSelector": {},
        "resourceGroups": [{"coveredResources": [resource], "flavors": flavors}],
        # Try every flavor for quota before preempting or borrowing in the first one.
        "flavorFungibility": {"whenCanBorrow": "TryNextFlavor", "whenCanPreempt": "TryNextFlavor"},
    }
    if cohort:
        spec["cohortName"] = cohort
    if preemption:
        spec["preemption"] = dict(preemption)
    return {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": name},
            "spec": spec}


def class_models_from(classes: list[dict[str, Any]]) -> dict[str, tuple[str, ...]]:
    """Models per DeviceClass: the catalog, plus cluster classes whose ``topodra.io/match`` names models.

    A class that also filters on memory or compute capability is left out: a model flavor would
    admit nodes whose GPUs the class does not select.
    """
    from pydantic import ValidationError

    from topodra.selectors import MATCH_ANNOTATION, DeviceMatch

    out = catalog_class_models()
    for obj in classes:
        meta = obj.get("metadata") or {}
        ann = (meta.get("annotations") or {}).get(MATCH_ANNOTATION)
        if not ann or meta.get("name") in out:
            continue
        try:
            match = DeviceMatch.from_annotation(ann)
        except (ValidationError, ValueError):
            continue
        if match.type == "gpu" and match.models and not match.min_memory and not match.min_compute_capability:
            out[meta["name"]] = tuple(match.models)
    return out


def queueing_status(profile: ClaimProfile, class_models: Mapping[str, tuple[str, ...]],
                    driver: str = DEFAULT_DRIVER_NAME) -> tuple[dict[str, Any], bool, str]:
    """(``status.queueing``, admissible, message) for a Kueue-mode profile."""
    try:
        p = plan(profile, class_models, driver)
    except KueueUnsupported as e:
        return {"mode": "Kueue", "localQueue": profile.spec.local_queue or "", "message": str(e)}, False, str(e)
    msg = (f"pods request {p.resource}: {p.count} and label {QUEUE_LABEL}: {p.local_queue}; "
           f"flavors {', '.join(p.flavors)}")
    if p.unsupported:
        msg += f"; not honoured: {'; '.join(p.unsupported)}"
    return {**p.to_status(), "message": msg}, True, msg
