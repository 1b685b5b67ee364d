"""topodra on kind: the examples, ClaimProfile fallback across nodes, shared claims, CDI cleanup, plugin restarts.

Everything runs against kind's real kubelets, containerd and DaemonSets (see conftest.py). Pods here use the
cluster's pod network (the examples keep their hostNetwork: true, which kind also runs).
"""

from __future__ import annotations

import re
from functools import partial
from typing import Any

import pytest

from .conftest import DRIVER, PLUGIN_NS, REPO, Kind, wait_until

EXAMPLES = REPO / "deploy" / "examples"
IMAGE = "localhost/busybox:1.35"
# Devices each example's pod must receive, by kind (TOPODRA_DEVICE_<name>_KIND lines in its output).
EXPECTED = {
    "claimprofile-train": {"gpu": 4},
    "gpu-1-rail-nic": {"gpu": 1, "nic": 1},
    "gpu-2-basic": {"gpu": 2},
    "gpu-2-distinct-rails": {"gpu": 2},
    "gpu-4-numa": {"gpu": 4},
    "gpu-8-nvlink": {"gpu": 8},
    "gpu-first-available": {"gpu": 2},
}
# Needs H100 NVL bridge pairs; neither mock DGX has them, so the scheduler must refuse it.
UNSATISFIABLE = {"gpu-2-nvl-bridge"}


def injected(log: str) -> dict[str, Any]:
    """What the driver's CDI spec put into a container's environment (from `env | sort` output)."""
    env = dict(line.split("=", 1) for line in log.splitlines() if "=" in line)
    kinds: dict[str, int] = {}
    models = set()
    for k, v in env.items():
        if re.fullmatch(r"TOPODRA_DEVICE_.+_KIND", k):
            kinds[v] = kinds.get(v, 0) + 1
        if re.fullmatch(r"TOPODRA_DEVICE_.+_MODEL", k):
            models.add(v)
    return {"visible": env.get("TOPODRA_VISIBLE_DEVICES", ""), "nvidia": env.get("TOPODRA_VISIBLE_UUIDS", ""),
            "kinds": kinds, "models": models}


def logged_devices(kind: Kind, ns: str, pod: str, container: str = "c0") -> dict[str, Any] | None:
    """injected() of a running container's log, once it has printed its environment."""
    got = injected(kind.k("logs", "-n", ns, pod, "-c", container).stdout)
    return got if got["kinds"] else None


def slice_strings(kind: Kind, node: str) -> set[str]:
    """Every string attribute value (models, UUIDs, ...) of the devices a node's ResourceSlices publish."""
    slices = kind.get("resourceslices", "--field-selector", f"spec.driver={DRIVER},spec.nodeName={node}")
    return {v["string"] for s in slices["items"] for d in s["spec"].get("devices") or []
            for v in (d.get("attributes") or {}).values() if "string" in v}


def claim_pod(name: str, *, template: str | None = None, claim: str | None = None, containers: int = 1,
              command: str = "env | sort; sleep 3600", node: str | None = None) -> str:
    """A pod manifest using one claim (from a template or an existing ResourceClaim) in every container."""
    ref = f"resourceClaimTemplateName: {template}" if template else f"resourceClaimName: {claim}"
    ctrs = "".join(f"""
    - name: c{i}
      image: {IMAGE}
      imagePullPolicy: Never
      command: ["sh", "-c", {command!r}]
      resources:
        claims: [{{name: gpus}}]""" for i in range(containers))
    pin = f"\n  nodeSelector: {{kubernetes.io/hostname: {node}}}" if node else ""
    return f"""
apiVersion: v1
kind: Pod
metadata:
  name: {name}
spec:
  restartPolicy: Never
  terminationGracePeriodSeconds: 1{pin}
  resourceClaims:
  - name: gpus
    {ref}
  containers:{ctrs}
"""


def gpu_template(name: str, count: int, device_class: str = "gpu.topodra.io") -> str:
    return f"""
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata:
  name: {name}
spec:
  spec:
    devices:
      requests:
      - name: gpus
        exactly: {{deviceClassName: {device_class}, count: {count}}}
"""


