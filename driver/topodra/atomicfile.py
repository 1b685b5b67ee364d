"""Crash-safe file replacement.

A reader (the container runtime reading CDI specs, a restarted plugin reading
its checkpoint) must see either the old file or the complete new one, never a
torn write.  Hence: write a temp file in the same directory, rename it over the
target.  Temp names start with a dot and end in ``.tmp-<pid>`` so the CDI cache
(which loads only ``*.json``/``*.yaml``) ignores them.

How much to fsync is the caller's choice (``sync``), because each fsync costs
a disk flush on the prepare path:

* ``"none"``: files rebuilt from the checkpoint at start (CDI specs).  A kill -9
  cannot tear them (the page cache survives the process); a power loss reboots
  the node, and the restarted plugin re-creates them.
* ``"data"``: fsync the temp file before the rename.  A rename can reach the
  disk before the data it points to; after a power loss the file would then be
  empty or torn.  With this, every version on disk is complete, but after a
  power loss the file may still be the previous version.
* ``"durable"``: also fsync the directory after the rename, so the new version
  survives a power loss.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Literal

Sync = Literal["none", "data", "durable"]

TMP_MARKER = ".tmp-"


def fsync_dir(directory: str | Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, mode: int = 0o644, *, sync: Sync = "durable") -> None:
    """Replace ``path`` with ``data`` atomically; on error the old file is untouched."""
    # Plain strings for the syscalls: a Path is converted again for each one, on every prepare.
    target = os.fspath(path)
    directory, name = os.path.split(target)
    tmp = os.path.join(directory, f".{name}{TMP_MARKER}{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fchmod(fd, mode)  # umask must not narrow what the runtime may read
            if sync != "none":
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if sync == "durable":
        fsync_dir(directory or ".")


def remove(path: Path) -> bool:
    """Unlink ``path``; False when it did not exist."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def remove_stale_temps(directory: Path, stem_prefix: str) -> list[Path]:
    """Delete temp files (``.<stem_prefix>*.tmp-<pid>``) left by a writer that crashed.

    Call only while holding the node-wide state lock: every writer holds it
    while a temp file exists, so any temp file seen then is stale.  (PIDs are
    no help: a peer plugin pod lives in another PID namespace.)
    """
    removed: list[Path] = []
    try:
        entries = list(directory.iterdir())
    except FileNotFoundError:
        return removed
    for p in entries:
        if p.name.startswith("." + stem_prefix) and TMP_MARKER in p.name:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
                removed.append(p)
    return removed
