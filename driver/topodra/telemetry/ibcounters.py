"""InfiniBand / RoCE port data counters from sysfs, under the same root discovery reads.

``/sys/class/infiniband/<dev>/ports/<n>/counters/port_{rcv,xmit}_data`` count octets divided by 4 (the IBA
PortXmitData/PortRcvData unit; 64-bit on current mlx5 drivers), so bytes are the value x 4. A port whose files
are missing or garbled gives no reading and a named failure (a missing series, never a guessed number).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from topodra.hardware.sysfs import Sysfs

WORD_BYTES = 4


@dataclass(frozen=True)
class PortCounters:
    port: str
    rcv_bytes: int
    xmit_bytes: int


def read_ports(sysfs: Sysfs, rdma: str) -> tuple[list[PortCounters], list[str]]:
    """The RDMA device's port counters, and the failed reads (``sysfs_port_counters``)."""
    ports_dir = sysfs.path(f"sys/class/infiniband/{rdma}/ports")
    try:
        ports = sorted(os.listdir(ports_dir), key=lambda p: (len(p), p))
    except OSError:
        return [], ["sysfs_ports"]
    out: list[PortCounters] = []
    errors: list[str] = []
    for p in ports:
        vals = []
        for name in ("port_rcv_data", "port_xmit_data"):
            text = sysfs.read(os.path.join(ports_dir, p, "counters", name))
            try:
                vals.append(int((text or "").strip()) * WORD_BYTES)
            except ValueError:
                vals.append(-1)
        if min(vals) < 0:
            errors.append("sysfs_port_counters")
            continue
        out.append(PortCounters(p, vals[0], vals[1]))
    return out, errors
