"""Claims written for NVIDIA's DRA driver, with only the class and driver renamed, on the real node (issue 35).

The claims are ``deploy/examples/nvidia/*.yaml``, loaded unchanged (the docs point at the same files).  The real
scheduler allocates them, the real kubelet has the plugin prepare them and containerd starts the containers, on
mock GPUs: ``dgx-a100-80gb`` for GPUs selected by ``index`` with NVIDIA's ``GpuConfig`` (time slicing records its
level in the mock GPUs' state file; MPS runs the stand-in control daemon, ``topodra.hardware.mockmps``) and
``dgx-a100-80gb-mig`` for MIG devices picked by ``profile`` and paired by ``parentUUID``.  A ``GpuConfig`` field
topodra cannot honour fails the pod's prepare with the field named and leaves nothing on the node.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_plugin_e2e import delete_pod, env_of, pod_claim, wait_phase
from testkit.handle import ClusterHandle, wait_for
from testkit.paths import REPO
from testkit.pluginproc import PluginProcess

from topodra import checkpoint
from topodra.apipaths import slices_path
from topodra.hardware import mockmps
from topodra.hardware.mockmig import MigState

pytestmark = pytest.mark.node
R = "/apis/resource.k8s.io/v1"
EXAMPLES = REPO / "deploy/examples/nvidia"
PLAIN, MIG = "mock:dgx-a100-80gb", "mock:dgx-a100-80gb-mig"


class Plugins:
    """One plugin process at a time, on the hardware a test needs (both publish the node's one pool)."""

    def __init__(self, nc: ClusterHandle, tmp: pytest.TempPathFactory) -> None:
        self.nc, self.tmp = nc, tmp
        self.current: PluginProcess | None = None
        self.hardware = ""
        self.state: dict[str, Path] = {}
        boot = tmp.mktemp("boot") / "boot_id"
        boot.write_text(Path("/proc/sys/kernel/random/boot_id").read_text())
        self.boot = boot

    def use(self, hardware: str) -> PluginProcess:
        if self.current is not None and self.hardware == hardware:
            return self.current
        self.stop()
        state = self.state.setdefault(hardware, self.tmp.mktemp("gpu") / "gpu-state.json")
        cfg = self.tmp.mktemp("hw") / "hardware.yaml"
        cfg.write_text(f"migStateFile: {state}\n")
        p = PluginProcess(self.nc.kubeconfig, self.nc.node_name,
                          self.nc.lc.logs / f"topodra-plugin-nvidia-{hardware.split(':')[1]}.log", hardware=hardware,
                          extra_env={"TOPODRA_BOOT_ID_FILE": str(self.boot), "TOPODRA_HARDWARE_CONFIG": str(cfg),
                                     "TOPODRA_MPS_CONTROL": str(Path(mockmps.__file__))})
        p.start()
        self.current, self.hardware = p, hardware
        # Registration does not wait for the publisher, and the pool another plugin left on this node has the same
        # device names: wait for this hardware's devices.
        def ready() -> bool:
            if hardware == MIG:
                return bool(published(self.nc, "gpu-0-mig-1g-10gb-0", "type") == "mig")
            return published(self.nc, "gpu-7", "type") == "gpu" and "A100" in str(published(self.nc, "gpu-7", "model"))

        wait_for(ready, 60, f"{hardware} devices published")
        return p

    def stop(self) -> None:
        if self.current is not None:
            self.current.stop()
            self.current = None


@pytest.fixture(scope="module")
def plugins(node_cluster: ClusterHandle, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plugins]:
    for cls in ("gpu.topodra.io", "mig.topodra.io"):
        node_cluster.apply_yaml(REPO / f"deviceclasses/{cls}.yaml")
    ps = Plugins(node_cluster, tmp_path_factory)
    yield ps
    ps.stop()


def devices_by_name(nc: ClusterHandle) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for s in nc.kube.list(
        slices_path(), field_selector=f"spec.driver=gpu.topodra.io,spec.nodeName={nc.node_name}")
        for d in s["spec"].get("devices") or []}


def published(nc: ClusterHandle, device: str, attribute: str) -> Any:
    d = devices_by_name(nc).get(device)
    if d is None or attribute not in d["attributes"]:
        return None
    return next(iter(d["attributes"][attribute].values()))


def example(name: str) -> dict[str, Any]:
    (doc,) = [d for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d]
    assert doc["kind"] == "ResourceClaimTemplate"
    return dict(doc)


def create_template(nc: ClusterHandle, ns: str, name: str) -> str:
    tmpl = example(name)
    nc.kube.create(f"{R}/namespaces/{ns}/resourceclaimtemplates", tmpl)
    return str(tmpl["metadata"]["name"])


