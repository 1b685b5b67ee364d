"""Issue 15: the placement scorer beside the real kube-scheduler, on simulated DGX H100 nodes.

The same workload runs twice on four fresh 8-GPU nodes: sixteen 1-GPU pods, one at a time, each
asking for a DGX share of CPU and memory (12 CPU, 96Gi per GPU), then one 8-GPU pod on one NVLink
domain. With stock scoring, NodeResourcesFit's LeastAllocated puts each small pod on the least
loaded node, so they spread 4 per node and the 8-GPU pod stays Pending with half the GPUs free.
With the scorer (`topodra placement-scorer`, wired in as a prioritize-only extender through the
harness) they pack onto two nodes and the 8-GPU pod gets a whole server.  The outcome of each run
does not depend on how ties are broken: LeastAllocated always evens the nodes out, the scorer
always fills the started node first.
"""

from __future__ import annotations

import re
import subprocess
import sys
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
from test_scheduling_topology import Scenario, apply_example, one, scenario_maker
from testkit.handle import ClusterHandle, wait_for
from testkit.paths import REPO
from testkit.ports import free_port

from topodra.apipaths import slices_path

pytestmark = pytest.mark.cluster

SMALL_PODS = 16  # half of the 32 GPUs
PER_GPU = {"cpu": "12", "memory": "96Gi"}  # fake nodes: 128 CPU, 2Ti


@pytest.fixture
def scenarios(cluster: ClusterHandle) -> Iterator[Callable[..., Scenario]]:
    yield from scenario_maker(cluster)


@pytest.fixture
def stock_scheduler(cluster: ClusterHandle) -> Iterator[None]:
    """Whatever a test does to the scheduler's config, the next test gets the stock one back."""
    yield
    if cluster.lc.meta().get("scheduler_config"):
        cluster.lc.restart_scheduler()


class ScorerProcess:
    """`topodra placement-scorer` as its own process, watching the test cluster."""

    def __init__(self, cluster: ClusterHandle, log: Path, args: Sequence[str] = ()) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self._logf = log.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "topodra.cli", "placement-scorer", "--kubeconfig", cluster.kubeconfig,
             "--listen", f"127.0.0.1:{self.port}", *args], stdout=self._logf, stderr=subprocess.STDOUT)
        wait_for(self._ready, 30, "placement scorer ready (every kind listed)")

    def _ready(self) -> bool:
        assert self.proc.poll() is None, f"scorer exited: {self.log.read_text()[-2000:]}"
        with urllib.request.urlopen(f"{self.url}/readyz", timeout=2) as r:
            return bool(r.status == 200)

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=5) as r:
            text = r.read().decode()
        m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._logf.close()


def one_gpu_template(s: Scenario) -> str:
    s.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
              "metadata": {"name": "one-gpu"}, "spec": {"spec": {"devices": {"requests": [
                  {"name": "gpus", "exactly": {"deviceClassName": "gpu.topodra.io", "count": 1}}]}}}})
    return "one-gpu"


def small_pod(template: str) -> dict[str, object]:
    """A 1-GPU pod with a DGX share of CPU and memory (LeastAllocated then spreads such pods)."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {}, "spec": {
        "restartPolicy": "Never",
        "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": template}],
        "containers": [{"name": "main", "image": "localhost/busybox:1.35", "imagePullPolicy": "Never",
                        "command": ["true"],
                        "resources": {"requests": dict(PER_GPU), "claims": [{"name": "gpus"}]}}]}}


def fill_then_ask_for_8(s: Scenario) -> tuple[Counter[str], str]:
    """Sixteen 1-GPU pods one at a time (each bound before the next), then an 8-GPU NVLink pod.

    The 8-GPU pod asks for no CPU, so only its claim can keep it Pending.
    """
    small = one_gpu_template(s)
    placed: Counter[str] = Counter()
    for i in range(SMALL_PODS):
        s.pod(f"small-{i}", small, s.nodes(), small_pod(small))
        node, _results = s.wait_allocated(f"small-{i}")
        placed[node] += 1
    big, base = apply_example(s, "gpu-8-nvlink")
    s.pod("big", big, s.nodes(), base)
    return placed, "big"


def test_stock_scoring_strands_the_8_gpu_job_and_the_scorer_does_not(
        cluster: ClusterHandle, scenarios: Callable[..., Scenario], tmp_path: Path,
        stock_scheduler: None) -> None:
    cluster.apply_yaml(REPO / "deviceclasses")
    if cluster.lc.meta().get("scheduler_config"):
        cluster.lc.restart_scheduler()

    # Stock kube-scheduler: LeastAllocated spreads the small pods evenly.
    stock = scenarios([("h100", "dgx-h100", 4)], "stock")
    placed, big = fill_then_ask_for_8(stock)
    assert sorted(placed.values()) == [4, 4, 4, 4], placed
    message = stock.wait_unschedulable(big)
    # The scenario's 4 nodes cannot take the claim; other nodes of the session's cluster (the real
    # node, other tests' simulated nodes) are excluded by the pod's node affinity.
    assert "4 cannot allocate all claims" in message, message
    stock.close()

    # The same workload with the scorer: the small pods pack, a whole server stays free.
    s = ScorerProcess(cluster, tmp_path / "scorer.log")
    try:
        cluster.lc.restart_scheduler(scheduler_extender=s.url)
        packed = scenarios([("h100", "dgx-h100", 4)], "packed")
        # Every slice the API holds, not just 4: slices other tests left on their nodes count too, and
        # would let a scorer that has not seen this scenario's nodes yet score the first pods.
        published = len(list(cluster.kube.list(slices_path(), field_selector="spec.driver=gpu.topodra.io")))
        wait_for(lambda: s.metric('topodra_placement_cache_objects{kind="slices"}') >= published, 30,
                 f"scorer sees all {published} slices, the new nodes' among them")
        placed, big = fill_then_ask_for_8(packed)
        assert sorted(placed.values()) == [0, 0, 8, 8] or sorted(placed.values()) == [8, 8], placed
        node, results = packed.wait_allocated(big)
        assert node not in placed
        devs = packed.devices(results)
        assert len(devs) == 8
        one(d["nvlinkDomain"] for d in devs)
        assert s.metric("topodra_placement_prioritize_duration_seconds_count") >= SMALL_PODS
        assert s.metric('topodra_placement_prioritize_total{result="ok"}') >= SMALL_PODS
    finally:
        s.stop()


def test_scheduling_goes_on_when_the_scorer_is_down(
        cluster: ClusterHandle, scenarios: Callable[..., Scenario], stock_scheduler: None) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    cluster.lc.restart_scheduler(scheduler_extender=dead)
    extenders = cluster.lc.meta()["scheduler_config"]["extenders"]
    assert [e["urlPrefix"] for e in extenders] == [dead] and extenders[0]["ignorable"] is True
    s = scenarios([("h100", "dgx-h100", 2)], "noscorer")
    small = one_gpu_template(s)
    for i in range(3):
        s.pod(f"p-{i}", small, s.nodes())
        node, results = s.wait_allocated(f"p-{i}", timeout=60)
        assert node in s.nodes() and len(results) == 1
    # The harness reads the scheduler's metrics as the admin (benchmarks wait on its pending pods).
    metrics = cluster.lc.scheduler_metrics()
    assert re.search(r'^scheduler_pending_pods\{queue="active"\} 0$', metrics, re.M), metrics[:500]
