"""A small JSON client for the Kubernetes API, on top of the official client.

topodra talks to a handful of endpoints (ResourceClaims, ResourceSlices, Nodes,
DeviceClasses, ClaimProfiles).  Working with plain JSON dicts through the
official ``kubernetes`` client's transport (auth, TLS, kubeconfig loading)
keeps decoded objects small and avoids the generated model layer, which
matters for the per-node plugin's memory budget.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote, urlencode

from kubernetes import config as kconfig
from kubernetes.client import ApiClient, Configuration
from kubernetes.client.exceptions import ApiException

log = logging.getLogger(__name__)

Obj = dict[str, Any]

RESOURCE_V1 = "/apis/resource.k8s.io/v1"


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


def load_configuration(kubeconfig: str | None = None) -> Configuration:
    """Kubeconfig file when given (or $KUBECONFIG), else in-cluster config."""
    cfg = Configuration()
    path = kubeconfig or os.environ.get("KUBECONFIG")
    if path:
        kconfig.load_kube_config(config_file=path, client_configuration=cfg)
    else:
        kconfig.load_incluster_config(client_configuration=cfg)
    return cfg


class Kube:
    """Blocking JSON access to the API server. Thread-safe (urllib3 pool)."""

    def __init__(self, configuration: Configuration, timeout: float = 15.0) -> None:
        self._api = ApiClient(configuration)
        self._timeout = timeout
        self.host = configuration.host

    @classmethod
    def from_kubeconfig(cls, kubeconfig: str | None = None) -> Kube:
        return cls(load_configuration(kubeconfig))

    def close(self) -> None:
        self._api.close()

    def request(
        self,
        method: str,
        path: str,
        body: Obj | list[Obj] | None = None,
        query: dict[str, str] | None = None,
        content_type: str = "application/json",
    ) -> Obj:
        if query:
            path = f"{path}?{urlencode(query)}"
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        _method, url, hdrs, ser_body, _post = self._api.param_serialize(
            method=method, resource_path=path, header_params=headers, body=body,
            auth_settings=["BearerToken"],
        )
        try:
            resp = self._api.call_api(method, url, header_params=hdrs, body=ser_body,
                                      _request_timeout=self._timeout)
            resp.read()
        except ApiException as e:  # transport raises for non-2xx
            raise _to_error(e.status or 0, e.reason or "", e.body) from None
        except Exception as e:  # connection refused, TLS, timeouts
            raise KubeError(0, type(e).__name__, str(e)) from None
        if resp.status >= 300:
            raise _to_error(resp.status, resp.reason or "", resp.data)
        if not resp.data:
            return {}
        out: Obj = json.loads(resp.data)
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

    def create(self, path: str, obj: Obj) -> Obj:
        return self.request("POST", path, obj)

    def replace(self, path: str, obj: Obj) -> Obj:
        return self.request("PUT", path, obj)

    def merge_patch(self, path: str, patch: Obj) -> Obj:
        return self.request("PATCH", path, patch, content_type="application/merge-patch+json")

    def delete(self, path: str, missing_ok: bool = True) -> None:
        try:
            self.request("DELETE", path)
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


def claim_path(namespace: str, name: str) -> str:
    return f"{RESOURCE_V1}/namespaces/{quote(namespace)}/resourceclaims/{quote(name)}"


def slices_path(name: str | None = None) -> str:
    return f"{RESOURCE_V1}/resourceslices" + (f"/{quote(name)}" if name else "")
