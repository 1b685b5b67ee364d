"""Disk-full campaign: the CDI directory, then the checkpoint directory, on a full size-limited tmpfs.

For each target directory and round: mount a small tmpfs on it (needs root; it is
unmounted at the end), prepare one claim while there is room, fill the tmpfs to
the last byte, then:

* prepare a batch of two new claims: each gets a clear per-claim error naming
  the file it could not write and "No space left on device", and the node's files
  are byte-identical to before (no partial spec, no temp file, no new entry);
* unprepare the prepared claim: with the CDI directory full it succeeds (removing
  needs no space); with the checkpoint directory full it fails with a clear error
  and the spec is put back, so files and checkpoint still agree;
* a plugin restart while the disk is still full starts and changes nothing;
* the filler is removed, and the kubelet's retries succeed; invariants hold.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import tempfile
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.reliability.common import DRIVER, NODE, Node, claim_obj, quiet, violations

from topodra.claims import ClaimRef
from topodra.plugin.server import ClaimFetcher

TMPFS_SIZE = "256k"


@contextlib.contextmanager
def small_tmpfs(path: Path) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE},mode=0755", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(directory: Path) -> Path:
    """Write a filler file until the filesystem has not one byte left; returns it."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as f:
        for size in (65536, 4096, 1):
            while True:
                try:
                    f.write(b"\0" * size)
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    break
    return filler


def one_round(root: Path, target: str, round_no: int) -> list[str]:
    """One round on a fresh node; returns everything that went wrong."""
    lost: list[str] = []
    node = Node(root).setup()
    tag = f"{target} full, round {round_no}"
    with small_tmpfs(node.cdi_root if target == "cdi" else node.state_dir) as mnt:
        api: dict[tuple[str, str], dict[str, Any]] = {}

        def add(name: str, devs: list[str]) -> ClaimRef:
            uid = f"d15c0000-{round_no:04d}-4000-8000-{zlib.crc32(name.encode()):012d}"
            api[("disk", name)] = claim_obj("disk", name, uid, devs)
            return ClaimRef("disk", uid, name)

        fetcher = ClaimFetcher(lambda ns, n: api.get((ns, n)), DRIVER, NODE, max_workers=2)
        st = node.state()
        held = add("held", ["gpu-0", "nic-0"])
        if st.prepare(fetcher.fetch([held]))[held.uid].error:
            return [f"{tag}: the first prepare failed while there was room"]
        filler = fill(mnt)
        before = node.snapshot()

        batch = [add("new-a", ["gpu-1"]), add("new-b", ["gpu-2", "gpu-3"])]
        out = st.prepare(fetcher.fetch(batch))
        what = "cannot write CDI spec" if target == "cdi" else "cannot write checkpoint"
        for ref in batch:
            err = out[ref.uid].error
            if what not in err or "No space left on device" not in err or ref.name not in err:
                lost.append(f"{tag}: prepare of {ref.name} answered {err!r}, want {what!r} + ENOSPC + the claim")
        if node.snapshot() != before:
            lost.append(f"{tag}: a failed prepare changed files: {sorted(set(node.snapshot()) ^ set(before))}")

        un = st.unprepare([held])[held.uid]
        if target == "cdi" and un:
            lost.append(f"{tag}: unprepare failed though it needs no space on the CDI dir: {un}")
        if target == "state":
            if "cannot write checkpoint" not in un or "No space left on device" not in un:
                lost.append(f"{tag}: unprepare answered {un!r}, want a checkpoint write error")
            if node.snapshot() != before:
                lost.append(f"{tag}: a failed unprepare changed files")
        lost.extend(f"{tag}, disk still full: {v}" for v in violations(node))

        st = node.state()  # a restart while the disk is still full
        lost.extend(f"{tag}, restarted while full: {v}" for v in violations(node))

        filler.unlink()
        out = st.prepare(fetcher.fetch(batch))
        lost.extend(f"{tag}: retry of {r.name} after space returned: {out[r.uid].error}"
                    for r in batch if out[r.uid].error)
        if target == "state":
            un = st.unprepare([held])[held.uid]
            if un:
                lost.append(f"{tag}: retried unprepare failed after space returned: {un}")
        lost.extend(f"{tag}, after recovery: {v}" for v in violations(node))
        data = node.checkpoint()
        if set(data.claims) != {r.uid for r in batch}:
            lost.append(f"{tag}: prepared {sorted(data.claims)} after recovery, want the batch")
        fetcher.close()
    return lost


def run(rounds: int = 1, root: Path | None = None) -> dict[str, Any]:
    """``rounds`` rounds for each of the CDI and the checkpoint directory (root needed for mount)."""
    quiet()
    if os.geteuid() != 0:
        raise PermissionError("the disk-full campaign mounts tmpfs: run it as root")
    lost: list[str] = []
    start = time.monotonic()
    for target in ("cdi", "state"):
        for k in range(rounds):
            with tempfile.TemporaryDirectory(prefix="topodra-disk-", dir=root) as tmp:
                lost += one_round(Path(tmp), target, k)
    return {"rounds_per_target": rounds, "targets": ["cdi", "state"], "lost": lost,
            "seconds": round(time.monotonic() - start, 2)}
