"""Per-device telemetry on the node: what the GPUs and NICs that claims hold are doing.

``gpureads`` reads one GPU through NVML (the same ``pynvml``-shaped object discovery uses), ``ibcounters`` the
InfiniBand port counters in sysfs, ``attribution`` says which claim and pods hold a device (pure), ``idle``
decides when a claim is idle (pure), ``claimstatus`` writes that decision where users look (the claim's
per-device status and an Event on its pods), ``reclaim`` evicts idle claims' pods in namespaces that opt in,
and ``sampler`` runs it all in one thread of the kubelet plugin. The Prometheus exposition is the plugin's
(``topodra.plugin.telemetry``): this package never imports prometheus_client.
"""
