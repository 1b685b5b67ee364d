"""Configuration of ``topodra kubelet-plugin``: flags, ``TOPODRA_*`` env vars, validation.

A DaemonSet usually sets everything through the environment (node name and pod
UID from the downward API), so every flag ``--some-flag`` can also be given as
``TOPODRA_SOME_FLAG``; a flag on the command line wins over the environment.
``NODE_NAME`` is accepted as a fallback for ``--node-name``.
"""

from __future__ import annotations

import argparse
import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from topodra import DEFAULT_DRIVER_NAME
from topodra.health.policy import NO_EXECUTE_NAMES
from topodra.nodelabels import label_value

DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
POD_UID = re.compile(r"^[A-Za-z0-9][-A-Za-z0-9]{0,62}$")
NUMA_ALIAS_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,31}$")  # an attribute's C identifier (<= 32 characters)
KUBELET_PLUGINS_DIR = Path("/var/lib/kubelet/plugins")
KUBELET_REGISTRY_DIR = Path("/var/lib/kubelet/plugins_registry")
DEFAULT_CDI_HOOK_PATH = "/usr/bin/nvidia-cdi-hook"  # where the NVIDIA Container Toolkit's packages install it
# Below Linux's ephemeral range (32768-60999), so an outgoing connection can never hold them.
DEFAULT_HEALTH_PORT = 9415
DEFAULT_METRICS_PORT = 9416


class ConfigError(ValueError):
    """Invalid plugin configuration; the message names the flag and env var."""


@dataclass(frozen=True)
class Flag:
    field: str
    help: str
    metavar: str = "VALUE"

    @property
    def option(self) -> str:
        return "--" + self.field.replace("_", "-")

    @property
    def env(self) -> str:
        return "TOPODRA_" + self.field.upper()


