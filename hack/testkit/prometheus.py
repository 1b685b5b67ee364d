"""Real Prometheus and promtool for tests: Debian's pinned package, unpacked by hack/prometheus-bin."""

from __future__ import annotations

import subprocess
from pathlib import Path

from testkit.paths import REPO


def bin_dir() -> Path:
    """The directory holding ``prometheus`` and ``promtool`` (fetched and unpacked on first use)."""
    r = subprocess.run([str(REPO / "hack" / "prometheus-bin")], capture_output=True, text=True, timeout=300,
                       check=False)  # fmt: skip
    assert r.returncode == 0, f"hack/prometheus-bin failed: {r.stderr}"
    return Path(r.stdout.strip()) / "usr" / "bin"
