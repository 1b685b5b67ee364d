"""Talking to a claim's MPS control daemon through its pipe directory, the only channel that means anything.

``echo <command> | nvidia-cuda-mps-control`` with the claim's ``CUDA_MPS_PIPE_DIRECTORY``, bounded by a
timeout: liveness is ``get_server_list`` answering (a pid file checked with ``kill -0`` says nothing once the
daemon runs in another PID namespace), and the limits are set on the daemon itself
(``set_default_active_thread_percentage``, ``set_default_device_pinned_mem_limit <uuid> <MiB>M``), where a
workload cannot override them as it can its own ``CUDA_MPS_*`` variables.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

from topodra.selectors import parse_quantity
from topodra.sharing.config import Mps
from topodra.sharing.driverbins import DriverTool

TIMEOUT_S = 10.0


class MpsError(RuntimeError):
    """A daemon could not be started, reached or stopped; the message names the claim and the cause."""


def pinned_limit_mib(mps: Mps, consumed: str | None) -> int | None:
    """A device's pinned-memory limit in MiB: the config's default, else a GPU share's consumed memory (pure)."""
    limit = mps.pinned_limit_bytes()
    if limit is None and consumed:
        limit = int(parse_quantity(consumed))
    return None if limit is None else max(1, limit // 2**20)


def limit_commands(mps: Mps, devices: Sequence[tuple[str, str | None]]) -> list[str]:
    """The daemon commands that set the claim's limits; ``devices``: (UUID, consumed memory) each (pure)."""
    cmds = []
    if mps.defaultActiveThreadPercentage is not None:
        cmds.append(f"set_default_active_thread_percentage {mps.defaultActiveThreadPercentage}")
    for uuid, consumed in devices:
        mib = pinned_limit_mib(mps, consumed)
        if mib is not None:
            cmds.append(f"set_default_device_pinned_mem_limit {uuid} {mib}M")
    return cmds


def send(tool: DriverTool, pipe: Path, logs: Path, commands: Sequence[str], timeout: float = TIMEOUT_S) -> str:
    """Run the control client with ``commands`` on stdin; its stdout.  MpsError on failure or timeout."""
    env = tool.environ(os.environ, {"CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(logs)})
    try:
        r = subprocess.run([str(tool.path)], input="".join(f"{c}\n" for c in commands), env=env,
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise MpsError(f"{commands[0] if commands else 'nothing'}: no answer through {pipe} within "
                       f"{timeout:g} s") from e
    except OSError as e:
        raise MpsError(f"cannot run {tool.path}: {e}") from e
    if r.returncode != 0:
        raise MpsError(f"{'; '.join(commands)}: {tool.path.name} exited {r.returncode}: "
                       f"{(r.stderr or r.stdout).strip()}")
    bad = [line for line in r.stdout.splitlines() if line.startswith(("Unrecognized", "Invalid"))]
    if bad:
        raise MpsError(f"{'; '.join(commands)}: the daemon answered {'; '.join(bad)}")
    return r.stdout


def answering(tool: DriverTool, pipe: Path, logs: Path, timeout: float = TIMEOUT_S) -> bool:
    """Whether a daemon answers ``get_server_list`` on ``pipe``: False when the client says none listens;
    MpsError when nothing answers within ``timeout`` (a daemon may be there: the caller must not assume
    either way, so it neither starts a second one nor removes the directories of a live one)."""
    if not pipe.is_dir():
        return False
    env = tool.environ(os.environ, {"CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(logs)})
    try:
        r = subprocess.run([str(tool.path)], input="get_server_list\n", env=env, capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise MpsError(f"get_server_list: no answer through {pipe} within {timeout:g} s") from e
    except OSError as e:
        raise MpsError(f"cannot run {tool.path}: {e}") from e
    return r.returncode == 0
