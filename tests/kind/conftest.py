"""The kind suite: topodra installed with its Helm chart on a real kind cluster with stand-in GPUs.

Real kubelets, containerd, DaemonSets and pod networking in docker containers (hack/kind-up), unlike the
rest of the tests, which share one loopback cluster. Not collected by `pytest tests` (norecursedirs);
run it as `make kind-test` (control plane + 3 workers: DGX H100, DGX A100 80GB, DGX H100 with MIG on) or
`make kind-smoke` (one node, the tests marked smoke). Every plugin node runs the chart's real-GPU branch
(hardware nvml) on a host driver tree under STANDIN/<node> (hack/kind-standin).

The session fixture starts a private dockerd when no engine works (hack/dockerd), builds or reuses the
offline node image (hack/kind-image), creates the cluster, and always deletes it again, on success and
on failure (TOPODRA_KIND_KEEP=1 keeps it for debugging). Phase times are printed at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
from testkit.ports import free_port

REPO = Path(__file__).resolve().parents[2]
HACK = REPO / "hack"

T = TypeVar("T")
CLUSTER = os.environ.get("TOPODRA_KIND_CLUSTER", "topodra-test")
TOPOLOGY = os.environ.get("TOPODRA_KIND_TOPOLOGY", "full")  # full: 3 nodes; single: 1 node (kind-smoke)
KEEP = os.environ.get("TOPODRA_KIND_KEEP") == "1"
DRIVER = "gpu.topodra.io"
PLUGIN_NS = "topodra-system"
CDI_DIR = "/var/run/cdi"
# Where hack/kind-up puts the nodes' host driver trees: STANDIN/<node>/{driver,sys} (hack/kind_standin.py).
STANDIN = Path(os.environ.get("TOPODRA_KIND_STANDIN_DIR", "/var/tmp/topodra-kind")) / CLUSTER
TIMINGS: dict[str, float] = {}
KIND_TEST_TIMEOUT = 1800  # s per test, the first one's share of the session fixture (kind-up) included


def run(argv: list[str], *, env: dict[str, str] | None = None, timeout: float = 600, check: bool = True,
        input: str | None = None) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(argv, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=timeout,
                       input=input, check=False)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} failed ({r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}")
    return r


def timed(name: str, argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    t0 = time.monotonic()
    try:
        return run(argv, **kw)
    finally:
        TIMINGS[name] = time.monotonic() - t0


def wait_until(what: str, probe: Callable[[], T | None], timeout: float = 180, interval: float = 1.0) -> T:
    """Poll probe until it returns something other than None/False; fail with what was awaited."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            got = probe()
            if got is not None and got is not False:
                return got
        except (AssertionError, subprocess.SubprocessError, KeyError, ValueError) as e:
            last = e
        time.sleep(interval)
    detail = f" (last error: {last})" if last else ""
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}{detail}")