@pytest.mark.smoke
@pytest.mark.parametrize("example", sorted(p.stem for p in EXAMPLES.glob("*.yaml")))
def test_example(kind: Kind, ns: str, example: str) -> None:
    """Each deploy/examples manifest, unchanged: its pod gets exactly the devices it asks for."""
    kind.k("apply", "-n", ns, "-f", str(EXAMPLES / f"{example}.yaml"))
    pod_name = kind.get("pods", "-n", ns)["items"][0]["metadata"]["name"]
    if example in UNSATISFIABLE:
        def unschedulable() -> bool:
            conds = {c["type"]: c for c in kind.pod(ns, pod_name)["status"].get("conditions") or []}
            c = conds.get("PodScheduled")
            return bool(c and c["status"] == "False" and c.get("reason") == "Unschedulable")
        wait_until(f"{example} reported Unschedulable", unschedulable, timeout=120)
        return
    assert example in EXPECTED, f"new example {example}: add its expected devices to EXPECTED"
    pod = kind.wait_pod_phase(ns, pod_name, ("Succeeded",), timeout=240)
    got = injected(kind.k("logs", "-n", ns, pod_name).stdout)
    assert got["kinds"] == EXPECTED[example], got
    assert len(got["visible"].split(",")) == sum(EXPECTED[example].values()), got
    assert len(got["nvidia"].split(",")) == EXPECTED[example]["gpu"], got
    # The generated claim is gone once the pod is done; its GPUs must be ones the pod's node publishes.
    published = slice_strings(kind, pod["spec"]["nodeName"])
    assert set(got["nvidia"].split(",")) <= published, (got["nvidia"], pod["spec"]["nodeName"])


def test_claimprofile_falls_back_from_h100_worker_to_a100_worker(kind: Kind, ns: str) -> None:
    """A ClaimProfile preferring 8 H100s, else 8 A100 80GB: the first pod fills the H100 worker, the second
    lands on the A100 worker through the rendered template's next alternative."""
    nodes = kind.nodes_by_profile()
    assert {"dgx-h100", "dgx-a100-80gb"} <= set(nodes), nodes
    kind.apply(ns, """
apiVersion: topodra.io/v1alpha1
kind: ClaimProfile
metadata:
  name: eight
spec:
  alternatives:
  - {deviceClassName: gpu-h100, count: 8}
  - {deviceClassName: gpu-a100-80gb, count: 8}
  topology:
    nvlink: Required
""")
    wait_until("the controller to render ResourceClaimTemplate eight",
               lambda: kind.k("get", "resourceclaimtemplate", "-n", ns, "eight", check=False).returncode == 0,
               timeout=120)
    placed: dict[str, Any] = {}
    for pod_name, profile, model in (("first", "dgx-h100", "H100"), ("second", "dgx-a100-80gb", "A100")):
        kind.apply(ns, claim_pod(pod_name, template="eight"))
        pod = kind.wait_pod_phase(ns, pod_name, ("Running",))
        assert pod["spec"]["nodeName"] == nodes[profile], (pod_name, pod["spec"]["nodeName"], nodes)
        got = wait_until(f"{pod_name}'s environment in its log", partial(logged_devices, kind, ns, pod_name))
        assert got["kinds"] == {"gpu": 8}, got
        assert got["models"] and all(model in m for m in got["models"]), got
        results = kind.claim_of(pod)["status"]["allocation"]["devices"]["results"]
        assert len(results) == 8 and all(r["pool"] == nodes[profile] for r in results), results
        placed[pod_name] = {r["request"] for r in results}
    # Two different alternatives of the same request were chosen (gpus/<h100 sub> then gpus/<a100 sub>).
    assert len(placed["first"]) == 1 and len(placed["second"]) == 1 and placed["first"] != placed["second"], placed
    assert all(r.startswith("gpus/") for rs in placed.values() for r in rs), placed


@pytest.mark.smoke
def test_two_containers_share_one_claim(kind: Kind, ns: str) -> None:
    """Both containers of a pod get the same devices from one claim, prepared once (one CDI spec)."""
    kind.apply(ns, gpu_template("two", 2))
    kind.apply(ns, claim_pod("shared", template="two", containers=2))
    pod = kind.wait_pod_phase(ns, "shared", ("Running",))
    logs = [wait_until(f"container c{i}'s environment", partial(logged_devices, kind, ns, "shared", f"c{i}"))
            for i in range(2)]
    assert logs[0]["kinds"] == {"gpu": 2}, logs
    assert logs[0]["visible"] and logs[0]["visible"] == logs[1]["visible"], logs
    assert logs[0]["nvidia"] == logs[1]["nvidia"], logs
    claim = kind.claim_of(pod)
    assert kind.cdi_spec_exists(pod["spec"]["nodeName"], claim["metadata"]["uid"])


