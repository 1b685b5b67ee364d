"""The plugin's keep-alive claim GET answers as ``Kube.get`` does, and keeps its connections."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from topodra.kube import KubeError
from topodra.plugin.claimget import ClaimReader, claim_reader


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the apiserver
    server: _Server

    def do_GET(self) -> None:
        srv = self.server
        srv.seen.append((self.path, self.headers.get("Authorization"), self.client_address[1]))
        status, body = srv.answers.get(self.path, (404, {"kind": "Status", "message": "not found", "code": 404}))
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        if srv.close_after_each:
            self.close_connection = True

    def log_message(self, *_args: object) -> None:
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.seen: list[tuple[str, str | None, int]] = []
        self.answers: dict[str, tuple[int, object]] = {}
        self.close_after_each = False


@pytest.fixture
def server() -> Iterator[_Server]:
    srv = _Server()
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def url(srv: _Server) -> str:
    return f"http://127.0.0.1:{srv.server_address[1]}"


CLAIM = "/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims/c"


def test_answers_like_kube_get(server: _Server) -> None:
    server.answers[CLAIM] = (200, {"metadata": {"uid": "u1"}})
    server.answers["/boom"] = (500, {"kind": "Status", "message": "etcd is sad"})
    server.answers["/garbage"] = (200, b"{not json")
    r = ClaimReader(url(server), token="t0")
    assert r.get(CLAIM) == {"metadata": {"uid": "u1"}}
    assert r.get("/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims/gone") is None
    with pytest.raises(KubeError, match="etcd is sad") as e:
        r.get("/boom")
    assert e.value.status == 500
    with pytest.raises(KubeError, match="not JSON"):
        r.get("/garbage")
    assert {auth for _p, auth, _port in server.seen} == {"Bearer t0"}
    r.close()


def test_one_connection_serves_sequential_gets(server: _Server) -> None:
    server.answers[CLAIM] = (200, {"metadata": {"uid": "u1"}})
    r = ClaimReader(url(server))
    for _ in range(20):
        assert r.get(CLAIM) is not None
    assert r.connections_made == 1
    assert len({port for _p, _a, port in server.seen}) == 1  # the server saw one client socket
    r.close()


def test_a_connection_the_server_closed_is_replaced(server: _Server) -> None:
    server.answers[CLAIM] = (200, {"metadata": {"uid": "u1"}})
    server.close_after_each = True  # the answer says nothing about closing: the next request finds it closed
    r = ClaimReader(url(server))
    for _ in range(5):
        assert r.get(CLAIM) == {"metadata": {"uid": "u1"}}
    assert len(server.seen) == 5  # no GET lost, none doubled at the server
    assert r.connections_made == 5
    r.close()


def test_refused_connection_is_a_status_0_error() -> None:
    srv = _Server()
    port = srv.server_address[1]
    srv.server_close()  # nothing listens there now
    r = ClaimReader(f"http://127.0.0.1:{port}", timeout=2.0)
    with pytest.raises(KubeError) as e:
        r.get(CLAIM)
    assert e.value.status == 0


def test_rotated_token_file_is_reread(server: _Server, tmp_path: Path) -> None:
    server.answers[CLAIM] = (200, {})
    tok = tmp_path / "token"
    tok.write_text("first\n")
    r = ClaimReader(url(server), token_file=str(tok))
    r.get(CLAIM)
    tok.write_text("second\n")
    later = time.time() + 5
    os.utime(tok, (later, later))
    r.get(CLAIM)
    assert [a for _p, a, _port in server.seen] == ["Bearer first", "Bearer second"]
    r.close()


def test_bad_urls_and_configs_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not http"):
        ClaimReader("ftp://example.org")
    with pytest.raises(KubeError, match="cannot read kubeconfig"):
        claim_reader(str(tmp_path / "missing"))


def test_kubeconfigs_only_the_official_client_reads_get_no_reader(tmp_path: Path) -> None:
    p = tmp_path / "kubeconfig"
    p.write_text(json.dumps({
        "current-context": "c", "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
        "clusters": [{"name": "k", "cluster": {"server": "https://127.0.0.1:6443"}}],
        "users": [{"name": "u", "user": {"exec": {"command": "get-token"}}}]}))
    assert claim_reader(str(p)) is None