FLAGS: tuple[Flag, ...] = (
    Flag("driver_name", f"DRA driver name (default {DEFAULT_DRIVER_NAME})", "NAME"),
    Flag("node_name", "name of this node (required; NODE_NAME is also read)", "NAME"),
    Flag("kubeconfig", "kubeconfig file (default: in-cluster service account)", "PATH"),
    Flag("hardware", "nvml, mock:<profile>, mock:/path/profile.yaml or replay:/path/capture.yaml (default nvml)",
         "SPEC"),
    Flag("hardware_config", "YAML file with hardware overrides (e.g. NIC rails) for discovery", "PATH"),
    Flag("cdi_root", "directory for CDI spec files (default /var/run/cdi)", "DIR"),
    Flag("plugin_dir", f"directory of the DRA socket (default {KUBELET_PLUGINS_DIR}/<driver-name>)", "DIR"),
    Flag("registry_dir", f"kubelet plugin registry directory (default {KUBELET_REGISTRY_DIR})", "DIR"),
    Flag("pod_uid", "UID of this pod; enables per-pod socket names for rolling updates", "UID"),
    Flag("health_port", f"127.0.0.1 port of the gRPC health service, 0 = off (default {DEFAULT_HEALTH_PORT})",
         "PORT"),
    Flag("metrics_port", f"port of /metrics on --metrics-address, 0 disables (default {DEFAULT_METRICS_PORT})",
         "PORT"),
    Flag("metrics_address", "IP address /metrics listens on (default 127.0.0.1: this host only; the pod IP or "
         "0.0.0.0 lets Prometheus scrape it)", "IP"),
    Flag("sysfs_root", "directory that contains the sys/ tree discovery reads (default /)", "DIR"),
    Flag("nvidia_driver_root", "root of the NVIDIA driver files (/ on the host, /driver-root in the chart's pod): "
         "--hardware nvml loads <root>/{usr/lib64,usr/lib/x86_64-linux-gnu,...}/libnvidia-ml.so.1 by absolute "
         "path (default /)", "DIR"),
    Flag("nvidia_host_driver_root", "the same driver root as the container runtime on the host sees it: CDI "
         "mounts of the driver libraries use it (default: --nvidia-driver-root; the chart: plugin.nvidiaDriverRoot)",
         "DIR"),
    Flag("nvidia_dev_root", "directory whose dev/ holds /dev/nvidiactl, nvidia-uvm, nvidiaN (default: the driver "
         "root when it has dev/nvidiactl, else /)", "DIR"),
    Flag("nvidia_proc_root", "the proc tree whose devices and driver/nvidia/capabilities the plugin reads "
         "(nvidia-caps major, MIG capability minors; default /proc)", "DIR"),
    Flag("nvidia_cdi_hook_path", "nvidia-cdi-hook as the host's container runtime runs it (hooks run on the "
         "host): claim specs carry the NVIDIA toolkit's hooks (create-symlinks, update-ldcache, ...) when it is "
         "there; none disables them (default /usr/bin/nvidia-cdi-hook; the chart: plugin.nvidiaCDIHookPath)",
         "PATH"),
    Flag("nvidia_cdi_hook_local_path", "where this process sees that same file, to check it exists (default: "
         "--nvidia-cdi-hook-path; the chart mounts its directory)", "PATH"),
    Flag("rediscover_interval", "seconds between hardware re-discoveries; SIGHUP also re-reads --hardware-config "
         "and re-discovers; 0 = only on SIGHUP (default 60)", "SECONDS"),
    Flag("claim_cleanup_interval", "seconds between passes that unprepare claims whose ResourceClaim was "
         "deleted, replaced or deallocated and remove orphan CDI specs; one pass always runs at start; "
         "0 = only then (default 300)", "SECONDS"),
    Flag("boot_id_file", "file holding this boot's ID; a change means the node rebooted "
         "(default /proc/sys/kernel/random/boot_id)", "PATH"),
    Flag("quarantine_corrupt_checkpoint", "true: move a corrupt checkpoint aside and start empty "
         "(default false: refuse to start)", "BOOL"),
    Flag("health_hold_seconds", "a device taint is removed once its signal has not been seen for this long "
         "(default 300)", "SECONDS"),
    Flag("health_poll_interval", "seconds between polls of GPU/NVLink/NIC state; NVML events arrive at once "
         "(default 5)", "SECONDS"),
    Flag("health_no_execute", "comma list of health conditions that evict (NoExecute instead of NoSchedule): "
         "XID codes, gpu-lost, recovery-action (default none, as NVIDIA's DRA driver)", "LIST"),
    Flag("node_labels", "true: keep this node's topodra.io/ labels (gpu-model, gpu-count, nvlink-clique; "
         "leaf-group, scalable-unit and spine-group from Topograph's labels, else --hardware-config's "
         "leafGroup/scalableUnit/spineGroup; rail-group from railGroup) in sync with discovery; "
         "false: never write the Node (default true)", "BOOL"),
    Flag("numa_alias", "also publish each GPU's and NIC's NUMA node under this attribute, for a CPU driver that "
         "lacks resource.kubernetes.io/numaNode: dra.net/numaNode for dra-driver-cpu v0.2.0 (default none)",
         "ATTRIBUTE"),
    Flag("mps_daemon", "where an MPS claim's control daemon runs: process (a child of the plugin; it survives "
         "the plugin only when the plugin is a host process) or pod (a pod of its own per claim on this node, "
         "NVIDIA's way: it survives a restart or upgrade of the plugin's pod; needs --mps-daemon-namespace and "
         "--mps-daemon-image) (default process; the chart: pod)", "MODE"),
    Flag("mps_daemon_namespace", "namespace of the MPS daemon pods (the chart: the plugin's own)", "NAMESPACE"),
    Flag("mps_daemon_image", "image of the MPS daemon pods (the chart: the plugin's own image)", "IMAGE"),
    Flag("telemetry", "true: sample every GPU and claimed compute NIC (NVML, sysfs) in a thread and serve the "
         "series on /metrics, and flag idle claims; false: none of it (default true; docs/telemetry.md)", "BOOL"),
    Flag("telemetry_interval", "seconds between telemetry samples (default 10)", "SECONDS"),
    Flag("idle_activity_below", "a claim's GPUs count as idle below this compute activity, 0-1 (GPM SM activity, "
         "else NVML utilisation; default 0.05)", "RATIO"),
    Flag("idle_memory_below", "... and below this share of their memory in use, 0-1 (default 0.10)", "RATIO"),
    Flag("idle_seconds", "a claim is idle once its GPUs stayed below both for this long (default 900)", "SECONDS"),
    Flag("idle_conditions", "true: write the Idle condition into the claim's status.devices and an Event on its "
         "pods when a claim becomes idle or active again; false: metrics only (default true)", "BOOL"),
    Flag("idle_reclaim", "true: evict the pods of idle claims in namespaces labelled topodra.io/idle-reclaim=enabled "
         "(an Event only for =dry-run) once idle for their grace period; false: never read namespaces or evict "
         "(default true; no namespace is labelled by default, so nothing is evicted; docs/telemetry.md)", "BOOL"),
    Flag("idle_reclaim_grace", "grace period of a namespace that opts in without the topodra.io/idle-reclaim-grace "
         "annotation: seconds its claims' GPUs must have been below the idle thresholds, at least --idle-seconds "
         "(default 3600)", "SECONDS"),
    Flag("status_summary_interval", "at most this often per claim, write the GPUs' activity, memory, idle-since "
         "and held/active seconds into the claim's status.devices[].data (on change, refreshed every 6 intervals; "
         "0: never; default 300; docs/telemetry.md)", "SECONDS"),
)
# Keys of the --hardware-config file that are node labels for the admin's topology, not discovery overrides.
NODE_LABEL_KEYS = {"leafGroup": "leaf_group", "scalableUnit": "scalable_unit", "spineGroup": "spine_group",
                   "railGroup": "rail_group"}


