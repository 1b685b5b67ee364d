"""The real ClaimProfile controller as a subprocess, for cluster and node tests.

One namespace, its own lease there, a short refresh, output to a log file; SIGTERM at the end and a kill if
it does not stop within 20 s. Several test files start it the same way: one copy here.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def controller_process(kubeconfig: str, namespace: str, identity: str, log_path: Path,
                       refresh_s: int = 2) -> Iterator[subprocess.Popen[str]]:
    """``topodra controller`` watching only ``namespace`` (lease there too), refreshing every ``refresh_s``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "topodra.cli", "controller", "--kubeconfig", kubeconfig,
             "--namespace", namespace, "--refresh-interval", str(refresh_s), "--lease-namespace", namespace,
             "--identity", identity],
            stdout=log, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            yield proc
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
