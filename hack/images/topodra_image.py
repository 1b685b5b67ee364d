"""Build the topodra container image as an OCI tarball: no Docker, no registry.

Two layers:

1. Debian bookworm ``minbase`` with ``python3`` (debootstrap), plus a ``topodra`` user (uid 65532) so that
   tools asking for a login name find one. The package set must equal ``debian-packages.lock``.
2. ``/opt/topodra``: a venv made by the image's own python3, with the wheels of ``requirements.lock``
   (exact versions and sha256 hashes, installed with ``--require-hashes``) and the topodra wheel built
   from this checkout. Byte code is compiled with unchecked-hash pycs, so clamped mtimes cannot
   invalidate it and the layer is reproducible.

Both lock files sit next to this module. ``--lock`` rewrites them from the pins in pyproject.toml and
from what bookworm's mirror serves today; the build refuses any drift from them with a diff.

Beside the tarball go ``<tar>.contents.txt`` (digests, Debian packages, Python distributions, and
path/mode/owner/size/sha256 of every file) and ``<tar>.build.json`` (timings, sizes).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

from images import mkoci

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent

SUITE = "bookworm"
MIRROR = os.environ.get("TOPODRA_DEBIAN_MIRROR", "http://deb.debian.org/debian")
INCLUDE = ["python3"]
DEB_LOCK = HERE / "debian-packages.lock"
PY_LOCK = HERE / "requirements.lock"
# 2026-11-01T00:00:00Z: every mtime in the image is clamped to this (older ones from .debs are kept).
SOURCE_DATE_EPOCH = 1793491200
NONROOT_UID = 65532
VENV = "/opt/topodra"
PIP_VERSION = "26.3"  # runs from its wheel inside the build root; it is not installed in the image
# Not part of a container's content: caches, logs, docs, and files that differ per build run.
PRUNE = ["var/cache/apt", "var/lib/apt/lists", "var/log", "usr/share/doc", "usr/share/man", "usr/share/info",
         "usr/share/locale", "usr/share/lintian", "var/cache/debconf/templates.dat-old",
         "var/cache/debconf/config.dat-old", "var/lib/dpkg/status-old", "var/lib/dpkg/diversions-old",
         "var/cache/ldconfig/aux-cache", "etc/machine-id", "var/lib/dbus/machine-id", "etc/hostname",
         "etc/resolv.conf", "etc/hosts", "debootstrap"]


class BuildError(RuntimeError):
    """A clear failure of one build step."""


def log(msg: str) -> None:
    print(f"build-image: {msg}", file=sys.stderr, flush=True)


def sh(*argv: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    r = subprocess.run(argv, capture_output=True, text=True, cwd=cwd, env={**os.environ, **(env or {})},
                       check=False)
    if r.returncode != 0:
        raise BuildError(f"{' '.join(argv[:4])}... failed ({r.returncode}):\n{(r.stdout + r.stderr)[-3000:]}")
    return r.stdout


def project_version() -> str:
    return str(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"])


def pinned_dependencies() -> list[str]:
    return list(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"])


def cache_root() -> Path:
    return Path(os.environ.get("TOPODRA_CACHE", "/var/cache/topodra")) / "image"


def digest_of(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p)
    return h.hexdigest()[:12]


# --------------------------------------------------------------------------- locks (pure parsing)


def parse_deb_lock(text: str) -> dict[str, str]:
    """``name version`` per line (``#`` comments): {name: version}."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split()
            out[name] = version
    return out


def parse_py_lock(text: str) -> dict[str, str]:
    """``name==version --hash=sha256:...`` per line: {normalized name: version}."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = line.split()[0]
            name, version = req.split("==")
            out[normalize(name)] = version
    return out


def normalize(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def lock_drift(expected: dict[str, str], actual: dict[str, str]) -> list[str]:
    """Human-readable differences between two {name: version} maps (empty when equal)."""
    out = [f"- {n} {v}" for n, v in sorted(expected.items()) if actual.get(n) != v]
    out += [f"+ {n} {v}" for n, v in sorted(actual.items()) if expected.get(n) != v]
    return out


# --------------------------------------------------------------------------- Debian layer


@contextlib.contextmanager
def scratch(prefix: str) -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix=prefix, dir=os.environ.get("TMPDIR", "/var/tmp")))
    try:
        yield d
    finally:
        unmount_below(d)
        shutil.rmtree(d, ignore_errors=True)


def unmount_below(root: Path) -> None:
    mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
    for m in sorted((m for m in mounts if m.startswith(str(root) + "/")), key=len, reverse=True):
        subprocess.run(["umount", "-l", m], check=False)


def debootstrap(root: Path) -> None:
    if shutil.which("debootstrap") is None:
        raise BuildError("debootstrap is not installed (hack/install-deps installs it)")
    t0 = time.monotonic()
    debs = cache_root() / "debs"  # downloaded .debs, checked by debootstrap against the signed Release
    debs.mkdir(parents=True, exist_ok=True)
    sh("debootstrap", "--variant=minbase", f"--cache-dir={debs}", f"--include={','.join(INCLUDE)}", SUITE, str(root),
       MIRROR)
    log(f"debootstrap {SUITE} minbase + {' '.join(INCLUDE)}: {time.monotonic() - t0:.0f} s")


def installed_debs(root: Path) -> dict[str, str]:
    out = sh("dpkg-query", f"--admindir={root}/var/lib/dpkg", "-W", "-f=${Package} ${Version}\n")
    return parse_deb_lock(out)


def finish_base(root: Path) -> None:
    """Prune run-specific files and add the non-root user."""
    for rel in PRUNE:
        p = root / rel
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
            if rel.startswith("var/"):
                p.mkdir(mode=0o755)
        elif p.exists() or p.is_symlink():
            p.unlink()
    for pyc in root.glob("usr/lib/python3*/**/__pycache__"):  # py3compile output: regenerated below
        shutil.rmtree(pyc)
    with (root / "etc/passwd").open("a") as f:
        f.write(f"topodra:x:{NONROOT_UID}:{NONROOT_UID}:topodra:/home/topodra:/usr/sbin/nologin\n")
    with (root / "etc/group").open("a") as f:
        f.write(f"topodra:x:{NONROOT_UID}:\n")
    (root / "home/topodra").mkdir(mode=0o755)
    os.chown(root / "home/topodra", NONROOT_UID, NONROOT_UID)
    # The standard library's byte code, reproducibly (debootstrap's py3compile used timestamps).
    sh("chroot", str(root), "python3", "-m", "compileall", "-q", "-j1", "--invalidation-mode", "unchecked-hash",
       "/usr/lib/python3.11", env={"PYTHONHASHSEED": "0"})


def base_layer(update_lock: bool) -> Path:
    """The unpacked Debian root, cached under its key; verified against debian-packages.lock."""
    lock_text = DEB_LOCK.read_text() if DEB_LOCK.exists() else ""
    key = digest_of(SUITE.encode(), " ".join(INCLUDE).encode(), lock_text.encode(), str(SOURCE_DATE_EPOCH).encode(),
                    " ".join(PRUNE).encode(), str(NONROOT_UID).encode())
    done = cache_root() / f"base-{key}"
    if (done / "rootfs").is_dir() and not update_lock:
        log(f"Debian layer cached: {done}")
        return done / "rootfs"
    tmp = cache_root() / f"base-{key}.tmp.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        debootstrap(tmp / "rootfs")
        unmount_below(tmp)
        debs = installed_debs(tmp / "rootfs")
        if update_lock:
            DEB_LOCK.write_text("# Debian packages of the topodra image's base layer (hack/build-image --lock)\n" +
                                "".join(f"{n} {v}\n" for n, v in sorted(debs.items())))
            log(f"wrote {DEB_LOCK} ({len(debs)} packages)")
        else:
            drift = lock_drift(parse_deb_lock(lock_text), debs)
            if drift:
                raise BuildError(f"{MIRROR} {SUITE} no longer matches {DEB_LOCK.name} (a point release?):\n" +
                                 "\n".join(drift[:40]) + "\nreview and run: hack/build-image --lock")
        finish_base(tmp / "rootfs")
        shutil.rmtree(done, ignore_errors=True)
        tmp.rename(done)
    finally:
        unmount_below(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
    if update_lock:  # the key includes the lock text: rebuild under the new key next time
        return base_layer(False)
    return done / "rootfs"


# --------------------------------------------------------------------------- Python layer


def write_py_lock() -> None:
    with scratch("topodra-lock-") as d:
        sh(sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed", "--only-binary=:all:",
           "--report", str(d / "report.json"), *pinned_dependencies())
        report = json.loads((d / "report.json").read_text())
    lines = []
    for item in report["install"]:
        meta, info = item["metadata"], item["download_info"]
        sha = info["archive_info"]["hashes"]["sha256"]
        lines.append(f"{meta['name']}=={meta['version']} --hash=sha256:{sha}")
    PY_LOCK.write_text("# Every Python distribution in the topodra image but topodra itself (hack/build-image --lock)\n"
                       + "\n".join(sorted(lines, key=str.lower)) + "\n")
    log(f"wrote {PY_LOCK} ({len(lines)} distributions)")


def check_py_lock() -> None:
    """The lock pins exactly pyproject's versions (transitive ones are the lock's own)."""
    locked = parse_py_lock(PY_LOCK.read_text())
    wrong = [d for d in pinned_dependencies()
             if locked.get(normalize(d.split("==")[0])) != d.split("==")[1]]
    if wrong:
        raise BuildError(f"{PY_LOCK.name} disagrees with pyproject.toml on {wrong}; run hack/build-image --lock")


def wheels() -> Path:
    """Locked wheels (hash-checked) and pip, cached by the lock's content."""
    key = digest_of(PY_LOCK.read_bytes(), PIP_VERSION.encode())
    d = cache_root() / f"wheels-{key}"
    if not (d / ".complete").exists():
        d.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        sh(sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--no-deps", "--require-hashes",
           "-r", str(PY_LOCK), "-d", str(d))
        sh(sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--no-deps", f"pip=={PIP_VERSION}",
           "-d", str(d / "pip"))
        (d / ".complete").touch()
        log(f"downloaded the locked wheels in {time.monotonic() - t0:.0f} s")
    return d


