"""``topodra simulate CLUSTER.yaml``: a whole GPU cluster's ResourceSlices from one process.

Scheduling on 50 nodes / 400 GPUs must be testable without 50 kubelets.  For
each node described in the cluster file this creates (or reuses) a kubelet-less
Ready Node object, runs the *real* discovery code against the node's mock
hardware profile (for two nodes of each kind; the others' devices are derived
and must equal what discovery finds, see ``discover_all``), and keeps its
ResourceSlices published with the same publisher the kubelet plugin uses.  Nothing is prepared on these nodes: pods
bound to them stay Pending in the kubelet sense, but the scheduler's
allocation decisions are real.

Thousands of nodes from one process: one list of Nodes and one list+watch of
slices per driver (``SlicePublisher`` compares against it), never a request
or a thread per node that a real kubelet plugin would not also need; the
watch's events are fanned out to a few workers.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import logging
import signal
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from topodra import DEFAULT_DRIVER_NAME, cpudriver
from topodra.apipaths import device_class_path, node_path, slices_path
from topodra.devices import AttributeValue, Device
from topodra.fabric import TIERS, fabric_labels
from topodra.fabricfile import ClusterFabric, GroupFabric, check_nesting, group_tiers
from topodra.inventory import Inventory
from topodra.kube import Kube, KubeError
from topodra.nodelabels import node_labels
from topodra.publisher import SlicePublisher
from topodra.slicewatch import SliceWatch

log = logging.getLogger(__name__)

FAKE_NODE_LABEL = "topodra.io/fake-node"
NOT_READY_TAINT = "node.kubernetes.io/not-ready"
# Concurrent API calls when creating nodes and publishing: the round trips overlap and the apiserver
# uses every core; 8 is also the Kube client's connection pool size.
API_WORKERS = 8
TTL_ANNOTATION = "node.alpha.kubernetes.io/ttl"
TTL_STEPS = ((100, 0), (500, 15), (1000, 30), (2000, 60))  # (cluster size at most, seconds)
TTL_LARGEST = 300
RACK_NAMESPACE = uuid.UUID("0b7c2f4e-5a61-4d2e-9f3b-1c8d7e6a5b40")


class NodeGroup(BaseModel):
    """``count`` nodes named ``<namePrefix><i>`` with one hardware profile."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name_prefix: str = Field(alias="namePrefix", pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?-?$")
    count: int = Field(ge=1, le=1000)
    profile: str = Field(description="mock profile name or path, as for --hardware mock:<profile>")
    labels: dict[str, str] = Field(default_factory=dict)
    overrides: dict[str, Any] = Field(default_factory=dict, description="discovery overrides (rails, ...)")
    nodes_per_rack: int | None = Field(
        default=None, alias="nodesPerRack", ge=1,
        description="multi-node NVLink: consecutive nodes form a rack sharing one fabric clusterUUID")
    start_index: int = Field(default=0, alias="startIndex", ge=0)
    fabric: GroupFabric | None = Field(default=None, description="leaf group / scalable unit / spine group")


class SimulatedCluster(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    api_version: str = Field(default="topodra.io/v1alpha1", alias="apiVersion")
    kind: str = "SimulatedCluster"
    driver_name: str = Field(default=DEFAULT_DRIVER_NAME, alias="driverName")
    groups: list[NodeGroup] = Field(min_length=1)
    fabric: ClusterFabric | None = Field(default=None, description="uniform tiers over the nodes in file order")
    # Also publish dra-driver-cpu's grouped-mode slices of this release on every node (topodra.cpudriver).
    cpu_driver: cpudriver.Release | None = Field(default=None, alias="cpuDriver")

    @model_validator(mode="after")
    def _check(self) -> SimulatedCluster:
        if self.kind != "SimulatedCluster":
            raise ValueError(f"kind must be SimulatedCluster, got {self.kind!r}")
        names = [n for n, _ in self.expand()]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"node names occur more than once: {dupes[:5]}")
        if self.fabric is not None and any(g.fabric is not None for g in self.groups):
            raise ValueError("declare the fabric once for the file or per group, not both")
        for g in self.groups:
            given = set(g.labels) & set(TIERS)
            if given and (self.fabric is not None or g.fabric is not None):
                raise ValueError(f"group {g.name_prefix}: {sorted(given)} set both in labels and by fabric")
        check_nesting([(n, {**g.labels, **t}) for (n, g), t in zip(self.expand(), self.tiers(), strict=True)])
        return self

    def expand(self) -> list[tuple[str, NodeGroup]]:
        return [(f"{g.name_prefix}{g.start_index + k}", g) for g in self.groups for k in range(g.count)]

    def tiers(self) -> list[dict[str, str]]:
        """The fabric tiers ``fabric`` declares for each node, in ``expand()`` order."""
        if self.fabric is not None:
            return [self.fabric.tiers(i) for i in range(sum(g.count for g in self.groups))]
        return [t for per_group in group_tiers([(g.count, g.fabric) for g in self.groups]) for t in per_group]


