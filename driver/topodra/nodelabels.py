"""Node labels from discovery, for placing the pods of one job relative to each other. Pure.

Claim constraints work inside one node; multi-node jobs are placed with node labels (pod
affinity, Kueue topology-aware scheduling).  From a node's discovered devices:

* ``topodra.io/gpu-model``: the GPU model (the most common one on a mixed node);
* ``topodra.io/gpu-count``: how many GPUs the node has;
* ``topodra.io/nvlink-clique``: the multi-node NVLink domain (GB200/GB300 NVL: ``<clusterUUID>.<cliqueId>``),
  shared by every tray of one NVL72 partition; absent on nodes whose NVLink stays inside the node;
* ``topodra.io/rail-group``: from the admin's configuration (cabling is not visible from the node);
* the fabric tiers, finest first, ``topodra.io/leaf-group`` / ``topodra.io/scalable-unit`` /
  ``topodra.io/spine-group``: mirrored from Topograph's labels, else the admin's configuration
  (``topodra.fabric`` holds that rule).

``label_patch`` turns the wanted labels into a merge patch that also removes our labels that no longer
apply (a GPU fell off the bus, the fabric changed), and touches no other label.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # topodra.devices defines pydantic models (~0.15 s to import); the names here need none
    from topodra.devices import Device

PREFIX = "topodra.io/"
GPU_MODEL = PREFIX + "gpu-model"
GPU_COUNT = PREFIX + "gpu-count"
NVLINK_CLIQUE = PREFIX + "nvlink-clique"
RAIL_GROUP = PREFIX + "rail-group"
# Fabric tiers, finest first: behind the same leaf switches / under one spine group (SU) / one core block.
LEAF_GROUP = PREFIX + "leaf-group"
SCALABLE_UNIT = PREFIX + "scalable-unit"
SPINE_GROUP = PREFIX + "spine-group"
# Read from the hardware by discovery: always ours to set and to remove.
DISCOVERED = (GPU_MODEL, GPU_COUNT, NVLINK_CLIQUE)
# Given by the admin or Topograph (cabling is not visible from the node): ours only where a source gives them.
CONFIGURED = (RAIL_GROUP, LEAF_GROUP, SCALABLE_UNIT, SPINE_GROUP)
MANAGED = DISCOVERED + CONFIGURED
_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def label_value(text: str) -> str:
    """``text`` as a valid label value: at most 63 characters of [A-Za-z0-9_.-], alphanumeric at both ends."""
    v = re.sub(r"[^A-Za-z0-9_.-]+", "-", text)[:63].strip("-_.")
    if not v or not _VALUE.match(v):
        raise ValueError(f"cannot make a label value of {text!r}")
    return v


def _attr(d: Device, name: str) -> str | int | bool | None:
    a = d.attributes.get(name)
    return a.value if a is not None else None


def node_labels(devices: Iterable[Device], *, scalable_unit: str | None = None,
                rail_group: str | None = None) -> dict[str, str]:
    """The labels a node with these devices carries (only keys in MANAGED)."""
    gpus = [d for d in devices if d.kind == "gpu"]
    out: dict[str, str] = {GPU_COUNT: str(len(gpus))}
    models = Counter(str(m) for d in gpus if (m := _attr(d, "model")) is not None)
    if models:
        out[GPU_MODEL] = label_value(sorted(models.items(), key=lambda kv: (-kv[1], kv[0]))[0][0])
    # A multi-node domain is <clusterUUID>.<cliqueId>; node-local ones are <node>/nvl-<hash>.
    cliques = {str(v) for d in gpus if (v := _attr(d, "nvlinkDomain")) is not None and "/" not in str(v)}
    if len(cliques) == 1:
        out[NVLINK_CLIQUE] = label_value(cliques.pop())
    if scalable_unit:
        out[SCALABLE_UNIT] = label_value(scalable_unit)
    if rail_group:
        out[RAIL_GROUP] = label_value(rail_group)
    return out


def label_patch(current: Mapping[str, str], wanted: Mapping[str, str],
                managed: Collection[str] = MANAGED) -> dict[str, str | None]:
    """Merge-patch ``metadata.labels``: set what differs, delete (None) ``managed`` labels no longer wanted.

    ``managed`` (a subset of MANAGED) is what the caller owns: a label outside it is never removed, so a
    scalable unit an admin set by hand survives a writer that was not told the unit.
    """
    unknown = (set(wanted) | set(managed)) - set(MANAGED)
    if unknown:
        raise ValueError(f"not a topodra node label: {sorted(unknown)}")
    if set(wanted) - set(managed):
        raise ValueError(f"wanted labels outside the managed ones: {sorted(set(wanted) - set(managed))}")
    patch: dict[str, str | None] = {k: v for k, v in wanted.items() if current.get(k) != v}
    patch.update({k: None for k in managed if k in current and k not in wanted})
    return patch
