"""The kubelet-facing gRPC servers of the plugin, on unix sockets.

* DRA socket (``<plugin-dir>/dra.sock``): ``DRAPlugin`` v1 and v1beta1 — one
  implementation parameterised by the API module, v1beta1 just cannot carry
  ``share_id`` — plus ``DRAResourceHealth`` v1 and v1alpha1.
* Registration socket (``<registry-dir>/<driver>-reg.sock``): the plugin watcher's
  ``Registration`` service.

One call, in one direction: parse the request (malformed and duplicate claims are
answered here), read every claim from the API server concurrently and check it
(``topodra.claims``) — all before the prepare lock — then hand plain values to the
``DeviceState``, whose critical section does only local work, and translate its
answers back to protobuf.  A gRPC error is returned only when the whole call
fails; a claim that fails gets its own ``error`` string, and every requested claim
gets an entry, as the kubelet demands.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import grpc

from topodra import reservations
from topodra.claims import (
    SHOWN_CHARS,
    ClaimError,
    ClaimRef,
    FetchedClaim,
    UnavailableClaim,
    allocated_claim,
    ref_problem,
    shown,
)
from topodra.pb.dra.v1 import api_pb2 as dra_v1
from topodra.pb.dra.v1 import api_pb2_grpc as dra_v1_grpc
from topodra.pb.dra.v1beta1 import api_pb2 as dra_v1beta1
from topodra.pb.dra.v1beta1 import api_pb2_grpc as dra_v1beta1_grpc
from topodra.pb.drahealth.v1 import api_pb2 as health_v1
from topodra.pb.drahealth.v1 import api_pb2_grpc as health_v1_grpc
from topodra.pb.drahealth.v1alpha1 import api_pb2 as health_v1alpha1
from topodra.pb.drahealth.v1alpha1 import api_pb2_grpc as health_v1alpha1_grpc
from topodra.pb.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from topodra.plugin import metrics
from topodra.plugin.device_health import DeviceHealthBoard, DeviceHealthServicer
from topodra.plugin.registration import (
    RegistrationServicer,
    SocketPathError,
    dra_socket_path,
    registration_socket_path,
    supported_services,
)
from topodra.state import PreparedDevice, PrepareResult

log = logging.getLogger(__name__)

DRA_WORKERS = 10
CLAIM_READERS = 8  # concurrent ResourceClaim GETs for one node (kubelet batches are small)
MAX_HEALTH_STREAMS = 4  # the kubelet keeps one per registration; the rest is slack for re-dials

ClaimGetter = Callable[[str, str], dict[str, Any] | None]
"""(namespace, name) → the ResourceClaim object from the API server, None when it does not exist."""


class DeviceStateLike(Protocol):
    """What the gRPC layer needs from the prepare state (topodra.state.DeviceState)."""

    def prepare(self, claims: Sequence[FetchedClaim]) -> dict[str, PrepareResult]: ...

    def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, str]: ...


class CallFailed(Exception):
    """The whole gRPC call fails with this status (no per-claim answers)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _claim_label(c: Any) -> str:
    """``ns/name uid=...`` for logs, each part cut short (a malformed request may carry megabytes)."""
    return f"{_cut(c.namespace)}/{_cut(c.name)} uid={_cut(c.uid)}"


def _cut(value: str) -> str:
    return value if len(value) <= SHOWN_CHARS else f"{value[:SHOWN_CHARS]}...({len(value)} chars)"


def parse_claims(claims: Sequence[Any]) -> tuple[list[ClaimRef], dict[str, str]]:
    """Protobuf claims → (valid ClaimRefs, uid → error for malformed ones).

    A claim without a UID cannot get a response entry, so it fails the call.
    A UID that appears twice cannot get two answers: it gets one error and is
    not handled at all, so an ambiguous batch changes nothing.  This is the only
    duplicate check: the state relies on it.
    """
    refs: list[ClaimRef] = []
    bad: dict[str, str] = {}
    seen: set[str] = set()
    for c in claims:
        if not c.uid:
            raise CallFailed(grpc.StatusCode.INVALID_ARGUMENT,
                             f"claim {_cut(c.namespace)}/{_cut(c.name)} has no uid; claims need namespace, uid "
                             "and name")
        if c.uid in seen:
            bad[c.uid] = f"claim {_claim_label(c)} appears more than once in one batch (duplicate); not handled"
            refs = [r for r in refs if r.uid != c.uid]
            continue
        seen.add(c.uid)
        missing = [f for f in ("namespace", "name") if not getattr(c, f)]
        problem = None if missing else ref_problem(c.namespace, c.uid, c.name)
        if missing:
            bad[c.uid] = f"claim uid={shown(c.uid)} lacks {' and '.join(missing)}"
        elif problem:
            bad[c.uid] = f"claim {shown(c.namespace)}/{shown(c.name)} is malformed: {problem}; not handled"
        else:
            refs.append(ClaimRef(namespace=c.namespace, uid=c.uid, name=c.name))
    return refs, bad