class SimNode(BaseModel):
    name: str
    profile: str
    labels: dict[str, str]
    overrides: dict[str, Any]


def load_cluster(path: str | Path) -> SimulatedCluster:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"cannot read cluster file {path}: {e}") from None
    try:
        return SimulatedCluster.model_validate(data)
    except ValidationError as e:
        raise ValueError(f"invalid cluster file {path}:\n{e}") from None


def plan(cluster: SimulatedCluster) -> list[SimNode]:
    """Pure: every node with its profile, labels (fabric tiers included) and overrides (racks get a shared
    fabric UUID)."""
    out = []
    tiers = iter(cluster.tiers())
    for g in cluster.groups:
        for k in range(g.count):
            name = f"{g.name_prefix}{g.start_index + k}"
            ov = dict(g.overrides)
            labels = {"topodra.io/profile": g.profile.rsplit("/", 1)[-1].removesuffix(".yaml"), **g.labels,
                      **next(tiers)}
            if g.nodes_per_rack:
                rack = f"{g.name_prefix}rack{k // g.nodes_per_rack}"
                ov.setdefault("clusterUUID", str(uuid.uuid5(RACK_NAMESPACE, rack)))
                labels["topodra.io/nvlink-rack"] = rack
            out.append(SimNode(name=name, profile=g.profile, labels=labels, overrides=ov))
    return out


def discover(node: SimNode) -> list[Device]:
    from topodra.hardware import load_backend

    return load_backend(f"mock:{node.profile}", node.name, overrides=node.overrides).discover()


def _by_name(node: str, devices: Sequence[Device]) -> tuple[dict[tuple[str, str], str], dict[tuple[str, str], str]]:
    """The values of ``devices`` the mock and discovery derive from the node's name, by a key that is the same
    on every node of the profile: (what it would be for ``node``, what it is), for GPU UUIDs (by slot) and
    node-local NVLink domain ids (by member BDFs)."""
    from topodra.hardware.mockprofile import gpu_uuid
    from topodra.hardware.nvlink import local_domain_id

    derived: dict[tuple[str, str], str] = {}
    actual: dict[tuple[str, str], str] = {}
    members: dict[str, set[str]] = {}
    for d in devices:
        if d.kind != "gpu":
            continue
        minor, bdf, domain = (d.attributes.get(k) for k in ("minor", "resource.kubernetes.io/pciBusID", "nvlinkDomain"))
        if minor is None or bdf is None:
            continue
        derived[("uuid", str(minor.value))] = gpu_uuid(node, int(minor.value))
        actual[("uuid", str(minor.value))] = d.uuid
        if domain is not None:
            members.setdefault(str(domain.value), set()).add(str(bdf.value))
    for domain_id, bdfs in members.items():
        key = ("nvl", ",".join(sorted(bdfs)))
        derived[key], actual[key] = local_domain_id(node, bdfs), domain_id
    return derived, actual