def run_pod(nc: ClusterHandle, ns: str, name: str, template: str, containers: list[str | None], script: str) -> None:
    """A pod on the claim from ``template``; one container per entry, naming that request (None: all of them)."""
    def claim_ref(request: str | None) -> dict[str, str]:
        return {"name": "claim"} if request is None else {"name": "claim", "request": request}

    nc.kube.create(f"/api/v1/namespaces/{ns}/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {"hostNetwork": True, "restartPolicy": "Never", "automountServiceAccountToken": False,
                 "terminationGracePeriodSeconds": 1,
                 "resourceClaims": [{"name": "claim", "resourceClaimTemplateName": template}],
                 "containers": [{"name": f"c{k}", "image": "localhost/busybox:1.35", "imagePullPolicy": "Never",
                                 "command": ["sh", "-c", script], "resources": {"claims": [claim_ref(r)]}}
                                for k, r in enumerate(containers)]}})


def logs(nc: ClusterHandle, ns: str, pod: str, container: str) -> str:
    return nc.kubectl("logs", "-n", ns, pod, "-c", container, check=False)


def wait_done(nc: ClusterHandle, ns: str, pod: str, containers: int) -> None:
    wait_phase(nc, ns, pod, "Running")
    for k in range(containers):
        wait_for(functools.partial(lambda c: "done" in logs(nc, ns, pod, c), f"c{k}"), 30, f"{pod}/c{k}'s output")


def results(claim: dict[str, Any]) -> list[dict[str, Any]]:
    return list(claim["status"]["allocation"]["devices"]["results"])


def device_uuids(env: dict[str, str]) -> dict[str, str]:
    """Per-device UUID variables a container got: device env fragment -> UUID."""
    return {k.removeprefix("TOPODRA_DEVICE_").removesuffix("_UUID"): v for k, v in env.items()
            if k.startswith("TOPODRA_DEVICE_") and k.endswith("_UUID")}


def levels(path: Path) -> dict[str, int]:
    return dict(json.loads(path.read_text()).get("timeslices", {})) if path.exists() else {}


def test_index_selector_and_time_slicing_gpuconfig(node_cluster: ClusterHandle, plugins: Plugins) -> None:
    nc = node_cluster
    plugins.use(PLAIN)
    state = plugins.state[PLAIN]
    ns = nc.namespace("nvts")
    template = create_template(nc, ns, "gpu-test6-index.yaml")
    pods = [f"pod-{i}" for i in range(4)]  # NVIDIA's Deployment has 4 replicas
    for p in pods:
        run_pod(nc, ns, p, template, [None], "env | sort; echo done; sleep 3600")
    claims = {p: pod_claim(nc, ns, p) for p in pods}
    for p in pods:
        wait_done(nc, ns, p, 1)
    by_name = devices_by_name(nc)
    got: dict[str, str] = {}
    for p in pods:
        (r,) = results(claims[p])
        dev = by_name[r["device"]]
        assert dev["attributes"]["index"]["int"] in (0, 2, 4, 6), r["device"]
        assert "a100" in dev["attributes"]["productName"]["string"].lower()
        uuid = dev["attributes"]["uuid"]["string"]
        env = env_of(logs(nc, ns, p, "c0"))
        assert env["TOPODRA_VISIBLE_UUIDS"] == uuid, env
        frag = r["device"].upper().replace("-", "_")
        assert env[f"TOPODRA_DEVICE_{frag}_SHARING"] == "TimeSlicing"
        assert env[f"TOPODRA_DEVICE_{frag}_TIMESLICE_INTERVAL"] == "Long"
        got[p] = uuid
    assert len(set(got.values())) == 4  # the four GPUs the selector allows, one per pod
    assert levels(state) == {u: 3 for u in got.values()}  # Long, set on each GPU by prepare
    for p in pods:
        delete_pod(nc, ns, p)
    wait_for(lambda: levels(state) == {}, 60, "time-slice levels back to Default after unprepare")