class PluginConfig(BaseModel):
    """Validated settings of one kubelet-plugin process."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    driver_name: str = DEFAULT_DRIVER_NAME
    node_name: str
    kubeconfig: Path | None = None
    hardware: str = "nvml"
    hardware_config: Path | None = None
    cdi_root: Path = Path("/var/run/cdi")
    plugin_dir: Path
    registry_dir: Path = KUBELET_REGISTRY_DIR
    pod_uid: str | None = None
    health_port: int = Field(default=DEFAULT_HEALTH_PORT, ge=0, le=65535)
    metrics_port: int = Field(default=DEFAULT_METRICS_PORT, ge=0, le=65535)
    metrics_address: str = "127.0.0.1"
    sysfs_root: Path | None = None
    nvidia_driver_root: Path = Path("/")
    nvidia_host_driver_root: Path | None = None
    nvidia_dev_root: Path | None = None
    nvidia_proc_root: Path = Path("/proc")
    nvidia_cdi_hook_path: str = DEFAULT_CDI_HOOK_PATH
    nvidia_cdi_hook_local_path: Path | None = None
    rediscover_interval: float = Field(default=60.0, ge=0)
    claim_cleanup_interval: float = Field(default=300.0, ge=0)
    boot_id_file: Path = Path("/proc/sys/kernel/random/boot_id")
    quarantine_corrupt_checkpoint: bool = False
    health_hold_seconds: float = Field(default=300.0, ge=0)
    health_poll_interval: float = Field(default=5.0, gt=0)
    health_no_execute: tuple[str, ...] = ()
    node_labels: bool = True
    numa_alias: str | None = None
    mps_daemon: Literal["process", "pod"] = "process"
    mps_daemon_namespace: str | None = None
    mps_daemon_image: str | None = None
    telemetry: bool = True
    telemetry_interval: float = Field(default=10.0, gt=0)
    idle_activity_below: float = Field(default=0.05, gt=0, le=1)
    idle_memory_below: float = Field(default=0.10, gt=0, le=1)
    idle_seconds: float = Field(default=900.0, ge=0)
    idle_conditions: bool = True
    idle_reclaim: bool = True
    idle_reclaim_grace: float = Field(default=3600.0, gt=0)
    status_summary_interval: float = Field(default=300.0, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _default_plugin_dir(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("plugin_dir") in (None, ""):
            driver = data.get("driver_name") or DEFAULT_DRIVER_NAME
            data = {**data, "plugin_dir": KUBELET_PLUGINS_DIR / str(driver)}
        return data

    @model_validator(mode="after")
    def _mps_pod_settings(self) -> PluginConfig:
        if self.mps_daemon == "pod" and not (self.mps_daemon_namespace and self.mps_daemon_image):
            raise ValueError("--mps-daemon pod (env TOPODRA_MPS_DAEMON) needs --mps-daemon-namespace (env "
                             "TOPODRA_MPS_DAEMON_NAMESPACE) and --mps-daemon-image (env TOPODRA_MPS_DAEMON_IMAGE)")
        if self.mps_daemon_namespace is not None and not DNS_SUBDOMAIN.match(self.mps_daemon_namespace):
            raise ValueError(f"--mps-daemon-namespace {self.mps_daemon_namespace!r} is not a namespace name")
        return self

    @model_validator(mode="after")
    def _reclaim_grace(self) -> PluginConfig:
        if self.idle_reclaim_grace < self.idle_seconds:
            raise ValueError(f"--idle-reclaim-grace {self.idle_reclaim_grace:g} (env TOPODRA_IDLE_RECLAIM_GRACE) is "
                             f"shorter than --idle-seconds {self.idle_seconds:g}: a claim is reclaimed only after it "
                             "is idle")
        return self

    @field_validator("driver_name", "node_name")
    @classmethod
    def _dns_subdomain(cls, v: str) -> str:
        if len(v) > 63 or not DNS_SUBDOMAIN.match(v):
            raise ValueError(f"{v!r} is not a DNS subdomain of at most 63 characters")
        return v

    @field_validator("hardware")
    @classmethod
    def _hardware_spec(cls, v: str) -> str:
        kind, _, arg = v.partition(":")
        if v != "nvml" and not (kind in ("mock", "replay") and arg):
            raise ValueError(f"{v!r} is not 'nvml', 'mock:<profile>' or 'replay:<path>'")
        return v

    @field_validator("cdi_root", "plugin_dir", "registry_dir")
    @classmethod
    def _absolute(cls, v: Path) -> Path:
        if not v.is_absolute():
            raise ValueError(f"{str(v)!r} must be an absolute path (the kubelet needs absolute socket paths)")
        return v

    @field_validator("nvidia_cdi_hook_path")
    @classmethod
    def _hook_path(cls, v: str) -> str:
        if v == "none":  # an empty env var reads as unset, so the chart says "none"
            return ""
        if v and not v.startswith("/"):
            raise ValueError(f"{v!r} must be an absolute host path (or none: no hooks)")
        return v

    @field_validator("metrics_address")
    @classmethod
    def _ip_address(cls, v: str) -> str:
        try:
            return str(ipaddress.ip_address(v))
        except ValueError:
            raise ValueError(f"{v!r} is not an IP address") from None

    @field_validator("health_no_execute", mode="before")
    @classmethod
    def _no_execute(cls, v: Any) -> Any:
        names = tuple(x.strip() for x in v.split(",") if x.strip()) if isinstance(v, str) else v
        if isinstance(names, tuple | list):
            bad = [n for n in names if not (str(n).isdigit() or n in NO_EXECUTE_NAMES)]
            if bad:
                raise ValueError(f"{bad} are not XID codes or one of {sorted(NO_EXECUTE_NAMES)}")
        return names

    @field_validator("numa_alias")
    @classmethod
    def _qualified_attribute(cls, v: str | None) -> str | None:
        if v in (None, ""):
            return None
        domain, _, name = v.partition("/")
        if not (DNS_SUBDOMAIN.match(domain) and NUMA_ALIAS_NAME.match(name)):
            raise ValueError(f"{v!r} is not a qualified attribute name like dra.net/numaNode")
        return v

    @field_validator("pod_uid")
    @classmethod
    def _pod_uid(cls, v: str | None) -> str | None:
        if v in (None, ""):
            return None
        if not POD_UID.match(v):
            raise ValueError(f"{v!r} is not a pod UID (letters, digits and '-', at most 63)")
        return v

    def hardware_overrides(self) -> dict[str, Any] | None:
        """The --hardware-config file's discovery overrides, or None; a clear ConfigError when unusable."""
        data = self._hardware_config_file()
        return None if data is None else {k: v for k, v in data.items() if k not in NODE_LABEL_KEYS}

    def topology_labels(self) -> dict[str, str] | None:
        """``leaf_group`` / ``scalable_unit`` / ``spine_group`` / ``rail_group`` from --hardware-config; None
        without a file (then the plugin leaves those labels to Topograph and the admin)."""
        data = self._hardware_config_file()
        if data is None:
            return None
        out: dict[str, str] = {}
        for key, name in NODE_LABEL_KEYS.items():
            value = data.get(key)
            if value is None:
                continue
            if not isinstance(value, str | int) or isinstance(value, bool) or not str(value).strip():
                raise ConfigError(f"--hardware-config {self.hardware_config}: {key} must be a non-empty "
                                  f"string, got {value!r}")
            try:  # refused here, at start or re-read, rather than on every label sync
                label_value(str(value))
            except ValueError as e:
                raise ConfigError(f"--hardware-config {self.hardware_config}: {key}: {e}") from None
            out[name] = str(value)
        return out

    def _hardware_config_file(self) -> dict[str, Any] | None:
        if self.hardware_config is None:
            return None
        try:
            data = yaml.safe_load(self.hardware_config.read_text())
        except OSError as e:
            raise ConfigError(f"--hardware-config {self.hardware_config}: cannot read: {e.strerror}") from e
        except yaml.YAMLError as e:
            raise ConfigError(f"--hardware-config {self.hardware_config}: invalid YAML: {e}") from e
        if data is None:
            return {}
        if not isinstance(data, dict):
            raise ConfigError(
                f"--hardware-config {self.hardware_config}: expected a mapping, got {type(data).__name__}"
            )
        return data


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the plugin flags; defaults stay None so the environment can fill them in."""
    for flag in FLAGS:
        parser.add_argument(flag.option, dest=flag.field, metavar=flag.metavar, default=None,
                            help=f"{flag.help} [env {flag.env}]")


def from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> PluginConfig:
    """Merge flags over ``TOPODRA_*`` env vars and validate; ConfigError names the culprit."""
    values: dict[str, str] = {}
    for flag in FLAGS:
        value = getattr(args, flag.field, None)
        if value is None:
            value = environ.get(flag.env) or None
        if value is None and flag.field == "node_name":
            value = environ.get("NODE_NAME") or None
        if value is not None:
            values[flag.field] = value
    if "node_name" not in values:
        raise ConfigError("--node-name is required (or set TOPODRA_NODE_NAME or NODE_NAME)")
    try:
        return PluginConfig.model_validate(values)
    except ValidationError as e:
        by_field = {f.field: f for f in FLAGS}
        problems = []
        for err in e.errors():
            name = str(err["loc"][0]) if err["loc"] else ""
            known = by_field.get(name)
            where = f"{known.option} (env {known.env})" if known else (name or "config")
            problems.append(f"{where}: {err['msg']}")
        raise ConfigError("invalid kubelet-plugin configuration: " + "; ".join(problems)) from None