class _Template:
    """One real node's devices and which of their values its name explains (computed once per kind)."""

    def __init__(self, node: str, devices: Sequence[Device]) -> None:
        self.node, self.devices = node, list(devices)
        derived, self.actual = _by_name(node, devices)
        self.usable = (all(self.actual[k] == derived[k] for k in self.actual if k[0] == "uuid")
                       and not any(d.device_nodes or d.env or d.lost for d in devices))
        self.keys = [k for k in self.actual if self.actual[k] == derived[k]]

    def retarget(self, node: str) -> list[Device] | None:
        """The devices as ``node``'s: each value derived from the template's name replaced by the one derived
        from ``node``'s; None when the template's values are not all explained that way."""
        if not self.usable:
            return None
        derived, _ = _by_name(node, self.devices)
        swap = {self.actual[k]: derived[k] for k in self.keys}

        def one(d: Device) -> Device:
            # Validated construction: 4.7 µs against model_construct's 12 (it resolves every default in Python).
            attrs = {k: AttributeValue(string=swap[v.string]) for k, v in d.attributes.items() if v.string in swap}
            if not attrs and d.uuid not in swap:
                return d  # frozen, and equal on every node of the kind: shared
            return d.model_copy(update={"attributes": {**d.attributes, **attrs}, "uuid": swap.get(d.uuid, d.uuid)})

        return [one(d) for d in self.devices]


def discover_all(nodes: list[SimNode]) -> dict[str, list[Device]]:
    """Every node's devices, by name.

    The real discovery code runs for the first two nodes of each kind (profile and overrides); it costs
    15-50 ms a node, 30 s or more of a 2,048-node simulate. The mock derives only GPU UUIDs from a node's
    name, and discovery only the node-local NVLink domain ids: the other nodes of the kind get the first
    node's devices with those values derived for them, once that derivation reproduced the second node's
    real discovery exactly. A kind where it does not (MIG, another derived value) is discovered node by node.
    """
    kinds: dict[str, list[SimNode]] = {}
    for n in nodes:
        kinds.setdefault(f"{n.profile}|{json.dumps(n.overrides, sort_keys=True, default=str)}", []).append(n)
    out: dict[str, list[Device]] = {}
    for members in kinds.values():
        first = members[0]
        out[first.name] = discover(first)
        if len(members) == 1:
            continue
        out[members[1].name] = discover(members[1])
        template = _Template(first.name, out[first.name])
        exact = template.retarget(members[1].name) == out[members[1].name]
        if not exact:
            log.info("nodes of %s are discovered one by one (a value of theirs is not derived from the name alone)",
                     first.profile)
        for n in members[2:]:
            derived = template.retarget(n.name) if exact else None
            out[n.name] = derived if derived is not None else discover(n)
    return {n.name: out[n.name] for n in nodes}


def cpu_devices(node: SimNode, release: cpudriver.Release) -> list[Device]:
    """dra-driver-cpu's grouped-mode devices for the node's mock NUMA table.

    Mock profiles carry no SMT facts: a NUMA node whose CPU list is two ranges of one length (Linux numbers the
    second threads of the cores after the first ones) counts as SMT on, one range (Grace) as off.
    """
    from topodra.hardware.mockprofile import load_profile
    from topodra.hardware.sysfs import parse_cpulist

    numa = load_profile(node.profile).numa
    table = [(n.node, n.socket, len(parse_cpulist(n.cpus))) for n in numa]
    ranges = [n.cpus.split(",") for n in numa]
    smt = all(len(r) == 2 and len(parse_cpulist(r[0])) == len(parse_cpulist(r[1])) for r in ranges)
    return cpudriver.grouped_devices(table, release, smt=smt)


def node_ttl_seconds(nodes: int) -> int:
    """The ``node.alpha.kubernetes.io/ttl`` kube-controller-manager's TTL controller gives every Node of a cluster
    that grew to ``nodes`` (how long kubelets may cache objects: 0, 15, 30, 60, 300 s as the cluster passes
    100, 500, 1,000 and 2,000 nodes)."""
    for most, ttl in TTL_STEPS:
        if nodes <= most:
            return ttl
    return TTL_LARGEST


