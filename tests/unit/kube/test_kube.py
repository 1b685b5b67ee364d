"""Kubeconfig handling of the light transport, and the fallback to the official client."""

from __future__ import annotations

import base64
import os
import time
from pathlib import Path

import pytest
import yaml

from topodra.kube import Kube, KubeError, OfficialTransport, SimpleConfig, Urllib3Transport, simple_config


def kubeconfig(tmp_path: Path, user: dict[str, object], cluster: dict[str, object] | None = None) -> str:
    doc = {"apiVersion": "v1", "kind": "Config", "current-context": "c",
           "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
           "clusters": [{"name": "k", "cluster": cluster or {"server": "https://127.0.0.1:6443",
                                                              "certificate-authority": "ca.crt"}}],
           "users": [{"name": "u", "user": user}]}
    p = tmp_path / "kubeconfig"
    p.write_text(yaml.safe_dump(doc))
    return str(p)


def test_client_certificate_files_resolve_relative_to_the_kubeconfig(tmp_path: Path) -> None:
    cfg = simple_config(kubeconfig(tmp_path, {"client-certificate": "me.crt", "client-key": "/abs/me.key"}))
    assert cfg == SimpleConfig(server="https://127.0.0.1:6443", ca_file=str(tmp_path / "ca.crt"),
                               cert_file=str(tmp_path / "me.crt"), key_file="/abs/me.key")


def test_inline_data_and_token(tmp_path: Path) -> None:
    cfg = simple_config(kubeconfig(
        tmp_path, {"token": "abc"},
        {"server": "https://127.0.0.1:6443/", "certificate-authority-data": base64.b64encode(b"PEM").decode()}))
    assert cfg is not None
    assert (cfg.server, cfg.ca_data, cfg.token) == ("https://127.0.0.1:6443", b"PEM", "abc")


@pytest.mark.parametrize("user, cluster", [
    ({"exec": {"command": "get-token", "apiVersion": "client.authentication.k8s.io/v1"}}, None),
    ({"auth-provider": {"name": "oidc"}}, None),
    ({"token": "t"}, {"server": "https://127.0.0.1:6443", "proxy-url": "http://127.0.0.1:3128"}),
    ({"token": "t"}, {"server": "http://127.0.0.1:8080"}),
])
def test_other_kubeconfigs_go_to_the_official_client(tmp_path: Path, user: dict[str, object],
                                                     cluster: dict[str, object] | None) -> None:
    assert simple_config(kubeconfig(tmp_path, user, cluster)) is None


def test_bad_kubeconfigs_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read kubeconfig"):
        simple_config(str(tmp_path / "missing"))
    (tmp_path / "nocontext").write_text("apiVersion: v1\nkind: Config\n")
    with pytest.raises(ValueError, match="no current-context"):
        simple_config(str(tmp_path / "nocontext"))
    with pytest.raises(KubeError, match="cannot read kubeconfig"):
        Kube.from_kubeconfig(str(tmp_path / "missing"))


def test_in_cluster_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ValueError, match="not running in a pod"):
        simple_config(None)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    cfg = simple_config(None)
    assert cfg is not None and cfg.server == "https://[fd00::1]:443"
    assert cfg.token_file == "/var/run/secrets/kubernetes.io/serviceaccount/token"


def test_rotated_token_file_is_reread(tmp_path: Path) -> None:
    tok = tmp_path / "token"
    tok.write_text("first\n")
    t = Urllib3Transport(SimpleConfig(server="https://127.0.0.1:1", token_file=str(tok)))
    assert t._bearer() == "first"
    tok.write_text("second\n")
    later = time.time() + 5
    os.utime(tok, (later, later))
    assert t._bearer() == "second"


def test_exec_kubeconfig_loads_through_the_official_client(tmp_path: Path) -> None:
    path = kubeconfig(tmp_path, {"exec": {"command": "true", "apiVersion": "client.authentication.k8s.io/v1"}},
                      {"server": "https://127.0.0.1:1", "insecure-skip-tls-verify": True})
    kube = Kube.from_kubeconfig(path)
    assert isinstance(kube._t, OfficialTransport) and kube.host == "https://127.0.0.1:1"


def test_api_paths_quote_names_and_refuse_a_name_without_namespace() -> None:
    from topodra import apipaths

    assert apipaths.claim_path("ml", "a b") == "/apis/resource.k8s.io/v1/namespaces/ml/resourceclaims/a%20b"
    assert apipaths.claim_path() == "/apis/resource.k8s.io/v1/resourceclaims"  # all namespaces
    assert apipaths.slices_path("n/1") == "/apis/resource.k8s.io/v1/resourceslices/n%2F1"
    assert apipaths.profile_path("ml", "train") == "/apis/topodra.io/v1alpha1/namespaces/ml/claimprofiles/train"
    assert apipaths.lease_path("kube-system") == "/apis/coordination.k8s.io/v1/namespaces/kube-system/leases"
    assert apipaths.node_path("n1") + "/status" == "/api/v1/nodes/n1/status"
    with pytest.raises(ValueError, match="needs a namespace"):
        apipaths.template_path(None, "train")
