"""A small JSON client for the Kubernetes API.

topodra talks to a handful of endpoints (ResourceClaims, ResourceSlices, Nodes,
DeviceClasses, ClaimProfiles) with plain JSON dicts, which keeps decoded
objects small.  Two transports sit under one interface:

- the common cases, in-cluster service-account config and kubeconfigs whose
  user is a client certificate or a bearer token, go straight through
  ``urllib3``: importing the official ``kubernetes`` package would add 5.6 MiB
  to the per-node plugin's imports (55.0 -> 60.6 MiB, bench/run import_rss,
  docs/benchmarks.md "Memory"), of its 80 MB budget;
- anything else a kubeconfig can say (exec credential plugins, auth
  providers, proxies, ...) is loaded by the official client, imported only then.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import ssl
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlencode

import urllib3
import yaml

log = logging.getLogger(__name__)

Obj = dict[str, Any]

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class KubeError(Exception):
    """An API call failed; ``status`` is the HTTP status (0 for transport errors)."""

    def __init__(self, status: int, reason: str, message: str, body: Obj | None = None) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message
        self.body = body or {}

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def conflict(self) -> bool:
        return self.status == 409


class Transport(Protocol):
    """Sends one request; returns (status, reason, body). Raises on connection/TLS failure."""

    host: str

    def send(self, method: str, path: str, body: bytes | None, headers: dict[str, str],
             timeout: float) -> tuple[int, str, bytes]: ...

    def stream(self, path: str, headers: dict[str, str], timeout: float) -> Iterator[bytes]:
        """GET ``path`` and yield the body line by line (watch streams); KubeError on HTTP errors."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class SimpleConfig:
    """What the light transport supports: server, CA, and a client certificate or a bearer token."""

    server: str
    ca_file: str | None = None
    ca_data: bytes | None = None
    insecure: bool = False
    cert_file: str | None = None
    key_file: str | None = None
    cert_data: bytes | None = None
    key_data: bytes | None = None
    token: str | None = None
    token_file: str | None = None


_SIMPLE_USER_KEYS = {"client-certificate", "client-certificate-data", "client-key", "client-key-data",
                     "token", "tokenFile"}
_SIMPLE_CLUSTER_KEYS = {"server", "certificate-authority", "certificate-authority-data",
                        "insecure-skip-tls-verify", "tls-server-name"}


def simple_config(kubeconfig: str | None) -> SimpleConfig | None:
    """The config the light transport can serve, or None when the official client must load it.

    Raises ValueError for a kubeconfig that is unreadable or inconsistent (a clear error, not a fallback).
    """
    if not kubeconfig:
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
        if not host or not port:
            raise ValueError("no kubeconfig given and not running in a pod (KUBERNETES_SERVICE_HOST unset)")
        if ":" in host:
            host = f"[{host}]"
        return SimpleConfig(server=f"https://{host}:{port}", ca_file=str(SA_DIR / "ca.crt"),
                            token_file=str(SA_DIR / "token"))
    path = Path(kubeconfig)
    try:
        doc = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"cannot read kubeconfig {kubeconfig}: {e}") from None
    base = path.parent

    def named(kind: str, name: str) -> dict[str, Any]:
        for item in doc.get(kind) or []:
            if item.get("name") == name:
                return dict(item.get(kind[:-1]) or {})
        raise ValueError(f"kubeconfig {kubeconfig}: {kind[:-1]} {name!r} not found")

    ctx_name = doc.get("current-context")
    if not ctx_name:
        raise ValueError(f"kubeconfig {kubeconfig} has no current-context")
    ctx = named("contexts", ctx_name)
    cluster = named("clusters", str(ctx.get("cluster", "")))
    user = named("users", str(ctx.get("user", ""))) if ctx.get("user") else {}
    if set(cluster) - _SIMPLE_CLUSTER_KEYS or set(user) - _SIMPLE_USER_KEYS or "tls-server-name" in cluster:
        return None  # exec plugins, auth providers, proxies...: the official client knows them

    def rel(p: str | None) -> str | None:
        return None if p is None else str(base / p) if not os.path.isabs(p) else p

    def b64(v: str | None) -> bytes | None:
        return None if v is None else base64.b64decode(v)

    server = str(cluster.get("server", ""))
    if not server.startswith("https://"):
        return None
    return SimpleConfig(
        server=server.rstrip("/"), ca_file=rel(cluster.get("certificate-authority")),
        ca_data=b64(cluster.get("certificate-authority-data")),
        insecure=bool(cluster.get("insecure-skip-tls-verify", False)),
        cert_file=rel(user.get("client-certificate")), key_file=rel(user.get("client-key")),
        cert_data=b64(user.get("client-certificate-data")), key_data=b64(user.get("client-key-data")),
        token=user.get("token"), token_file=rel(user.get("tokenFile")))


