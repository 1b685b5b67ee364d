"""``topodra kubelet-plugin``: wire discovery, ResourceSlice publishing, prepare state and the servers.

Start order: discover devices into the inventory → prepare state → health
monitor → DRA + registration sockets → ResourceSlice publisher → probe/metrics
endpoints.  The inventory is the one owner of the devices: the state, the
device-health board, the health monitor and the publisher subscribe to it, and
re-discovery only sets it.  The health monitor owns device health: its taints go
into the ResourceSlices and its states to the kubelet's health board.

On SIGTERM/SIGINT everything stops in reverse order: sockets are removed so the kubelet deregisters the
plugin, but ResourceSlices are left alone — a restarting or updated plugin takes
them over, and the kubelet wipes them itself if no plugin comes back.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from contextlib import ExitStack
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from topodra.cpudriver import with_numa_alias
from topodra.plugin import config
from topodra.plugin.config import ConfigError, PluginConfig

if TYPE_CHECKING:
    from topodra.devices import Device
    from topodra.hardware import NvmlBackend
    from topodra.health.monitor import HealthMonitor
    from topodra.hostdriver import HostDriver
    from topodra.inventory import Inventory
    from topodra.observe import Observer
    from topodra.plugin.device_health import DeviceHealthBoard
    from topodra.plugin.nodelabel import NodeLabeler
    from topodra.plugin.server import PluginServer
    from topodra.publisher import SlicePublisher
    from topodra.sharing.computemode import ComputeModeControl
    from topodra.sharing.instances import MigInstances
    from topodra.sharing.mpspod import MpsPods
    from topodra.sharing.timeslice import TimeSliceControl
    from topodra.state import DeviceState
    from topodra.telemetry.sampler import Sampler

log = logging.getLogger(__name__)

STOP_GRACE_SECONDS = 10.0  # below the default 30 s terminationGracePeriod


def configure(parser: argparse.ArgumentParser) -> None:
    config.configure(parser)


class Plugin:
    """A running plugin; ``stop()`` undoes ``start()`` in reverse order."""

    def __init__(self, cfg: PluginConfig) -> None:
        self.cfg = cfg
        self._stack = ExitStack()
        self.inventory: Inventory | None = None
        self.server: PluginServer | None = None
        self.probe_port: int | None = None
        self.metrics_port: int | None = None
        self.state: DeviceState | None = None
        self.board: DeviceHealthBoard | None = None
        self.publisher: SlicePublisher | None = None
        self.monitor: HealthMonitor | None = None
        self.labeler: NodeLabeler | None = None
        self.sampler: Sampler | None = None
        self._rediscover = threading.Event()
        self._stopping = threading.Event()

    def backend(self) -> NvmlBackend:
        """The hardware backend for --hardware and the current --hardware-config."""
        from topodra.hardware import DiscoveryError, load_backend

        cfg = self.cfg
        overrides = cfg.hardware_overrides()
        try:
            return load_backend(cfg.hardware, cfg.node_name,
                                sysfs_root=str(cfg.sysfs_root) if cfg.sysfs_root else None,
                                overrides=overrides,
                                nvidia_driver_root=str(cfg.nvidia_driver_root) if cfg.hardware == "nvml" else None)
        except (ValueError, OSError, DiscoveryError) as e:
            raise ConfigError(f"--hardware {cfg.hardware} / --hardware-config: {e}") from e

    def discover(self) -> list[Device]:
        """Read --hardware-config and discover devices (mock devices get no host device nodes)."""
        return with_numa_alias(self.backend().discover(), self.cfg.numa_alias)

    def rediscover(self) -> None:
        """Hardware or its config changed (or may have): set the inventory; its subscribers follow."""
        assert self.inventory is not None, "start() first"
        try:
            devices = self.discover()
        except Exception as e:
            log.error("re-discovery failed node=%s, keeping the previous devices: %s", self.cfg.node_name, e)
            return
        if self.labeler is not None:  # the admin's fabric tiers / rail group may have changed with the file
            try:
                self.labeler.topology_changed(self.cfg.topology_labels())
            except ConfigError as e:
                log.error("node labels node=%s: keeping the previous fabric tiers / rail group: %s",
                          self.cfg.node_name, e)
        old = {d.name for d in self.inventory.devices}
        if not self.inventory.set(devices):
            log.debug("re-discovery node=%s: no change", self.cfg.node_name)
            return
        new = {d.name for d in devices}
        log.info("hardware changed node=%s: removed=%s added=%s (attributes may differ too); republished",
                 self.cfg.node_name, sorted(old - new) or "-", sorted(new - old) or "-")

    def start(self) -> None:
        cfg = self.cfg
        # Imported here so that config errors are reported before the heavy imports.
        from topodra.apipaths import claim_path, pod_path, slices_path
        from topodra.health.monitor import HealthMonitor
        from topodra.health.sources import NodeHealthSource
        from topodra.inventory import Inventory
        from topodra.kube import Kube, KubeError
        from topodra.plugin import metrics
        from topodra.plugin.claimget import claim_reader
        from topodra.plugin.cleanup import CleanupLoop
        from topodra.plugin.device_health import DeviceHealthBoard
        from topodra.plugin.nodelabel import NodeLabeler
        from topodra.plugin.probes import ProbeServer, all_of, answers
        from topodra.plugin.server import PluginServer
        from topodra.publisher import SlicePublisher
        from topodra.sharing.computemode import control_for as compute_mode_for
        from topodra.sharing.instances import MigInstances
        from topodra.sharing.timeslice import control_for
        from topodra.slices import published_taints

        observer = metrics.MetricsObserver()
        with ExitStack() as stack:
            inventory = Inventory(self.discover())
            self.inventory = inventory
            log.info("discovered devices node=%s hardware=%s count=%d names=%s", cfg.node_name, cfg.hardware,
                     len(inventory.devices), ",".join(d.name for d in inventory.devices))

            kube = Kube.from_kubeconfig(str(cfg.kubeconfig) if cfg.kubeconfig else None)
            stack.callback(kube.close)
            mig = MigInstances(self.backend().nvml, proc_root=str(cfg.nvidia_proc_root))
            stack.callback(mig.close)  # its NVML session lasts as long as the plugin
            state = build_state(cfg, inventory, observer, mig=mig,
                                timeslice_control=control_for(self.backend().nvml, driver_root=driver_root(cfg)),
                                compute_mode=compute_mode_for(self.backend().nvml, driver_root=driver_root(cfg)),
                                host=host_driver(cfg), mps_pods=mps_pods(cfg, kube))
            self.state = state
            board = DeviceHealthBoard(pool_name=cfg.node_name)
            inventory.subscribe(board.devices_changed)
            self.board = board

            # The monitor reads NVML and sysfs through the same backend discovery builds.
            hw = self.backend()
            monitor = HealthMonitor(inventory, lambda devices: NodeHealthSource(hw.nvml, hw.sysfs, devices),
                                    hold_seconds=cfg.health_hold_seconds, poll_interval=cfg.health_poll_interval,
                                    no_execute=cfg.health_no_execute)
            monitor.subscribe(board.health_changed)
            monitor.subscribe(metrics.health_changed)
            self.monitor = monitor
            try:  # a restart must not forget what the previous instance tainted
                monitor.adopt(published_taints(kube.list(slices_path(), field_selector=(
                    f"spec.driver={cfg.driver_name},spec.nodeName={cfg.node_name}"))))
            except KubeError as e:
                log.warning("cannot read the published device taints (%s); starting without them", e)

            reader = claim_reader(str(cfg.kubeconfig) if cfg.kubeconfig else None)
            get = reader.get if reader is not None else kube.get
            if reader is not None:
                stack.callback(reader.close)

            def get_claim(namespace: str, name: str) -> dict[str, Any] | None:
                return get(claim_path(namespace, name))

            def get_pod(namespace: str, name: str) -> dict[str, Any] | None:
                return kube.get(pod_path(namespace, name))  # only for backfill claims (plugin/server.py)

            server = PluginServer(driver_name=cfg.driver_name, node_name=cfg.node_name, state=state,
                                  claim_getter=get_claim, board=board, plugin_dir=cfg.plugin_dir,
                                  registry_dir=cfg.registry_dir, pod_uid=cfg.pod_uid, pod_getter=get_pod)
            server.start()
            stack.callback(server.stop, STOP_GRACE_SECONDS)
            self.server = server

            cleaner = CleanupLoop(state, get_claim, cfg.claim_cleanup_interval)
            cleaner.start()  # claims deleted while we were down; API reads happen outside the prepare lock
            stack.callback(cleaner.stop)

            publisher = SlicePublisher(kube, cfg.driver_name, cfg.node_name, inventory, observer=observer,
                                       taints=monitor.taints)
            monitor.subscribe(lambda _snapshot: publisher.refresh())
            publisher.start()
            stack.callback(publisher.stop)
            self.publisher = publisher
            monitor.start()
            stack.callback(monitor.stop)

            if cfg.telemetry:
                self.sampler = start_telemetry(cfg, inventory, hw, state, kube, get_claim, stack)

            if cfg.node_labels:  # after the publisher: a Node that cannot be labelled must not delay serving
                labeler = NodeLabeler(kube, cfg.node_name, cfg.topology_labels(), on_result=metrics.node_labels_result)
                inventory.subscribe(labeler.devices_changed)
                labeler.start()
                stack.callback(labeler.stop)
                self.labeler = labeler

            if cfg.metrics_port:
                try:
                    httpd = metrics.serve(cfg.metrics_port, cfg.metrics_address)
                except OSError as e:
                    # /metrics is optional: the kubelet must keep its plugin, so no crash loop over it.
                    log.error("metrics endpoint is off: cannot listen on %s:%d (%s); another process "
                              "holds the port, or the address is not this host's. Set --metrics-port / "
                              "TOPODRA_METRICS_PORT to a free port, or 0 to disable. The kubelet plugin keeps "
                              "serving.", cfg.metrics_address, cfg.metrics_port, e)
                else:
                    stack.callback(httpd.server_close)
                    stack.callback(httpd.shutdown)
                    self.metrics_port = httpd.server_port
            if cfg.health_port:
                try:
                    probe = ProbeServer(cfg.health_port, all_of(
                        server.problem, lambda: answers(server.dra_socket, server.registration_socket)))
                except OSError as e:
                    # Fatal: the exec probes dial this port, and would otherwise ask whoever holds it.
                    raise ConfigError(f"--health-port {cfg.health_port}: {e}; another process holds the port. "
                                      "Set --health-port / TOPODRA_HEALTH_PORT to a free port, or 0 to turn "
                                      "the health service off.") from e
                probe.start()
                stack.callback(probe.stop)
                self.probe_port = probe.port

            watcher = threading.Thread(target=self._rediscover_loop, name="rediscover", daemon=True)
            watcher.start()
            stack.callback(self._stopping.set)
            self._stack = stack.pop_all()
        log.info("kubelet plugin running driver=%s node=%s dra_socket=%s registration_socket=%s",
                 cfg.driver_name, cfg.node_name, server.dra_socket, server.registration_socket)

    def request_rediscovery(self) -> None:
        self._rediscover.set()

    def _rediscover_loop(self) -> None:
        interval = self.cfg.rediscover_interval or None
        while not self._stopping.is_set():
            self._rediscover.wait(interval)
            if self._stopping.is_set():
                return
            self._rediscover.clear()
            self.rediscover()

    def stop(self) -> None:
        log.info("kubelet plugin stopping driver=%s node=%s (ResourceSlices are kept)",
                 self.cfg.driver_name, self.cfg.node_name)
        self._stack.close()
        log.info("kubelet plugin stopped driver=%s node=%s", self.cfg.driver_name, self.cfg.node_name)


def start_telemetry(cfg: PluginConfig, inventory: Inventory, hw: NvmlBackend, state: DeviceState, kube: Any,
                    get_claim: Any, stack: ExitStack) -> Sampler:
    """The telemetry sampler (docs/telemetry.md): its own thread, reading the checkpoint without the node lock."""
    from topodra.plugin import telemetry
    from topodra.telemetry.claimstatus import ClaimStatusWriter
    from topodra.telemetry.idle import IdleRule
    from topodra.telemetry.reclaim import Reclaimer
    from topodra.telemetry.sampler import Sampler
    from topodra.telemetry.summary import SummaryPolicy

    rule = IdleRule(activity_below=cfg.idle_activity_below, memory_below=cfg.idle_memory_below,
                    idle_seconds=cfg.idle_seconds)
    api = ClaimStatusWriter(kube, cfg.driver_name, cfg.node_name)
    every = cfg.status_summary_interval
    policy = SummaryPolicy(min_interval=every, max_interval=6 * every) if every > 0 else None
    reclaimer = (Reclaimer(kube, cfg.node_name, idle_seconds=cfg.idle_seconds, default_grace=cfg.idle_reclaim_grace)
                 if cfg.idle_reclaim else None)
    sampler = Sampler(inventory, hw.nvml, hw.sysfs, pool=cfg.node_name, driver=cfg.driver_name,
                      held=state.held_devices, held_mig=state.held_mig, get_claim=get_claim,
                      writer=api if cfg.idle_conditions else None, reclaimer=reclaimer,
                      interval=cfg.telemetry_interval, rule=rule, summary_writer=api if policy else None,
                      summary_policy=policy)
    stack.callback(telemetry.register(cfg.node_name, lambda: sampler.snapshot))
    sampler.start()
    stack.callback(sampler.stop)
    return sampler


def host_driver(cfg: PluginConfig) -> HostDriver | None:
    """The node's NVIDIA driver files for containers; None on mock and replay hardware (their specs stay
    env-only: nothing of the host's driver belongs in a mock container)."""
    if cfg.hardware != "nvml":
        return None
    from topodra import hostdriver

    return hostdriver.discover(cfg.nvidia_driver_root, dev_root=cfg.nvidia_dev_root, proc_root=cfg.nvidia_proc_root,
                               host_driver_root=cfg.nvidia_host_driver_root, cdi_hook=cfg.nvidia_cdi_hook_path,
                               cdi_hook_local=cfg.nvidia_cdi_hook_local_path)


