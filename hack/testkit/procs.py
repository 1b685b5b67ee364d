"""What /proc says about the processes a cluster started: alive, memory, descendants, by command line."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path
from typing import Any


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return True


def proc_status(pid: int) -> dict[str, int]:
    """Memory fields of /proc/<pid>/status in KiB, plus Threads."""
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem", "Threads"):
            out[key] = int(rest.split()[0])
    return out


def rss_mib(pid: int) -> float:
    with contextlib.suppress(OSError, KeyError):
        return proc_status(pid)["VmRSS"] / 1024
    return 0.0


def tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def children_of(pids: set[int]) -> set[int]:
    """All live descendants of ``pids`` (from /proc)."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
    found: set[int] = set()
    frontier = set(pids)
    while frontier:
        nxt = {p for p, pp in parent.items() if pp in frontier and p not in found}
        found |= nxt
        frontier = nxt
    return found


def procs_matching(needle: str) -> set[int]:
    out: set[int] = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError):
                if needle in (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    out.add(int(d.name))
    return out


def stop(proc: subprocess.Popen[Any], grace: float = 30) -> int:
    """SIGTERM, then SIGKILL after ``grace`` seconds; the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return int(proc.returncode)