class Urllib3Transport:
    """HTTPS with a client certificate and/or a bearer token that is re-read when its file changes."""

    def __init__(self, cfg: SimpleConfig, pool_size: int = 8) -> None:
        ctx = ssl_context(cfg)
        self.host = cfg.server
        self._cfg = cfg
        self._token = cfg.token
        self._token_stamp: float | None = None
        self._lock = threading.Lock()
        self._pool = urllib3.PoolManager(num_pools=2, maxsize=pool_size, ssl_context=ctx,
                                         retries=False)

    def _bearer(self) -> str | None:
        if not self._cfg.token_file:
            return self._token
        with self._lock:  # projected service-account tokens rotate: re-read on change
            try:
                stamp = os.stat(self._cfg.token_file).st_mtime
                if stamp != self._token_stamp:
                    self._token = Path(self._cfg.token_file).read_text().strip()
                    self._token_stamp = stamp
            except OSError as e:
                log.warning("cannot read token file %s: %s", self._cfg.token_file, e)
            return self._token

    def send(self, method: str, path: str, body: bytes | None, headers: dict[str, str],
             timeout: float) -> tuple[int, str, bytes]:
        hdrs = dict(headers)
        token = self._bearer()
        if token:
            hdrs["Authorization"] = f"Bearer {token}"
        r = self._pool.request(method, self.host + path, body=body, headers=hdrs,
                               timeout=urllib3.Timeout(total=timeout), redirect=False)
        return r.status, r.reason or "", r.data

    def stream(self, path: str, headers: dict[str, str], timeout: float) -> Iterator[bytes]:
        hdrs = dict(headers)
        token = self._bearer()
        if token:
            hdrs["Authorization"] = f"Bearer {token}"
        r = self._pool.request("GET", self.host + path, headers=hdrs, preload_content=False,
                               timeout=urllib3.Timeout(connect=15.0, read=timeout), redirect=False)
        try:
            if r.status >= 300:
                raise _to_error(r.status, r.reason or "", r.read())
            yield from r
        finally:
            r.release_conn()

    def close(self) -> None:
        self._pool.clear()


def ssl_context(cfg: SimpleConfig) -> ssl.SSLContext:
    """The TLS context for ``cfg``: its CA (or none checked when insecure) and its client certificate."""
    ctx = ssl.create_default_context(cafile=cfg.ca_file, cadata=cfg.ca_data.decode() if cfg.ca_data else None)
    if cfg.insecure:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if cfg.cert_file or cfg.cert_data:
        _load_client_cert(ctx, cfg)
    return ctx


def error_from_response(status: int, reason: str, data: bytes | str | None) -> KubeError:
    """The KubeError for an HTTP error answer (other clients of the API answer as ``Kube`` does)."""
    return _to_error(status, reason, data)


def _load_client_cert(ctx: ssl.SSLContext, cfg: SimpleConfig) -> None:
    if cfg.cert_file and cfg.key_file:
        ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
        return
    # ssl only loads certificates from files: write inline data to a private temp dir, load, delete.
    with tempfile.TemporaryDirectory(prefix="topodra-kube-") as d:
        cert = Path(cfg.cert_file) if cfg.cert_file else Path(d, "cert.pem")
        key = Path(cfg.key_file) if cfg.key_file else Path(d, "key.pem")
        if cfg.cert_data:
            cert.write_bytes(cfg.cert_data)
        if cfg.key_data:
            fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(cfg.key_data)
        ctx.load_cert_chain(str(cert), str(key))


