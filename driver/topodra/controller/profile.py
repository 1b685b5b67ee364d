"""The ClaimProfile API (``topodra.io/v1alpha1``) as pydantic models.

A ClaimProfile names prioritized hardware alternatives plus topology wishes;
the controller renders it into a ResourceClaimTemplate of the same name.  The
CRD's OpenAPI schema and CEL rules reject most bad input at the API server;
these models repeat the checks (the controller must not trust that the CRD in
the cluster is current) and add the cross-field ones the schema cannot express.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError, model_validator

from topodra.apipaths import PROFILE_GROUP as GROUP
from topodra.apipaths import PROFILE_VERSION as VERSION
from topodra.controller.gangspec import MAX_PODS, AcrossNodes
from topodra.reservations import WINDOW_LADDER
from topodra.selectors import parse_quantity


def positive_quantity(field: str, value: str) -> None:
    """``value`` is a Kubernetes quantity above zero, else a ValueError that names ``field``."""
    try:
        amount = parse_quantity(value)
    except ValueError as e:
        raise ValueError(f"{field}: {e}") from None
    if amount <= 0:
        raise ValueError(f"{field}: {value!r} must be positive")

API_VERSION = f"{GROUP}/{VERSION}"
KIND = "ClaimProfile"

MAX_ALTERNATIVES = 8
MAX_REQUESTS = 32  # DeviceClaim.requests and .constraints: at most 32 each
MAX_CPUS_PER_GPU = 512
MAX_COUNT = 32  # AllocationResultsMaxSize: a claim holds at most 32 devices
ALT_NAME_MAX = 40  # leaves room for the "-nvlink-numa" suffix inside a 63-char DNS label
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")

Placement = Literal["Required", "Preferred", "None"]


class ProfileError(ValueError):
    """The profile cannot be turned into a template; the message is shown to the user."""


class Alternative(BaseModel):
    """One acceptable way to satisfy the claim: ``count`` devices of ``deviceClassName``."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    name: str | None = Field(default=None, max_length=ALT_NAME_MAX)
    device_class_name: str = Field(alias="deviceClassName", min_length=1, max_length=253)
    count: int = Field(default=1, ge=1, le=MAX_COUNT)
    # Consumable capacity each device must give (KEP-5075), e.g. {"memory": "10Gi"} of a shared GPU.
    capacity: dict[str, str] | None = Field(default=None, max_length=4)

    @model_validator(mode="after")
    def _names(self) -> Alternative:
        for key, value in (self.capacity or {}).items():
            if not DNS_LABEL.match(key):
                raise ValueError(f"capacity name {key!r} must be a DNS label (e.g. memory)")
            positive_quantity(f"capacity {key}", value)
        if self.name is not None and not DNS_LABEL.match(self.name):
            raise ValueError(f"name {self.name!r} must be a DNS label (lowercase letters, digits, '-')")
        if not DNS_SUBDOMAIN.match(self.device_class_name):
            raise ValueError(f"deviceClassName {self.device_class_name!r} is not a valid DeviceClass name")
        return self

    @property
    def effective_name(self) -> str:
        """The explicit name, else one derived from the class (``gpu-h200`` -> ``h200``)."""
        if self.name:
            return self.name
        base = self.device_class_name
        base = base.removeprefix("gpu-")
        slug = re.sub(r"[^a-z0-9]+", "-", base).strip("-")
        return slug[:ALT_NAME_MAX].rstrip("-") or "gpu"


class Topology(BaseModel):
    """Placement wishes applied to whichever alternative is chosen."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    nvlink: Placement = "None"
    numa: Placement = "None"
    nic: Literal["RailAligned", "None"] = "None"
    order: Literal["AlternativesFirst", "TopologyFirst"] = "AlternativesFirst"


class AlignCpus(BaseModel):
    """CPUs from dra-driver-cpu (grouped mode) on the NUMA nodes of the claim's GPUs (controller/cpualign.py).

    ``gpusPerNumaNode`` exists because one ``matchAttribute`` holds one value for every device it covers: 8 GPUs
    of a DGX sit on two NUMA nodes, so they are asked for as two groups of 4, each with its own CPUs.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    cpus_per_gpu: int = Field(alias="cpusPerGpu", ge=1, le=MAX_CPUS_PER_GPU)
    gpus_per_numa_node: int | None = Field(default=None, alias="gpusPerNumaNode", ge=1, le=MAX_COUNT)


