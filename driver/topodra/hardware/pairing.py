"""Choose compute NICs, give them rails, and pair every GPU with its nearest one.

Pure functions over sysfs facts.  Distance classes follow ``nvidia-smi topo -m``
(best first): PIX (one PCIe switch), PXB (several switches, no host bridge),
PHB (same host bridge), NODE (different host bridges, same NUMA node), SYS
(across NUMA nodes / sockets).  Where NUMA is unknown the CPU socket decides
between NODE and SYS; where both are unknown the class is SYS.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from topodra.hardware.base import DiscoveryConfig
from topodra.hardware.sysfs import PciLocation, RdmaNic

log = logging.getLogger(__name__)

DISTANCE_CLASSES: tuple[str, ...] = ("PIX", "PXB", "PHB", "NODE", "SYS")


def pcie_distance(a: PciLocation, b: PciLocation) -> str:
    """nvidia-smi style distance class between two PCI functions."""
    if a.root is not None and a.root == b.root:
        common = 0
        for x, y in zip(a.bridges, b.bridges, strict=False):
            if x != y:
                break
            common += 1
        if common == 0:
            return "PHB"
        # Below the deepest shared bridge, each side may cross at most one port
        # (the switch's downstream port) for the pair to sit on a single switch.
        if len(a.bridges) - common <= 1 and len(b.bridges) - common <= 1:
            return "PIX"
        return "PXB"
    if a.numa_node is not None and b.numa_node is not None:
        return "NODE" if a.numa_node == b.numa_node else "SYS"
    if a.cpu_socket is not None and a.cpu_socket == b.cpu_socket:
        return "NODE"
    return "SYS"


def _matches(nic: RdmaNic, names: Sequence[str]) -> bool:
    keys = {nic.name, nic.bdf, *nic.netdevs}
    return any(n in keys for n in names)


def select_compute_nics(nics: Sequence[RdmaNic], config: DiscoveryConfig) -> list[RdmaNic]:
    """Compute-fabric NICs in PCI order; the rest (storage, in-band, management) are logged and dropped.

    Rule: with ``computeNics`` set, exactly those.  Otherwise SR-IOV virtual
    functions are never compute NICs (their PF is; they belong to pods through
    the SR-IOV device plugin), and a NIC is excluded if it is named in
    ``excludeNics``, if its port is ACTIVE and its rate below ``minNicRateGbps``
    (a port that is down reports a minimal rate, so its rate says nothing about
    the NIC), or (``excludeMultiPort``) if another physical function shares its
    ``sys_image_guid`` (a multi-port card: DGX storage/in-band NICs are dual-port,
    compute NICs are one port per adapter).  Link state never changes the
    result, so rails (the index in this list) stay put when a port goes down.
    """
    if config.compute_nics is not None:
        chosen = [n for n in nics if _matches(n, config.compute_nics)]
        for n in nics:
            if n not in chosen:
                log.info("NIC %s (%s) excluded: not listed in computeNics", n.name, n.bdf)
        return chosen
    for n in nics:
        if n.virtual_function:
            log.info("NIC %s (%s) excluded as non-compute: an SR-IOV virtual function", n.name, n.bdf)
    pfs = [n for n in nics if not n.virtual_function]
    guids = Counter(n.sys_image_guid for n in pfs if n.sys_image_guid)
    out: list[RdmaNic] = []
    for n in pfs:
        reason = ""
        if _matches(n, config.exclude_nics):
            reason = "listed in excludeNics"
        elif n.rate_gbps is not None and n.port_active is not False and n.rate_gbps < config.min_nic_rate_gbps:
            reason = f"port rate {n.rate_gbps} Gb/s < minNicRateGbps {config.min_nic_rate_gbps}"
        elif config.exclude_multi_port and n.sys_image_guid and guids[n.sys_image_guid] > 1:
            reason = f"multi-port adapter (sys_image_guid {n.sys_image_guid} shared)"
        if reason:
            log.info("NIC %s (%s) excluded as non-compute: %s", n.name, n.bdf, reason)
        else:
            out.append(n)
    return out


def assign_rails(compute: Sequence[RdmaNic], overrides: dict[str, int]) -> dict[str, int]:
    """Rail per compute NIC: its index in compute-NIC (PCI) order unless ``overrides`` names it."""
    rails = {n.name: overrides.get(n.name, idx) for idx, n in enumerate(compute)}
    unknown = sorted(set(overrides) - set(rails))
    if unknown:
        log.warning("rail overrides name NICs that are not compute NICs on this node: %s", unknown)
    dup = [r for r, c in Counter(rails.values()).items() if c > 1]
    if dup:
        log.warning("several compute NICs share rail(s) %s: %s", dup, rails)
    return rails


@dataclass(frozen=True)
class NicPairing:
    """The compute NIC chosen for one GPU."""

    nic: str
    distance: str


def pair_gpus(gpus: Sequence[PciLocation | None], nics: Sequence[RdmaNic]) -> list[NicPairing | None]:
    """Nearest compute NIC per GPU, in GPU order.

    Ties (equal class) go to the NIC on the GPU's CPU socket, then to the NIC with
    the fewest GPUs so far (spreads GPUs over NICs, e.g. GB200 trays where every
    path is NODE/SYS), then to PCI order.  Deterministic for a given input.
    """
    uses = dict.fromkeys((n.name for n in nics), 0)
    out: list[NicPairing | None] = []
    for g in gpus:
        if g is None or not nics:
            out.append(None)
            continue
        best: tuple[int, int, int, int] | None = None
        choice: NicPairing | None = None
        for idx, n in enumerate(nics):
            d = pcie_distance(g, n.location)
            same_socket = g.cpu_socket is not None and g.cpu_socket == n.location.cpu_socket
            key = (DISTANCE_CLASSES.index(d), 0 if same_socket else 1, uses[n.name], idx)
            if best is None or key < best:
                best, choice = key, NicPairing(n.name, d)
        assert choice is not None
        uses[choice.nic] += 1
        out.append(choice)
    return out
