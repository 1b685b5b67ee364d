"""Run ``topodra kubelet-plugin`` as a root host process next to the real kubelet (tests, bench, demo)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from testkit import procs
from testkit.paths import REPO
from testkit.ports import free_port

DRIVER = "gpu.topodra.io"
PLUGIN_DIR = Path("/var/lib/kubelet/plugins") / DRIVER
REGISTRY_DIR = Path("/var/lib/kubelet/plugins_registry")
CDI_ROOT = Path("/var/run/cdi")
DRA_SOCKET = PLUGIN_DIR / "dra.sock"


class PluginProcess:
    """One plugin process; ``start``/``stop``/``kill9`` keep the same on-disk state across restarts.

    Defaults are the real node's kubelet directories; the benchmark points it at private
    directories for a kubelet-less node instead.
    """

    def __init__(self, kubeconfig: str | Path, node_name: str, log_path: Path, hardware: str = "mock:dgx-h100",
                 extra_env: dict[str, str] | None = None, *, plugin_dir: Path = PLUGIN_DIR,
                 registry_dir: Path = REGISTRY_DIR, cdi_root: Path = CDI_ROOT,
                 metrics_port: int | None = None, health_port: int | None = None,
                 inherit_topodra_env: bool = True) -> None:
        self.kubeconfig = str(kubeconfig)
        self.node_name = node_name
        self.log_path = log_path
        self.hardware = hardware
        self.extra_env = dict(extra_env or {})
        self.plugin_dir, self.registry_dir, self.cdi_root = plugin_dir, registry_dir, cdi_root
        # Chosen free at run time, below the ephemeral range (testkit.ports.free_port).
        self.metrics_port = metrics_port or free_port()
        self.health_port = health_port or free_port()
        self.inherit_topodra_env = inherit_topodra_env
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def socket(self) -> Path:
        return self.plugin_dir / "dra.sock"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, extra_env: dict[str, str] | None = None, wait: bool = True) -> None:
        env = {k: v for k, v in os.environ.items() if self.inherit_topodra_env or not k.startswith("TOPODRA_")}
        env.update({**self.extra_env, **(extra_env or {}), "PYTHONUNBUFFERED": "1"})
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        log.write(f"\n===== start {time.strftime('%H:%M:%S')} env={extra_env or {}} =====\n".encode())
        log.flush()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "topodra.cli", "kubelet-plugin", f"--node-name={self.node_name}",
             f"--hardware={self.hardware}", f"--kubeconfig={self.kubeconfig}", f"--cdi-root={self.cdi_root}",
             f"--plugin-dir={self.plugin_dir}", f"--registry-dir={self.registry_dir}",
             f"--metrics-port={self.metrics_port}", f"--health-port={self.health_port}"],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        if wait:
            self.wait_registered()

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return str(r.read().decode())

    def metric(self, name: str) -> float | None:
        """The sum over all label sets of one metric; None when it is not exported."""
        values = [float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", self.metrics(), re.M)]
        return sum(values) if values else None

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
        """SIGTERM, then SIGKILL after 30 s; returns the exit code (None if never started)."""
        if self.proc is None:
            return None
        rc = procs.stop(self.proc)
        self.proc = None
        return rc

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"
