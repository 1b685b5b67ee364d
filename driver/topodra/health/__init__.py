"""Device health: hardware signals → device taints and kubelet health, with hysteresis.

``policy`` is pure (what a signal means, when a taint clears); ``sources``
reads the signals from NVML and sysfs (the same code for real, mock and replay
hardware); ``monitor`` is the one thread per node that polls the sources, feeds
the policy and tells its subscribers (the ResourceSlice publisher and the
kubelet's device-health board) when the result changed.  docs/health.md has the
table of signals and effects.
"""
