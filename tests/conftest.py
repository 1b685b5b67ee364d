"""Session fixtures that run tests against the real local cluster (testkit.cluster), and tier markers.

``cluster`` brings up the control plane once per test run; ``node_cluster`` the
same plus containerd and a real kubelet.  Asking for ``node_cluster`` after
``cluster`` upgrades the running cluster (the control plane is restarted with a
node) so the whole run shares one cluster.  ``workload_cluster`` and
``workload_node_cluster`` do the same with the Workload API and topology-aware
workload scheduling turned on (``testkit.cluster.GATE_SETS``); once upgraded, the
rest of the run keeps the gates (they change nothing for pods without a PodGroup).  ``resource_beta_cluster``
adds the resource.k8s.io beta versions the same way.  Component logs are copied to
``.run/logs/<timestamp>`` in the repo when the session ends, pass or fail.
"""

from __future__ import annotations

import fcntl
import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from testkit.cluster import TOPOLOGY_SCHEDULING, WORKLOAD_API, Cluster, default_state_dir, stop_demo_cluster
from testkit.handle import ClusterHandle
from testkit.locks import CLUSTER_LOCK_FILE
from testkit.paths import REPO
from testkit.procs import pid_alive

LOG_ARCHIVE = REPO / ".run" / "logs"
TESTS = Path(__file__).resolve().parent
# The tier a test's directory names sets its marker, so `-m "not cluster and not node"` and the
# cluster lock follow where a file lives; explicit @pytest.mark.cluster / node markers still work.
TIER_MARKERS = {"cluster": "cluster", "node": "node"}


class _Manager:
    """One cluster per pytest session, upgraded to a node cluster on demand."""

    def __init__(self) -> None:
        self.lc: Cluster | None = None
        self.with_node = False
        self.features: frozenset[str] = frozenset()
        self.owned = False
        self._lock_fd: int | None = None
        self.leftovers: list[str] = []
        self.config: pytest.Config | None = None  # set by pytest_configure: where the one-line notices go

    def _lock(self) -> None:
        """The cluster uses fixed loopback ports: concurrent test sessions on one machine take turns."""
        if self._lock_fd is None:
            self._lock_fd = os.open(CLUSTER_LOCK_FILE, os.O_CREAT | os.O_RDWR, 0o644)
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)

    def get(self, node: bool, features: frozenset[str] = frozenset()) -> ClusterHandle:
        if self.lc is None or (node and not self.with_node) or not features <= self.features:
            self._start(node or self.with_node, features | self.features)
        assert self.lc is not None
        return ClusterHandle(self.lc, self.with_node)

    def _start(self, node: bool, features: frozenset[str] = frozenset()) -> None:
        self._lock()
        state = os.environ.get("TOPODRA_TEST_CLUSTER_DIR") or tempfile.mkdtemp(prefix="topodra-test-cluster-")
        if self.lc is not None:
            self._stop_cluster()
        elif Path(state).resolve() != default_state_dir().resolve():
            self._stop_demo()
        lc = Cluster(state_dir=Path(state))
        if not os.environ.get("TOPODRA_TEST_CLUSTER_DIR"):
            # A fresh temp dir: let the harness own it (it refuses non-empty foreign dirs).
            Path(state).rmdir()
        lc.up(node=node, build=True, features=sorted(features))
        self.lc, self.with_node, self.features, self.owned = lc, node, features, True

    def _stop_demo(self) -> None:
        """``make demo`` leaves its cluster running on the ports and the node these tests need: stop it and
        say so in one line on the terminal (past pytest's capture), so ``make demo`` then ``make test`` passes."""
        line = stop_demo_cluster()
        if line is None:
            return
        plugins = self.config.pluginmanager if self.config else None
        reporter = plugins.get_plugin("terminalreporter") if plugins else None
        capture = plugins.get_plugin("capturemanager") if plugins else None
        if reporter is None or capture is None:
            print(f"[topodra] {line}", file=sys.stderr)
            return
        with capture.global_and_fixture_disabled():  # fixtures run with stdout captured at the fd level
            reporter.write_line(f"\n[topodra] {line}")

    def _stop_cluster(self) -> None:
        if self.lc is not None and self.owned:
            os.environ["TOPODRA_LOG_ARCHIVE"] = str(LOG_ARCHIVE)
            pids = dict(self.lc.meta().get("pids") or {})
            self.lc.down(quiet=True, keep_logs=True)
            # `down` must leave nothing behind: no process, no mount, no state directory.
            alive = {n: p for n, p in pids.items() if pid_alive(p)}
            mounts = list(self.lc._mounts())
            if alive or mounts or self.lc.state_dir.exists():
                self.leftovers.append(f"after down: processes {alive}, mounts {mounts}, "
                                      f"state dir exists: {self.lc.state_dir.exists()}")
        self.lc = None

    def stop(self) -> None:
        self._stop_cluster()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