class ClaimFetcher:
    """Reads and checks the claims of one call concurrently, before the state takes its lock."""

    def __init__(self, getter: ClaimGetter, driver_name: str, node_name: str,
                 max_workers: int = CLAIM_READERS, pod_getter: ClaimGetter | None = None) -> None:
        self._getter = getter
        self._pod_getter = pod_getter
        self._driver_name = driver_name
        self._node_name = node_name
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="claim-get")

    def fetch(self, refs: Sequence[ClaimRef]) -> list[FetchedClaim]:
        """One result per ref, in order; errors are per claim, never raised."""
        if len(refs) == 1:  # the common case: no thread hand-off
            return [self._fetch_one(refs[0])]
        return list(self._pool.map(self._fetch_one, refs))

    def _fetch_one(self, ref: ClaimRef) -> FetchedClaim:
        try:
            obj = self._getter(ref.namespace, ref.name)
        except Exception as e:
            return UnavailableClaim(ref, f"claim {ref}: cannot read the ResourceClaim: {e}")
        try:
            claim = allocated_claim(ref, obj, self._driver_name, pool_name=self._node_name, node_name=self._node_name)
        except ClaimError as e:
            return UnavailableClaim(ref, str(e))
        refusal = self._backfill_refusal(ref, obj or {})
        return claim if refusal is None else UnavailableClaim(ref, refusal)

    def _backfill_refusal(self, ref: ClaimRef, obj: dict[str, Any]) -> str | None:
        """A backfill claim (``reservations.claim_backfill_bound``) is prepared only for pods whose
        ``activeDeadlineSeconds`` fits its bound: what keeps a backfilled pod from running into the reservation
        it borrowed from (docs/multi-node.md). Other claims cost nothing here (no pod is read)."""
        if reservations.claim_backfill_bound(obj) is None:
            return None
        if self._pod_getter is None:
            return f"claim {ref} is a backfill claim, and this plugin cannot read pods to check its deadline"
        pods: list[dict[str, Any] | None] = []
        for name in reservations.reserved_pods(obj):
            try:
                pods.append(self._pod_getter(ref.namespace, name))
            except Exception as e:
                return f"claim {ref} is a backfill claim, and its pod {name} cannot be read: {e}"
        return reservations.backfill_refusal(obj, pods)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def device_to_pb(pb: ModuleType, d: PreparedDevice) -> Any:
    msg = pb.Device(request_names=list(d.request_names), pool_name=d.pool_name,
                    device_name=d.device_name, cdi_device_ids=list(d.cdi_device_ids))
    if d.share_id and "share_id" in pb.Device.DESCRIPTOR.fields_by_name:
        msg.share_id = d.share_id
    return msg


