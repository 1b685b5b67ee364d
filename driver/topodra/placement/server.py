"""The extender's HTTP face: POST /prioritize, GET /healthz, GET /metrics.

kube-scheduler posts ``ExtenderArgs`` (``Pod`` and, with ``nodeCacheCapable: true``,
``NodeNames``; Go's field names, no JSON tags) and reads a ``HostPriorityList``
(``[{"Host", "Score"}]``, 0..10).  Scoring reads only the watched state: the request
path makes no API call.  Anything unexpected yields an HTTP error, which an
``ignorable`` extender turns into "no opinion" in the scheduler.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from itertools import repeat
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from topodra.fleet.demand import pod_tolerance
from topodra.fleet.domains import Candidate
from topodra.fleet.fgd import Mix, make_mix
from topodra.fleet.hostfrag import HostJob
from topodra.fleet.nodestates import NodeStates
from topodra.fleet.pods import pod_group_name
from topodra.fleet.reserve import NO_STEER, steering
from topodra.placement.bystate import StateScorer
from topodra.placement.cache import Cache, settle_heap
from topodra.placement.gang import Gangs
from topodra.placement.hostaware import host_fits, host_job
from topodra.placement.reply import encode_reply
from topodra.placement.score import Scorer, steered

log = logging.getLogger(__name__)

Obj = dict[str, Any]
MAX_BODY = 16 << 20  # a pod plus 5,000 node names is far below this
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


def _field(args: Mapping[str, Any], name: str) -> Any:
    """Go decodes JSON field names case-insensitively; so do we."""
    for k, v in args.items():
        if k.lower() == name.lower():
            return v
    return None


class BadRequest(ValueError):
    pass


def candidate_names(args: Mapping[str, Any]) -> list[str]:
    names = _field(args, "NodeNames")
    if names is None:  # nodeCacheCapable: false sends whole Node objects
        nodes = _field(args, "Nodes") or {}
        names = [((n.get("metadata") or {}).get("name")) for n in (nodes.get("items") or [])]
    if not isinstance(names, list) or not all(map(isinstance, names, repeat(str, len(names)))):
        raise BadRequest("NodeNames must be a list of node names")
    return names


class _CacheCollector(Collector):
    def __init__(self, cache: Cache) -> None:
        self.cache = cache

    def collect(self) -> Any:
        with self.cache.lock:
            sizes = self.cache.state.sizes()
        g = GaugeMetricFamily("topodra_placement_cache_objects", "Objects in the scorer's watched view, by kind.",
                              labels=["kind"])
        for kind, n in sizes.items():
            g.add_metric([kind], n)
        yield g
        yield GaugeMetricFamily("topodra_placement_cache_synced",
                                "1 once every kind has been listed at least once.",
                                value=1.0 if self.cache.synced() else 0.0)
        failing = GaugeMetricFamily("topodra_placement_cache_failing_seconds",
                                    "Seconds a kind's list/watch has been failing (absent: working).",
                                    labels=["kind"])
        for kind, age in self.cache.stale(-1.0).items():
            failing.add_metric([kind], age)
        yield failing


class Placement:
    """Scores pods against the cache; owns the scorer's memo and the metrics."""

    def __init__(self, cache: Cache, prior: Mapping[int, float], prior_weight: float,
                 registry: CollectorRegistry | None = None, host_aware: bool = True, by_state: bool = True,
                 stale_after: float = 60.0, per_class: bool = False) -> None:
        self.cache = cache
        self.stale_after = stale_after  # /healthz fails once a watched kind has been failing this long
        self.host_aware = host_aware  # count nodes' free CPU and memory (fleet.hostfrag)
        # Issue 34 (``--host-resources mix``): each request class capped with its own share (fleet.shares), and
        # pods without claims scored by the GPUs their CPU and memory strand (placement.bystate).
        self.per_class = host_aware and per_class
        self.prior = dict(prior)
        self.prior_weight = prior_weight
        self.scorer = Scorer()
        # Scores per node state, not per node (placement.bystate); False: every pod takes the per-node path
        # (the reference the fast path is tested against, and what gangs and CEL selectors always take).
        self.by_state = by_state
        self.states = StateScorer(self.scorer, NodeStates(cache.state))
        self.gangs = Gangs()  # pods of a PodGroup: the fabric domain first (placement.gang)
        # The request mix changes only when a claim arrives or the classes change: build it then,
        # not on every call (hashing 200 recent claims per call was most of a call's time).
        self._mix: tuple[tuple[int, frozenset[str]], Mix] | None = None
        self.registry = registry or CollectorRegistry()
        self.latency = Histogram("topodra_placement_prioritize_duration_seconds",
                                 "Time to answer one prioritize call (parsing, scoring, encoding).",
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        # CPU time of the serving thread for the same span: when the wall time is much larger, the
        # call waited (for a CPU, the GIL, the cache lock), it did not compute.
        self.cpu = Histogram("topodra_placement_prioritize_cpu_seconds",
                             "CPU time of the serving thread for one prioritize call.",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.calls = Counter("topodra_placement_prioritize", "prioritize calls, by result.", ["result"],
                             registry=self.registry)
        self.candidates = Gauge("topodra_placement_last_candidates", "Candidate nodes in the last call.",
                                registry=self.registry)
        self.registry.register(_CacheCollector(cache))

    def health(self, ready: bool = False) -> tuple[int, str]:
        """(HTTP status, text) of ``/healthz`` (``ready``: ``/readyz``). Both fail while a watched kind's list or
        watch has been failing for over ``stale_after`` seconds: scores from a view that old would steer pods by
        a cluster that is gone, and the scheduler ignores an extender that errors. ``/readyz`` also waits for
        the first list of every kind."""
        return _health(self, ready)

    def warm(self, _kind: str = "") -> None:
        """After a relist (the cache's ``on_relist``, in its watch thread): every node's state now, not in the
        next ``prioritize`` call (at 2,048 nodes the rebuild is ~30 ms, the whole of that call's time)."""
        with self.cache.lock:
            self.states.states.sync()
        settle_heap()  # the states are as long-lived as the listed objects

    def prioritize(self, args: Mapping[str, Any]) -> list[Obj]:
        """The ``HostPriorityList`` for ``args`` (``ExtenderArgs``) as objects."""
        names, scores = self.scores(args)
        return [{"Host": n, "Score": s} for n, s in zip(names, scores, strict=True)]

    def prioritize_json(self, args: Mapping[str, Any]) -> bytes:
        """The same list as the reply's JSON, without building its objects (``placement.reply``): what the
        server does per call once the request is parsed."""
        names, scores = self.scores(args)
        return encode_reply(names, scores)

    def scores(self, args: Mapping[str, Any]) -> tuple[list[str], list[int]]:
        """The candidates' names and their scores (0..10), in the order given."""
        pod = _field(args, "Pod")
        if not isinstance(pod, dict):
            raise BadRequest("ExtenderArgs has no Pod")
        names = candidate_names(args)
        self.candidates.set(len(names))
        with self.cache.lock:
            state = self.cache.state
            demands = state.pod_demands(pod)
            # Tolerations (issue 33): the nodes where this pod meets other unavailable devices than an ordinary
            # claim (none for a pod without tolerations: the check is one pass over its alternatives).
            tolerance = pod_tolerance(demands)
            own = state.tolerated_unavailable(tolerance) if tolerance else {}
            marks = state.reservation_marks() if state.taint_rules else {}
            steer = NO_STEER
            if marks:

                def unavailable(n: str) -> frozenset[int] | None:
                    v = state.node_view(n)
                    return None if v is None else own.get(n, state.unavailable_indices(v))

                steer = steering(marks, tolerance, unavailable)
            known = frozenset(k for k, m in state.classes.items() if m is not None)
            if self._mix is None or self._mix[0] != (state.mix_version, known):
                mix = make_mix(self.prior, self.prior_weight, state.observed_mix(), state.driver, known)
                self._mix = ((state.mix_version, known), mix)
            mix = self._mix[1]
            by_state = self.by_state and not any(d.has_selectors for d in demands)
            if by_state and self.per_class:  # issue 34: each class its own share; pods without GPUs scored too
                job: HostJob | None = host_job(pod, demands, state.shares.shares())
            else:
                job = host_job(pod, demands) if by_state and self.host_aware and demands else None
            if by_state and not pod_group_name(pod):
                self.gangs.last = None
                scores = self.states.score(names, demands, mix, job, own)
                if steer and demands:
                    scores = [s for _n, s in steered(list(zip(names, scores, strict=True)), steer, lambda ns: list(
                        zip(ns, self.states.score(ns, demands, mix, job, own), strict=True)))]
                return names, scores
            cands = []
            for n in names:
                view = state.node_view(n)
                cands.append((n, view, own.get(n, state.unavailable_indices(view)) if view is not None
                              else frozenset()))
            if by_state:  # a gang's pod: the domain rule per node, the node rule per state

                def rule(cs: Sequence[Candidate]) -> list[tuple[str, int]]:
                    ns = [c[0] for c in cs]
                    return list(zip(ns, self.states.score(ns, demands, mix, job, own), strict=True))

                scored = self.gangs.score(pod, state.pods, state.node_labels, cands, demands, mix, self.scorer,
                                          rule=rule, steer=steer)
            else:
                # CEL selectors (and by_state off): per class its own share too (issue 34, one rule).
                hosts = (host_fits(state, pod, demands, names, state.shares.shares() if self.per_class else None)
                         if self.host_aware and demands else None)
                scored = self.gangs.score(pod, state.pods, state.node_labels, cands, demands, mix, self.scorer,
                                          hosts, steer=steer)
        return [n for n, _s in scored], [s for _n, s in scored]


def make_handler(placement: Placement) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: the scheduler reuses its connection
        # Headers and body go out in two writes: without TCP_NODELAY, Nagle holds the body back
        # until the client's delayed ACK (40 ms on Linux) -- longer than the whole scoring.
        disable_nagle_algorithm = True

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("%s " + format, self.address_string(), *args)

        def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path in ("/healthz", "/readyz"):
                code, text = placement.health(ready=self.path == "/readyz")
                self._send(code, text.encode(), "text/plain")
            elif self.path == "/metrics":
                self._send(200, generate_latest(placement.registry), "text/plain; version=0.0.4")
            else:
                self._send(404, b"not found\n", "text/plain")

        def do_POST(self) -> None:
            t0 = time.perf_counter()
            c0 = time.thread_time()
            if self.path.rstrip("/") != "/prioritize":
                self._send(404, b'{"error":"only /prioritize is served"}')
                return
            try:
                length = int(self.headers.get("Content-Length") or 0)
                if length <= 0 or length > MAX_BODY:
                    raise BadRequest(f"body length {length} out of range")
                args = json.loads(self.rfile.read(length))
                if not isinstance(args, dict):
                    raise BadRequest("ExtenderArgs must be a JSON object")
                reply = placement.prioritize_json(args)
            except (BadRequest, ValueError) as e:
                placement.calls.labels("bad_request").inc()
                self._send(400, json.dumps({"error": str(e)}).encode())
                return
            except Exception as e:  # never take the server down; the scheduler ignores us
                log.exception("prioritize failed")
                placement.calls.labels("error").inc()
                self._send(500, json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
                return
            # Counted before the reply is written: a caller that has the reply finds the call in /metrics
            # (observed after the write, a /metrics read right after the reply could miss it).
            placement.calls.labels("ok").inc()
            placement.latency.observe(time.perf_counter() - t0)
            placement.cpu.observe(time.thread_time() - c0)
            self._send(200, reply)

    return Handler


def _health(placement: Placement, ready: bool) -> tuple[int, str]:
    stale = placement.cache.stale(placement.stale_after)
    if stale:
        why = "; ".join(f"{kind} failing for {age:.0f}s ({placement.cache.errors.get(kind, 'no error kept')})"
                        for kind, age in stale.items())
        return 503, f"cache stale: {why}\n"
    if ready and not placement.cache.synced():
        return 503, "cache not synced\n"
    return 200, "ok\n"


class Server:
    """A threaded HTTP server on ``host:port`` (port 0: any free one) serving a Placement."""

    def __init__(self, placement: Placement, host: str, port: int) -> None:
        self.httpd = ThreadingHTTPServer((host, port), make_handler(placement))
        self.httpd.daemon_threads = True
        self.port = int(self.httpd.server_address[1])
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="extender-http", daemon=True)
        self._thread.start()

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def shutdown(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