class PodRequests(BaseModel):
    """What each pod of the profile asks of its node besides the claim: its ``resources.requests`` as the
    scheduler sums them (containers, init containers, overhead). The controller renders no pods, so this is
    only what it counts in ``nodesFit``: a node whose free CPU or memory cannot hold the pod does not fit."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cpu: str | None = None
    memory: str | None = None

    @model_validator(mode="after")
    def _quantities(self) -> PodRequests:
        for key, value in (("cpu", self.cpu), ("memory", self.memory)):
            if value is None:
                continue
            positive_quantity(f"podRequests.{key}", value)
        return self


# Reservations (issue 33): a whole server is 8 GPUs; a duration is seconds or Go-style "15m", "1h30m", "90s".
WHOLE_SERVER_GPUS = 8
MAX_RESERVATION_S = 7 * 24 * 3600
_DURATION = re.compile(r"^(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?$")


def parse_duration(value: int | str, field: str) -> int:
    """Seconds from an integer or a Go-style duration of hours, minutes and seconds (``1h30m``, ``90s``)."""
    if isinstance(value, bool):
        raise ValueError(f"{field}: {value!r} is not a duration")
    if isinstance(value, int):
        seconds = value
    else:
        text = str(value).strip()
        m = _DURATION.match(text)
        if not text or m is None or not any(m.groups()):
            if text.isdigit():
                return parse_duration(int(text), field)
            raise ValueError(f"{field}: {value!r} is not a duration (seconds, or e.g. 15m, 2h, 1h30m, 90s)")
        h, mi, se = (int(g or 0) for g in m.groups())
        seconds = h * 3600 + mi * 60 + se
    if seconds < 0 or seconds > MAX_RESERVATION_S:
        raise ValueError(f"{field}: {value!r} must be between 0s and 7 days")
    return seconds


class Reservation(BaseModel):
    """When a waiting job of this profile may hold devices for itself (controller/reservation.py).

    Unset times take the controller's cluster-wide defaults (``--reservation-after``, ``--reservation-max-hold``).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    enabled: bool = True
    after_waiting: StrictInt | StrictStr | None = Field(default=None, alias="afterWaiting")
    max_hold: StrictInt | StrictStr | None = Field(default=None, alias="maxHold")
    # Where ``acrossNodes.sameDomain`` lists levels narrower than the one the gang got: hold a narrower domain
    # only if it starts at most this much later than the gang's own level would (controller/reservation.py).
    narrower_within: StrictInt | StrictStr | None = Field(default=None, alias="narrowerWithin")

    @model_validator(mode="after")
    def _durations(self) -> Reservation:
        if self.narrower_within is not None:
            parse_duration(self.narrower_within, "reservation.narrowerWithin")
        if self.after_waiting is not None:
            parse_duration(self.after_waiting, "reservation.afterWaiting")
        if self.max_hold is not None and parse_duration(self.max_hold, "reservation.maxHold") == 0:
            raise ValueError("reservation.maxHold must be above 0s")
        return self

    @property
    def after_waiting_s(self) -> int | None:
        return None if self.after_waiting is None else parse_duration(self.after_waiting, "afterWaiting")

    @property
    def max_hold_s(self) -> int | None:
        return None if self.max_hold is None else parse_duration(self.max_hold, "maxHold")

    @property
    def narrower_within_s(self) -> int | None:
        return None if self.narrower_within is None else parse_duration(self.narrower_within, "narrowerWithin")


