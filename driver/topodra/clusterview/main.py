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
import gc
import logging
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, TextIO

from topodra import DEFAULT_DRIVER_NAME
from topodra.clusterview.model import DEFAULT_PRIOR_WEIGHT, DEFAULT_WINDOW, ClusterView

# clusterview.domains' GROUP_BY keys (a unit test keeps them equal): domains imports topodra.fabric, which
# every output but --help would then pay for at start-up.
GROUP_BY = ("scalable-unit", "leaf-group", "spine-group", "pool")
DEFAULT_GROUP_BY = "scalable-unit"
PER_NODE_MAX = 64  # --picture auto: one row per node up to this many nodes (50 x 8 GPUs: 650 x 1,450 px)

if TYPE_CHECKING:
    from topodra.kube import Kube

log = logging.getLogger(__name__)

CLEAR = "\x1b[H\x1b[2J"


@contextmanager
def paused_gc() -> Iterator[None]:
    """No cyclic garbage collection while a view is read, built and written.

    The lists decode into millions of acyclic objects (32,768 devices at 2,048 nodes), and every full
    collection walks them all: 0.5 s of a 2.5 s build there. Reference counting still frees them."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


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
    p.add_argument("--domain", metavar="NAME", default=None,
                   help="only the nodes of this fabric domain (a scalable unit, leaf or spine group, or a node-name "
                        "pool such as h100-su2 when nodes carry no fabric labels); --png draws them node by node")
    p.add_argument("--node", metavar="NAME", default=None, help="only this node (--png: its GPUs)")
    p.add_argument("--picture", choices=("auto", "domains", "nodes"), default="auto",
                   help=f"--png draws one bar per fabric domain and GPU model, or one row per node; auto: nodes "
                        f"up to {PER_NODE_MAX} nodes or with --domain/--node, else domains")
    p.add_argument("--group-by", choices=GROUP_BY, default=DEFAULT_GROUP_BY,
                   help="the fabric tier --picture domains aggregates by (nodes without it: the other tiers, "
                        "then their name pool)")
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
        self.domain: str | None = getattr(args, "domain", None)
        self.node: str | None = getattr(args, "node", None)

    def load(self) -> ClusterView:
        """The view; UnknownName (nothing read is shown) when --domain or --node selects no node."""
        with paused_gc():
            return self._load()

    def _load(self) -> ClusterView:
        from topodra.clusterview.domains import fabric_of, select_nodes
        from topodra.clusterview.fetch import fetch
        from topodra.clusterview.model import build_view
        from topodra.fleet.pools import newest_slices

        src = fetch(self.kube, self.driver, self.selector)
        nodes: set[str] | None = {str(n["metadata"]["name"]) for n in src.nodes} if self.selector else None
        if self.domain is not None or self.node is not None:
            labels = {str(n["metadata"]["name"]): (n["metadata"].get("labels") or {}) for n in src.nodes}
            ours = {str(s["spec"]["nodeName"]) for s in newest_slices(src.slices, self.driver, node_local=True)}
            fabric = {n: fabric_of(labels.get(n)) for n in ours if nodes is None or n in nodes}
            nodes = select_nodes(fabric, domain=self.domain, node=self.node)
        return build_view(src, self.driver, prior=self.prior, prior_weight=self.prior_weight,
                          window=DEFAULT_WINDOW, nodes=nodes)


def emit(view: ClusterView, output: str, out: TextIO) -> None:
    from topodra.clusterview.table import render_table

    if output == "json":
        from topodra.clusterview.jsonout import json_text

        out.write(json_text(view.to_dict()))
    elif output == "yaml":
        import yaml

        # libyaml's emitter when PyYAML has it: the same text, ~10x faster (0.7 s -> 0.08 s at 400 GPUs).
        dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
        out.write(yaml.dump(view.to_dict(), Dumper=dumper, sort_keys=False))
    else:
        out.write(render_table(view))
    out.flush()


def picture_kind(view: ClusterView, picture: str, drill_down: bool) -> str:
    """``nodes`` or ``domains``: what ``--picture auto`` draws for this view (see ``--picture``)."""
    if picture != "auto":
        return picture
    return "nodes" if drill_down or len(view.nodes) <= PER_NODE_MAX else "domains"


def draw(view: ClusterView, path: str, kind: str, group_by: str) -> tuple[str, int, int]:
    """Render one picture; (path, width, height). Module-level so that the ``--watch`` worker can run it."""
    if kind == "domains":
        from topodra.clusterview.domainpicture import render_domains_png

        d = render_domains_png(view, path, group_by)
        return d.path, d.width, d.height
    from topodra.clusterview.picture import render_png

    pic = render_png(view, path)
    return pic.path, pic.width, pic.height


class PngWriter:
    """Renders ``--png`` in place: a one-shot command draws once, in this process.

    A one-shot ``--png`` used to fork a worker that imported matplotlib while this process read the
    cluster; paired runs (docs/inventory.md) measured 0.12 s gained at load 1-2 and nothing at load 4-6,
    where the command is bound by its CPU time, so it draws here. Errors (no matplotlib, an unwritable
    path) propagate as themselves.
    """

    def __init__(self, picture: str = "auto", group_by: str = DEFAULT_GROUP_BY, drill_down: bool = False) -> None:
        self.picture = picture
        self.group_by = group_by
        self.drill_down = drill_down

    def write(self, view: ClusterView, path: str) -> None:
        got = draw(view, path, picture_kind(view, self.picture, self.drill_down), self.group_by)
        log.debug("wrote %s (%dx%d px)", *got)

    def close(self) -> None:
        pass


class WatchPngWriter(PngWriter):
    """``--watch --png``: renders in one long-lived worker process, matplotlib loaded once.

    The worker keeps matplotlib's figures, fonts and caches out of this process, which lives as long
    as the watch does; forked before any thread of this process exists."""

    def __init__(self, picture: str = "auto", group_by: str = DEFAULT_GROUP_BY, drill_down: bool = False) -> None:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        from topodra.clusterview.picture import preload

        super().__init__(picture, group_by, drill_down)
        self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork"))
        self._pool.submit(preload)

    def write(self, view: ClusterView, path: str) -> None:
        kind = picture_kind(view, self.picture, self.drill_down)
        got = self._pool.submit(draw, view, path, kind, self.group_by).result()
        log.debug("wrote %s (%dx%d px)", *got)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def once(inv: InventoryReader, args: argparse.Namespace, out: TextIO, png: PngWriter | None = None) -> None:
    show(inv.load(), args, out, png)


def show(view: ClusterView, args: argparse.Namespace, out: TextIO, png: PngWriter | None = None) -> None:
    with paused_gc():
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
            if args.domain is not None or args.node is not None:
                raise ValueError("--domain and --node filter the report, not the exporter (--serve): "
                                 "filter its gauges by their node label instead")
    except ValueError as e:
        log.error("%s", e)
        return 2
    stop = threading.Event()
    if args.serve or args.watch:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    png: PngWriter | None = None
    if args.png and not args.serve:
        drill = args.domain is not None or args.node is not None
        writer = WatchPngWriter if args.watch else PngWriter  # the worker forks before any thread exists
        png = writer(args.picture, args.group_by, drill)
    try:
        return _run(args, stop, png)
    finally:
        if png is not None:
            png.close()


def _run(args: argparse.Namespace, stop: threading.Event, png: PngWriter | None) -> int:
    from topodra.clusterview.domains import UnknownName
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
        first = True
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                view = inv.load()
                if args.output == "table" and sys.stdout.isatty():
                    sys.stdout.write(CLEAR)
                show(view, args, sys.stdout, png)
            except KubeError as e:  # the API server may come back: keep watching
                log.error("cannot read the cluster: %s", e)
            except UnknownName as e:  # a misspelt name stops at once; a domain that empties later may refill
                if first:
                    raise
                log.error("%s", e)
            first = False
            stop.wait(max(0.0, args.interval - (time.monotonic() - t0)))
        return 0
    except UnknownName as e:  # before anything was written
        log.error("%s", e)
        return 2
    except (KubeError, RuntimeError, OSError) as e:
        log.error("%s", e)
        return 1
