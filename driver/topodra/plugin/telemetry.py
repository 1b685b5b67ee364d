"""The telemetry sampler's series on the plugin's /metrics (``topodra.telemetry`` samples; this exposes).

Every GPU series carries the dcgm-exporter labels that mean the same here (``Hostname``, ``gpu``, ``UUID``,
``pci_bus_id``, ``modelName``, and ``namespace``/``pod`` while a claim holds the GPU), plus dcgm-exporter's DRA
label names (``dra_device_name``, ``dra_claim_name``) and ``dra_claim_uid``. A MIG device's series keep the
parent's ``UUID`` and ``gpu`` and add dcgm-exporter's ``GPU_I_ID`` and ``GPU_I_PROFILE`` and the MIG device's UUID
(``dra_mig_device_uuid``); these are '' on whole GPUs. ``topodra_gpu_claim_info`` (one series per GPU or MIG
device, claim and pod) joins with dcgm-exporter's own series on ``UUID`` (and ``GPU_I_ID`` for MIG;
docs/telemetry.md).
A value the sampler could not read is left out (no series), never exported as 0.

``METRICS`` is the one list of names, types and label sets; docs/telemetry.md lists exactly these
(tests/unit/telemetry/test_exposition.py checks it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import REGISTRY, Collector

from topodra.telemetry.sampler import GpuSeries, NicSeries, Snapshot

GPU_LABELS = ("Hostname", "gpu", "UUID", "pci_bus_id", "modelName", "dra_device_name", "namespace", "pod",
              "dra_claim_name", "dra_claim_uid", "GPU_I_ID", "GPU_I_PROFILE", "dra_mig_device_uuid")
MIG_LABELS = ("GPU_I_ID", "GPU_I_PROFILE", "dra_mig_device_uuid")  # '' on a whole GPU's series
NIC_LABELS = ("Hostname", "dra_device_name", "rdma_device", "port", "namespace", "pod", "dra_claim_name",
              "dra_claim_uid")
CLAIM_LABELS = ("Hostname", "namespace", "dra_claim_name", "dra_claim_uid")

# name -> (type, extra labels, help, GpuReading attribute or None)
GPU_GAUGES: dict[str, tuple[str, str]] = {
    "topodra_gpu_utilization_ratio": ("util_gpu", "Time a kernel ran over NVML's sample period (0-1; "
                                      "nvmlDeviceGetUtilizationRates.gpu, as DCGM_FI_DEV_GPU_UTIL)."),
    "topodra_gpu_memory_utilization_ratio": ("util_memory", "Time device memory was read or written (0-1; "
                                             "nvmlDeviceGetUtilizationRates.memory)."),
    "topodra_gpu_memory_used_bytes": ("memory_used", "Device memory in use (nvmlDeviceGetMemoryInfo_v2.used)."),
    "topodra_gpu_memory_total_bytes": ("memory_total", "Device memory (nvmlDeviceGetMemoryInfo_v2.total)."),
    "topodra_gpu_power_watts": ("power_watts", "Power draw (nvmlDeviceGetPowerUsage)."),
    "topodra_gpu_temperature_celsius": ("temperature_celsius", "GPU die temperature (nvmlDeviceGetTemperature)."),
    "topodra_gpu_sm_clock_hertz": ("sm_clock_hertz", "SM clock (nvmlDeviceGetClockInfo NVML_CLOCK_SM)."),
    "topodra_gpu_pcie_tx_bytes_per_second": ("pcie_tx_bytes_per_second",
                                             "PCIe transmit throughput over NVML's 20 ms window "
                                             "(nvmlDeviceGetPcieThroughput TX)."),
    "topodra_gpu_pcie_rx_bytes_per_second": ("pcie_rx_bytes_per_second",
                                             "PCIe receive throughput over NVML's 20 ms window "
                                             "(nvmlDeviceGetPcieThroughput RX)."),
    "topodra_gpu_graphics_active_ratio": ("graphics_active", "Time any graphics/compute engine was active since "
                                          "the previous sample (GPM GRAPHICS_UTIL, as DCGM_FI_PROF_GR_ENGINE_ACTIVE; "
                                          "Hopper and later)."),
    "topodra_gpu_sm_active_ratio": ("sm_active", "Share of SMs busy since the previous sample (GPM SM_UTIL, as "
                                    "DCGM_FI_PROF_SM_ACTIVE; Hopper and later)."),
    "topodra_gpu_tensor_active_ratio": ("tensor_active", "Time the SMs ran any tensor operation since the previous "
                                        "sample (GPM ANY_TENSOR_UTIL, as DCGM_FI_PROF_PIPE_TENSOR_ACTIVE)."),
}
GPU_COUNTERS: dict[str, tuple[str, str]] = {
    "topodra_gpu_nvlink_tx_bytes": ("nvlink_tx_bytes", "NVLink data transmitted, all links "
                                    "(NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, KiB x 1024)."),
    "topodra_gpu_nvlink_rx_bytes": ("nvlink_rx_bytes", "NVLink data received, all links "
                                    "(NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, KiB x 1024)."),
}
METRICS: dict[str, tuple[str, tuple[str, ...]]] = {
    **{n: ("gauge", GPU_LABELS) for n in GPU_GAUGES},
    **{n + "_total": ("counter", GPU_LABELS) for n in GPU_COUNTERS},
    "topodra_gpu_ecc_errors_total": ("counter", (*GPU_LABELS, "type")),
    "topodra_gpu_xid_errors_total": ("counter", (*GPU_LABELS, "xid")),
    "topodra_gpu_claim_info": ("gauge", ("Hostname", "UUID", "dra_device_name", "namespace", "pod",
                                         "dra_claim_name", "dra_claim_uid", *MIG_LABELS)),
    "topodra_nic_port_rcv_bytes_total": ("counter", NIC_LABELS),
    "topodra_nic_port_xmit_bytes_total": ("counter", NIC_LABELS),
    "topodra_claim_idle": ("gauge", CLAIM_LABELS),
    "topodra_claim_below_threshold_seconds": ("gauge", CLAIM_LABELS),
    "topodra_idle_reclaims_total": ("counter", ("Hostname", "namespace", "result")),
    "topodra_telemetry_samples_total": ("counter", ("Hostname",)),
    "topodra_telemetry_errors_total": ("counter", ("Hostname", "call")),
    "topodra_telemetry_api_errors_total": ("counter", ("Hostname",)),
    "topodra_telemetry_summary_writes_total": ("counter", ("Hostname",)),
    "topodra_telemetry_sample_duration_seconds": ("gauge", ("Hostname",)),
    "topodra_telemetry_last_sample_timestamp_seconds": ("gauge", ("Hostname",)),
}


def _mig_labels(s: GpuSeries) -> list[str]:
    return ["", "", ""] if s.mig is None else [str(s.mig.gpu_instance), s.mig.profile, s.mig.uuid]


def _gpu_labels(node: str, s: GpuSeries) -> list[str]:
    t, h = s.target, s.holder
    return [node, "" if s.index is None else str(s.index), t.uuid, t.bus_id, t.model, t.name, h.namespace, h.pod,
            h.claim, h.claim_uid, *_mig_labels(s)]


def _nic_labels(node: str, s: NicSeries, port: str) -> list[str]:
    h = s.holder
    return [node, s.target.name, s.target.rdma, port, h.namespace, h.pod, h.claim, h.claim_uid]


def families(node: str, snap: Snapshot) -> list[Metric]:
    """The snapshot as metric families (pure)."""
    out: list[Metric] = []
    per_gpu = [(GaugeMetricFamily, GPU_GAUGES), (CounterMetricFamily, GPU_COUNTERS)]
    for family, readings in per_gpu:
        for name, (attr, help_) in readings.items():
            f = family(name, help_, labels=GPU_LABELS)
            for s in snap.gpus:
                v = getattr(s.reading, attr)
                if v is not None:
                    f.add_metric(_gpu_labels(node, s), float(v))
            out.append(f)
    ecc = CounterMetricFamily("topodra_gpu_ecc_errors", "ECC errors since the driver loaded "
                              "(nvmlDeviceGetTotalEccErrors, volatile counts).", labels=(*GPU_LABELS, "type"))
    for s in snap.gpus:
        for kind, v in (("corrected", s.reading.ecc_corrected), ("uncorrected", s.reading.ecc_uncorrected)):
            if v is not None:
                ecc.add_metric([*_gpu_labels(node, s), kind], float(v))
    out.append(ecc)
    xid = CounterMetricFamily("topodra_gpu_xid_errors", "XID events seen since the plugin started (NVML event "
                              "set, nvmlEventTypeXidCriticalError), by XID code.", labels=(*GPU_LABELS, "xid"))
    by_name = {s.target.name: s for s in snap.gpus if s.mig is None}
    for (device, code), n in sorted(snap.xids.items()):
        if device in by_name:
            xid.add_metric([*_gpu_labels(node, by_name[device]), str(code)], float(n))
    out.append(xid)
    info = GaugeMetricFamily("topodra_gpu_claim_info", "1 for each GPU or MIG device a claim holds, per pod the claim "
                             "is reserved for: join on UUID (and GPU_I_ID for MIG) with dcgm-exporter's series.",
                             labels=METRICS["topodra_gpu_claim_info"][1])
    by_device = {s.target.name: s for s in snap.gpus}
    for device, claim, pod in snap.claims:
        if device in by_device:
            s = by_device[device]
            info.add_metric([node, s.target.uuid, device, claim.namespace, pod, claim.name, claim.uid,
                             *_mig_labels(s)], 1.0)
    out.append(info)
    rcv = CounterMetricFamily("topodra_nic_port_rcv_bytes", "Bytes received on the port of a compute NIC in a "
                              "claim (sysfs counters/port_rcv_data x 4).", labels=NIC_LABELS)
    xmit = CounterMetricFamily("topodra_nic_port_xmit_bytes", "Bytes sent on the port of a compute NIC in a claim "
                               "(sysfs counters/port_xmit_data x 4).", labels=NIC_LABELS)
    for nic in snap.nics:
        for p in nic.ports:
            rcv.add_metric(_nic_labels(node, nic, p.port), float(p.rcv_bytes))
            xmit.add_metric(_nic_labels(node, nic, p.port), float(p.xmit_bytes))
    out += [rcv, xmit]
    idle = GaugeMetricFamily("topodra_claim_idle", "1 while the claim is idle (its GPUs below the activity and "
                             "memory thresholds for the idle time), else 0.", labels=CLAIM_LABELS)
    below = GaugeMetricFamily("topodra_claim_below_threshold_seconds", "How long the claim's GPUs have been below "
                              "the idle thresholds (0 when they are not).", labels=CLAIM_LABELS)
    for ci in snap.idle:
        lab = [node, ci.claim.namespace, ci.claim.name, ci.claim.uid]
        idle.add_metric(lab, 1.0 if ci.idle else 0.0)
        below.add_metric(lab, ci.idle_seconds)
    out += [idle, below]
    reclaims = CounterMetricFamily("topodra_idle_reclaims", "Opt-in reclaim of idle claims, by result: evicted "
                                   "(pods), dry_run (pods a dry-run namespace would lose), blocked (evictions a "
                                   "PodDisruptionBudget refused, retried), invalid (claims in a namespace whose "
                                   "setting is bad), failed (other eviction errors).",
                                   labels=("Hostname", "namespace", "result"))
    for (ns, result), n in sorted(snap.reclaims.items()):
        reclaims.add_metric([node, ns, result], float(n))
    out.append(reclaims)
    samples = CounterMetricFamily("topodra_telemetry_samples", "Sampling rounds done.", labels=("Hostname",))
    samples.add_metric([node], float(snap.samples))
    errors = CounterMetricFamily("topodra_telemetry_errors", "Failed reads (NVML calls, sysfs) by call; a failed "
                                 "read leaves its series out. NOT_SUPPORTED is not counted.",
                                 labels=("Hostname", "call"))
    for call, n in sorted(snap.errors.items()):
        errors.add_metric([node, call], float(n))
    api = CounterMetricFamily("topodra_telemetry_api_errors", "Failed API reads of claims and writes of the Idle "
                              "condition (retried at the next sample).", labels=("Hostname",))
    api.add_metric([node], float(snap.api_errors))
    writes = CounterMetricFamily("topodra_telemetry_summary_writes", "Summaries applied to claims' status.devices[]"
                                 ".data (at most one per claim per --status-summary-interval).", labels=("Hostname",))
    writes.add_metric([node], float(snap.summary_writes))
    dur = GaugeMetricFamily("topodra_telemetry_sample_duration_seconds", "Time the last sampling round took.",
                            labels=("Hostname",))
    last = GaugeMetricFamily("topodra_telemetry_last_sample_timestamp_seconds", "Unix time of the last sample.",
                             labels=("Hostname",))
    if snap.samples:
        dur.add_metric([node], snap.duration)
        last.add_metric([node], snap.taken_at)
    out += [samples, errors, api, writes, dur, last]
    return out


class TelemetryCollector(Collector):
    """Exposes the sampler's last snapshot at every scrape (no NVML call at scrape time)."""

    def __init__(self, node: str, snapshot: Callable[[], Snapshot]) -> None:
        self.node = node
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        yield from families(self.node, self._snapshot())

    def describe(self) -> Iterator[Metric]:
        yield from families(self.node, Snapshot())


def register(node: str, snapshot: Callable[[], Snapshot], registry: Any = REGISTRY) -> Callable[[], None]:
    """Register the collector; returns its unregister."""
    c = TelemetryCollector(node, snapshot)
    registry.register(c)
    return lambda: registry.unregister(c)
