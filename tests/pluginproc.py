"""Run ``topodra kubelet-plugin`` as a root host process next to the real kubelet (tests, bench, demo)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DRIVER = "gpu.topodra.io"
PLUGIN_DIR = Path("/var/lib/kubelet/plugins") / DRIVER
REGISTRY_DIR = Path("/var/lib/kubelet/plugins_registry")
CDI_ROOT = Path("/var/run/cdi")
DRA_SOCKET = PLUGIN_DIR / "dra.sock"
METRICS_PORT = 51526
HEALTH_PORT = 51525


class PluginProcess:
    """One plugin process; ``start``/``stop``/``kill9`` keep the same on-disk state across restarts."""

    def __init__(self, kubeconfig: str, node_name: str, log_path: Path, hardware: str = "mock:dgx-h100",
                 extra_env: dict[str, str] | None = None) -> None:
        self.kubeconfig = kubeconfig
        self.node_name = node_name
        self.log_path = log_path
        self.hardware = hardware
        self.extra_env = dict(extra_env or {})
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, extra_env: dict[str, str] | None = None, wait: bool = True) -> None:
        env = {**os.environ, **self.extra_env, **(extra_env or {}), "PYTHONUNBUFFERED": "1"}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        log.write(f"\n===== start {time.strftime('%H:%M:%S')} env={extra_env or {}} =====\n".encode())
        log.flush()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "topodra.cli", "kubelet-plugin", f"--node-name={self.node_name}",
             f"--hardware={self.hardware}", f"--kubeconfig={self.kubeconfig}", f"--cdi-root={CDI_ROOT}",
             f"--plugin-dir={PLUGIN_DIR}", f"--registry-dir={REGISTRY_DIR}",
             f"--metrics-port={METRICS_PORT}", f"--health-port={HEALTH_PORT}"],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        if wait:
            self.wait_registered()

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=2) as r:
            return str(r.read().decode())

    def metric(self, name: str) -> float | None:
        m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", self.metrics(), re.M)
        return float(m.group(1)) if m else None

    def wait_registered(self, timeout: float = 60) -> None:
        """Until the kubelet has called NotifyRegistrationStatus(registered=true)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"plugin exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if self.metric("topodra_plugin_registration_status") == 1.0:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"kubelet did not register the plugin in {timeout}s:\n{self.tail()}")

    def wait_exit(self, timeout: float = 30) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(30)
        self.proc = None
        return rc

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def rss_mib(self) -> float:
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"