def fake_node(name: str, labels: dict[str, str] | None = None, ttl: int | None = None) -> dict[str, Any]:
    """A kubelet-less Node as a real one looks to the scheduler (labels, capacity).

    ``ttl``: the TTL controller's annotation, as it would set it. It PATCHes every Node whose annotation is not
    what it wants, once per Node event: for a Node created without one that is a PATCH, and its watch events, for
    every simulated node (with the node lifecycle controller's taint PATCHes, 1,103-2,071 Node PATCHes at
    51-121 ms each ran during a 2,048-node publish at load 4-8).
    """
    meta: dict[str, Any] = {"name": name, "labels": {
        "kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
        FAKE_NODE_LABEL: "true", **(labels or {})}}
    if ttl is not None:
        meta["annotations"] = {TTL_ANNOTATION: str(ttl)}
    return {"apiVersion": "v1", "kind": "Node", "metadata": meta, "spec": {}}


def fake_node_status(name: str, cpu: str = "128", memory: str = "2Ti", pods: str = "250") -> dict[str, Any]:
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    cap = {"cpu": cpu, "memory": memory, "pods": pods, "ephemeral-storage": "10Ti"}
    return {"status": {
        "capacity": cap, "allocatable": cap,
        "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                        "message": "kubelet-less simulated node (topodra)",
                        "lastHeartbeatTime": now, "lastTransitionTime": now}],
        "addresses": [{"type": "Hostname", "address": name}],
        "nodeInfo": {"kubeletVersion": "v1.37.2", "operatingSystem": "linux", "architecture": "amd64",
                     "containerRuntimeVersion": "simulated://0", "kernelVersion": "", "osImage": "",
                     "kubeProxyVersion": "", "machineID": "", "systemUUID": "", "bootID": ""}}}


def with_fabric(current: dict[str, str], labels: dict[str, str]) -> dict[str, str]:
    """``labels`` (the file's) with its fabric tiers resolved: Topograph's labels on the Node as it is, or in
    the file, win over the file's tier names (``topodra.fabric``); foreign keys are only ever read."""
    fabric = fabric_labels({**current, **labels}, cluster_file={k: labels[k] for k in TIERS if k in labels})
    return {**labels, **fabric.labels}


def ensure_node(kube: Kube, name: str, labels: dict[str, str], allocatable: tuple[str, str] = ("128", "2Ti"),
                listed: Mapping[str, dict[str, Any]] | None = None, cluster_nodes: int | None = None) -> str:
    """Create the Node if missing (or adopt one from hack/cluster --fake-nodes) and mark it Ready with
    ``allocatable`` (CPUs, memory) as capacity and allocatable; returns its UID.

    ``listed``: every Node by name, from one list (a node missing from it does not exist), instead of a GET.
    A new Node is created Ready in one request: Nodes, unlike most kinds, take their status on create.
    ``cluster_nodes``: how many Nodes the cluster has once this one exists, for the TTL controller's annotation
    (``fake_node``): the controller checks a Node when its add event reaches a worker, against the cluster's size
    then, so it patches only a Node created shortly before the size passed a step (about 92 at the 100-node step
    of a 256-node run). The final size's value instead: 1,870 Node PATCHes in a 2,048-node run at load 11 (the
    controller kept up and saw the smaller sizes), 1,091 with this at load 8-10, taint PATCHes included.
    """
    existing = kube.get(node_path(name)) if listed is None else listed.get(name)
    labels = with_fabric((existing or {}).get("metadata", {}).get("labels") or {}, labels)
    if existing is None:
        ttl = None if cluster_nodes is None else node_ttl_seconds(cluster_nodes)
        created = kube.create(node_path(), {**fake_node(name, labels, ttl), **fake_node_status(name, *allocatable)})
        return str(created["metadata"]["uid"])
    if any(existing["metadata"].get("labels", {}).get(k) != v for k, v in labels.items()):
        existing = kube.merge_patch(node_path(name), {"metadata": {"labels": labels}})
    if FAKE_NODE_LABEL in existing["metadata"].get("labels", {}):
        existing = kube.merge_patch(node_path(name) + "/status", fake_node_status(name, *allocatable))
    return str(existing["metadata"]["uid"])


