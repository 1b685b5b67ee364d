"""``topodra placement-scorer``: the fragmentation-aware scheduler extender (prioritize only).

Run beside kube-scheduler and point an ``extenders[]`` entry at it (deploy/placement/,
docs/placement.md).  It lists and watches ResourceSlices, ResourceClaims,
ResourceClaimTemplates, DeviceClasses, DeviceTaintRules, Nodes and Pods, and answers ``POST /prioritize``
from that view alone.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading

from topodra import DEFAULT_DRIVER_NAME
from topodra.fleet.fgd import parse_prior
from topodra.fleet.state import ClusterState
from topodra.kube import Kube, KubeError
from topodra.placement.cache import Cache
from topodra.placement.server import Placement, Server

log = logging.getLogger(__name__)

DEFAULT_LISTEN = "127.0.0.1:9417"  # below the ephemeral port range
DEFAULT_PRIOR = "1:0.6,2:0.1,4:0.1,8:0.2"


def parse_listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--listen must be HOST:PORT, got {text!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kubeconfig", default=None, help="kubeconfig (default: $KUBECONFIG, else in-cluster)")
    p.add_argument("--listen", default=DEFAULT_LISTEN, help=f"HOST:PORT to serve on (default {DEFAULT_LISTEN})")
    p.add_argument("--driver", default=DEFAULT_DRIVER_NAME, help="DRA driver whose devices are scored")
    p.add_argument("--prior", default=DEFAULT_PRIOR,
                   help="expected request sizes before claims are seen, GPUS:WEIGHT,... "
                        f"(default {DEFAULT_PRIOR}; multi-GPU sizes are NVLink-local)")
    p.add_argument("--prior-weight", type=float, default=20.0,
                   help="how many claims the prior counts as when mixed with observed claims (default 20)")
    p.add_argument("--window", type=int, default=200,
                   help="learn the request mix from this many most recent claims (default 200; 0: prior only)")
    p.add_argument("--stale-after", type=float, default=60.0, metavar="SECONDS",
                   help="/healthz and /readyz fail once a watched kind's list/watch has failed for this long "
                        "(default 60)")
    p.add_argument("--host-resources", choices=["on", "off", "mix"], default="on",
                   help="count nodes' free CPU and memory: GPUs a job class cannot use for lack of them are "
                        "fragments, and a node without room for the pod scores 0 (default on: every class "
                        "judged with the scored pod's CPU and memory per GPU); mix: each class with what the "
                        "cluster's pods of its size ask for, and pods without claims scored too (nodes where "
                        "their CPU and memory strand the fewest GPUs first)")


def run(args: argparse.Namespace) -> int:
    try:
        host, port = parse_listen(args.listen)
        prior = parse_prior(args.prior)
        if args.window < 0 or args.prior_weight < 0:
            raise ValueError("--window and --prior-weight must be >= 0")
        if args.stale_after <= 0:
            raise ValueError(f"--stale-after must be > 0, got {args.stale_after}")
        kube = Kube.from_kubeconfig(args.kubeconfig)
    except (ValueError, KubeError) as e:
        log.error("%s", e)
        return 2
    placement: Placement | None = None

    def relisted(kind: str) -> None:  # in the watch thread: node states now, not in the next call
        if placement is not None:
            placement.warm(kind)

    cache = Cache(kube, ClusterState(args.driver, window=args.window), on_relist=relisted)
    placement = Placement(cache, prior, args.prior_weight, host_aware=args.host_resources != "off",
                          per_class=args.host_resources == "mix",
                          stale_after=args.stale_after)
    try:
        server = Server(placement, host, port)
    except OSError as e:
        log.error("cannot listen on %s: %s", args.listen, e)
        return 2
    cache.start()
    server.start()
    log.info("placement scorer for %s on http://%s:%d (POST /prioritize)", args.driver, host, server.port)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass
    server.shutdown()
    cache.close()
    return 0