@pytest.mark.smoke
def test_deleted_pod_removes_its_cdi_spec_on_the_node(kind: Kind, ns: str) -> None:
    """Deleting the pod deletes its generated claim; the plugin unprepares it and removes the CDI spec file
    inside the node container."""
    kind.apply(ns, gpu_template("one", 1))
    kind.apply(ns, claim_pod("victim", template="one"))
    pod = kind.wait_pod_phase(ns, "victim", ("Running",))
    node, uid = pod["spec"]["nodeName"], kind.claim_of(pod)["metadata"]["uid"]
    assert kind.cdi_spec_exists(node, uid), f"no CDI spec for claim {uid} on {node}"
    kind.k("delete", "pod", "-n", ns, "victim", "--wait=true", "--timeout=120s")
    wait_until(f"CDI spec of claim {uid} removed on {node}", lambda: not kind.cdi_spec_exists(node, uid), timeout=120)


@pytest.mark.smoke
def test_plugin_pod_restart_keeps_prepared_claims(kind: Kind, ns: str) -> None:
    """Delete the plugin pod next to a running workload: the DaemonSet starts a new one, the prepared claim
    survives (spec file, workload untouched), and the new plugin still unprepares it later."""
    kind.apply(ns, gpu_template("keep", 2))
    kind.apply(ns, claim_pod("worker", template="keep"))
    pod = kind.wait_pod_phase(ns, "worker", ("Running",))
    node, uid = pod["spec"]["nodeName"], kind.claim_of(pod)["metadata"]["uid"]
    assert kind.cdi_spec_exists(node, uid)
    old = kind.plugin_pod_on(node)
    assert old is not None, f"no plugin pod on {node}"
    kind.k("delete", "pod", "-n", PLUGIN_NS, old["metadata"]["name"], "--wait=false")

    def replaced_and_ready() -> Any:
        new = kind.plugin_pod_on(node)
        if new is None or new["metadata"]["uid"] == old["metadata"]["uid"]:
            return None
        ready = {c["type"]: c["status"] for c in new["status"].get("conditions") or []}.get("Ready")
        return new if ready == "True" else None
    new = wait_until(f"a new Ready plugin pod on {node}", replaced_and_ready, timeout=180)
    assert new["metadata"]["ownerReferences"][0]["kind"] == "DaemonSet"
    # The old pod is gone for good (not just terminating) before we judge what survived it.
    wait_until("the old plugin pod gone", lambda: kind.k("get", "pod", "-n", PLUGIN_NS, old["metadata"]["name"],
                                                         check=False).returncode != 0, timeout=120)
    assert kind.cdi_spec_exists(node, uid), "the restart lost the prepared claim's CDI spec"
    after = kind.pod(ns, "worker")
    assert after["status"]["phase"] == "Running"
    assert after["status"]["containerStatuses"][0]["restartCount"] == 0
    # The node's slice is published again by the new pod.
    slices = kind.get("resourceslices", "--field-selector", f"spec.driver={DRIVER},spec.nodeName={node}")["items"]
    assert slices, f"no ResourceSlice for {node} after the restart"
    # A new claim on the same node is served by the new plugin...
    kind.apply(ns, claim_pod("after", template="keep", node=node))
    kind.wait_pod_phase(ns, "after", ("Running",))
    # ...and the claim prepared by the old one is unprepared by the new one.
    kind.k("delete", "pod", "-n", ns, "worker", "--wait=true", "--timeout=120s")
    wait_until(f"CDI spec of claim {uid} removed by the new plugin", lambda: not kind.cdi_spec_exists(node, uid),
               timeout=120)


def test_every_plugin_node_publishes_its_own_mock_profile(kind: Kind) -> None:
    """One Helm release, two profiles: each worker's slices name its own GPU model and never the other's."""
    nodes = kind.nodes_by_profile()
    assert {"dgx-h100", "dgx-a100-80gb"} <= set(nodes), nodes
    for profile, mine, other in (("dgx-h100", "H100", "A100"), ("dgx-a100-80gb", "A100", "H100")):
        strings = slice_strings(kind, nodes[profile])
        assert any(mine in v for v in strings), (profile, sorted(strings))
        assert not any(other in v for v in strings), (profile, sorted(strings))
