"""The other DRA kubelet plugin of ``--compare-with``: its argument template, its process, its registration.

``--compare-with BINARY`` runs a second DRA kubelet plugin next to topodra in the same cluster:
topodra serves the kubelet-less node NODE, the other plugin OTHER_NODE, each with its own
directories. The benchmark finds the other plugin the way the kubelet does (GetInfo on the
registration socket it creates in its registry directory), selects its devices with a DeviceClass
on its driver name, and has the real scheduler allocate claims from the ResourceSlices it publishes.
"""

from __future__ import annotations

import os
import shlex
import string
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import grpc
from bench.prepare.common import DRIVER, BenchError
from testkit import cluster as localcluster
from testkit import procs
from testkit.kubeletstub import KubeletStub

from topodra.apipaths import slices_path
from topodra.kube import Kube

OTHER_NODE = "fake-bench-1"
OTHER_CLASS = "bench-compare"
OTHER_DEVICES = 8
PLACEHOLDERS: dict[str, str] = {
    "node": "name of the other plugin's node",
    "kubeconfig": "admin kubeconfig of the local cluster",
    "plugins_dir": "kubelet plugins directory (the plugin makes <driver>/dra.sock in it)",
    "registry_dir": "kubelet plugin registry directory (where the registration socket goes)",
    "cdi_root": "CDI spec directory",
    "state_dir": "an empty private directory for anything else",
    "metrics_port": "a free loopback port",
    "health_port": "another free loopback port",
}
# kubernetes-sigs/dra-example-driver's dra-example-kubeletplugin: 8 GPUs, the client rate limit out of the way,
# and, like topodra in this benchmark, its metrics and health servers on.
EXAMPLE_ARGS = ("--node-name={node} --kubeconfig={kubeconfig} --kubelet-plugins-directory-path={plugins_dir} "
                "--kubelet-registrar-directory-path={registry_dir} --cdi-root={cdi_root} --num-devices=8 "
                "--device-profile=gpu --kube-api-qps=10000 --kube-api-burst=10000 --metrics-port={metrics_port} "
                "--healthcheck-port={health_port}")


def expand_template(template: str, values: Mapping[str, str]) -> list[str]:
    """Shell-split ``template``, then fill ``{placeholder}`` fields of each word from ``values``.

    Splitting first keeps a path with spaces one argument. Only bare names in ``values`` are
    accepted (no ``{0}``, ``{x.attr}``, ``{x!r}`` or format specs); ``{{``/``}}`` are literal braces.
    """
    try:
        words = shlex.split(template)
    except ValueError as e:
        raise BenchError(f"--compare-args: {e}") from None
    out = []
    for word in words:
        parts = []
        try:
            parsed = list(string.Formatter().parse(word))
        except ValueError as e:
            raise BenchError(f"--compare-args: {word!r}: {e}") from None
        for literal, name, spec, conversion in parsed:
            parts.append(literal)
            if name is None:
                continue
            if name not in values or spec or conversion:
                raise BenchError(f"--compare-args: {word!r} uses {{{name}{'!' + conversion if conversion else ''}"
                                 f"{':' + spec if spec else ''}}}; the placeholders are "
                                 + ", ".join(f"{{{k}}}" for k in sorted(values)))
            parts.append(values[name])
        out.append("".join(parts))
    return out


class OtherPlugin:
    """The plugin to compare with: ``binary`` started with the expanded template, its own directories."""

    def __init__(self, binary: Path, template: str, kubeconfig: Path, root: Path, log_path: Path,
                 extra_env: dict[str, str]) -> None:
        self.root = root
        self.plugins_dir, self.registry_dir, self.cdi_root = root / "plugins", root / "registry", root / "cdi"
        state = root / "state"
        for d in (self.plugins_dir, self.registry_dir, self.cdi_root, state):
            d.mkdir(parents=True, exist_ok=True)
        values = {"node": OTHER_NODE, "kubeconfig": str(kubeconfig), "plugins_dir": str(self.plugins_dir),
                  "registry_dir": str(self.registry_dir), "cdi_root": str(self.cdi_root), "state_dir": str(state),
                  "metrics_port": str(localcluster.free_port()), "health_port": str(localcluster.free_port())}
        assert values.keys() == PLACEHOLDERS.keys()
        self.argv = [str(binary), *expand_template(template, values)]
        self.log_path = log_path
        self.env = {**os.environ, **extra_env}
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = 0.0

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.started = time.monotonic()
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                         cwd=self.root, start_new_session=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def sample_rss(self) -> dict[str, int]:
        assert self.proc is not None
        return localcluster.proc_status(self.proc.pid)

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after 30 s; the exit code (None if never started)."""
        if self.proc is None:
            return None
        rc = procs.stop(self.proc)
        self.proc = None
        return rc

    def tail(self, n: int = 40) -> str:
        return localcluster.tail(self.log_path, n)

    def spec_exists(self, claim_uid: str) -> bool:
        """Transient CDI specs carry the claim UID in their file name (the CDI library's convention)."""
        return any(claim_uid in p.name for p in self.cdi_root.iterdir())

    def ready(self, kube: Kube, timeout: float) -> tuple[str, Path, frozenset[str], float]:
        """Registered and published: (driver name, DRA socket, pool names, seconds since start)."""
        driver, socket = self.discover(timeout)
        if driver == DRIVER:
            raise BenchError(f"the other plugin registers {DRIVER} too; give it another driver name")
        pools = wait_published(kube, driver, OTHER_NODE, OTHER_DEVICES, timeout)
        return driver, socket, pools, time.monotonic() - self.started

    def discover(self, timeout: float) -> tuple[str, Path]:
        """Like the kubelet's plugin watcher: GetInfo on a socket in the registry directory, then
        NotifyRegistrationStatus(true). Returns (driver name, DRA socket)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise BenchError(f"{self.argv[0]} exited with {self.proc.returncode if self.proc else '?'}:\n"
                                 f"{self.tail()}")
            for sock in sorted(self.registry_dir.glob("*.sock")):
                with KubeletStub(sock) as reg:
                    try:
                        info = reg.get_info()
                    except grpc.RpcError:
                        continue
                    if info.type != "DRAPlugin":
                        continue
                    if "v1.DRAPlugin" not in info.supported_versions:
                        raise BenchError(f"{info.name} serves {list(info.supported_versions)}, not v1.DRAPlugin")
                    reg.notify_registration(True)
                    return str(info.name), Path(info.endpoint)
            time.sleep(0.2)
        raise BenchError(f"no DRA registration socket in {self.registry_dir} after {timeout:.0f}s:\n{self.tail()}")


def wait_published(kube: Kube, driver: str, node: str, devices: int, timeout: float) -> frozenset[str]:
    """Until ``driver`` has published at least ``devices`` devices for ``node``; returns its pool names."""
    deadline = time.monotonic() + timeout
    found: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        found = list(kube.list(slices_path(), field_selector=f"spec.driver={driver},spec.nodeName={node}"))
        if sum(len(s["spec"].get("devices") or []) for s in found) >= devices:
            return frozenset(s["spec"]["pool"]["name"] for s in found)
        time.sleep(0.25)
    raise BenchError(f"{driver} published {sum(len(s['spec'].get('devices') or []) for s in found)} devices for "
                     f"{node} within {timeout:.0f}s; the comparison needs {devices}")
