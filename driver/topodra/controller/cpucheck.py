"""Is dra-driver-cpu there for a profile's ``alignCpus``?  Read from the API, decided by a pure function.

An aligned template in a cluster without the CPU driver would leave every pod Pending ("cannot allocate all
claims") with nothing pointing at the cause, so the profile is refused with a condition that names it, unless the
admin opted in to falling back (``--allow-unaligned-cpus``): then the template is the GPU one without CPUs and the
status says the CPUs are not aligned.  A NUMA attribute no CPU device (or no topodra device) publishes is a
misconfiguration, not a missing driver, so it is refused either way: dra-driver-cpu v0.2.0 has no
``resource.kubernetes.io/numaNode`` and needs the v0.2.0 settings (docs/deploy.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from topodra import cpudriver
from topodra.apipaths import device_class_path, slices_path
from topodra.controller.cpualign import CpuOptions, cpus_per_claim
from topodra.controller.profile import ClaimProfile
from topodra.kube import Kube

Obj = dict[str, Any]

MISSING = "CpuDriverMissing"
NO_ATTRIBUTE = "CpuNumaAttributeMissing"


@dataclass(frozen=True)
class CpuSettings:
    """The controller's flags for alignCpus (chart value ``cpuDriver``)."""

    device_class: str = cpudriver.DRIVER
    numa_attribute: str = cpudriver.STANDARD_NUMA
    allow_unaligned: bool = False


@dataclass(frozen=True)
class CpuReadiness:
    """What the controller does with one profile's alignCpus: render with ``options`` (None: without CPUs)."""

    ok: bool
    aligned: bool
    reason: str
    message: str
    options: CpuOptions | None
    pod_cpu_request: str
    settings: CpuSettings

    def to_api(self) -> Obj:
        return {"aligned": self.aligned, "podCpuRequest": self.pod_cpu_request,
                "deviceClassName": self.settings.device_class, "numaAttribute": self.settings.numa_attribute,
                "message": self.message}


def _has_attribute(slices: Iterable[Obj], attribute: str) -> bool:
    domain, _, name = attribute.partition("/")
    for sl in slices:
        own = (sl.get("spec") or {}).get("driver") == domain
        for d in (sl.get("spec") or {}).get("devices") or []:
            attrs = d.get("attributes") or {}
            if attribute in attrs or (own and name in attrs):
                return True
    return False


def decide(profile: ClaimProfile, settings: CpuSettings, device_class: Obj | None, cpu_slices: list[Obj],
           gpu_slices: list[Obj]) -> CpuReadiness:
    """The decision for a profile with alignCpus, from what the API holds (pure)."""
    cpus = str(cpus_per_claim(profile))
    where = (f"DeviceClass {settings.device_class} does not exist" if device_class is None
             else f"no ResourceSlice of driver {cpudriver.DRIVER} exists")
    if device_class is None or not cpu_slices:
        if settings.allow_unaligned:
            return CpuReadiness(True, False, MISSING,
                                f"{where}: rendered without CPU alignment (--allow-unaligned-cpus); pods get "
                                "their GPUs but no NUMA-local CPUs", None, cpus, settings)
        return CpuReadiness(False, False, MISSING,
                            f"alignCpus needs dra-driver-cpu, but {where}: install it (docs/deploy.md, "
                            "\"CPU alignment\"), or let the controller render without CPUs "
                            "(--allow-unaligned-cpus, chart cpuDriver.allowUnaligned)", None, cpus, settings)
    attr = settings.numa_attribute
    # No GPU slices yet (nodes still starting) says nothing about the plugin's settings.
    lacking = [what for what, slices in (("CPU", cpu_slices), ("GPU", gpu_slices))
               if slices and not _has_attribute(slices, attr)]
    if lacking:
        hint = ("dra-driver-cpu v0.2.0 publishes only dra.cpu/numaNodeID and dra.net/numaNode: set chart "
                "cpuDriver.release v0.2.0 (controller --cpu-numa-attribute dra.net/numaNode, plugin --numa-alias "
                "dra.net/numaNode)" if attr == cpudriver.STANDARD_NUMA else
                f"the plugin publishes {attr} only with --numa-alias {attr}")
        return CpuReadiness(False, False, NO_ATTRIBUTE,
                            f"no {' and no '.join(lacking)} device publishes {attr}, so the NUMA constraint "
                            f"could never hold: {hint}", None, cpus, settings)
    return CpuReadiness(True, True, "Aligned",
                        f"{cpus} CPUs of {settings.device_class} per claim, matched on {attr}; pods must set "
                        f"resources.requests.cpu: {cpus} (alternatives[].nodesFit counts only nodes with that much "
                        "CPU free)",
                        CpuOptions(device_class=settings.device_class, numa_attribute=attr), cpus, settings)


def readiness(kube: Kube, profile: ClaimProfile, settings: CpuSettings, driver: str) -> CpuReadiness | None:
    """None when the profile has no alignCpus; else the decision on the cluster's current state."""
    if profile.spec.align_cpus is None:
        return None
    device_class = kube.get(device_class_path(settings.device_class))
    cpu_slices = list(kube.list(slices_path(), field_selector=f"spec.driver={cpudriver.DRIVER}"))
    # topodra's GPUs always publish the standard attribute; another one only with the plugin's --numa-alias,
    # so only then are its slices read (they are the cluster's biggest list).
    gpu_slices = ([] if settings.numa_attribute == cpudriver.STANDARD_NUMA
                  else list(kube.list(slices_path(), field_selector=f"spec.driver={driver}")))
    return decide(profile, settings, device_class, cpu_slices, gpu_slices)