def topodra_wheel(out: Path) -> Path:
    sh(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(REPO),
       env={"SOURCE_DATE_EPOCH": str(SOURCE_DATE_EPOCH)})
    (whl,) = out.glob("topodra-*.whl")
    return whl


def app_layer(base: Path, work: Path) -> Path:
    """Install the venv on an overlay of the Debian root; the overlay's upper dir is the layer."""
    upper, ovl, merged = work / "upper", work / "ovl-work", work / "merged"
    for d in (upper, ovl, merged):
        d.mkdir()
    whl = topodra_wheel(work / "dist")
    wh = wheels()
    sh("mount", "-t", "overlay", "overlay", "-o", f"lowerdir={base},upperdir={upper},workdir={ovl}", str(merged))
    try:
        stage = merged / "tmp/wheels"
        shutil.copytree(wh, stage, ignore=shutil.ignore_patterns(".complete"))
        shutil.copy(whl, stage)
        (pip_whl,) = (stage / "pip").glob("pip-*.whl")
        py = f"{VENV}/bin/python"
        env = {"PYTHONHASHSEED": "0", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root"}
        sh("chroot", str(merged), "python3", "-m", "venv", "--without-pip", VENV, env=env)
        pip = ["chroot", str(merged), py, f"/tmp/wheels/pip/{pip_whl.name}/pip", "install", "-q", "--no-index",
               "--no-compile", "--no-cache-dir", "--disable-pip-version-check", "--find-links", "/tmp/wheels"]
        shutil.copy(PY_LOCK, stage / PY_LOCK.name)
        sh(*pip, "--require-hashes", "--no-deps", "-r", f"/tmp/wheels/{PY_LOCK.name}", env=env)
        sh(*pip, "--no-deps", f"/tmp/wheels/{whl.name}", env=env)
        # Check the environment is complete and consistent, then compile it reproducibly.
        sh("chroot", str(merged), py, "-c", "import topodra.cli, topodra.plugin.probes, topodra.controller.main",
           env=env)
        sh("chroot", str(merged), py, "-m", "compileall", "-q", "-j1", "--invalidation-mode", "unchecked-hash",
           f"{VENV}/lib", env=env)
        shutil.rmtree(stage)
    finally:
        subprocess.run(["umount", str(merged)], check=False)
    # Files the overlay copied up without changing them (directories' metadata) stay; /tmp is empty again.
    for junk in ("root/.cache",):
        shutil.rmtree(upper / junk, ignore_errors=True)
    return upper


# --------------------------------------------------------------------------- contents list


def contents(roots: list[Path], digests: dict[str, str], debs: dict[str, str], py: dict[str, str]) -> str:
    lines = [f"# topodra image contents (hack/build-image); {k} {v}" for k, v in sorted(digests.items())]
    lines += [f"deb {n} {v}" for n, v in sorted(debs.items())]
    lines += [f"py {n} {v}" for n, v in sorted(py.items())]
    for i, root in enumerate(roots):
        for p in sorted(root.rglob("*")):
            st = p.lstat()
            rel = p.relative_to(root)
            if p.is_symlink():
                what = f"-> {os.readlink(p)}"
            elif p.is_file():
                what = f"{st.st_size} {hashlib.sha256(p.read_bytes()).hexdigest()}"
            else:
                what = "-"
            lines.append(f"layer{i} {oct(st.st_mode)} {st.st_uid}:{st.st_gid} /{rel} {what}")
    return "\n".join(lines) + "\n"


def installed_dists(venv_root: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for meta in venv_root.glob("opt/topodra/lib/python3*/site-packages/*.dist-info/METADATA"):
        head = meta.read_text().split("\n\n", 1)[0]  # the headers end at the first blank line
        fields = dict(line.split(": ", 1) for line in head.splitlines() if ": " in line)
        out[normalize(fields["Name"])] = fields["Version"]
    return out


# --------------------------------------------------------------------------- main


def build(out: Path, name: str, update_lock: bool) -> dict[str, object]:
    t0 = time.monotonic()
    if update_lock:
        write_py_lock()
    check_py_lock()
    base = base_layer(update_lock)
    t_base = time.monotonic() - t0
    with scratch("topodra-image-") as work:
        app = app_layer(base, work)
        t_app = time.monotonic() - t0 - t_base
        dists = installed_dists(app)
        expected = {**parse_py_lock(PY_LOCK.read_text()), "topodra": project_version()}
        drift = lock_drift(expected, dists)
        if drift:
            raise BuildError("the venv does not hold exactly the locked distributions:\n" + "\n".join(drift))
        env = [f"PATH={VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
               "PYTHONUNBUFFERED=1", "PYTHONDONTWRITEBYTECODE=1", "LANG=C.UTF-8"]
        labels = {"org.opencontainers.image.title": "topodra",
                  "org.opencontainers.image.version": project_version(),
                  "org.opencontainers.image.description": "Topology-aware Kubernetes DRA driver for GPU clusters",
                  "org.opencontainers.image.licenses": "Apache-2.0"}
        out.parent.mkdir(parents=True, exist_ok=True)
        digests = mkoci.build([base, app], name, [], ["topodra", "--help"], out, env=env,
                              user=f"{NONROOT_UID}:{NONROOT_UID}", labels=labels,
                              source_date_epoch=SOURCE_DATE_EPOCH)
        listing = contents([base, app], digests, installed_debs(base), dists)
    Path(f"{out}.contents.txt").write_text(listing)
    with tarfile.open(out) as tar:
        layer_sizes = [m.size for m in tar.getmembers() if m.name.startswith("blobs/") and m.size > 100_000]
    report: dict[str, object] = {
        "image": name, "tarball": str(out), "tarball_bytes": out.stat().st_size, "layer_gz_bytes": layer_sizes,
        "unpacked_bytes": sum(p.lstat().st_size for r in (base,) for p in r.rglob("*") if p.is_file()),
        "seconds_total": round(time.monotonic() - t0, 1), "seconds_debian_layer": round(t_base, 1),
        "seconds_app_layer": round(t_app, 1), **digests}
    Path(f"{out}.build.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hack/build-image", description=__doc__.splitlines()[0])
    p.add_argument("-o", "--output", type=Path, default=None,
                   help="tarball path (default: $TOPODRA_CACHE/image/topodra-<version>.tar)")
    p.add_argument("--name", default=None, help="image name (default: localhost/topodra:<version>)")
    p.add_argument("--lock", action="store_true", help="rewrite debian-packages.lock and requirements.lock first")
    p.add_argument("--import", dest="import_to", metavar="CONTAINERD_SOCKET", default=None,
                   help="then import it: ctr -a SOCKET -n k8s.io images import")
    a = p.parse_args(argv)
    if os.geteuid() != 0:
        print("build-image: needs root (debootstrap, chroot, overlay mount)", file=sys.stderr)
        return 2
    name = a.name or f"localhost/topodra:{project_version()}"
    out = a.output or cache_root() / f"topodra-{name.rsplit(':', 1)[-1]}.tar"
    try:
        report = build(out, name, a.lock)
    except BuildError as e:
        print(f"build-image: {e}", file=sys.stderr)
        return 1
    log(f"{name}: {out} ({report['tarball_bytes']} bytes) in {report['seconds_total']} s")
    if a.import_to:
        ctr = os.environ.get("CTR", "ctr")
        sh(ctr, "--address", a.import_to, "-n", "k8s.io", "images", "import", "--platform", "linux/amd64", str(out))
        log(f"imported into containerd at {a.import_to}")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
