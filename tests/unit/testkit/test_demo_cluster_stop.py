"""``make demo`` then ``make test`` (issue 31): the test run stops the demo's cluster, and only the demo's.

The processes here are ``sleep`` stand-ins recorded in a cluster.json on private ports, so ``down`` touches no
host-wide state (mounts, /etc/hosts, sysctls are only handled for a fixed-port node cluster). The real order,
``make demo`` then ``make test`` on one machine, runs in ``hack/fresh-machine-check`` (FRESH_FULL=1).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from testkit import cluster as localcluster
from testkit.procs import pid_alive


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(["sleep", "300"])
    yield proc
    proc.kill()
    proc.wait()


def record(state: Path, owner: str, pid: int) -> None:
    state.mkdir()
    ports = dataclasses.asdict(localcluster.Ports(20001, 20002, 20003, 20004, 20005))
    (state / "cluster.json").write_text(json.dumps({"pids": {"etcd": pid}, "owner": owner, "ports": ports}))


def test_the_demo_cluster_is_stopped_with_one_line(tmp_path: Path, sleeper: subprocess.Popen[bytes]) -> None:
    state = tmp_path / "demo"
    record(state, localcluster.DEMO_OWNER, sleeper.pid)
    line = localcluster.stop_demo_cluster(state)
    assert line is not None and "demo" in line and str(state) in line and "\n" not in line
    sleeper.wait(timeout=15)  # reaped: down's SIGTERM ended it
    assert not pid_alive(sleeper.pid)
    assert not state.exists()


def test_a_cluster_started_by_hand_is_left_alone_with_a_clear_error(
        tmp_path: Path, sleeper: subprocess.Popen[bytes]) -> None:
    state = tmp_path / "mine"
    record(state, "", sleeper.pid)
    before = (state / "cluster.json").read_text()
    with pytest.raises(localcluster.ClusterError, match=r"started by hand .*hack/cluster down"):
        localcluster.stop_demo_cluster(state)
    assert pid_alive(sleeper.pid)
    assert (state / "cluster.json").read_text() == before


def test_nothing_running_is_nothing_to_stop(tmp_path: Path) -> None:
    assert localcluster.stop_demo_cluster(tmp_path / "absent") is None
    dead = subprocess.Popen(["true"])
    dead.wait()
    state = tmp_path / "stale"
    record(state, localcluster.DEMO_OWNER, dead.pid)
    assert localcluster.stop_demo_cluster(state) is None
    assert (state / "cluster.json").exists()  # a stopped cluster's state is `up`'s to clean, not the tests'

