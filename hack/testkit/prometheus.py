"""Real Prometheus and promtool for tests: Debian's pinned package, unpacked by hack/prometheus-bin."""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from testkit.handle import wait_for
from testkit.paths import REPO
from testkit.ports import free_port


def bin_dir() -> Path:
    """The directory holding ``prometheus`` and ``promtool`` (fetched and unpacked on first use)."""
    r = subprocess.run([str(REPO / "hack" / "prometheus-bin")], capture_output=True, text=True, timeout=300,
                       check=False)  # fmt: skip
    assert r.returncode == 0, f"hack/prometheus-bin failed: {r.stderr}"
    return Path(r.stdout.strip()) / "usr" / "bin"


class PrometheusProcess:
    """A real Prometheus scraping ``targets`` (host:port, path /metrics) every ``interval``, on loopback only.

    Storage and the log live under ``workdir``; no service, no remote write. ``query`` is the HTTP API's
    instant query."""

    def __init__(self, workdir: Path, targets: list[str], interval: str = "1s") -> None:
        self.workdir = workdir
        self.port = free_port()
        self.targets = targets
        self.interval = interval
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        cfg = self.workdir / "prometheus.yml"
        cfg.write_text(json.dumps({
            "global": {"scrape_interval": self.interval, "evaluation_interval": self.interval},
            "scrape_configs": [{"job_name": "t", "static_configs": [{"targets": self.targets}]}]}))
        log = (self.workdir / "prometheus.log").open("ab")
        self.proc = subprocess.Popen(
            [str(bin_dir() / "prometheus"), f"--config.file={cfg}", f"--storage.tsdb.path={self.workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"], stdout=log, stderr=subprocess.STDOUT)
        wait_for(self._ready, 60, "prometheus ready")

    def _ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited: {(self.workdir / 'prometheus.log').read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def query(self, expr: str) -> list[dict[str, Any]]:
        url = f"http://127.0.0.1:{self.port}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def evaluate(self, expr: str) -> tuple[list[dict[str, Any]] | None, str]:
        """An instant query that reports instead of raising: (result, "") or (None, Prometheus's error, e.g. a
        parse error's 400 body)."""
        url = f"http://127.0.0.1:{self.port}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:
            return None, f"{e.code}: {e.read().decode(errors='replace')}"
        if body.get("status") != "success":
            return None, str(body)
        result: list[dict[str, Any]] = body["data"]["result"]
        return result, ""

    def label_values(self, label: str, match: str) -> list[str]:
        """Grafana's ``label_values(match, label)``, through the HTTP API's label values endpoint."""
        q = urllib.parse.urlencode({"match[]": match})
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/api/v1/label/{label}/values?{q}", timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return [str(v) for v in body["data"]]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