class DRAPluginServicer:
    """NodePrepareResources/NodeUnprepareResources for one API version (``pb`` = its api_pb2)."""

    def __init__(self, state: DeviceStateLike, fetcher: ClaimFetcher, pb: ModuleType, api: str) -> None:
        self._state = state
        self._fetcher = fetcher
        self._pb = pb
        self._api = api
        # The labelled children of the per-call metrics, looked up once instead of on every call.
        self._calls = {m: (metrics.REQUESTS.labels(m, api), metrics.REQUESTS_IN_FLIGHT.labels(m),
                           metrics.REQUEST_LATENCY.labels(m))
                       for m in ("NodePrepareResources", "NodeUnprepareResources")}

    def NodePrepareResources(self, request: Any, context: Any) -> Any:
        def run(refs: list[ClaimRef]) -> Mapping[str, PrepareResult]:
            return self._state.prepare(self._fetcher.fetch(refs))

        def fill(entry: Any, ref: ClaimRef, result: PrepareResult) -> None:
            entry.devices.extend(device_to_pb(self._pb, d) for d in result.devices)
            log.info("prepared claim=%s api=%s devices=%s", _claim_label(ref), self._api,
                     ",".join(f"{d.pool_name}/{d.device_name}" for d in result.devices) or "-")

        return self._serve("NodePrepareResources", "prepare", request, context,
                           self._pb.NodePrepareResourcesResponse(), run, fill)

    def NodeUnprepareResources(self, request: Any, context: Any) -> Any:
        def run(refs: list[ClaimRef]) -> Mapping[str, PrepareResult]:
            return {uid: PrepareResult(error=e) for uid, e in self._state.unprepare(refs).items()}

        def fill(_entry: Any, ref: ClaimRef, _result: PrepareResult) -> None:
            log.info("unprepared claim=%s api=%s", _claim_label(ref), self._api)  # an empty entry means "done"

        return self._serve("NodeUnprepareResources", "unprepare", request, context,
                           self._pb.NodeUnprepareResourcesResponse(), run, fill)

    def _serve(self, method: str, what: str, request: Any, context: Any, response: Any,
               run: Callable[[list[ClaimRef]], Mapping[str, PrepareResult]],
               fill: Callable[[Any, ClaimRef, PrepareResult], None]) -> Any:
        """The one skeleton of both methods: parse, run, one entry per requested claim."""
        with self._observe(method, context):
            refs, bad = parse_claims(request.claims)
            results = run(refs) if refs else {}
            by_uid = {c.uid: c for c in request.claims}
            _warn_unknown(method, results, by_uid)
            for uid, error in bad.items():
                self._claim_failed(method, what, by_uid[uid], error)
                response.claims[uid].error = error
            for ref in refs:
                entry = response.claims[ref.uid]
                result = results.get(ref.uid)
                if result is None:
                    entry.error = f"driver returned no {what} result for claim {ref.namespace}/{ref.name}"
                elif result.error:
                    entry.error = result.error
                else:
                    fill(entry, ref, result)
                    continue
                self._claim_failed(method, what, ref, entry.error)
        return response

    @contextmanager
    def _observe(self, method: str, context: Any) -> Iterator[None]:
        """Metrics around one call, and CallFailed/unexpected errors → gRPC status."""
        requests, in_flight, latency = self._calls[method]
        requests.inc()
        in_flight.inc()
        start = time.perf_counter()
        try:
            yield
        except CallFailed as e:
            metrics.REQUEST_ERRORS.labels(method, "call").inc()
            log.error("%s failed api=%s code=%s error=%s", method, self._api, e.code.name, e)
            context.abort(e.code, str(e))
        except Exception as e:
            metrics.REQUEST_ERRORS.labels(method, "call").inc()
            log.exception("%s failed unexpectedly api=%s", method, self._api)
            context.abort(grpc.StatusCode.INTERNAL, f"{method}: {type(e).__name__}: {e}")
        finally:
            in_flight.dec()
            latency.observe(time.perf_counter() - start)

    def _claim_failed(self, method: str, what: str, claim: Any, error: str) -> None:
        metrics.REQUEST_ERRORS.labels(method, "claim").inc()
        log.error("%s failed for claim=%s api=%s error=%s", what, _claim_label(claim), self._api, error)


def _warn_unknown(method: str, results: Mapping[str, Any], requested: dict[str, Any]) -> None:
    """The kubelet rejects a whole response with an unknown UID, so such results are dropped."""
    for uid in results.keys() - requested.keys():
        log.warning("%s: state answered for claim uid=%s that was not requested; dropped", method, uid)


