"""The kubelet plugin on the real node with the C NVML stand-in (``hardware=nvml``), for the telemetry node tests.

One place for the set-up those tests share: a sysfs tree of the same profile, a boot id, an empty hardware
config, no stale CDI specs of ours, the GPU class applied, then the plugin pointed at the stand-in's driver
root. The caller builds the driver root (``standin.driver_tree``) and its scenario first.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from testkit.handle import ClusterHandle
from testkit.paths import REPO
from testkit.pluginproc import CDI_ROOT, PluginProcess

from topodra.hardware.mockprofile import build_tree, load_profile


@contextmanager
def standin_plugin(nc: ClusterHandle, base: Path, tree: Path, profile: str, log_name: str,
                   env: Mapping[str, str]) -> Iterator[PluginProcess]:
    """The started plugin (``env`` added to its environment), stopped on exit."""
    sysfs = base / "sysfs"
    build_tree(load_profile(profile), frozenset()).materialize(str(sysfs))
    boot = base / "boot_id"
    boot.write_text(Path("/proc/sys/kernel/random/boot_id").read_text())
    hw = base / "hardware.yaml"
    hw.write_text("{}\n")
    for f in CDI_ROOT.glob("k8s.gpu.topodra.io-claim_*.json"):
        f.unlink()
    nc.apply_yaml(REPO / "deviceclasses/gpu.topodra.io.yaml")
    p = PluginProcess(nc.kubeconfig, nc.node_name, nc.lc.logs / log_name, hardware="nvml",
                      extra_env={"TOPODRA_BOOT_ID_FILE": str(boot), "TOPODRA_HARDWARE_CONFIG": str(hw),
                                 "TOPODRA_SYSFS_ROOT": str(sysfs), "TOPODRA_NVIDIA_DRIVER_ROOT": str(tree),
                                 "TOPODRA_NVIDIA_PROC_ROOT": str(tree / "proc"), **env})
    p.start()
    try:
        yield p
    finally:
        p.stop()
