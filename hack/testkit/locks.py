"""Who may run a cluster now: the fixed-port shared cluster has one lock, each private instance its own."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
from collections.abc import Iterator

from testkit.errors import ClusterError
from testkit.log import log

# Every user of the fixed-port local cluster (pytest fixtures, benchmarks) takes this lock first.
CLUSTER_LOCK_FILE = "/tmp/topodra-test-cluster.lock"


def instance_lock_file(instance: str) -> str:
    """The lock of a private cluster instance (see ``Cluster.private``): one run per instance name."""
    if not instance or not all(ch.isalnum() or ch in "-_" for ch in instance):
        raise ClusterError(f"cluster instance name must be letters, digits, '-' or '_', got {instance!r}")
    return f"/tmp/topodra-cluster-{instance}.lock"


@contextlib.contextmanager
def cluster_lock(timeout: float, path: str = CLUSTER_LOCK_FILE) -> Iterator[None]:
    """The local cluster uses fixed ports: take turns with the pytest fixtures and other benchmarks.

    ``path`` names another lock (``instance_lock_file``) for a private instance, which shares
    nothing with the fixed-port cluster and so never waits for it.
    A blocking flock (bounded by SIGALRM) queues us fairly behind the other waiters; polling with
    LOCK_NB let every blocking waiter (pytest) go first, so a bench could wait for ever."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for {path} (another test session or benchmark runs a cluster)")

            def expired(_sig: int, _frame: object) -> None:
                raise TimeoutError

            old = signal.signal(signal.SIGALRM, expired)
            signal.alarm(max(1, int(timeout)))
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except TimeoutError:
                raise ClusterError(f"{path} still held by another cluster user after "
                                   f"{timeout:.0f}s") from None
            finally:
                signal.alarm(0)
                signal.signal(signal.SIGALRM, old)
        yield
    finally:
        os.close(fd)