@dataclass
class Kind:
    """Handle on the suite's kind cluster: kubectl in its context and commands inside its node containers."""

    name: str
    topology: str
    kubectl: str
    engine: str = "docker"
    created: list[str] = field(default_factory=list)

    @property
    def context(self) -> str:
        return f"kind-{self.name}"

    def k(self, *args: str, input: str | None = None, check: bool = True,
          timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return run([self.kubectl, "--context", self.context, *args], input=input, check=check, timeout=timeout)

    def get(self, *args: str) -> Any:
        return json.loads(self.k("get", "-o", "json", *args).stdout)

    def apply(self, ns: str, manifest: str) -> None:
        self.k("apply", "-n", ns, "-f", "-", input=manifest)

    def node_exec(self, node: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a command inside a node's container (kind names containers after their nodes)."""
        return run([self.engine, "exec", node, *argv], check=check, timeout=60)

    def cdi_spec_exists(self, node: str, claim_uid: str) -> bool:
        path = f"{CDI_DIR}/k8s.{DRIVER}-claim_{claim_uid}.json"
        return self.node_exec(node, "test", "-f", path, check=False).returncode == 0

    def tree(self, node: str) -> Path:
        """The host driver tree the node mounts (its driver root, as a GPU node's)."""
        return STANDIN / node / "driver"

    def nodes_by_profile(self) -> dict[str, str]:
        """mock profile -> node name, from the labels deploy/kind/*.yaml put on the plugin nodes."""
        nodes = self.get("nodes", "-l", "topodra.io/mock-profile")["items"]
        return {n["metadata"]["labels"]["topodra.io/mock-profile"]: n["metadata"]["name"] for n in nodes}

    def pod(self, ns: str, name: str) -> Any:
        return self.get("pod", "-n", ns, name)

    def wait_pod_phase(self, ns: str, name: str, phases: tuple[str, ...], timeout: float = 180) -> Any:
        def probe() -> Any:
            p = self.pod(ns, name)
            phase = p["status"].get("phase")
            if phase == "Failed" and "Failed" not in phases:
                logs = self.k("logs", "-n", ns, name, "--all-containers", check=False).stdout
                raise AssertionError(f"pod {ns}/{name} failed: {logs}")
            return p if phase in phases else None
        try:
            return wait_until(f"pod {ns}/{name} in {phases}", probe, timeout)
        except AssertionError:
            print(self.k("describe", "pod", "-n", ns, name, check=False).stdout, file=sys.stderr)
            raise

    def claim_of(self, pod: Any, claim: str = "gpus") -> Any:
        """The ResourceClaim a pod's claim entry resolved to (generated from a template or named directly)."""
        ns = pod["metadata"]["namespace"]
        for st in pod["status"].get("resourceClaimStatuses") or []:
            if st["name"] == claim:
                return self.get("resourceclaim", "-n", ns, st["resourceClaimName"])
        for rc in pod["spec"].get("resourceClaims") or []:
            if rc["name"] == claim and rc.get("resourceClaimName"):
                return self.get("resourceclaim", "-n", ns, rc["resourceClaimName"])
        raise AssertionError(f"pod {ns}/{pod['metadata']['name']} has no claim {claim!r}")

    def plugin_pod_on(self, node: str) -> Any | None:
        pods = self.get("pods", "-n", PLUGIN_NS, "-l", "app.kubernetes.io/component=kubelet-plugin",
                        "--field-selector", f"spec.nodeName={node}")["items"]
        live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        return live[0] if len(live) == 1 else None


def _engine() -> str:
    return os.environ.get("CONTAINER_TOOL", "docker")


@pytest.fixture(scope="session")
def kind() -> Iterator[Kind]:
    """Bring up the kind cluster (and, if needed, a private dockerd); tear both down whatever happens."""
    started_dockerd = False
    env = {"KIND_CLUSTER_NAME": CLUSTER, "KIND_API_SERVER_PORT": str(free_port()),
           "TOPODRA_KIND_STANDIN_DIR": str(STANDIN.parent)}
    bins = run([str(HACK / "build-bins"), "--print"]).stdout.strip()
    kind_bin = run([str(HACK / "kind-image"), "--kind"]).stdout.strip()
    kind_cmd = kind_bin if Path(kind_bin).exists() else "kind"
    try:
        if run([str(HACK / "dockerd"), "status"]).stdout.strip() == "stopped":
            timed("dockerd up", [str(HACK / "dockerd"), "up"])
            started_dockerd = True
        if not os.environ.get("KIND_NODE_IMAGE"):
            timed("kind-image (node image, cached when built)", [str(HACK / "kind-image")], timeout=3600)
            kind_cmd = kind_bin
        # A cluster of this name left by an interrupted run would make `kind create` fail.
        run([kind_cmd, "delete", "cluster", "--name", CLUSTER], check=False)
        up = [str(HACK / "kind-up")] + (["--single"] if TOPOLOGY == "single" else [])
        r = timed("kind-up (cluster, image load, helm install, slices published)", up, env=env, timeout=1200,
                  check=False)
        if r.returncode != 0:
            raise AssertionError(f"hack/kind-up failed ({r.returncode}):\n{r.stdout[-6000:]}\n{r.stderr[-6000:]}")
        yield Kind(name=CLUSTER, topology=TOPOLOGY, kubectl=str(Path(bins) / "kubectl"), engine=_engine())
    finally:
        if KEEP:
            print(f"\nTOPODRA_KIND_KEEP=1: cluster {CLUSTER} kept (hack/kind-up down with KIND_CLUSTER_NAME={CLUSTER})",
                  file=sys.stderr)
        else:
            timed("kind-up down", [str(HACK / "kind-up"), "down"], env=env, check=False)
            if started_dockerd:
                timed("dockerd down", [str(HACK / "dockerd"), "down"], check=False)


@pytest.fixture
def ns(kind: Kind) -> Iterator[str]:
    """A namespace per test, deleted (and waited for, so its claims are unprepared) afterwards."""
    name = f"kt-{uuid.uuid4().hex[:8]}"
    kind.k("create", "namespace", name)
    try:
        yield name
    finally:
        kind.k("delete", "namespace", name, "--wait=true", "--timeout=180s", check=False, timeout=240)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On the one-node topology only the tests marked smoke apply (the others need both mock servers).

    The session fixture's setup counts against the first test's pytest-timeout: kind-up alone may take its own
    limit (1200 s; 600 s was exceeded at load 30-50 on 2 cores), so kind tests get more than the default."""
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(KIND_TEST_TIMEOUT))
    if TOPOLOGY != "single":
        return
    keep = [i for i in items if i.get_closest_marker("smoke")]
    dropped = [i for i in items if not i.get_closest_marker("smoke")]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if TIMINGS:
        terminalreporter.write_sep("-", "kind phase timings")
        for name, secs in TIMINGS.items():
            terminalreporter.write_line(f"{secs:8.1f} s  {name}")