class OfficialTransport:
    """The official client's transport, for kubeconfigs the light one does not understand."""

    def __init__(self, kubeconfig: str) -> None:
        from kubernetes import config as kconfig
        from kubernetes.client import ApiClient, Configuration

        cfg = Configuration()
        kconfig.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
        self._api = ApiClient(cfg)
        self.host = str(cfg.host)

    def send(self, method: str, path: str, body: bytes | None, headers: dict[str, str],
             timeout: float) -> tuple[int, str, bytes]:
        from kubernetes.client.exceptions import ApiException

        _m, url, hdrs, _body, _p = self._api.param_serialize(
            method=method, resource_path=path, header_params=dict(headers), body=None,
            auth_settings=["BearerToken"])
        try:
            resp = self._api.call_api(method, url, header_params=hdrs, body=body, _request_timeout=timeout)
            resp.read()
        except ApiException as e:
            return e.status or 0, e.reason or "", (e.body or b"") if isinstance(e.body, bytes) else \
                str(e.body or "").encode()
        return resp.status, resp.reason or "", resp.data or b""

    def stream(self, path: str, headers: dict[str, str], timeout: float) -> Iterator[bytes]:
        from kubernetes.client.exceptions import ApiException

        _m, url, hdrs, _body, _p = self._api.param_serialize(
            method="GET", resource_path=path, header_params=dict(headers), body=None,
            auth_settings=["BearerToken"])
        try:
            resp = self._api.call_api("GET", url, header_params=hdrs, _request_timeout=(15.0, timeout))
        except ApiException as e:
            raise _to_error(e.status or 0, e.reason or "", e.body) from None
        raw = resp.response
        try:
            if resp.status >= 300:
                raise _to_error(resp.status, resp.reason or "", raw.read())
            yield from raw
        finally:
            raw.release_conn()

    def close(self) -> None:
        self._api.close()


def load_configuration(kubeconfig: str | None = None) -> Any:
    """The official client's ``Configuration`` (the controller hands it to kopf's login)."""
    from kubernetes import config as kconfig
    from kubernetes.client import Configuration

    cfg = Configuration()
    path = kubeconfig or os.environ.get("KUBECONFIG")
    if path:
        kconfig.load_kube_config(config_file=path, client_configuration=cfg)
    else:
        kconfig.load_incluster_config(client_configuration=cfg)
    return cfg


def make_transport(kubeconfig: str | None) -> Transport:
    """The light transport when it can serve the config, else the official client's."""
    path = kubeconfig or os.environ.get("KUBECONFIG") or None
    try:
        cfg = simple_config(path)
    except ValueError as e:
        raise KubeError(0, "BadConfig", str(e)) from None
    if cfg is not None:
        return Urllib3Transport(cfg)
    assert path is not None  # in-cluster config is always simple
    log.info("kubeconfig %s needs the official client (exec/auth-provider/proxy settings)", path)
    return OfficialTransport(path)


