"""``topodra inventory``: what is free, where, and what can still be placed (read-only).

Lists ResourceSlices, ResourceClaims, DeviceClasses, DeviceTaintRules, Nodes and pending Pods
with any kubeconfig that may list them, and prints a table per node and a cluster summary
(``-o json|yaml`` for machines, ``--png FILE`` for people, ``--watch`` to follow), or serves
the numbers as Prometheus gauges (``--serve HOST:PORT``). It never writes to the cluster.

Imports that cost (the API client, the fleet modules behind the view, yaml, matplotlib) sit
inside the functions that use them, so each output loads only what it needs.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, TextIO

from topodra import DEFAULT_DRIVER_NAME
from topodra.clusterview.model import DEFAULT_PRIOR_WEIGHT, DEFAULT_WINDOW, ClusterView

if TYPE_CHECKING:
    from topodra.kube import Kube

log = logging.getLogger(__name__)

CLEAR = "\x1b[H\x1b[2J"


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``:PORT`` (all interfaces)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"--serve must be HOST:PORT or :PORT, got {text!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kubeconfig", default=None, help="kubeconfig (default: $KUBECONFIG, else in-cluster)")
    p.add_argument("--driver", default=DEFAULT_DRIVER_NAME, help="DRA driver whose devices are shown")
    p.add_argument("-o", "--output", choices=("table", "json", "yaml"), default="table", help="output format")
    p.add_argument("-l", "--selector", default=None,
                   help="only nodes matching this label selector (e.g. topodra.io/scalable-unit=su1)")
    p.add_argument("--png", metavar="FILE", default=None,
                   help="also draw the inventory into FILE (PNG; needs matplotlib: topodra[png])")
    p.add_argument("--watch", action="store_true", help="refresh every --interval seconds until interrupted")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between refreshes (--watch, --serve)")
    p.add_argument("--serve", metavar="HOST:PORT", default=None,
                   help="serve Prometheus gauges on HOST:PORT (e.g. 127.0.0.1:9418) instead of printing")
    p.add_argument("--prior", default=None,
                   help="request mix prior of the fragmentation measure, GPUS:WEIGHT,... (default: the "
                        "placement scorer's)")
    p.add_argument("--prior-weight", type=float, default=DEFAULT_PRIOR_WEIGHT,
                   help=f"claims the prior counts as (default {DEFAULT_PRIOR_WEIGHT:g}, as the scorer)")


class InventoryReader:
    """One kubeconfig, driver and mix: ``load()`` reads the cluster and builds the view."""

    def __init__(self, kube: Kube, args: argparse.Namespace) -> None:
        from topodra.fleet.fgd import parse_prior

        self.kube = kube
        self.driver = str(args.driver)
        self.selector = args.selector
        self.prior = parse_prior(args.prior) if args.prior else None  # None: the scorer's
        self.prior_weight = float(args.prior_weight)

    def load(self) -> ClusterView:
        from topodra.clusterview.fetch import fetch
        from topodra.clusterview.model import build_view

        src = fetch(self.kube, self.driver, self.selector)
        nodes = [str(n["metadata"]["name"]) for n in src.nodes] if self.selector else None
        return build_view(src, self.driver, prior=self.prior, prior_weight=self.prior_weight,
                          window=DEFAULT_WINDOW, nodes=nodes)


def emit(view: ClusterView, output: str, out: TextIO) -> None:
    from topodra.clusterview.table import render_table

    if output == "json":
        out.write(json.dumps(view.to_dict(), indent=2) + "\n")
    elif output == "yaml":
        import yaml

        # libyaml's emitter when PyYAML has it: the same text, ~10x faster (0.7 s -> 0.08 s at 400 GPUs).
        dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
        out.write(yaml.dump(view.to_dict(), Dumper=dumper, sort_keys=False))
    else:
        out.write(render_table(view))
    out.flush()


class PngWriter:
    """Renders ``--png`` in place: a one-shot command draws once, in this process.

    A one-shot ``--png`` used to fork a worker that imported matplotlib while this process read the
    cluster; paired runs (docs/inventory.md) measured 0.12 s gained at load 1-2 and nothing at load 4-6,
    where the command is bound by its CPU time, so it draws here. Errors (no matplotlib, an unwritable
    path) propagate as themselves.
    """

    def write(self, view: ClusterView, path: str) -> None:
        from topodra.clusterview.picture import render_png

        pic = render_png(view, path)
        log.debug("wrote %s (%dx%d px)", pic.path, pic.width, pic.height)

    def close(self) -> None:
        pass


class WatchPngWriter(PngWriter):
    """``--watch --png``: renders in one long-lived worker process, matplotlib loaded once.

    The worker keeps matplotlib's figures, fonts and caches out of this process, which lives as long
    as the watch does; forked before any thread of this process exists."""

    def __init__(self) -> None:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        from topodra.clusterview.picture import preload

        self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork"))
        self._pool.submit(preload)

    def write(self, view: ClusterView, path: str) -> None:
        from topodra.clusterview.picture import render_png

        pic = self._pool.submit(render_png, view, path).result()
        log.debug("wrote %s (%dx%d px)", pic.path, pic.width, pic.height)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def once(inv: InventoryReader, args: argparse.Namespace, out: TextIO, png: PngWriter | None = None) -> None:
    view = inv.load()
    if png is not None:
        png.write(view, args.png)
    emit(view, args.output, out)


def serve(inv: InventoryReader, listen: str, interval: float, stop: threading.Event) -> int:
    from prometheus_client import CollectorRegistry, start_http_server

    from topodra.clusterview.exporter import InventoryCollector

    host, port = parse_listen(listen)
    registry = CollectorRegistry()
    registry.register(InventoryCollector(inv.load, min_interval=interval))
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        log.error("cannot listen on %s: %s", listen, e)
        return 2
    log.info("inventory exporter on http://%s:%d/metrics", host, port)
    stop.wait()
    server.shutdown()
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        if args.interval <= 0:
            raise ValueError("--interval must be > 0")
        if args.serve:
            parse_listen(args.serve)
    except ValueError as e:
        log.error("%s", e)
        return 2
    stop = threading.Event()
    if args.serve or args.watch:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    png: PngWriter | None = None
    if args.png and not args.serve:
        png = WatchPngWriter() if args.watch else PngWriter()  # the worker forks before any thread exists
    try:
        return _run(args, stop, png)
    finally:
        if png is not None:
            png.close()


def _run(args: argparse.Namespace, stop: threading.Event, png: PngWriter | None) -> int:
    from topodra.kube import Kube, KubeError

    try:
        inv = InventoryReader(Kube.from_kubeconfig(args.kubeconfig), args)
    except (ValueError, KubeError, OSError) as e:
        log.error("%s", e)
        return 2
    if args.serve:
        return serve(inv, args.serve, args.interval, stop)
    try:
        if not args.watch:
            once(inv, args, sys.stdout, png)
            return 0
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                if args.output == "table" and sys.stdout.isatty():
                    sys.stdout.write(CLEAR)
                once(inv, args, sys.stdout, png)
            except KubeError as e:  # the API server may come back: keep watching
                log.error("cannot read the cluster: %s", e)
            stop.wait(max(0.0, args.interval - (time.monotonic() - t0)))
        return 0
    except (KubeError, RuntimeError, OSError) as e:
        log.error("%s", e)
        return 1
