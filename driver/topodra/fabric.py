"""Which value each of topodra's fabric labels gets, and from where. Pure.

The network fabric is not visible from a node, so the tiers come from outside, per key, in this order:

1. **Topograph's labels** on the Node (NVIDIA Topograph v1.0 ``fabric.topograph.run/tier-N``, closest switch
   first; ≤ v0.5 ``network.topology.nvidia.com/{leaf,spine,core}``). Clusters that run Topograph already
   schedule with them (Kueue, KAI, Volcano); topodra mirrors the value into its own key so one label key works
   on every cluster, and never writes or removes a foreign key.
2. The kubelet plugin's ``--hardware-config`` (``leafGroup``, ``scalableUnit``, ``spineGroup``).
3. The simulated cluster file (``topodra simulate``).

The plugin has no cluster file and the simulator no ``--hardware-config``: each passes its own fallback.
NVLink domains are not here: ``topodra.io/nvlink-clique`` comes from discovery (NVML's fabric info), which is
the authority Topograph's ``accelerator.topograph.run/domain`` is itself derived from (docs/multi-node.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from topodra.nodelabels import LEAF_GROUP, SCALABLE_UNIT, SPINE_GROUP, label_value

# topodra's fabric keys, finest first.
TIERS = (LEAF_GROUP, SCALABLE_UNIT, SPINE_GROUP)
TOPOGRAPH_V1 = {LEAF_GROUP: "fabric.topograph.run/tier-0", SCALABLE_UNIT: "fabric.topograph.run/tier-1",
                SPINE_GROUP: "fabric.topograph.run/tier-2"}
TOPOGRAPH_V05 = {LEAF_GROUP: "network.topology.nvidia.com/leaf", SCALABLE_UNIT: "network.topology.nvidia.com/spine",
                 SPINE_GROUP: "network.topology.nvidia.com/core"}
# Topograph's NVLink-domain keys (v1.0, ≤ v0.5): documented next to topodra.io/nvlink-clique, never mirrored.
TOPOGRAPH_NVLINK_DOMAIN = ("accelerator.topograph.run/domain", "network.topology.nvidia.com/accelerator")
# --hardware-config keys of the tiers (railGroup is not a tier: it stays in nodelabels).
CONFIG_KEYS = {"leafGroup": LEAF_GROUP, "scalableUnit": SCALABLE_UNIT, "spineGroup": SPINE_GROUP}

SOURCE_HARDWARE_CONFIG = "hardware-config"
SOURCE_CLUSTER_FILE = "cluster-file"


@dataclass(frozen=True)
class Fabric:
    """The tier labels to write, where each came from, and the tier keys the writer owns (may remove)."""

    labels: Mapping[str, str]
    sources: Mapping[str, str]  # key -> the Topograph key it mirrors, or SOURCE_*
    owned: frozenset[str]


def topograph_value(node_labels: Mapping[str, str], key: str) -> tuple[str, str] | None:
    """(Topograph key, value) for topodra ``key`` on a Node; v1.0 first, as it replaces ≤ v0.5's keys."""
    for foreign in (TOPOGRAPH_V1[key], TOPOGRAPH_V05[key]):
        value = node_labels.get(foreign)
        if value:  # an empty value names no switch
            return foreign, value
    return None


def fabric_labels(node_labels: Mapping[str, str], *, hardware_config: Mapping[str, str] | None = None,
                  cluster_file: Mapping[str, str] | None = None) -> Fabric:
    """The tier labels for a Node that carries ``node_labels``.

    ``hardware_config`` / ``cluster_file`` map topodra tier keys to raw names (None: that source is absent).
    A key the Topograph labels give is owned, so a changed or removed tier is followed. With a
    ``--hardware-config`` every tier key is owned (a key missing from the file is removed, as before); without
    one, a topodra tier no source gives is left alone, because it may have been set by hand.
    ValueError (naming the key and the source) when a configured name cannot be a label value.
    """
    labels: dict[str, str] = {}
    sources: dict[str, str] = {}
    for key in TIERS:
        mirrored = topograph_value(node_labels, key)
        if mirrored is not None:
            labels[key], sources[key] = mirrored[1], mirrored[0]
            continue
        for source, given in ((SOURCE_HARDWARE_CONFIG, hardware_config), (SOURCE_CLUSTER_FILE, cluster_file)):
            raw = (given or {}).get(key)
            if raw is None:
                continue
            try:
                labels[key] = label_value(str(raw))
            except ValueError as e:
                raise ValueError(f"{source} {key}: {e}") from None
            sources[key] = source
            break
    owned = frozenset(TIERS) if hardware_config is not None else frozenset(
        k for k, s in sources.items() if s not in (SOURCE_HARDWARE_CONFIG, SOURCE_CLUSTER_FILE))
    return Fabric(labels, sources, owned)
