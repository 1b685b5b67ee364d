"""What every part of the prepare bench shares: the bench node, the targets, its error and its log."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from typing import Any

from topodra import DEFAULT_DRIVER_NAME
from topodra.kube import KubeError

DRIVER = DEFAULT_DRIVER_NAME
NODE = "fake-bench-0"
HARDWARE = "mock:dgx-h100"
R = "/apis/resource.k8s.io/v1"
ADMIN_LABEL = "resource.kubernetes.io/admin-access"
TARGET_P99_MS_8DEV = 20.0
TARGET_RSS_MB = 80.0  # decimal megabytes (80e6 bytes), the stricter reading of "80 MB"
MiB = 1024 * 1024


class BenchError(RuntimeError):
    """The benchmark cannot continue; the message says why."""


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def wait_until(fn: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(KubeError):
            v = fn()
            if v:
                return v
        time.sleep(0.2)
    raise BenchError(f"timed out waiting for {what}")
