"""The CPU and memory per GPU that GPU pods of each size actually ask for, learned from bound pods. Pure.

The host-aware measure (``fleet.hostfrag``) needs, per request class of k GPUs, the CPU and memory one of its
GPUs comes with. The scored pod's own per-GPU share stands in for the classes of its own size (``HostJob``);
for the other sizes, and for a pod without GPUs, the share is the one the cluster's GPU pods of that size
asked for: the last ``window`` bound GPU pods, per size k, sum of their CPU (memory) over the sum of their
GPUs. This is what makes a whole free server count: an 8-GPU class judged with the CPU-heavy 1-GPU pod's
share can never run anywhere (so breaking a whole server costs nothing), judged with what 8-GPU pods ask
for it can run on a whole server that still has that CPU.

Shares are rounded to ``CPU_STEP`` millicores and ``MEMORY_STEP`` bytes per GPU: the scorer caches its
per-state results by share, and a mean that moves by a few millicores with every new pod would start them
over on every call.
"""

from __future__ import annotations

from collections import OrderedDict

from topodra.fleet.hostres import Share, host_gpu_limit

CPU_STEP = 250  # millicores per GPU
MEMORY_STEP = 256 << 20  # bytes per GPU
Shares = tuple[tuple[int, Share], ...]  # (GPUs per pod, its share), by size: hashable, keys caches


class ObservedShares:
    """The window of recent bound GPU pods: uid -> (GPUs, CPU millicores, memory bytes). Not thread-safe."""

    def __init__(self, window: int = 200) -> None:
        if window < 0:
            raise ValueError("window must be >= 0")
        self.window = window
        self._recent: OrderedDict[str, tuple[int, int, int]] = OrderedDict()
        self._sums: dict[int, list[int]] = {}  # k -> [pods' GPUs, CPU, memory]
        self._cached: Shares | None = None

    def __len__(self) -> int:
        return len(self._recent)

    def seen(self, uid: str) -> bool:
        return uid in self._recent

    def add(self, uid: str, gpus: int, cpu_milli: int, memory_bytes: int) -> bool:
        """Count a bound GPU pod once (by uid); False when it was counted already or has no GPUs."""
        if not uid or gpus <= 0 or uid in self._recent or not self.window:
            return False
        self._recent[uid] = (gpus, cpu_milli, memory_bytes)
        self._bump(gpus, cpu_milli, memory_bytes, 1)
        while len(self._recent) > self.window:
            _uid, (k, c, m) = self._recent.popitem(last=False)
            self._bump(k, c, m, -1)
        return True

    def _bump(self, k: int, cpu: int, mem: int, sign: int) -> None:
        s = self._sums.setdefault(k, [0, 0, 0])
        s[0] += sign * k
        s[1] += sign * cpu
        s[2] += sign * mem
        if s[0] <= 0:
            del self._sums[k]
        self._cached = None

    def shares(self) -> Shares:
        """Per pod size (GPUs), the rounded share its pods asked for, smallest size first."""
        if self._cached is None:
            self._cached = tuple((k, rounded(c / g, m / g)) for k, (g, c, m) in sorted(self._sums.items()))
        return self._cached


def rounded(cpu_milli: float, memory_bytes: float) -> Share:
    """A share rounded to the nearest ``CPU_STEP`` / ``MEMORY_STEP`` (module docstring)."""
    return Share(float(round(cpu_milli / CPU_STEP) * CPU_STEP), float(round(memory_bytes / MEMORY_STEP) * MEMORY_STEP))


def share_for(k: int, own_k: int, own: Share | None, observed: Shares, fair: Share | None = None) -> Share | None:
    """The share a class of ``k`` GPUs per placement is judged with: the scored pod's own for its own size
    (``own_k``); else what pods of size k asked for; else (size not seen yet) ``fair``, the node's allocatable
    per GPU (what the server was built for); else the pod's own (None: GPUs only)."""
    if own is not None and k == own_k:
        return own
    for size, share in observed:
        if size == k:
            return share
    return fair if fair is not None else own


def stranded_by_shares(free_gpus: int, cpu_free: int, memory_free: int, observed: Shares,
                       fair: Share | None) -> tuple[int, int]:
    """Free GPUs of one node that its free CPU (and, separately, its free memory) leaves no pod size the cluster
    runs able to use: (by CPU, by memory). The inventory's measure (``clusterview.hostcols``), on the shares the
    scorer learns (``ObservedShares``), so both read one model.

    The sizes judged are the observed ones that fit the free GPUs (k <= free), each with what its pods asked for
    per GPU; a size takes whole placements of k. A GPU counts as stranded by CPU when even the size that can use
    the most of the free GPUs under the free CPU leaves it unused. With no observed size that fits, the node's
    allocatable per GPU (``fair``: what the server was built for) judges 1-GPU placements; without that,
    nothing is stranded (GPU-only).
    """
    sizes = [(k, s) for k, s in observed if 0 < k <= free_gpus]
    if not sizes:
        if fair is None:
            return 0, 0
        sizes = [(1, fair)]
    by_devices = max(k * (free_gpus // k) for k, _s in sizes)
    best_cpu = best_memory = 0
    for k, share in sizes:
        devices = k * (free_gpus // k)
        cpu, memory = host_gpu_limit(cpu_free, memory_free, share, k)
        best_cpu = max(best_cpu, min(devices, cpu))
        best_memory = max(best_memory, min(devices, memory))
    return max(0, by_devices - best_cpu), max(0, by_devices - best_memory)
