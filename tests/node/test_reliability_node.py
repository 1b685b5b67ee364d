"""The disk-full part of the reliability campaign (bench/reliability) at a reduced size.

It mounts small tmpfs filesystems under the CDI and checkpoint directories, so it needs root: the node
tier. The other parts run without root in tests/unit/bench/test_reliability.py.

Split by tier; the rest: tests/unit/bench/test_reliability.py.
"""

from __future__ import annotations

from pathlib import Path

from bench.reliability import disk as reliability_disk


def test_disk_full_on_cdi_and_checkpoint_dirs(tmp_path: Path) -> None:
    out = reliability_disk.run(1, root=tmp_path)  # mounts tmpfs: the test suite runs as root, as the cluster does
    assert out["lost"] == []