class UnixSocketServer:
    """One grpc.server on one unix socket that it owns: stale file removed, own file removed at stop."""

    def __init__(self, path: Path, name: str, max_workers: int) -> None:
        self.path = path
        self.name = name
        self.server = grpc.server(ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=name))
        self._identity: tuple[int, int, int] | None = None

    def start(self) -> None:
        """Listen on a hidden temporary name, then rename it into place.

        gRPC core unlinks its socket path at shutdown even when another process has
        put a new socket there; binding to a private name keeps that unlink away from
        the public path, which ``stop`` removes only if it is still ours. The rename
        also makes the socket appear only once it accepts connections. The kubelet's
        watcher ignores dot-files; the temporary name is never longer than any public
        one (>= 8 characters), so it fits AF_UNIX whenever the public path does.
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_socket(self.path)
        tmp = self.path.parent / f".{self.name[0]}{os.getpid():x}"
        remove_stale_socket(tmp)
        if not self.server.add_insecure_port(f"unix:{tmp}"):
            raise OSError(f"cannot listen on unix socket {tmp}")
        self.server.start()
        try:
            os.rename(tmp, self.path)
        except OSError:
            self.server.stop(0).wait()
            raise
        self._identity = _identity(os.stat(self.path))
        log.info("%s server listening socket=%s", self.name, self.path)

    def owns_socket(self) -> bool:
        """False when our socket file was deleted or replaced (the kubelet could not reach us)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False
        return stat.S_ISSOCK(st.st_mode) and _identity(st) == self._identity

    def stop(self, grace: float) -> None:
        self.server.stop(grace).wait()
        if self._identity is not None and self.owns_socket():
            self.path.unlink()
            log.info("%s socket removed socket=%s", self.name, self.path)
        self._identity = None


def _identity(st: os.stat_result) -> tuple[int, int, int]:
    """Which file this is: inode numbers are reused at once, so the change time is included."""
    return st.st_dev, st.st_ino, st.st_ctime_ns


def remove_stale_socket(path: Path) -> None:
    """Delete a socket left by a previous run; refuse to delete anything that is not a socket."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise SocketPathError(f"{path} exists and is not a socket; refusing to replace it")
    path.unlink()
    log.info("removed stale socket=%s", path)


class PluginServer:
    """Both sockets of one plugin instance, started and stopped in the order the kubelet needs."""

    def __init__(self, *, driver_name: str, node_name: str, state: DeviceStateLike, claim_getter: ClaimGetter,
                 board: DeviceHealthBoard, plugin_dir: Path, registry_dir: Path, pod_uid: str | None = None,
                 serve_health: bool = True, pod_getter: ClaimGetter | None = None) -> None:
        self.dra_socket = dra_socket_path(plugin_dir, pod_uid)
        self.registration_socket = registration_socket_path(registry_dir, driver_name, pod_uid)
        self.board = board
        self.fetcher = ClaimFetcher(claim_getter, driver_name, node_name, pod_getter=pod_getter)
        self._dra = UnixSocketServer(self.dra_socket, "dra", DRA_WORKERS)
        services: list[tuple[Callable[[Any, Any], None], object]] = [
            (dra_v1_grpc.add_DRAPluginServicer_to_server, DRAPluginServicer(state, self.fetcher, dra_v1, "v1")),
            (dra_v1beta1_grpc.add_DRAPluginServicer_to_server,
             DRAPluginServicer(state, self.fetcher, dra_v1beta1, "v1beta1")),
        ]
        if serve_health:
            streams = threading.BoundedSemaphore(MAX_HEALTH_STREAMS)
            services += [
                (health_v1_grpc.add_DRAResourceHealthServicer_to_server,
                 DeviceHealthServicer(board, health_v1, "v1", streams)),
                (health_v1alpha1_grpc.add_DRAResourceHealthServicer_to_server,
                 DeviceHealthServicer(board, health_v1alpha1, "v1alpha1", streams)),
            ]
        for add, servicer in services:
            add(servicer, self._dra.server)
        self.registration = RegistrationServicer(driver_name, self.dra_socket,
                                                 supported_services(serve_health))
        self._reg = UnixSocketServer(self.registration_socket, "registration", 2)
        add_registration: Callable[[Any, Any], None] = reg_grpc.add_RegistrationServicer_to_server
        add_registration(self.registration, self._reg.server)
        self._running = False

    def start(self) -> None:
        """DRA socket first: the kubelet dials it as soon as it sees the registration socket."""
        self._dra.start()
        try:
            self._reg.start()
        except Exception:
            self._dra.stop(0)
            raise
        self._running = True

    def stop(self, grace: float = 5.0) -> None:
        """Registration socket first (the kubelet deregisters us), then drain the DRA socket."""
        self._running = False
        self._reg.stop(0)
        self.board.close()
        self._dra.stop(grace)
        self.fetcher.close()

    def problem(self) -> str | None:
        """None while healthy; else why the kubelet could not use this plugin."""
        if not self._running:
            return "servers are not running"
        for srv in (self._dra, self._reg):
            if not srv.owns_socket():
                return f"{srv.name} socket {srv.path} was removed or replaced"
        return None
