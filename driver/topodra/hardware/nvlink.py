"""Group GPUs into NVLink domains and name the domains.

A domain is the set of GPUs that can talk over NVLink: all GPUs on one
NVSwitch fabric (HGX: the whole node), one bridged pair/quad (H100/H200 NVL),
or a multi-node partition (GB200 NVL72: named by fabric clusterUUID + cliqueID,
shared by every tray of the rack).  Pure functions.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

MAX_VALUE_LEN = 64  # DeviceAttribute string limit


@dataclass(frozen=True)
class LinkPeer:
    """Far end of one active NVLink: a PCI address and whether it is an NVSwitch."""

    remote_bdf: str
    switch: bool


def local_groups(links: Mapping[str, Sequence[LinkPeer]]) -> dict[str, frozenset[str]]:
    """Union-find over GPU<->GPU and GPU<->NVSwitch links.

    ``links`` maps each local GPU's BDF to its active links.  Returns, for each GPU
    with at least one active link, the set of local GPU BDFs in its group.
    """
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(a: str, b: str) -> None:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)

    for gpu, peers in links.items():
        find("gpu:" + gpu)
        for p in peers:
            union("gpu:" + gpu, ("switch:" if p.switch else "gpu:") + p.remote_bdf)
    members: dict[str, set[str]] = {}
    for gpu in links:
        members.setdefault(find("gpu:" + gpu), set()).add(gpu)
    return {gpu: frozenset(members[find("gpu:" + gpu)]) for gpu, peers in links.items() if peers}


def local_domain_id(node_name: str, members: Iterable[str]) -> str:
    """Deterministic id for a node-local domain: ``<node>/nvl-<hash of node + member BDFs>``.

    The node name is cut so the value fits the 64-character attribute limit; the
    hash covers the full name, so ids stay distinct.
    """
    digest = hashlib.sha256((node_name + "|" + ",".join(sorted(members))).encode()).hexdigest()[:12]
    suffix = f"/nvl-{digest}"
    return node_name[: MAX_VALUE_LEN - len(suffix)] + suffix


def fabric_domain_id(cluster_uuid: str, clique_id: int) -> str:
    """Multi-node NVLink domain: ``<clusterUUID>.<cliqueID>`` (the GFD clique label format)."""
    return f"{cluster_uuid}.{clique_id}"