def driver_root(cfg: PluginConfig) -> Path | None:
    """Where the driver's tools (nvidia-smi, MPS) are run from; None on mock and replay hardware (PATH only,
    no preload: their stand-ins need no driver libraries)."""
    return cfg.nvidia_driver_root if cfg.hardware == "nvml" else None


def mps_pods(cfg: PluginConfig, kube: Any) -> MpsPods | None:
    """``--mps-daemon pod``: the daemon pods' API access (``kube``: a ``topodra.kube.Kube``); None: processes."""
    if cfg.mps_daemon != "pod":
        return None
    from topodra.sharing.mpspod import MpsPods

    assert cfg.mps_daemon_namespace and cfg.mps_daemon_image  # PluginConfig checked both
    return MpsPods(kube, cfg.mps_daemon_namespace, cfg.node_name, cfg.mps_daemon_image)


def build_state(cfg: PluginConfig, inventory: Inventory, observer: Observer,
                mig: MigInstances | None = None, timeslice_control: TimeSliceControl | None = None,
                host: HostDriver | None = None, compute_mode: ComputeModeControl | None = None,
                mps_pods: MpsPods | None = None) -> DeviceState:
    """The node's prepare state; its checkpoint lives in the plugin dir next to the DRA socket.

    ``mig``: NVML access to create and destroy MIG instances of allocated MIG placement devices;
    ``timeslice_control``: sets GPUs' time-slice levels, ``compute_mode`` their compute mode for MPS (the GPU
    effects, ``topodra.effects``); ``mps_pods``: run the MPS daemons in pods of their own (``--mps-daemon pod``).
    """
    from topodra import effects
    from topodra.sharing.mps import MpsDaemons
    from topodra.state import DeviceState

    daemons = MpsDaemons(cfg.plugin_dir, driver_root=driver_root(cfg), compute_mode=compute_mode, pods=mps_pods,
                         host_driver_root=cfg.nvidia_host_driver_root if cfg.hardware == "nvml" else None)

    return DeviceState(cfg.driver_name, cfg.node_name, inventory, cdi_root=cfg.cdi_root, state_dir=cfg.plugin_dir,
                       boot_id_path=str(cfg.boot_id_file), quarantine_corrupt=cfg.quarantine_corrupt_checkpoint,
                       observer=observer,
                       gpu_effects=effects.standard(cfg.plugin_dir, mig=mig, timeslice=timeslice_control,
                                                    mps=daemons),
                       host_driver=host)


def run(args: argparse.Namespace) -> int:
    from topodra.checkpoint import CheckpointCorrupt
    from topodra.plugin.malloc import cap_arenas

    cap_arenas()  # before any thread starts (topodra.plugin.malloc)
    try:
        cfg = config.from_args(args, os.environ)
    except ConfigError as e:
        log.error("%s", e)
        return 2
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("received %s, shutting down node=%s", signal.Signals(signum).name, cfg.node_name)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    plugin = Plugin(cfg)
    previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, lambda *_: plugin.request_rediscovery())
    try:
        try:
            plugin.start()
        except ConfigError as e:
            log.error("%s", e)
            return 2
        except CheckpointCorrupt as e:
            log.error("refusing to start node=%s: %s", cfg.node_name, e)
            return 3
        except Exception as e:
            log.exception("kubelet plugin failed to start driver=%s node=%s: %s",
                          cfg.driver_name, cfg.node_name, e)
            return 1
        stop.wait()
        plugin.stop()
        return 0
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
