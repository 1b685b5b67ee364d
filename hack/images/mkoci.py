#!/usr/bin/env python3
"""Write an OCI image-layout tarball from directories (one layer each), without a registry.

Used to build the sandbox (pause) image and the busybox test image that the local
cluster imports into containerd with ``ctr images import``, and the topodra image
(hack/build-image: a Debian layer and an application layer).  Output is byte-reproducible:
sorted entries, numeric owners, mtimes clamped to ``source_date_epoch``, gzip without a timestamp.

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
import time
from pathlib import Path


def _layer(rootfs: Path, source_date_epoch: int = 0) -> bytes:
    """An uncompressed layer tar of ``rootfs`` (owners kept as numbers; sockets and fifos skipped)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(rootfs.rglob("*")):
            info = tar.gettarinfo(str(path), arcname=str(path.relative_to(rootfs)))
            if info is None:  # socket: not representable in a tar
                continue
            if info.isfifo():
                continue
            info.uname = info.gname = ""
            info.mtime = min(int(info.mtime), source_date_epoch)
            info.pax_headers = {}
            if info.isreg():
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


def build(rootfs: Path | list[Path], name: str, entrypoint: list[str], cmd: list[str], out: Path,
          env: list[str] | None = None, user: str = "", labels: dict[str, str] | None = None,
          source_date_epoch: int = 0) -> dict[str, str]:
    """Write the image to ``out``; returns the digests of the manifest, config and layers."""
    roots = rootfs if isinstance(rootfs, list) else [rootfs]
    layers = [_layer(r, source_date_epoch) for r in roots]
    gz = [gzip.compress(layer, compresslevel=6, mtime=0) for layer in layers]
    cfg: dict[str, object] = {"Entrypoint": entrypoint or None, "Cmd": cmd or None,
                              "Env": env or ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]}
    if user:
        cfg["User"] = user
    if labels:
        cfg["Labels"] = labels
    config: dict[str, object] = {
        "architecture": "amd64",
        "os": "linux",
        "config": cfg,
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(layer).hexdigest() for layer in layers]},
    }
    if source_date_epoch:
        config["created"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(source_date_epoch))
    with tarfile.open(out, "w") as tar:
        cfg_bytes = json.dumps(config, sort_keys=True).encode()
        cfg_digest = _blob(tar, cfg_bytes)
        layer_digests = [_blob(tar, data) for data in gz]
        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                       "digest": f"sha256:{cfg_digest}", "size": len(cfg_bytes)},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                        "digest": f"sha256:{d}", "size": len(data)} for d, data in zip(layer_digests, gz, strict=True)],
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
    return {"manifest": f"sha256:{man_digest}", "config": f"sha256:{cfg_digest}",
            **{f"layer{i}": f"sha256:{d}" for i, d in enumerate(layer_digests)}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rootfs", type=Path, action="append", required=True, help="one layer each, bottom first")
    p.add_argument("--name", required=True)
    p.add_argument("--entrypoint", nargs="*", default=[])
    p.add_argument("--cmd", nargs="*", default=[])
    p.add_argument("-o", "--output", type=Path, required=True)
    a = p.parse_args()
    for r in a.rootfs:
        if not r.is_dir():
            print(f"mkoci: rootfs {r} is not a directory", file=sys.stderr)
            return 2
    build(a.rootfs, a.name, a.entrypoint, a.cmd, a.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
