"""Which claim and pods hold each device (pure): the labels every telemetry series carries.

Inputs are snapshots: the checkpoint's prepared claims (``DeviceState.held_devices``, read without the node
lock: the file is replaced atomically) and, per claim, the pods its ``status.reservedFor`` names (read from the
API server by the sampler, outside any lock). A device held by several claims (shared GPUs) carries all of
them, joined with ``,`` in a stable order; the info series (``claim_rows``) has one row per claim and pod.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from topodra.claims import ClaimRef, HeldDevice


@dataclass(frozen=True)
class ClaimInfo:
    namespace: str
    name: str
    uid: str
    pods: tuple[str, ...] = ()


@dataclass(frozen=True)
class Holder:
    """The claim labels of one device ('' when no claim holds it)."""

    namespace: str = ""
    claim: str = ""
    claim_uid: str = ""
    pod: str = ""


def pods_of(claim: Mapping[str, Any]) -> tuple[str, ...]:
    """The pod names of a ResourceClaim's ``status.reservedFor`` (pods only: a claim may be reserved for other
    consumers, which have no pod to name)."""
    out = []
    for r in (claim.get("status") or {}).get("reservedFor") or []:
        if r.get("resource") == "pods" and not r.get("apiGroup") and r.get("name"):
            out.append(str(r["name"]))
    return tuple(sorted(out))


def claims_by_device(held: Mapping[str, tuple[ClaimRef, frozenset[HeldDevice]]], pool: str) -> dict[str, list[str]]:
    """device name → UIDs of the claims holding it in ``pool``, sorted."""
    out: dict[str, list[str]] = {}
    for uid, (_ref, devices) in held.items():
        for dev_pool, device, _share in devices:
            if dev_pool == pool:
                out.setdefault(device, []).append(uid)
    return {d: sorted(set(uids)) for d, uids in out.items()}


def holders(held: Mapping[str, tuple[ClaimRef, frozenset[HeldDevice]]], infos: Mapping[str, ClaimInfo],
            pool: str) -> dict[str, Holder]:
    """device name → its claim labels; a claim whose pods are not known yet still names itself."""
    out: dict[str, Holder] = {}
    for device, uids in claims_by_device(held, pool).items():
        refs = [infos.get(u) or ClaimInfo(held[u][0].namespace, held[u][0].name, u) for u in uids]
        refs.sort(key=lambda c: (c.namespace, c.name, c.uid))
        out[device] = Holder(namespace=",".join(dict.fromkeys(c.namespace for c in refs)),
                             claim=",".join(c.name for c in refs), claim_uid=",".join(c.uid for c in refs),
                             pod=",".join(p for c in refs for p in c.pods))
    return out


def claim_rows(held: Mapping[str, tuple[ClaimRef, frozenset[HeldDevice]]], infos: Mapping[str, ClaimInfo],
               pool: str) -> list[tuple[str, ClaimInfo, str]]:
    """(device name, claim, pod) rows for the info series: one per claim and pod ('' when it has none yet)."""
    rows = []
    for device, uids in claims_by_device(held, pool).items():
        for u in uids:
            c = infos.get(u) or ClaimInfo(held[u][0].namespace, held[u][0].name, u)
            for pod in c.pods or ("",):
                rows.append((device, c, pod))
    return sorted(rows, key=lambda r: (r[0], r[1].namespace, r[1].name, r[2]))
