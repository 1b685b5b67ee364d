"""The plugin's ResourceClaim GET on keep-alive ``http.client`` connections.

Every NodePrepareResources reads its claims from the API server (a quorum GET, as the Go
``kubeletplugin`` helper does), so that GET's client cost is on the sequential prepare path.
Through ``topodra.kube``'s urllib3 transport it cost 250-450 µs of CPU per call, a bare
``http.client`` connection 160-250 µs (docs/benchmarks.md, 2026-12-01). This module's path, against a
local keep-alive TLS server in another process (a ResourceClaim-sized answer, 3 x 1,000 GETs, load 4-5,
2026-12-02): 242-264 µs of CPU and 401-454 µs wall per GET, against 469-541 µs and 633-774 µs for
``Kube.get`` in the same runs. The rest of the plugin keeps the shared transport: only this one hot,
read-only call gets its own connections.

Why not a claim cache fed by a watch, which would skip the GET altogether: a ResourceClaim
can only be field-selected by ``metadata.name``/``metadata.namespace`` (Kubernetes v1.37.2
``pkg/registry/resource/resourceclaim/strategy.go``, ``toSelectableFields``), so each node's
watch would carry every claim change of the whole cluster: at 2,048 nodes one claim update
becomes 2,048 watch events, and the apiserver's fan-out grows with nodes times cluster claim
churn. It would also still need the GET whenever the cache may lag behind the version the
kubelet just read (a claim deallocated and allocated again keeps its UID), which is exactly
the prepare path.

Same answers as ``Kube.get``: the object, None for 404, ``KubeError`` otherwise (status 0 for
connection and TLS failures). A GET on an idle connection that the server closed meanwhile is
sent once more on a new connection (a GET changes nothing).
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import socket
import ssl
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from topodra.kube import KubeError, SimpleConfig, error_from_response, simple_config, ssl_context

log = logging.getLogger(__name__)

Obj = dict[str, Any]

_RETRYABLE = (http.client.RemoteDisconnected, http.client.BadStatusLine, ConnectionResetError,
              BrokenPipeError, ConnectionAbortedError, ssl.SSLEOFError)


class _Https(http.client.HTTPSConnection):
    def connect(self) -> None:
        super().connect()
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as urllib3: no Nagle wait


class _Http(http.client.HTTPConnection):
    def connect(self) -> None:
        super().connect()
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class ClaimReader:
    """GETs of API objects over a small pool of persistent connections; thread-safe.

    ``server``: ``https://host:port[/prefix]`` (``http://`` only for tests); ``token`` or
    ``token_file`` (re-read when its mtime changes: projected tokens rotate).
    """

    def __init__(self, server: str, context: ssl.SSLContext | None = None, *, token: str | None = None,
                 token_file: str | None = None, timeout: float = 15.0, max_idle: int = 8) -> None:
        url = urlsplit(server)
        if url.scheme not in ("https", "http") or not url.hostname:
            raise ValueError(f"API server URL {server!r} is not http(s)://host[:port]")
        self._https = url.scheme == "https"
        self._host = url.hostname
        self._port = url.port or (443 if self._https else 80)
        self._prefix = url.path.rstrip("/")
        self._context = context
        self._timeout = timeout
        self._max_idle = max_idle
        self._token = token
        self._token_file = token_file
        self._token_stamp: float | None = None
        self._lock = threading.Lock()
        self._idle: list[http.client.HTTPConnection] = []
        self._closed = False
        self.connections_made = 0  # for tests and benchmarks: how often a new connection was needed

    @classmethod
    def from_config(cls, cfg: SimpleConfig) -> ClaimReader:
        return cls(cfg.server, ssl_context(cfg), token=cfg.token, token_file=cfg.token_file)

    def _bearer(self) -> str | None:
        if not self._token_file:
            return self._token
        with self._lock:
            try:
                stamp = os.stat(self._token_file).st_mtime
                if stamp != self._token_stamp:
                    self._token = Path(self._token_file).read_text().strip()
                    self._token_stamp = stamp
            except OSError as e:
                log.warning("cannot read token file %s: %s", self._token_file, e)
            return self._token

    def _connection(self) -> tuple[http.client.HTTPConnection, bool]:
        """An idle connection (True: reused) or a new one."""
        with self._lock:
            if self._idle:
                return self._idle.pop(), True
            self.connections_made += 1
        if self._https:
            return _Https(self._host, self._port, timeout=self._timeout, context=self._context), False
        return _Http(self._host, self._port, timeout=self._timeout), False

    def _release(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self._max_idle:
                self._idle.append(conn)
                return
        conn.close()

    def get(self, path: str) -> Obj | None:
        """GET ``path`` (``/apis/...``); None when it does not exist."""
        headers = {"Accept": "application/json", "User-Agent": "topodra"}
        token = self._bearer()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        target = self._prefix + path
        while True:
            conn, reused = self._connection()
            try:
                conn.request("GET", target, headers=headers)
                resp = conn.getresponse()
                raw = resp.read()
            except _RETRYABLE as e:
                conn.close()
                if reused:  # the server closed it while idle: a fresh connection is no repeat of a change
                    continue
                raise KubeError(0, type(e).__name__, str(e)) from None
            except Exception as e:  # refused, TLS, timeouts
                conn.close()
                raise KubeError(0, type(e).__name__, str(e)) from None
            if resp.will_close:
                conn.close()
            else:
                self._release(conn)
            break
        if resp.status == 404:
            return None
        if resp.status >= 300:
            raise error_from_response(resp.status, resp.reason or "", raw)
        try:
            out: Obj = json.loads(raw)
        except ValueError as e:
            raise KubeError(resp.status, "BadBody", f"GET {path}: answer is not JSON: {e}") from None
        return out

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


def claim_reader(kubeconfig: str | None) -> ClaimReader | None:
    """A reader for the plugin's kubeconfig (as ``topodra.kube.make_transport`` finds it); None when only the
    official client can talk to that API server (exec plugins, proxies...): then the shared transport GETs."""
    path = kubeconfig or os.environ.get("KUBECONFIG") or None
    try:
        cfg = simple_config(path)
    except ValueError as e:
        raise KubeError(0, "BadConfig", str(e)) from None
    return ClaimReader.from_config(cfg) if cfg is not None else None
