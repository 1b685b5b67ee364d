"""The per-claim tmpfs that an MPS daemon and its clients share as ``/dev/shm``.

CUDA's MPS client and server exchange memory through ``/dev/shm``: a container with its own (the runtime's
default) cannot talk to a daemon that has another, and CUDA then silently runs without MPS.  NVIDIA's drivers
mount one tmpfs of a set size per daemon and hand it to the daemon and every client as ``/dev/shm``; so do we,
at ``<state dir>/mps/<claim>/shm``.  mount(2)/umount2(2) through libc (no ``mount`` binary in the image needed);
both are idempotent, so a prepare retried after a crash between mount and checkpoint finds the mount and keeps
it, and recovery's stop of an unrecorded claim unmounts it.  Needs CAP_SYS_ADMIN (the plugin runs privileged).
"""

from __future__ import annotations

import ctypes
import errno
import os
from pathlib import Path

MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MNT_DETACH = 0x2
DEFAULT_SIZE = "1Gi"

_libc = ctypes.CDLL(None, use_errno=True)


class ShmError(RuntimeError):
    """The claim's tmpfs could not be mounted or unmounted; the message names the path and errno."""


def _octal_unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as ``\\ooo``."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mount_points(mountinfo: str) -> dict[str, str]:
    """Mount point -> filesystem type, from ``/proc/self/mountinfo`` text (pure; the last mount on a path wins)."""
    out: dict[str, str] = {}
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields or len(fields) < 5:
            continue
        out[_octal_unescape(fields[4])] = fields[fields.index("-") + 1]
    return out


def fstype(path: str | os.PathLike[str]) -> str | None:
    """The type of the filesystem mounted exactly at ``path`` in this mount namespace, or None."""
    return mount_points(Path("/proc/self/mountinfo").read_text()).get(os.path.realpath(path))


def size_option(size: int) -> str:
    """tmpfs's ``size=`` in KiB (rounded up, at least one page)."""
    return f"size={max(4, -(-size // 1024))}k"


def mount(path: str | os.PathLike[str], size: int) -> bool:
    """A tmpfs of ``size`` bytes at ``path`` (mode 1777, nosuid, nodev), unless one is there; True if mounted now."""
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True, mode=0o755)
    if fstype(p) == "tmpfs":
        return False
    data = f"{size_option(size)},mode=1777".encode()
    if _libc.mount(b"tmpfs", os.fsencode(str(p)), b"tmpfs", MS_NOSUID | MS_NODEV, data) != 0:
        e = ctypes.get_errno()
        hint = " (MPS needs the plugin to run as root / privileged)" if e == errno.EPERM else ""
        raise ShmError(f"cannot mount a tmpfs at {p}: {os.strerror(e)}{hint}")
    return True


def unmount(path: str | os.PathLike[str]) -> bool:
    """Detach every mount at ``path`` (a lazy detach: a client still holding it keeps its view); True if any."""
    p = os.fsencode(os.path.realpath(path))
    done = False
    while fstype(os.fsdecode(p)) is not None:
        if _libc.umount2(p, MNT_DETACH) != 0:
            e = ctypes.get_errno()
            raise ShmError(f"cannot unmount {os.fsdecode(p)}: {os.strerror(e)}")
        done = True
    return done


def enter_private_namespace_with_shm(shm: str | os.PathLike[str]) -> None:
    """In this (just started, single-threaded) process: a mount namespace of its own, with ``shm`` bound
    over ``/dev/shm``.  Mounts made here never reach the host; the namespace ends with its last process."""
    if _libc.unshare(0x00020000) != 0:  # CLONE_NEWNS
        raise ShmError(f"unshare(CLONE_NEWNS): {os.strerror(ctypes.get_errno())}")
    if _libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        raise ShmError(f"making / private: {os.strerror(ctypes.get_errno())}")
    if _libc.mount(os.fsencode(str(shm)), b"/dev/shm", None, MS_BIND, None) != 0:
        raise ShmError(f"binding {shm} over /dev/shm: {os.strerror(ctypes.get_errno())}")