class Kube:
    """Blocking JSON access to the API server. Thread-safe (urllib3 pool)."""

    def __init__(self, transport: Transport, timeout: float = 15.0) -> None:
        self._t = transport
        self._timeout = timeout
        self.host = transport.host

    @classmethod
    def from_kubeconfig(cls, kubeconfig: str | None = None) -> Kube:
        """Kubeconfig file when given (or $KUBECONFIG), else in-cluster service-account config."""
        return cls(make_transport(kubeconfig))

    def close(self) -> None:
        self._t.close()

    def request(
        self,
        method: str,
        path: str,
        body: Obj | list[Obj] | None = None,
        query: dict[str, str] | None = None,
        content_type: str = "application/json",
        data: bytes | None = None,
    ) -> Obj:
        """``body`` goes as JSON; ``data``, already encoded, as ``content_type`` (the reply is JSON either way)."""
        if query:
            path = f"{path}?{urlencode(query)}"
        headers = {"Accept": "application/json", "User-Agent": "topodra"}
        if data is None and body is not None:
            data = json.dumps(body).encode()
        if data is not None:
            headers["Content-Type"] = content_type
        try:
            status, reason, raw = self._t.send(method, path, data, headers, self._timeout)
        except Exception as e:  # connection refused, TLS, timeouts
            raise KubeError(0, type(e).__name__, str(e)) from None
        if status >= 300 or status == 0:
            raise _to_error(status, reason, raw)
        if not raw:
            return {}
        out: Obj = json.loads(raw)
        return out

    def get(self, path: str) -> Obj | None:
        """GET an object; None when it does not exist."""
        try:
            return self.request("GET", path)
        except KubeError as e:
            if e.not_found:
                return None
            raise

    def list(self, path: str, label_selector: str | None = None,
             field_selector: str | None = None) -> Iterator[Obj]:
        """All items of a collection, following ``continue`` tokens."""
        query: dict[str, str] = {"limit": "500"}
        if label_selector:
            query["labelSelector"] = label_selector
        if field_selector:
            query["fieldSelector"] = field_selector
        while True:
            page = self.request("GET", path, query=query)
            yield from page.get("items") or []
            cont = (page.get("metadata") or {}).get("continue")
            if not cont:
                return
            query["continue"] = cont

    def list_snapshot(self, path: str, field_selector: str | None = None) -> tuple[tuple[Obj, ...], str]:
        """All items of a collection and the list's resourceVersion (where a watch resumes from)."""
        query: dict[str, str] = {"limit": "500"}
        if field_selector:
            query["fieldSelector"] = field_selector
        items: list[Obj] = []  # one list for all pages: tuple += tuple copied every page again
        version = ""
        while True:
            page = self.request("GET", path, query=query)
            items.extend(page.get("items") or ())
            meta = page.get("metadata") or {}
            version = version or str(meta.get("resourceVersion", ""))
            if not meta.get("continue"):
                return tuple(items), version
            query["continue"] = str(meta["continue"])

    def watch(self, path: str, resource_version: str, timeout_seconds: int = 300,
              field_selector: str | None = None) -> Iterator[Obj]:
        """Watch events (``{"type", "object"}``, bookmarks included) of a collection after ``resource_version``.

        Ends when the server closes the watch (after about ``timeout_seconds``): resume from the last
        event's resourceVersion. An expired version (410 Gone, as HTTP status or as an ERROR event)
        raises KubeError with status 410: list again.
        """
        query = {"watch": "1", "resourceVersion": resource_version, "allowWatchBookmarks": "true",
                 "timeoutSeconds": str(timeout_seconds)}
        if field_selector:
            query["fieldSelector"] = field_selector
        headers = {"Accept": "application/json", "User-Agent": "topodra"}
        try:
            lines = self._t.stream(f"{path}?{urlencode(query)}", headers, timeout_seconds + 30.0)
            for line in lines:
                if not line.strip():
                    continue
                event: Obj = json.loads(line)
                if event.get("type") == "ERROR":
                    st = event.get("object") or {}
                    raise KubeError(int(st.get("code") or 0), str(st.get("reason") or "Error"),
                                    str(st.get("message") or ""), st)
                yield event
        except KubeError:
            raise
        except Exception as e:  # connection reset, read timeout, truncated JSON
            raise KubeError(0, type(e).__name__, str(e)) from None

    def create(self, path: str, obj: Obj) -> Obj:
        return self.request("POST", path, obj)

    def replace(self, path: str, obj: Obj) -> Obj:
        return self.request("PUT", path, obj)

    def merge_patch(self, path: str, patch: Obj) -> Obj:
        return self.request("PATCH", path, patch, content_type="application/merge-patch+json")

    def delete(self, path: str, missing_ok: bool = True, uid: str | None = None) -> None:
        """DELETE ``path``; ``uid``: only the object with that UID (``preconditions.uid``): one re-created under
        the same name since it was read is left alone, and the API server answers 409 Conflict."""
        body = None if uid is None else {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"uid": uid}}
        try:
            self.request("DELETE", path, body)
        except KubeError as e:
            if not (missing_ok and e.not_found):
                raise


def _to_error(status: int, reason: str, data: bytes | str | None) -> KubeError:
    body: Obj = {}
    message = ""
    if data:
        try:
            body = json.loads(data)
            message = str(body.get("message", ""))
        except (ValueError, TypeError):
            message = data.decode(errors="replace") if isinstance(data, bytes) else str(data)
    return KubeError(status, reason, message or reason, body)
