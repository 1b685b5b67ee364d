"""hack/build-bins keys nvidia-ctk on its own: bumping the toolkit must not move (and so rebuild) Kubernetes."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from testkit.paths import REPO


def print_bin(hack: Path, cache: Path) -> str:
    r = subprocess.run([str(hack / "build-bins"), "--print"], capture_output=True, text=True, timeout=60,
                       check=True, env={**os.environ, "TOPODRA_CACHE": str(cache)})
    return r.stdout.strip()


def test_a_new_toolkit_pin_keeps_the_bin_dir_and_a_new_kubernetes_pin_moves_it(tmp_path: Path) -> None:
    hack = tmp_path / "hack"
    shutil.copytree(REPO / "hack", hack, ignore=shutil.ignore_patterns("__pycache__", "images", "kind*"))
    before = print_bin(hack, tmp_path / "cache")
    (hack / "ctk-bin" / "go.sum").write_text((hack / "ctk-bin" / "go.sum").read_text() + "# bumped\n")
    assert print_bin(hack, tmp_path / "cache") == before
    (hack / "k8s-bins" / "go.sum").write_text((hack / "k8s-bins" / "go.sum").read_text() + "# bumped\n")
    assert print_bin(hack, tmp_path / "cache") != before


def test_the_toolkit_is_pinned_to_the_version_build_bins_names() -> None:
    text = (REPO / "hack/build-bins").read_text()
    (line,) = [x for x in text.splitlines() if x.startswith("CTK_VERSION=")]
    version = line.split("=", 1)[1]
    go_mod = (REPO / "hack/ctk-bin/go.mod").read_text()
    assert f"require github.com/NVIDIA/nvidia-container-toolkit {version}\n" in go_mod
    assert version.startswith("v1.20.")