def test_mps_gpuconfig_shared_by_two_containers(node_cluster: ClusterHandle, plugins: Plugins) -> None:
    nc = node_cluster
    plugin = plugins.use(PLAIN)
    ns = nc.namespace("nvmps")
    template = create_template(nc, ns, "gpu-test-mps.yaml")
    run_pod(nc, ns, "mps", template, ["mps-gpu", "mps-gpu"],
            "env | sort; ls $CUDA_MPS_PIPE_DIRECTORY | sed 's/^/PIPE=/'; echo done; sleep 3600")
    claim = pod_claim(nc, ns, "mps")
    wait_done(nc, ns, "mps", 2)
    (r,) = results(claim)
    uuid = devices_by_name(nc)[r["device"]]["attributes"]["uuid"]["string"]
    for c in ("c0", "c1"):
        out = logs(nc, ns, "mps", c)
        env = env_of(out)
        assert env["TOPODRA_VISIBLE_UUIDS"] == uuid
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=10240M"
        assert f"PIPE={mockmps.PID_FILE}" in out, out  # both containers reach the claim's one daemon
    pipe = plugin.plugin_dir / "mps" / claim["metadata"]["uid"] / "pipe"
    assert (pipe / mockmps.PID_FILE).exists()
    delete_pod(nc, ns, "mps")
    wait_for(lambda: not pipe.exists(), 60, "the MPS daemon stopped by unprepare")


def test_unsupported_gpuconfig_field_is_refused_and_nothing_prepared(node_cluster: ClusterHandle,
                                                                     plugins: Plugins) -> None:
    nc = node_cluster
    plugin = plugins.use(PLAIN)
    state = plugins.state[PLAIN]
    ns = nc.namespace("nvbad")
    template = create_template(nc, ns, "unsupported-per-device-limit.yaml")
    run_pod(nc, ns, "bad", template, [None], "env; sleep 3600")
    uid = pod_claim(nc, ns, "bad")["metadata"]["uid"]

    def event() -> str | None:
        for e in nc.kube.list(f"/api/v1/namespaces/{ns}/events"):
            if e.get("involvedObject", {}).get("name") == "bad" and "invalid GpuConfig" in e.get("message", ""):
                return str(e["message"])
        return None

    message = wait_for(event, 90, "the pod's prepare-failure event")
    assert "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit" in message and uid in message, message
    assert nc.kubectl("get", "pod", "-n", ns, "bad", "-o", "jsonpath={.status.phase}") == "Pending"
    data = checkpoint.load(plugin.plugin_dir / checkpoint.FILE_NAME)
    assert data is None or uid not in data.claims
    assert not list(plugin.cdi_root.glob(f"*{uid}*")) and levels(state) == {}
    assert not (plugin.plugin_dir / "mps" / uid).exists()
    delete_pod(nc, ns, "bad")


def mig_instances(path: Path) -> dict[str, int]:
    """GPU UUID -> number of GPU instances the mock GPUs hold now."""
    if not path.exists():
        return {}
    st = MigState.model_validate_json(path.read_text())
    return {g: len(gis) for g, gis in st.gpus.items() if gis}


def test_mig_by_profile_paired_by_parent_uuid(node_cluster: ClusterHandle, plugins: Plugins) -> None:
    nc = node_cluster
    plugins.use(MIG)
    state = plugins.state[MIG]
    ns = nc.namespace("nvmig")
    tmpl = example("gpu-test4-mig.yaml")
    requests = [r["name"] for r in tmpl["spec"]["spec"]["devices"]["requests"]]
    template = create_template(nc, ns, "gpu-test4-mig.yaml")
    run_pod(nc, ns, "mig", template, list(requests), "env | sort; echo done; sleep 3600")
    claim = pod_claim(nc, ns, "mig")
    wait_done(nc, ns, "mig", len(requests))
    by_name = devices_by_name(nc)
    res = {r["request"]: r["device"] for r in results(claim)}
    assert sorted(res) == sorted(requests)
    attrs = {req: by_name[dev]["attributes"] for req, dev in res.items()}
    assert {req: a["profile"]["string"] for req, a in attrs.items()} == {
        "mig-1g-10gb-0": "1g.10gb", "mig-1g-10gb-1": "1g.10gb", "mig-2g-20gb": "2g.20gb", "mig-3g-40gb": "3g.40gb"}
    parents = {a["parentUUID"]["string"] for a in attrs.values()}
    assert len(parents) == 1  # the matchAttribute constraint: one GPU
    (parent,) = parents
    assert mig_instances(state) == {parent: 4}
    seen = set()
    for k, req in enumerate(requests):  # container k names request k: it sees that MIG device and no other
        env = env_of(logs(nc, ns, "mig", f"c{k}"))
        per_device = device_uuids(env)
        assert list(per_device) == [res[req].upper().replace("-", "_")], per_device
        (uuid,) = per_device.values()
        assert uuid.startswith("MIG-") and parent not in json.dumps(env)
        seen.add(uuid)
    assert len(seen) == 4
    delete_pod(nc, ns, "mig")
    wait_for(lambda: parent not in mig_instances(state), 60, "MIG instances destroyed by unprepare")