def profile_allocatable(profile: str) -> tuple[str, str]:
    """A simulated node's (CPUs, memory): its profile's logical CPUs and ``hostMemory`` (the server's
    datasheet), 2Ti where the profile names no memory. No kubelet reservations are subtracted."""
    from topodra.hardware.mockprofile import host_allocatable, load_profile

    cpus, memory = host_allocatable(load_profile(profile))
    return cpus, memory or "2Ti"


class Simulation:
    """Publishes and reconciles the slices of every simulated node."""

    def __init__(self, kube: Kube, cluster: SimulatedCluster) -> None:
        self.kube = kube
        self.cluster = cluster
        self.nodes = plan(cluster)
        self.failed: list[SlicePublisher] = []  # of the last pass
        self._cpu_inventories: dict[str, Inventory] = {}
        self.publishers: dict[str, SlicePublisher] = {}
        self.cpu_publishers: dict[str, SlicePublisher] = {}  # cluster file's cpuDriver
        # One list+watch of slices per driver, shared by every node's publisher.
        self.watches: dict[str, SliceWatch] = {cluster.driver_name: SliceWatch(kube, cluster.driver_name)}
        if cluster.cpu_driver is not None:
            self.watches[cpudriver.DRIVER] = SliceWatch(kube, cpudriver.DRIVER)

    def setup(self) -> None:
        """Discover every node's mock hardware, then create its Node object (API calls run concurrently)."""
        t0 = time.monotonic()
        devices = discover_all(self.nodes)
        release = self.cluster.cpu_driver
        if release is not None:  # v0.2.0: the plugin runs with --numa-alias dra.net/numaNode (docs/deploy.md)
            alias = cpudriver.LEGACY_NUMA if release == "v0.2.0" else None
            devices = {name: cpudriver.with_numa_alias(devs, alias) for name, devs in devices.items()}
            if self.kube.get(device_class_path(cpudriver.DRIVER)) is None:
                self.kube.create(device_class_path(), cpudriver.device_class())
            self._cpu_inventories = {n.name: Inventory(cpu_devices(n, release)) for n in self.nodes}
        t1 = time.monotonic()
        listed = {str(o["metadata"]["name"]): o for o in self.kube.list(node_path())}
        size, sizes = len(listed), {}  # the cluster's size once each new Node exists, in creation order
        for n in self.nodes:
            if n.name not in listed:
                size += 1
                sizes[n.name] = size
        with ThreadPoolExecutor(API_WORKERS) as pool:
            # Discovery's node labels (gpu-model, gpu-count, nvlink-clique); the cluster file's labels win,
            # except that Topograph's tiers on an existing Node win over the file's tier names.
            uids = list(pool.map(lambda n: ensure_node(
                self.kube, n.name, {**node_labels(devices[n.name]), **n.labels}, self._allocatable(n), listed,
                sizes.get(n.name)), self.nodes))
        for n, uid in zip(self.nodes, uids, strict=True):
            self.publishers[n.name] = SlicePublisher(
                self.kube, self.cluster.driver_name, n.name, Inventory(devices[n.name]), min_write_interval=0,
                slices=self.watches[self.cluster.driver_name], node_uid=uid)
            if release is not None:
                self.cpu_publishers[n.name] = SlicePublisher(
                    self.kube, cpudriver.DRIVER, n.name, self._cpu_inventories[n.name], min_write_interval=0,
                    slices=self.watches[cpudriver.DRIVER], node_uid=uid)
        log.info("simulating %d nodes (discovery + node objects in %.1fs; discovery %.1fs)", len(self.nodes),
                 time.monotonic() - t0, t1 - t0)

    def _allocatable(self, n: SimNode) -> tuple[str, str]:
        """(CPUs, memory) of the node's profile; with the CPU driver the CPUs are the ones its slices publish
        (pods repeat their claimed CPUs in requests.cpu, so both must agree)."""
        cpus, memory = profile_allocatable(n.profile)
        inv = self._cpu_inventories.get(n.name)
        if inv is not None:
            cpus = str(sum(int(d.capacity[cpudriver.CAPACITY]) for d in inv.devices))
        return cpus, memory

    def _all(self) -> list[SlicePublisher]:
        return [*self.publishers.values(), *self.cpu_publishers.values()]

    def not_ready(self) -> list[str]:
        """The simulated Nodes that still carry ``node.kubernetes.io/not-ready`` (one list of Nodes)."""
        ours = {n.name for n in self.nodes}
        return sorted(n["metadata"]["name"] for n in self.kube.list(node_path())
                      if n["metadata"]["name"] in ours
                      and any(t.get("key") == NOT_READY_TAINT for t in (n.get("spec") or {}).get("taints") or []))

    def wait_schedulable(self, timeout: float, clock: Any = time.monotonic, pause: Any = time.sleep) -> list[str]:
        """Wait until kube-controller-manager's node lifecycle controller has lifted ``not-ready`` from every
        simulated Node; the ones still tainted at ``timeout`` (empty: all schedulable).

        The apiserver's TaintNodesByCondition admission taints every new Node ``not-ready``, and the controller
        lifts it from Ready Nodes a few per second (105 s for 500 Nodes, bench/schedule_throughput). Until then
        no pod can bind there, so ``--once`` returning earlier handed its caller a cluster that was not there
        yet (issue 31). The lifting stays the controller's, as on a real cluster: this only waits for it."""
        deadline = clock() + timeout
        last_log = clock()
        while True:
            left = self.not_ready()
            if not left or clock() >= deadline:
                return left
            if clock() - last_log >= 10:
                log.info("%d of %d simulated nodes still carry %s (kube-controller-manager lifts it)", len(left),
                         len(self.nodes), NOT_READY_TAINT)
                last_log = clock()
            pause(0.5)

    def reconcile_all(self) -> int:
        """One pass over every node, ``API_WORKERS`` at a time; returns how many pools were written.

        Unless ``run`` keeps them watched, the slices are listed first (one paged list per driver).
        """
        for w in self.watches.values():
            if not w.running:
                w.relist()
        return self._reconcile(self._all())

    def _reconcile(self, pubs: list[SlicePublisher]) -> int:
        failed: list[SlicePublisher] = []

        def one(pub: SlicePublisher) -> int:
            try:
                return int(pub.reconcile_once())
            except KubeError as e:
                log.warning("node %s: publishing %s failed: %s", pub.node_name, pub.driver_name, e)
                failed.append(pub)
                return 0

        with ThreadPoolExecutor(API_WORKERS) as pool:
            written = sum(pool.map(one, pubs))
        self.failed = [p for p in self.failed if p not in pubs] + failed  # failures of pools not retried stay
        return written

    def run(self, stop: threading.Event, resync: float) -> None:
        """Reconcile the pools the watches report changed as they change, failed ones with backoff, and every
        pool every ``resync`` seconds against the watched slices (no requests when nothing changed)."""
        dirty: set[tuple[str, str]] = set()
        wake = threading.Condition()

        def changed(driver: str) -> Callable[[str], None]:
            def mark(node: str) -> None:
                with wake:
                    dirty.add((driver, node))
                    wake.notify()
            return mark

        for driver, w in self.watches.items():
            w.subscribe(changed(driver))
            w.start()
        for w in self.watches.values():  # a pass before the first list would list every pool on its own
            while not (w.wait_synced(1.0) or stop.is_set()):
                pass
        by_key = {(p.driver_name, p.node_name): p for p in self._all()}
        next_resync, backoff, retry_at = time.monotonic(), 1.0, float("inf")
        try:
            while not stop.is_set():
                now = time.monotonic()
                if now >= next_resync:
                    todo, next_resync = self._all(), now + resync
                    with wake:
                        dirty.clear()
                else:
                    with wake:
                        wake.wait_for(lambda: bool(dirty) or stop.is_set(),  # stop is seen within 1 s
                                      max(0.0, min(next_resync, retry_at, now + 1.0) - now))
                        keys = set(dirty)
                        dirty.clear()
                    todo = [by_key[k] for k in keys if k in by_key]
                    if time.monotonic() >= retry_at:
                        todo += [p for p in self.failed if p not in todo]
                if not todo or stop.is_set():
                    continue
                n = self._reconcile(todo)
                if n:
                    log.info("reconciled: %d pool(s) written", n)
                if self.failed:
                    retry_at, backoff = time.monotonic() + backoff, min(backoff * 2, 60.0)
                else:
                    retry_at, backoff = float("inf"), 1.0
        finally:
            for w in self.watches.values():
                w.stop()

    def delete(self) -> None:
        """Remove the simulated nodes' slices and the Node objects this tool created."""
        drivers = [self.cluster.driver_name] + ([cpudriver.DRIVER] if self.cluster.cpu_driver else [])

        def one(n: SimNode) -> None:
            for driver in drivers:
                for sl in self.kube.list(slices_path(), field_selector=f"spec.driver={driver},spec.nodeName={n.name}"):
                    self.kube.delete(slices_path(sl["metadata"]["name"]))
            node = self.kube.get(node_path(n.name))
            if node and FAKE_NODE_LABEL in node["metadata"].get("labels", {}):
                self.kube.delete(node_path(n.name))

        with ThreadPoolExecutor(API_WORKERS) as pool:
            list(pool.map(one, self.nodes))


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("cluster_file", help="SimulatedCluster YAML (see hack/clusters/)")
    p.add_argument("--kubeconfig", default=None, help="kubeconfig (default: $KUBECONFIG, else in-cluster)")
    p.add_argument("--once", action="store_true",
                   help="publish everything once, wait until the nodes are schedulable, and exit (slices stay)")
    p.add_argument("--ready-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="with --once: how long to wait for kube-controller-manager to lift node.kubernetes.io/"
                        "not-ready from the simulated nodes (exit 1 if some still carry it); 0: do not wait")
    p.add_argument("--delete", action="store_true", help="delete the simulated nodes and their slices")
    p.add_argument("--resync", type=float, default=10.0, help="seconds between reconcile passes")