_MANAGER = _Manager()


def pytest_configure(config: pytest.Config) -> None:
    _MANAGER.config = config


@pytest.fixture(autouse=True)
def _logging_enabled() -> Iterator[None]:
    """bench's campaigns silence logging process-wide (``reliability_common.quiet``); a later test's
    caplog must not depend on whether one ran before it in the session."""
    yield
    logging.disable(logging.NOTSET)


@pytest.fixture(scope="session")
def cluster() -> Iterator[ClusterHandle]:
    yield _MANAGER.get(node=False)


@pytest.fixture(scope="session")
def node_cluster() -> Iterator[ClusterHandle]:
    yield _MANAGER.get(node=True)


GANG_FEATURES = frozenset({WORKLOAD_API, TOPOLOGY_SCHEDULING})


@pytest.fixture(scope="session")
def workload_cluster() -> Iterator[ClusterHandle]:
    """The control plane with GenericWorkload and TopologyAwareWorkloadScheduling on."""
    yield _MANAGER.get(node=False, features=GANG_FEATURES)


@pytest.fixture(scope="session")
def workload_node_cluster() -> Iterator[ClusterHandle]:
    """``workload_cluster`` plus containerd and the real kubelet."""
    yield _MANAGER.get(node=True, features=GANG_FEATURES)


@pytest.fixture(scope="session")
def resource_beta_cluster() -> Iterator[ClusterHandle]:
    """The control plane serving resource.k8s.io v1beta1 and v1beta2 beside v1 (off by default in 1.37)."""
    yield _MANAGER.get(node=False, features=frozenset({"resource-beta-apis"}))  # testkit.cluster.RESOURCE_BETA_APIS


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _MANAGER.stop()
    if _MANAGER.leftovers:
        print("\nhack/cluster down left things behind:\n  " + "\n  ".join(_MANAGER.leftovers), file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark tests by tier directory; run node tests last and cluster tests before them, and in each tier the
    tests that need the workload gates last, so the cluster is restarted as few times as possible."""
    for item in items:
        try:
            rel = Path(str(item.path)).resolve().relative_to(TESTS)
        except ValueError:
            continue
        marker = TIER_MARKERS.get(rel.parts[0]) if len(rel.parts) > 1 else None
        if marker and not item.get_closest_marker(marker):
            item.add_marker(marker)

    def rank(item: pytest.Item) -> int:
        # A session fixture's handle is bound to the cluster it was made for: a later restart (more gates) leaves
        # it pointing at a removed state directory. So every restart goes one way, and the fixtures of a rank are
        # all made after the restart of the rank before: stock, workload gates, beta resource APIs (one test
        # file, last), then the node tier likewise.
        names = getattr(item, "fixturenames", ())
        gated = 2 if "resource_beta_cluster" in names else int(
            any(f in names for f in ("workload_cluster", "workload_node_cluster")))
        if item.get_closest_marker("node"):
            return 5 + gated
        if item.get_closest_marker("cluster"):
            return 2 + gated
        return 0
    items.sort(key=rank)
