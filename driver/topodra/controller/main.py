"""``topodra controller``: run the ClaimProfile operator (kopf, in-process).

Connects only where ``--kubeconfig`` points (loopback in our clusters), with
one API client (``topodra.kube.Kube``) for all of our own calls; kopf keeps its
own inside.  With leader election on (the default), a replica first waits for
the Lease (``controller.leader``), then runs kopf standalone (no peering CRDs);
losing the Lease stops it with exit code 1 so its supervisor restarts it as a
standby.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import threading
import uuid
from collections.abc import Callable

from topodra import DEFAULT_DRIVER_NAME, cpudriver
from topodra.controller.cpucheck import CpuSettings
from topodra.controller.facts import WatchedFacts
from topodra.controller.leader import LeaderElector
from topodra.controller.operator import (
    ControllerConfig,
    RefreshLoop,
    build_registry,
    kopf_settings,
    refresh_all,
)
from topodra.controller.profile import parse_duration
from topodra.controller.render import DEFAULT_NIC_CLASS
from topodra.kube import Kube, KubeError

log = logging.getLogger(__name__)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kubeconfig", help="kubeconfig to use (default: $KUBECONFIG, else in-cluster)")
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("--namespace", action="append", default=[],
                       help="watch ClaimProfiles in this namespace (repeatable)")
    scope.add_argument("--all-namespaces", action="store_true", help="watch every namespace (default)")
    parser.add_argument("--driver-name", default=DEFAULT_DRIVER_NAME)
    parser.add_argument("--nic-class", default=DEFAULT_NIC_CLASS, help="DeviceClass for RailAligned NICs")
    parser.add_argument("--cpu-class", default=cpudriver.DRIVER,
                        help="DeviceClass of dra-driver-cpu for alignCpus (default dra.cpu)")
    parser.add_argument("--cpu-numa-attribute", default=cpudriver.STANDARD_NUMA,
                        help="attribute alignCpus matches GPUs, NICs and CPUs on (default "
                             "resource.kubernetes.io/numaNode, dra-driver-cpu main; dra.net/numaNode for v0.2.0)")
    parser.add_argument("--allow-unaligned-cpus", action="store_true",
                        help="without dra-driver-cpu, render alignCpus profiles without CPUs instead of refusing them")
    parser.add_argument("--refresh-interval", type=float, default=30.0,
                        help="seconds between availability/status refreshes of every profile")
    parser.add_argument("--reservations", choices=("on", "off"), default="on",
                        help="reserve devices for waiting jobs of profiles with a reservation (off: no profile "
                             "reserves, every reservation rule is deleted; docs/multi-node.md)")
    parser.add_argument("--reservation-after", type=duration_arg, default=900, metavar="DURATION",
                        help="how long a job waits before it may reserve, when its profile does not say "
                             "(seconds or e.g. 15m; default 15m)")
    parser.add_argument("--reservation-max-hold", type=duration_arg, default=86400, metavar="DURATION",
                        help="how long a reservation holds at most, when its profile does not say (default 24h: "
                             "a hold whose start is known ends at that start plus --reservation-grace anyway)")
    parser.add_argument("--reservation-grace", type=duration_arg, default=900, metavar="DURATION",
                        help="how long a hold lasts past its expected start before it is released (default 15m)")
    parser.add_argument("--reservation-cooldown", type=duration_arg, default=1800, metavar="DURATION",
                        help="after a hold ran out, how long the same wait waits before it may reserve again "
                             "(default 30m)")
    parser.add_argument("--reservation-narrower-within", type=duration_arg, default=1800, metavar="DURATION",
                        help="hold a narrower sameDomain level than the gang's own only if it starts at most this "
                             "much later (default 30m; a profile's reservation.narrowerWithin overrides it)")
    parser.add_argument("--max-reservations", type=int, default=2,
                        help="reservations that hold at once, oldest eligible job first (default 2)")
    parser.add_argument("--leader-elect", action=argparse.BooleanOptionalAction, default=True,
                        help="hold a coordination.k8s.io Lease so only one replica is active")
    parser.add_argument("--lease-namespace", default="default")
    parser.add_argument("--lease-name", default="topodra-controller")
    parser.add_argument("--identity", default=None, help="leader-election identity (default host_pid_rand)")


def duration_arg(text: str) -> int:
    """Seconds from ``900``, ``15m``, ``2h`` or ``1h30m`` (the profile's own duration syntax)."""
    try:
        return parse_duration(text, "duration")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def ensure_login_name() -> None:
    """Give the process a login name when its uid has no passwd entry (containers run as 65532).

    kopf names itself ``user@host`` through ``getpass.getuser()``, which raises KeyError for such a
    uid and crash-looped the controller pod. getuser() reads $LOGNAME first, so set that.
    """
    import getpass

    try:
        getpass.getuser()
    except (KeyError, OSError):
        os.environ["LOGNAME"] = f"uid-{os.getuid()}"


def install_stop_handlers(handler: Callable[[int, object], None]) -> None:
    """SIGTERM/SIGINT call ``handler`` instead of killing the process (main thread only, as Python requires)."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, handler)


def block_stop_signals(block: bool) -> None:
    """Hold (or deliver) SIGTERM/SIGINT in this thread, e.g. while no handler of ours is installed."""
    if threading.current_thread() is threading.main_thread():
        signal.pthread_sigmask(signal.SIG_BLOCK if block else signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})


def run(args: argparse.Namespace) -> int:
    stop = threading.Event()  # stops the refresh thread
    lost = threading.Event()
    # kopf's stop flag must be an asyncio primitive: a threading.Event would park a thread of the
    # default executor in wait(), and asyncio.run() would then hang at exit after SIGTERM.
    stop_kopf: list[Callable[[], None]] = []

    term = threading.Event()

    def stop_all() -> None:
        stop.set()
        for fn in stop_kopf:
            fn()

    def on_lost() -> None:
        lost.set()
        stop_all()

    def on_signal(signum: int, _frame: object) -> None:
        # kopf installs its own handlers only once its tasks run; a SIGTERM before that (while
        # waiting for the Lease, or during the first refresh) would kill the process with -15 and
        # leave the Lease held until it expires. CI caught that window (restart test, 1 in ~10 runs).
        log.info("received %s, stopping", signal.Signals(signum).name)
        term.set()
        stop_all()

    install_stop_handlers(on_signal)
    import kopf

    ensure_login_name()
    if args.refresh_interval < 1:
        log.error("--refresh-interval must be at least 1 second")
        return 2
    if args.max_reservations < 0 or args.reservation_max_hold <= 0:
        log.error("--max-reservations must not be negative and --reservation-max-hold must be above 0")
        return 2
    cfg = ControllerConfig(driver=args.driver_name, nic_class=args.nic_class,
                           namespaces=tuple(args.namespace), refresh_interval_s=args.refresh_interval,
                           snapshot_ttl_s=min(10.0, args.refresh_interval),
                           cpu=CpuSettings(device_class=args.cpu_class, numa_attribute=args.cpu_numa_attribute,
                                           allow_unaligned=args.allow_unaligned_cpus),
                           reservations=args.reservations == "on", reservation_after_s=args.reservation_after,
                           reservation_max_hold_s=args.reservation_max_hold,
                           max_reservations=args.max_reservations, reservation_grace_s=args.reservation_grace,
                           reservation_cooldown_s=args.reservation_cooldown,
                           reservation_narrower_within_s=args.reservation_narrower_within)
    try:
        kube = Kube.from_kubeconfig(args.kubeconfig)
    except Exception as e:  # kubeconfig missing/invalid: say so, start nothing
        log.error("cannot load kubeconfig %s: %s", args.kubeconfig or "$KUBECONFIG/in-cluster", e)
        return 2
    elector: LeaderElector | None = None
    if args.leader_elect:
        identity = args.identity or f"{socket.gethostname()}_{os.getpid()}_{uuid.uuid4().hex[:6]}"
        elector = LeaderElector(kube, args.lease_namespace, args.lease_name, identity)
        leading = elector.start(on_lost)
        while not leading.wait(0.2):
            if term.is_set():
                elector.release()
                kube.close()
                return 0
    # Availability reads watched facts (controller/facts.py), with a client of its own: its watches hold
    # their connections for minutes and must not take those of the handlers' requests.
    cache = WatchedFacts(Kube.from_kubeconfig(args.kubeconfig), cfg.driver, owns_client=True)
    cache.start()
    loop = RefreshLoop(kube, cfg, cache, stop=stop)
    if not term.is_set():
        try:
            refresh_all(kube, cfg, cache)  # converge at once after a restart or takeover
        except KubeError as e:
            log.warning("initial refresh failed: %s", e)
    loop.start()
    registry = build_registry(kube, args.kubeconfig, cfg, cache)
    log.info("controller running (driver %s, namespaces %s)", cfg.driver,
             ", ".join(cfg.namespaces) if cfg.namespaces else "all")

    async def serve() -> None:
        flag = asyncio.Event()
        running = asyncio.get_running_loop()
        def stop_from_thread() -> None:
            running.call_soon_threadsafe(flag.set)

        stop_kopf.append(stop_from_thread)
        if lost.is_set() or term.is_set():
            flag.set()
        await kopf.operator(registry=registry, settings=kopf_settings(), standalone=True,
                            clusterwide=not cfg.namespaces, namespaces=list(cfg.namespaces), stop_flag=flag)
        # Closing the loop resets kopf's handlers to the default (exit on -15): hold signals until ours are back.
        block_stop_signals(True)

    try:
        asyncio.run(serve())
    except asyncio.CancelledError:
        pass
    finally:
        install_stop_handlers(on_signal)
        block_stop_signals(False)
        stop.set()
        loop.join()
        cache.close()
        if elector is not None and not lost.is_set():
            elector.release()
        kube.close()
    return 1 if lost.is_set() else 0
