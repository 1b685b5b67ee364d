"""Which loopback ports a cluster instance, a test or a benchmark listens on, and who holds a busy one."""

from __future__ import annotations

import random
import socket
import subprocess
from dataclasses import dataclass

from testkit.errors import ClusterError

PORTS = {
    "etcd": [2379, 2380],
    "kube-apiserver": [6443],
    "kube-controller-manager": [10257],
    "kube-scheduler": [10259],
    "kubelet": [10250, 10248],
}
KUBELET_PORTS = PORTS["kubelet"]

# Ports for test and bench listeners: below Linux's ephemeral range (32768-60999), so the
# kernel never hands them to an outgoing connection (an apiserver->etcd socket in TIME_WAIT
# on a port in that range once broke every plugin e2e test). Above the cluster's own ports.
FREE_PORT_RANGE = (20000, 32000)


def free_port() -> int:
    """A loopback TCP port in FREE_PORT_RANGE that nothing is bound to right now."""
    lo, hi = FREE_PORT_RANGE
    for port in random.sample(range(lo, hi), 200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise ClusterError(f"no free loopback port in {lo}-{hi} after 200 tries")


def port_holder(port: int) -> str | None:
    """None if 127.0.0.1:port is free, else a description of what holds it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            pass
        else:
            return None
    try:
        out = subprocess.run(["ss", "-Hltnp", f"sport = :{port}"], capture_output=True, text=True,
                             check=False).stdout.strip()
    except FileNotFoundError:
        out = ""
    return out or "unknown process"


@dataclass(frozen=True)
class Ports:
    """Where one cluster instance's control plane listens (127.0.0.1). The defaults are the shared
    cluster's fixed ports; ``Ports.free()`` gives a private instance its own."""

    etcd: int = 2379
    etcd_peer: int = 2380
    apiserver: int = 6443
    controller_manager: int = 10257
    scheduler: int = 10259

    @classmethod
    def free(cls) -> Ports:
        """Five distinct ports nothing listens on now, from FREE_PORT_RANGE (never the fixed ones)."""
        picked: list[int] = []
        while len(picked) < 5:
            port = free_port()
            if port not in picked:
                picked.append(port)
        return cls(*picked)

    def by_component(self) -> dict[str, list[int]]:
        return {"etcd": [self.etcd, self.etcd_peer], "kube-apiserver": [self.apiserver],
                "kube-controller-manager": [self.controller_manager], "kube-scheduler": [self.scheduler],
                "kubelet": list(KUBELET_PORTS)}

    @property
    def is_default(self) -> bool:
        return self == Ports()