def fewer_full_collections() -> None:
    """The publishing process holds every pool's slices (the watch's store: about 2 million dicts at 2,048
    nodes), and a full collection walks all of them; what it frees is acyclic JSON that reference counting
    frees anyway. Python's default (700, 10, 10) ran 2 full collections in a 2,048-node publishing loop
    (build, encode, decode, store: 0.45 s of its 2.4 s CPU, all of it holding the GIL the API workers
    need); (700, 20, 100) ran none (0.09 s). Young collections stay as they were."""
    gen0, _, _ = gc.get_threshold()
    gc.set_threshold(gen0, 20, 100)


def run(args: argparse.Namespace) -> int:
    try:
        cluster = load_cluster(args.cluster_file)
    except ValueError as e:
        log.error("%s", e)
        return 2
    if args.ready_timeout < 0:
        log.error("--ready-timeout must be 0 (do not wait) or more, got %s", args.ready_timeout)
        return 2
    kube = Kube.from_kubeconfig(args.kubeconfig)
    sim = Simulation(kube, cluster)
    if args.delete:
        sim.delete()
        log.info("deleted %d simulated nodes and their slices", len(sim.nodes))
        return 0
    fewer_full_collections()
    sim.setup()
    t0 = time.monotonic()
    sim.reconcile_all()
    gpus = sum(1 for p in sim.publishers.values() for d in p.inventory.devices if d.kind == "gpu")
    log.info("published %d nodes, %d GPUs in %.1fs", len(sim.nodes), gpus, time.monotonic() - t0)
    if args.once:
        if args.ready_timeout <= 0:
            return 0
        t1 = time.monotonic()
        left = sim.wait_schedulable(args.ready_timeout)
        if left:
            log.error("%d of %d simulated nodes still carry %s after %.0fs (is kube-controller-manager running?): "
                      "%s", len(left), len(sim.nodes), NOT_READY_TAINT, args.ready_timeout, ", ".join(left[:5]))
            return 1
        log.info("all %d nodes schedulable after %.1fs more", len(sim.nodes), time.monotonic() - t1)
        return 0
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    sim.run(stop, args.resync)
    return 0
