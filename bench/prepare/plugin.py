"""topodra's plugin process as the bench runs it, and what the bench reads from it (memory, request totals)."""

from __future__ import annotations

import contextlib
import re
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.paths import REPO
from bench.prepare.common import HARDWARE, NODE, BenchError
from testkit import cluster as localcluster
from testkit.pluginproc import PluginProcess


class BenchPlugin(PluginProcess):
    """The plugin for the kubelet-less bench node, in its own directories and on free ports."""

    def __init__(self, kubeconfig: Path, root: Path, log_path: Path, extra_env: dict[str, str]) -> None:
        super().__init__(kubeconfig, NODE, log_path, HARDWARE, extra_env, plugin_dir=root / "plugin",
                         registry_dir=root / "registry", cdi_root=root / "cdi", metrics_port=localcluster.free_port(),
                         health_port=localcluster.free_port(), inherit_topodra_env=False)

    def wait_ready(self, timeout: float) -> float:
        """Until the DRA socket serves and the ResourceSlice is published; returns seconds taken."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if not self.alive():
                raise BenchError(f"plugin exited with {self.proc.returncode if self.proc else '?'}:\n"
                                 f"{self.tail()}")
            with contextlib.suppress(OSError, ValueError):
                if self.socket.is_socket() and self.metric("topodra_plugin_published_devices") == 16.0:
                    return time.monotonic() - t0
            time.sleep(0.1)
        raise BenchError(f"plugin not ready after {timeout:.0f}s:\n{self.tail()}")

    def sample_rss(self) -> dict[str, int]:
        return localcluster.proc_status(self.pid)


Sample = Callable[[], dict[str, int]]
"""A process's /proc status memory fields in KiB (``localcluster.proc_status``)."""


class RssSampler:
    """Samples a plugin's VmRSS every ``interval`` seconds in the background."""

    def __init__(self, sample: Sample, interval: float = 0.1) -> None:
        self.sample = sample
        self.interval = interval
        self.max_kib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            with contextlib.suppress(OSError, KeyError, AssertionError):
                self.max_kib = max(self.max_kib, self.sample()["VmRSS"])

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def server_totals(plugin: BenchPlugin) -> dict[str, tuple[float, float]]:
    text = plugin.metrics()
    out = {}
    for method in ("NodePrepareResources", "NodeUnprepareResources"):
        vals = []
        for suffix in ("_sum", "_count"):
            m = re.search(rf'^topodra_plugin_request_duration_seconds{suffix}{{method="{method}"}} (\S+)$', text, re.M)
            vals.append(float(m.group(1)) if m else 0.0)
        out[method] = (vals[0], vals[1])
    return out


def memory_point(sample: Sample) -> dict[str, Any]:
    st = sample()
    return {"VmRSS_MiB": round(st["VmRSS"] / 1024, 1), "VmHWM_MiB": round(st["VmHWM"] / 1024, 1),
            "RssAnon_MiB": round(st.get("RssAnon", 0) / 1024, 1), "RssFile_MiB": round(st.get("RssFile", 0) / 1024, 1),
            "Threads": st.get("Threads", 0)}


def nodes_with_gpu_class(lc: localcluster.Cluster, nodes: list[str]) -> None:
    """Kubelet-less ``nodes`` for the bench's plugins, and the DeviceClass their claims name."""
    lc.create_fake_nodes(nodes)
    subprocess.run([str(Path(lc.meta()["bin_dir"]) / "kubectl"), f"--kubeconfig={lc.admin_kubeconfig}",
                    "apply", "-f", str(REPO / "deviceclasses/gpu.topodra.io.yaml")],
                   check=True, capture_output=True)
