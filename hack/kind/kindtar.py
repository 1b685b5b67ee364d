#!/usr/bin/env python3
"""Rewrite a `docker save` archive so that `kind build node-image` counts every image in it as provided.

Why: kind reads an archive's image names from the first of `manifest.json` / `repositories` it meets and,
from manifest.json, only the first image's tags. `docker save` writes manifest.json first, so kind would
see one image and try to pull the rest from a registry (there is none here). This writes `repositories`
first and spells every name in full (`docker.io/...`), the way kind compares them.

    hack/kind/kindtar.py IN.tar OUT.tar
"""

from __future__ import annotations

import io
import json
import sys
import tarfile

INDEX_FILES = ("repositories", "manifest.json")


def full_name(name: str) -> str:
    """The fully qualified reference kind compares against (docker.io/library/x, docker.io/x/y, host/x)."""
    first = name.split("/", 1)[0]
    if "/" not in name:
        return "docker.io/library/" + name
    if "." in first or ":" in first or first == "localhost":
        return name
    return "docker.io/" + name


def rewrite(src: str, dst: str) -> list[str]:
    """Copy src to dst with full names and `repositories` first; returns the image references written."""
    with tarfile.open(src) as tin:
        members = tin.getmembers()
        names = {m.name for m in members}
        missing = [n for n in INDEX_FILES if n not in names]
        if missing:
            raise SystemExit(f"kindtar: {src} is not a `docker save` archive (no {', '.join(missing)})")
        repos_raw = tin.extractfile("repositories")
        manifest_raw = tin.extractfile("manifest.json")
        assert repos_raw is not None and manifest_raw is not None
        repos = {full_name(k): v for k, v in json.load(repos_raw).items()}
        manifest = json.load(manifest_raw)
        for entry in manifest:
            entry["RepoTags"] = [full_name(t) for t in entry.get("RepoTags") or []]
        index = {"repositories": json.dumps(repos).encode(), "manifest.json": json.dumps(manifest).encode()}
        with tarfile.open(dst, "w") as tout:
            for name in INDEX_FILES:
                info = tin.getmember(name)
                info.size = len(index[name])
                tout.addfile(info, io.BytesIO(index[name]))
            for m in members:
                if m.name in INDEX_FILES:
                    continue
                tout.addfile(m, tin.extractfile(m) if m.isfile() else None)
    return sorted(f"{repo}:{tag}" for repo, tags in repos.items() for tag in tags)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: kindtar.py IN.tar OUT.tar", file=sys.stderr)
        return 2
    for ref in rewrite(argv[0], argv[1]):
        print(f"kindtar: {argv[1]}: {ref}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