class Backfill(BaseModel):
    """This profile's claims may use devices held for another job, where they cannot delay it (issue 33).

    ``maxRuntime`` is the runtime bound its pods declare as ``activeDeadlineSeconds`` (the kubelet plugin refuses
    to prepare a backfill claim for a pod without such a deadline); the template tolerates every reservation,
    but only where the backfill window is at least this bound (``reservations.backfill_tolerations``)."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    max_runtime: StrictInt | StrictStr = Field(alias="maxRuntime")

    @model_validator(mode="after")
    def _bound(self) -> Backfill:
        secs = parse_duration(self.max_runtime, "backfill.maxRuntime")
        if secs <= 0 or secs > WINDOW_LADDER[-1][1]:
            raise ValueError(f"backfill.maxRuntime must be above 0s and at most {WINDOW_LADDER[-1][0]} "
                             f"(the largest backfill window), got {self.max_runtime}")
        return self

    @property
    def max_runtime_s(self) -> int:
        return parse_duration(self.max_runtime, "maxRuntime")


class ClaimProfileSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    alternatives: tuple[Alternative, ...] = Field(min_length=1, max_length=MAX_ALTERNATIVES)
    topology: Topology = Topology()
    # Kueue: pods ask for the generic extended resource and a LocalQueue (controller/kueue.py).
    queueing: Literal["None", "Kueue"] = "None"
    local_queue: str | None = Field(default=None, alias="localQueue", max_length=63)
    align_cpus: AlignCpus | None = Field(default=None, alias="alignCpus")
    pod_requests: PodRequests | None = Field(default=None, alias="podRequests")
    # A multi-node job: ``pods`` pods, all or nothing (a PodGroup, controller/gang.py), placed per acrossNodes.
    pods: int | None = Field(default=None, ge=2, le=MAX_PODS)
    across_nodes: AcrossNodes | None = Field(default=None, alias="acrossNodes")
    # Hold devices for a job that waited long enough (issue 33): multi-node or whole-server profiles only.
    reservation: Reservation | None = None
    backfill: Backfill | None = None

    @model_validator(mode="after")
    def _cross_checks(self) -> ClaimProfileSpec:
        if self.reservation is not None and self.pods is None:
            gpus = sorted({a.count for a in self.alternatives})
            if gpus != [WHOLE_SERVER_GPUS]:
                raise ValueError(f"reservation needs a multi-node job (pods) or a whole-server profile (count "
                                 f"{WHOLE_SERVER_GPUS} in every alternative, got {gpus}): a smaller job does "
                                 "not wait for a domain to drain, and holding devices for it would waste them")
        if self.backfill is not None and self.reservation is not None and self.reservation.enabled:
            raise ValueError("a profile either reserves (reservation) or backfills (backfill), not both")
        if self.reservation is not None and self.queueing == "Kueue":
            raise ValueError("reservation cannot be combined with queueing Kueue: Kueue admits the pods, "
                             "the controller cannot tell how long the job waited")
        if self.across_nodes is not None and self.pods is None:
            raise ValueError("acrossNodes needs pods (how many pods the job has)")
        if self.pods is not None and self.queueing == "Kueue":
            raise ValueError("pods (a gang PodGroup) cannot be combined with queueing Kueue: Kueue v0.17 neither "
                             "creates PodGroups nor places DRA devices with topology-aware scheduling")
        if (self.queueing == "Kueue") != bool(self.local_queue):
            raise ValueError("queueing Kueue needs localQueue (the LocalQueue pods are sent to), "
                             "and localQueue needs queueing Kueue")
        if self.local_queue and not DNS_LABEL.match(self.local_queue):
            raise ValueError(f"localQueue {self.local_queue!r} must be a DNS label (lowercase letters, digits, '-')")
        names = [a.effective_name for a in self.alternatives]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"alternative names must be unique, {dupes} repeat "
                             "(set spec.alternatives[].name explicitly)")
        if self.topology.nic == "RailAligned":
            counts = {a.count for a in self.alternatives}
            if len(counts) > 1:
                raise ValueError("topology.nic RailAligned needs the same count in every alternative "
                                 f"(got {sorted(counts)}): each GPU gets its own request paired with a NIC")
            if self.alternatives[0].count > MAX_COUNT // 2:
                raise ValueError(f"topology.nic RailAligned allows at most {MAX_COUNT // 2} GPUs "
                                 "(one GPU request plus one NIC request per GPU, 32 requests per claim)")
            if "Preferred" in (self.topology.nvlink, self.topology.numa):
                raise ValueError("topology.nic RailAligned cannot be combined with a Preferred nvlink/numa "
                                 "placement; use Required or None")
        if self.align_cpus is not None:
            align_cpus_checks(self)
        return self


def align_cpus_checks(spec: ClaimProfileSpec) -> None:
    """What alignCpus needs from the rest of the spec (the request shapes of controller/cpualign.py)."""
    align = spec.align_cpus
    assert align is not None
    counts = sorted({a.count for a in spec.alternatives})
    if len(counts) > 1:
        raise ValueError(f"alignCpus needs the same count in every alternative (got {counts}): the CPUs "
                         "asked for are cpusPerGpu x count")
    count = counts[0]
    per_numa = align.gpus_per_numa_node or count
    if count % per_numa:
        raise ValueError(f"alignCpus.gpusPerNumaNode {per_numa} must divide the GPU count {count}")
    groups = count // per_numa
    topo = spec.topology
    if "Preferred" in (topo.nvlink, topo.numa):
        raise ValueError("alignCpus cannot be combined with a Preferred nvlink/numa placement; use Required or None")
    if topo.numa == "Required" and groups > 1:
        raise ValueError(f"topology.numa Required puts all {count} GPUs on one NUMA node, but "
                         f"alignCpus.gpusPerNumaNode {per_numa} splits them over {groups}; drop one of the two")
    if spec.queueing == "Kueue":
        raise ValueError("alignCpus cannot be combined with queueing Kueue: Kueue's quota does not count "
                         "dra.cpu capacity")
    cpu = spec.pod_requests.cpu if spec.pod_requests is not None else None
    if cpu is not None and parse_quantity(cpu) != align.cpus_per_gpu * count:
        raise ValueError(f"podRequests.cpu {cpu} differs from the {align.cpus_per_gpu * count} CPUs alignCpus puts "
                         "in each claim (cpusPerGpu x count), which the pod must request: drop podRequests.cpu")
    if topo.nic == "RailAligned" and 2 * count + groups > MAX_REQUESTS:
        raise ValueError(f"alignCpus with topology.nic RailAligned needs {2 * count + groups} requests "
                         f"(a GPU and a NIC request per GPU, a CPU request per NUMA node); a claim allows "
                         f"{MAX_REQUESTS}: at most {(MAX_REQUESTS - groups) // 2} GPUs")


class ProfileRef(BaseModel):
    """The identity fields the controller needs from the object's metadata."""

    model_config = ConfigDict(frozen=True)

    name: str
    namespace: str
    uid: str = ""
    generation: int = 0


class ClaimProfile(BaseModel):
    model_config = ConfigDict(frozen=True)

    metadata: ProfileRef
    spec: ClaimProfileSpec

    @classmethod
    def from_api(cls, obj: dict[str, Any]) -> ClaimProfile:
        """Parse an API object; raise ``ProfileError`` with one line per problem."""
        meta = obj.get("metadata") or {}
        try:
            return cls(
                metadata=ProfileRef(name=meta.get("name", ""), namespace=meta.get("namespace", ""),
                                    uid=meta.get("uid", ""), generation=meta.get("generation") or 0),
                spec=ClaimProfileSpec.model_validate(obj.get("spec") or {}),
            )
        except ValidationError as e:
            raise ProfileError(format_errors(e)) from None


def format_errors(e: ValidationError) -> str:
    """``spec.alternatives[0].count: Input should be ...`` style, one per line."""
    lines = []
    for err in e.errors():
        path = "spec"
        for part in err["loc"]:
            path += f"[{part}]" if isinstance(part, int) else f".{part}"
        msg = str(err["msg"]).removeprefix("Value error, ")
        lines.append(f"{path}: {msg}")
    return "; ".join(lines)
