"""What topodra knows of kubernetes-sigs/dra-driver-cpu (pure): its names, its grouped-mode devices, its class.

topodra never runs that driver (its Go module is not served here, see docs/user-guide.md "Aligned CPUs"); the
simulator publishes the slices it would publish, so the real scheduler can be shown aligning GPUs, NICs and CPUs.
Its device shape in grouped mode (the default), from its docs/user/device-attributes.md:

* one device ``cpudevnuma<NNN>`` per NUMA node, ``allowMultipleAllocations: true``, consumable capacity
  ``dra.cpu/cpu`` = the node's allocatable logical CPUs;
* ``dra.cpu/numCPUs``, ``dra.cpu/socketID``, ``dra.cpu/smtEnabled``;
* NUMA node: v0.2.0 (the latest release) publishes only ``dra.cpu/numaNodeID`` and ``dra.net/numaNode``; main
  (fe4c45c, after the 1.37 rebase) adds the standard ``resource.kubernetes.io/numaNode`` and keeps both old names
  as deprecated.

A ``matchAttribute`` needs one attribute name on every device it covers, so with v0.2.0 topodra's GPUs and NICs
must carry ``dra.net/numaNode`` as well: ``with_numa_alias`` (the plugin's ``--numa-alias``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Literal

from topodra.devices import AttributeValue, Device

DRIVER = "dra.cpu"  # the driver name and the DeviceClass its install creates
CAPACITY = "dra.cpu/cpu"
STANDARD_NUMA = "resource.kubernetes.io/numaNode"
LEGACY_NUMA = "dra.net/numaNode"
NUMA_ID = "dra.cpu/numaNodeID"
Release = Literal["v0.2.0", "main"]
RELEASES: tuple[Release, ...] = ("v0.2.0", "main")
# The NUMA attribute each release offers for cross-driver alignment (what the controller's constraint names).
ALIGN_ATTRIBUTE: dict[Release, str] = {"v0.2.0": LEGACY_NUMA, "main": STANDARD_NUMA}


def device_class() -> dict[str, Any]:
    """The DeviceClass dra-driver-cpu's chart installs (deployment/helm/dra-driver-cpu/templates/deviceclass.yaml)."""
    return {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": DRIVER},
            "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]}}


def grouped_devices(numa: Sequence[tuple[int, int, int]], release: Release, smt: bool = True) -> list[Device]:
    """Grouped-mode devices for NUMA nodes given as (node, socket, logical CPUs)."""
    out = []
    for node, socket, cpus in sorted(numa):
        attrs: dict[str, AttributeValue] = {
            "dra.cpu/numCPUs": AttributeValue(int=cpus),
            "dra.cpu/socketID": AttributeValue(int=socket),
            "dra.cpu/smtEnabled": AttributeValue(bool=smt),
            NUMA_ID: AttributeValue(int=node),
            LEGACY_NUMA: AttributeValue(int=node),
        }
        if release == "main":
            attrs[STANDARD_NUMA] = AttributeValue(int=node)
        out.append(Device(name=f"cpudevnuma{node:03d}", kind="cpu", attributes=attrs,
                          capacity={CAPACITY: str(cpus)}, allow_multiple_allocations=True))
    return out


def with_numa_alias(devices: Iterable[Device], alias: str | None) -> list[Device]:
    """Devices with their standard NUMA node also published as ``alias`` (e.g. dra.net/numaNode for v0.2.0)."""
    if not alias:
        return list(devices)
    out = []
    for d in devices:
        numa = d.attributes.get(STANDARD_NUMA)
        out.append(d if numa is None else d.model_copy(update={"attributes": {**d.attributes, alias: numa}}))
    return out
