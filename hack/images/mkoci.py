#!/usr/bin/env python3
"""Write a single-layer OCI image-layout tarball from a directory, without a registry.

Used to build the sandbox (pause) image and the busybox test image that the local
cluster imports into containerd with ``ctr images import``.

    mkoci.py --rootfs DIR --name registry.k8s.io/pause:3.10.1 --entrypoint /pause -o pause.tar
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import sys
import tarfile
from pathlib import Path


def _layer(rootfs: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(rootfs.rglob("*")):
            info = tar.gettarinfo(str(path), arcname=str(path.relative_to(rootfs)))
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            info.mtime = 0
            if info.isfile():
                with path.open("rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)
    return buf.getvalue()


def _blob(tar: tarfile.TarFile, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    info = tarfile.TarInfo(f"blobs/sha256/{digest}")
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))
    return digest


def build(rootfs: Path, name: str, entrypoint: list[str], cmd: list[str], out: Path) -> None:
    layer = _layer(rootfs)
    layer_gz = gzip.compress(layer, mtime=0)
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Entrypoint": entrypoint, "Cmd": cmd or None,
                   "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]},
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(layer).hexdigest()]},
    }
    with tarfile.open(out, "w") as tar:
        cfg_bytes = json.dumps(config, sort_keys=True).encode()
        cfg_digest = _blob(tar, cfg_bytes)
        layer_digest = _blob(tar, layer_gz)
        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                       "digest": f"sha256:{cfg_digest}", "size": len(cfg_bytes)},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                        "digest": f"sha256:{layer_digest}", "size": len(layer_gz)}],
        }
        man_bytes = json.dumps(manifest, sort_keys=True).encode()
        man_digest = _blob(tar, man_bytes)
        tag = name.rsplit(":", 1)[1] if ":" in name.rsplit("/", 1)[-1] else "latest"
        index = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": [{
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": f"sha256:{man_digest}", "size": len(man_bytes),
                "platform": {"architecture": "amd64", "os": "linux"},
                "annotations": {"io.containerd.image.name": name, "org.opencontainers.image.ref.name": tag},
            }],
        }
        for fname, data in (("oci-layout", b'{"imageLayoutVersion":"1.0.0"}'),
                            ("index.json", json.dumps(index, sort_keys=True).encode())):
            info = tarfile.TarInfo(fname)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rootfs", type=Path, required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--entrypoint", nargs="*", default=[])
    p.add_argument("--cmd", nargs="*", default=[])
    p.add_argument("-o", "--output", type=Path, required=True)
    a = p.parse_args()
    if not a.rootfs.is_dir():
        print(f"mkoci: rootfs {a.rootfs} is not a directory", file=sys.stderr)
        return 2
    build(a.rootfs, a.name, a.entrypoint, a.cmd, a.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
