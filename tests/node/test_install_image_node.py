"""The topodra image (hack/build-image): content list and the image's own root filesystem at work.

Building needs root and (the first time) Debian's mirror and PyPI; later builds reuse the cached Debian
layer and wheels (about a minute). The image's layers are unpacked and its python runs, chrooted, as the
controller's uid and as root, the way a container runtime would start it.

Split by tier; the rest: tests/unit/deploy/test_install_image.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from images import topodra_image as ti
from testkit.paths import REPO


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("image") / "topodra.tar"
    r = subprocess.run([str(REPO / "hack/build-image"), "-o", str(out), "--name", "localhost/topodra:test"],
                       capture_output=True, text=True, timeout=900, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def rootfs(image: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The image's layers unpacked in order, as a runtime's snapshotter would stack them."""
    root = tmp_path_factory.mktemp("rootfs")
    root.chmod(0o755)  # a snapshotter's root directory; pytest makes its temp dirs 0700
    manifest = _manifest(image)
    with tarfile.open(image) as tar:
        for layer in manifest["layers"]:
            blob = tar.extractfile(f"blobs/sha256/{layer['digest'].split(':')[1]}")
            assert blob is not None
            with tarfile.open(fileobj=blob, mode="r:gz") as lt:
                lt.extractall(root, filter="fully_trusted")  # our own image; device nodes and owners kept
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _manifest(image: Path) -> dict[str, Any]:
    with tarfile.open(image) as tar:
        index = json.load(tar.extractfile("index.json"))  # type: ignore[arg-type]
        digest = index["manifests"][0]["digest"].split(":")[1]
        return dict(json.load(tar.extractfile(f"blobs/sha256/{digest}")))  # type: ignore[arg-type]


def _config(image: Path) -> dict[str, Any]:
    with tarfile.open(image) as tar:
        digest = _manifest(image)["config"]["digest"].split(":")[1]
        return dict(json.load(tar.extractfile(f"blobs/sha256/{digest}")))  # type: ignore[arg-type]


def test_content_list_matches_the_locks(image: Path) -> None:
    listing = Path(f"{image}.contents.txt").read_text().splitlines()
    debs = {x.split()[1]: x.split()[2] for x in listing if x.startswith("deb ")}
    pys = {x.split()[1]: x.split()[2] for x in listing if x.startswith("py ")}
    assert debs == ti.parse_deb_lock(ti.DEB_LOCK.read_text())
    assert pys == {**ti.parse_py_lock(ti.PY_LOCK.read_text()), "topodra": ti.project_version()}
    files = [x.split()[3] for x in listing if x.startswith("layer")]
    assert "/opt/topodra/bin/topodra" in files and "/usr/bin/python3.11" in files
    # Nothing that differs per build run: logs, apt lists, caches, machine id, stray byte code caches.
    assert not [f for f in files if f.startswith(("/var/log/", "/var/lib/apt/lists/", "/var/cache/apt/", "/tmp/"))]
    assert "/etc/machine-id" not in files
    report = json.loads(Path(f"{image}.build.json").read_text())
    with tarfile.open(image) as tar:
        index = json.load(tar.extractfile("index.json"))  # type: ignore[arg-type]
    assert report["manifest"] == index["manifests"][0]["digest"]
    assert listing[0].startswith("# topodra image contents") and report["manifest"] in "\n".join(listing[:4])
    cfg = _config(image)
    assert cfg["config"]["User"] == "65532:65532"
    assert cfg["config"]["Env"][0].startswith("PATH=/opt/topodra/bin:")
    assert len(cfg["rootfs"]["diff_ids"]) == 2


@pytest.mark.parametrize("uid", [0, 65532, 4242])
def test_the_image_runs_topodra_as_root_the_controller_uid_and_an_unknown_uid(rootfs: Path, uid: int) -> None:
    """4242 has no passwd entry in the image either (the controller copes: test_install_controller_uid)."""
    env = {"PATH": "/opt/topodra/bin:/usr/sbin:/usr/bin:/sbin:/bin", "PYTHONDONTWRITEBYTECODE": "1"}
    script = ("import getpass, topodra.cli, topodra.plugin.probes, topodra.controller.main, kopf, grpc;"
              "topodra.controller.main.ensure_login_name(); print(getpass.getuser())")
    r = subprocess.run(["chroot", f"--userspec={uid}:{uid}", str(rootfs), "python", "-c", script],
                       capture_output=True, text=True, env=env, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == {0: "root", 65532: "topodra", 4242: "uid-4242"}[uid]
    r = subprocess.run(["chroot", f"--userspec={uid}:{uid}", str(rootfs), "topodra", "kubelet-plugin", "--help"],
                       capture_output=True, text=True, env=env, timeout=120, check=False)
    assert r.returncode == 0 and "--hardware" in r.stdout, r.stderr
