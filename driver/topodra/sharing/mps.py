"""MPS: one CUDA MPS control daemon per claim (over the claim's MPS devices), started by prepare.

With an ``MPS`` GpuConfig the claim's containers do not open the GPU
directly: their CUDA runtime talks to the control daemon through its pipe
directory, so kernels of several processes run side by side on one GPU with
a share of its threads (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``) and a cap on
pinned device memory (``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``).

Each claim gets ``<state_dir>/mps/<claim UID>/{pipe,log}``; the daemon is
``nvidia-cuda-mps-control -d`` with ``CUDA_VISIBLE_DEVICES`` set to the claim's
GPU (or MIG) UUIDs, and ``echo quit | nvidia-cuda-mps-control`` stops it.  The
directories reach the containers through CDI mounts.  Daemons outlive the
plugin: a restart stops those of claims the checkpoint no longer records
(a prepare that died before its checkpoint write) and leaves the others.

The binary is ``TOPODRA_MPS_CONTROL`` when set, else found under the driver
root, then in PATH, and run with the root's libcuda and NVML preloaded
(``driverbins``); mock hardware installs a stand-in
(``topodra.hardware.mockmps``) that behaves the same way.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

from topodra.selectors import parse_quantity
from topodra.sharing import driverbins
from topodra.sharing.config import Mps

log = logging.getLogger(__name__)

BINARY = driverbins.MPS_CONTROL
BINARY_ENV = "TOPODRA_MPS_CONTROL"
PID_FILE = "nvidia-cuda-mps-control.pid"
CONTAINER_PIPE_DIR = "/tmp/nvidia-mps"  # the CUDA runtime's default pipe directory
CONTAINER_LOG_DIR = "/var/log/nvidia-mps"
SUBDIR = "mps"
_TIMEOUT_S = 15.0


class MpsError(RuntimeError):
    """A daemon could not be started or stopped; the message names the claim and the cause."""


def claim_env(mps: Mps, consumed_memory: Sequence[str | None]) -> list[str]:
    """Container variables of an MPS claim (pure).

    ``consumed_memory``: per MPS device in order, its consumed ``memory`` (a share of a GPU) or None.  The
    pinned limit is the config's default, else the share's consumed memory, else none.
    """
    env = [f"CUDA_MPS_PIPE_DIRECTORY={CONTAINER_PIPE_DIR}", f"CUDA_MPS_LOG_DIRECTORY={CONTAINER_LOG_DIR}"]
    if mps.defaultActiveThreadPercentage is not None:
        env.append(f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={mps.defaultActiveThreadPercentage}")
    limits = []
    for i, consumed in enumerate(consumed_memory):
        limit = mps.pinned_limit_bytes()
        if limit is None and consumed:
            limit = int(parse_quantity(consumed))
        if limit is not None:
            limits.append(f"{i}={max(1, limit // 2**20)}M")
    if limits:
        env.append(f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={','.join(limits)}")
    return env


class MpsDaemons:
    """Start, stop and list the per-claim control daemons under ``<state_dir>/mps``."""

    def __init__(self, state_dir: str | os.PathLike[str], binary: str | None = None,
                 driver_root: str | os.PathLike[str] | None = None) -> None:  # fmt: skip
        self.root = Path(state_dir) / SUBDIR
        self.binary = binary
        self.driver_root = driver_root

    def _tool(self) -> driverbins.DriverTool:
        """The control binary (``binary``, ``$TOPODRA_MPS_CONTROL``, the driver root's, PATH's) and its preload."""
        try:
            return driverbins.mps_control(self.driver_root, os.environ.get("PATH"),
                                          self.binary or os.environ.get(BINARY_ENV) or None)
        except driverbins.DriverToolMissing as e:
            raise MpsError(f"MPS needs {BINARY}: {e} (or set {BINARY_ENV})") from e

    def dirs(self, claim_uid: str) -> tuple[Path, Path]:
        """The claim's (pipe, log) directories on the host."""
        base = self.root / claim_uid
        return base / "pipe", base / "log"

    def command(self, claim_uid: str, extra: Mapping[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
        """The argv (without ``-d``) and environment of the claim's control program: the plugin's
        environment, ``extra``, the claim's pipe and log dirs, and the tool's preload and PATH."""
        pipe, logs = self.dirs(claim_uid)
        t = self._tool()
        env = t.environ(os.environ, {**(extra or {}), "CUDA_MPS_PIPE_DIRECTORY": str(pipe),
                                     "CUDA_MPS_LOG_DIRECTORY": str(logs)})
        return [str(t.path)], env

    def pid(self, claim_uid: str) -> int | None:
        """The claim's running daemon, or None."""
        pipe, _ = self.dirs(claim_uid)
        try:
            pid = int((pipe / PID_FILE).read_text().strip())
            os.kill(pid, 0)
        except (OSError, ValueError):
            return None
        return pid

    def start(self, claim_uid: str, uuids: Sequence[str]) -> None:
        """Start the claim's daemon over ``uuids`` (a running one is kept); MpsError leaves nothing behind."""
        if self.pid(claim_uid) is not None:
            return
        pipe, logs = self.dirs(claim_uid)
        pipe.mkdir(parents=True, exist_ok=True, mode=0o755)
        logs.mkdir(parents=True, exist_ok=True, mode=0o755)
        try:
            argv, env = self.command(claim_uid, {"CUDA_VISIBLE_DEVICES": ",".join(uuids)})
            r = subprocess.run([*argv, "-d"], env=env, capture_output=True, text=True, timeout=_TIMEOUT_S,
                               stdin=subprocess.DEVNULL)
            if r.returncode != 0:
                raise MpsError(f"claim {claim_uid}: {BINARY} -d failed ({r.returncode}): "
                               f"{(r.stderr or r.stdout).strip()}")
            self._wait(lambda: self.pid(claim_uid) is not None, f"claim {claim_uid}: the MPS daemon did not start")
        except (MpsError, OSError, subprocess.TimeoutExpired) as e:
            self._remove(claim_uid)
            raise e if isinstance(e, MpsError) else MpsError(f"claim {claim_uid}: cannot start {BINARY}: {e}") from e
        log.info("claim %s: MPS control daemon %s started for %s", claim_uid, self.pid(claim_uid), list(uuids))

    def stop(self, claim_uid: str) -> bool:
        """``echo quit | nvidia-cuda-mps-control``, then remove the claim's dirs; False if none was running."""
        running = self.pid(claim_uid) is not None
        if running:
            argv, env = self.command(claim_uid)
            try:
                r = subprocess.run(argv, input="quit\n", env=env, capture_output=True, text=True,
                                   timeout=_TIMEOUT_S)
            except (OSError, subprocess.TimeoutExpired) as e:
                raise MpsError(f"claim {claim_uid}: cannot stop the MPS daemon: {e}") from e
            if r.returncode != 0:
                raise MpsError(f"claim {claim_uid}: quit failed ({r.returncode}): {(r.stderr or r.stdout).strip()}")
            self._wait(lambda: self.pid(claim_uid) is None, f"claim {claim_uid}: the MPS daemon did not quit")
            log.info("claim %s: MPS control daemon stopped", claim_uid)
        self._remove(claim_uid)
        return running

    def claims(self) -> set[str]:
        """Claim UIDs that have MPS directories (running daemon or not)."""
        try:
            return {p.name for p in self.root.iterdir() if p.is_dir()}
        except FileNotFoundError:
            return set()

    def reconcile(self, recorded: Iterable[str]) -> list[str]:
        """Stop the daemons (and drop the dirs) of claims not in ``recorded``; returns their UIDs."""
        keep = set(recorded)
        stray = sorted(self.claims() - keep)
        for uid in stray:
            log.warning("claim %s: stopping its MPS daemon: no prepared claim records it", uid)
            self.stop(uid)
        return stray

    def _remove(self, claim_uid: str) -> None:
        shutil.rmtree(self.root / claim_uid, ignore_errors=True)

    @staticmethod
    def _wait(done: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + _TIMEOUT_S
        while not done():
            if time.monotonic() > deadline:
                raise MpsError(f"{what} within {_TIMEOUT_S:.0f} s")
            time.sleep(0.02)
