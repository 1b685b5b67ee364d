"""MPS: one CUDA MPS control daemon per claim (over the claim's MPS devices), started by prepare.

With an ``MPS`` GpuConfig the claim's containers do not open the GPU directly: their CUDA runtime talks to the
control daemon through its pipe directory and exchanges memory with its server through ``/dev/shm``, so kernels
of several processes run side by side on one GPU, with a share of its threads and a cap on pinned memory.

Each claim gets ``<state_dir>/mps/<claim UID>/{pipe,log,shm}``, the way NVIDIA's drivers set a daemon up:

* ``shm`` is a tmpfs of its own (``mpsshm``), the daemon's ``/dev/shm`` (it runs in a mount namespace with the
  tmpfs bound there, ``mpsns``) and every client container's (a CDI mount);
* the GPUs the claim holds whole go to ``EXCLUSIVE_PROCESS`` (``computemode``) while the daemon runs, so a client
  that misses the daemon fails instead of running without MPS; a GPU shared by memory with other claims stays in
  DEFAULT (a second claim's server could not run on it), and MIG slices are left as they are;
* the daemon is ``nvidia-cuda-mps-control -d`` with ``CUDA_VISIBLE_DEVICES`` set to the claim's GPU (or MIG)
  UUIDs, its stdin on /dev/null and its stdout/stderr in ``log/control-start.log`` (nothing of ours to hang on);
  readiness, liveness and the limits go through the control pipe (``mpscontrol``), never a pid;
* ``echo quit | nvidia-cuda-mps-control`` stops it; then the compute mode goes back to DEFAULT, the tmpfs is
  unmounted and the directories removed.

``intent.json`` (written first) names the GPUs set exclusive, so a stop after a crash (recovery's reconcile of a
claim the checkpoint does not record) restores them too.  Every step is idempotent, so a retried prepare keeps
what is there.  The binary is ``TOPODRA_MPS_CONTROL`` when set, else found under the driver root, then in PATH,
and run with the root's libcuda and NVML preloaded (``driverbins``); mock hardware installs a stand-in
(``topodra.hardware.mockmps``) that speaks the same protocol.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

from topodra.selectors import parse_quantity
from topodra.sharing import driverbins, mpscontrol, mpspod, mpsshm
from topodra.sharing.computemode import ComputeMode, ComputeModeControl, ComputeModeError
from topodra.sharing.config import Mps
from topodra.sharing.mpscontrol import MpsError
from topodra.sharing.mpsns import PARENT_ENV, PRELOAD_ENV
from topodra.sharing.mpspod import MpsPods

__all__ = ["MpsDaemons", "MpsError", "claim_env"]

log = logging.getLogger(__name__)

BINARY = driverbins.MPS_CONTROL
BINARY_ENV = "TOPODRA_MPS_CONTROL"
SHM_SIZE_ENV = "TOPODRA_MPS_SHM_SIZE"
PID_FILE = "nvidia-cuda-mps-control.pid"
CONTAINER_PIPE_DIR = "/tmp/nvidia-mps"  # the CUDA runtime's default pipe directory
CONTAINER_LOG_DIR = "/var/log/nvidia-mps"
CONTAINER_SHM_DIR = "/dev/shm"
START_LOG = "control-start.log"
INTENT = "intent.json"
SUBDIR = "mps"
_TIMEOUT_S = 15.0


def claim_env(mps: Mps, consumed_memory: Sequence[str | None]) -> list[str]:
    """Container variables of an MPS claim (pure); the daemon holds the same limits (``mpscontrol``).

    ``consumed_memory``: per MPS device in order, its consumed ``memory`` (a share of a GPU) or None.  The
    pinned limit is the config's default, else the share's consumed memory, else none.
    """
    env = [f"CUDA_MPS_PIPE_DIRECTORY={CONTAINER_PIPE_DIR}", f"CUDA_MPS_LOG_DIRECTORY={CONTAINER_LOG_DIR}"]
    if mps.defaultActiveThreadPercentage is not None:
        env.append(f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={mps.defaultActiveThreadPercentage}")
    limits = [f"{i}={mib}M" for i, consumed in enumerate(consumed_memory)
              if (mib := mpscontrol.pinned_limit_mib(mps, consumed)) is not None]
    if limits:
        env.append(f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={','.join(limits)}")
    return env


def shm_size_from_env(environ: Mapping[str, str]) -> int:
    """The per-claim tmpfs size: ``TOPODRA_MPS_SHM_SIZE`` (a quantity) or mpsshm.DEFAULT_SIZE."""
    raw = environ.get(SHM_SIZE_ENV) or mpsshm.DEFAULT_SIZE
    size = int(parse_quantity(raw))
    if size <= 0:
        raise ValueError(f"{SHM_SIZE_ENV}={raw!r} must be a positive quantity")
    return size


class MpsDaemons:
    """Start, stop and list the per-claim control daemons under ``<state_dir>/mps``."""

    def __init__(self, state_dir: str | os.PathLike[str], binary: str | None = None,
                 driver_root: str | os.PathLike[str] | None = None,
                 compute_mode: ComputeModeControl | None = None, shm_size: int | None = None,
                 pods: MpsPods | None = None,
                 host_driver_root: str | os.PathLike[str] | None = None) -> None:  # fmt: skip
        """``pods``: run each daemon in a pod of its own (``mpspod``): ``start`` then does the local half only
        and ``launch_pod`` (outside the node lock) the rest; ``stop`` leaves the pod to ``delete_pods``.
        ``host_driver_root``: the driver root as the host sees it (the pod's hostPath; default ``driver_root``)."""
        self.root = Path(state_dir) / SUBDIR
        self.pods = pods
        self.host_driver_root = host_driver_root
        self._doomed: set[str] = set()  # claims whose daemon quit under the lock; their pods go after it
        self._doomed_lock = threading.Lock()
        self.binary = binary
        self.driver_root = driver_root
        self.compute_mode = compute_mode
        self.shm_size = shm_size if shm_size is not None else shm_size_from_env(os.environ)

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

    def shm_dir(self, claim_uid: str) -> Path:
        """The claim's tmpfs, ``/dev/shm`` of its daemon and containers."""
        return self.root / claim_uid / "shm"

    def command(self, claim_uid: str, extra: Mapping[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
        """The argv (without ``-d``) and environment of the claim's control program: the plugin's
        environment, ``extra``, the claim's pipe and log dirs, and the tool's preload and PATH."""
        pipe, logs = self.dirs(claim_uid)
        t = self._tool()
        env = t.environ(os.environ, {**(extra or {}), "CUDA_MPS_PIPE_DIRECTORY": str(pipe),
                                     "CUDA_MPS_LOG_DIRECTORY": str(logs)})
        return [str(t.path)], env

    def control(self, claim_uid: str, commands: Sequence[str], timeout: float = mpscontrol.TIMEOUT_S) -> str:
        """Send ``commands`` to the claim's daemon; its answer.  MpsError naming the claim on failure."""
        pipe, logs = self.dirs(claim_uid)
        try:
            return mpscontrol.send(self._tool(), pipe, logs, commands, timeout)
        except MpsError as e:
            raise MpsError(f"claim {claim_uid}: {e}") from e

    def alive(self, claim_uid: str) -> bool:
        """Whether the claim's daemon answers ``get_server_list`` through its pipe; MpsError when nothing
        answers in time (then nobody may assume it is gone)."""
        pipe, logs = self.dirs(claim_uid)
        if not pipe.is_dir():
            return False
        try:
            return mpscontrol.answering(self._tool(), pipe, logs)
        except MpsError as e:
            raise MpsError(f"claim {claim_uid}: {e}") from e

    def pid(self, claim_uid: str) -> int | None:
        """The pid the claim's answering daemon wrote (as its own PID namespace sees it; for logs), or None."""
        try:
            if not self.alive(claim_uid):
                return None
            return int((self.dirs(claim_uid)[0] / PID_FILE).read_text().strip())
        except (MpsError, OSError, ValueError):
            return None

    def start(self, claim_uid: str, uuids: Sequence[str], limits: Sequence[str] = (),
              exclusive: Sequence[str] = ()) -> None:  # fmt: skip
        """Start the claim's daemon over ``uuids`` with the daemon commands ``limits``, ``exclusive`` GPUs in
        EXCLUSIVE_PROCESS; what is already there is kept.  MpsError leaves nothing behind."""
        base = self.root / claim_uid
        pipe, logs = self.dirs(claim_uid)
        tool = self._tool()  # a missing binary changes nothing
        if not (tool.path.is_file() and os.access(tool.path, os.X_OK)):
            raise MpsError(f"claim {claim_uid}: cannot start {BINARY}: {tool.path} is not an executable file")
        running = self.alive(claim_uid)  # MpsError (no answer): change nothing, the kubelet retries
        try:
            for d in (pipe, logs):
                d.mkdir(parents=True, exist_ok=True, mode=0o755)
            self._write_intent(claim_uid, exclusive)
            mpsshm.mount(self.shm_dir(claim_uid), self.shm_size)
            for uuid in exclusive:
                self._set_mode(uuid, "EXCLUSIVE_PROCESS")
            if self.pods is not None:  # the pod is made outside the node lock (launch_pod), limits with it
                with self._doomed_lock:
                    self._doomed.discard(claim_uid)
            else:
                if not running:
                    self._launch(claim_uid, uuids)
                if limits:
                    self.control(claim_uid, limits)
        except (MpsError, mpsshm.ShmError, ComputeModeError, OSError, subprocess.TimeoutExpired) as e:
            err = e if isinstance(e, MpsError) else MpsError(f"claim {claim_uid}: cannot start {BINARY}: {e}")
            if not running:  # a daemon that served before this call is left to the claim's unprepare
                try:
                    self.stop(claim_uid)
                except MpsError as again:
                    log.error("claim %s: cleaning up a failed start: %s", claim_uid, again)
            raise err from e
        log.info("claim %s: MPS control daemon serving %s (exclusive %s, %s)", claim_uid, list(uuids),
                 list(exclusive), base)

    def _launch(self, claim_uid: str, uuids: Sequence[str]) -> None:
        """``-d`` in a mount namespace with the claim's tmpfs as /dev/shm; stdio never captured; then wait
        until the pipe answers."""
        argv, env = self.command(claim_uid, {"CUDA_VISIBLE_DEVICES": ",".join(uuids)})
        if "LD_PRELOAD" in env:  # the control program's; the python launcher runs on the image's own libraries
            env[PRELOAD_ENV] = env.pop("LD_PRELOAD")
        env[PARENT_ENV] = str(os.getpid())  # the launcher dies with us (mpsns)
        _, logs = self.dirs(claim_uid)
        launcher = [sys.executable, "-m", "topodra.sharing.mpsns", str(self.shm_dir(claim_uid)), *argv, "-d"]
        with open(logs / START_LOG, "ab") as out:
            r = subprocess.run(launcher, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                               timeout=_TIMEOUT_S)
        if r.returncode != 0:
            tail = (logs / START_LOG).read_text(errors="replace").strip().splitlines()[-3:]
            raise MpsError(f"claim {claim_uid}: {BINARY} -d failed ({r.returncode}): {' | '.join(tail)}")
        self._wait(lambda: self._answers(claim_uid) is True,
                   f"claim {claim_uid}: the MPS daemon did not answer on its pipe")

    def stop(self, claim_uid: str) -> bool:
        """``echo quit | nvidia-cuda-mps-control``, DEFAULT compute mode again, the tmpfs unmounted, the dirs
        removed; False if no daemon was running.  MpsError keeps what it could not undo (recovery retries)."""
        base = self.root / claim_uid
        running = self.alive(claim_uid)
        if running:
            self.control(claim_uid, ["quit"], timeout=_TIMEOUT_S)
            self._wait(lambda: self._answers(claim_uid) is False, f"claim {claim_uid}: the MPS daemon did not quit")
            log.info("claim %s: MPS control daemon stopped", claim_uid)
        try:
            for uuid in self._read_intent(claim_uid):
                self._set_mode(uuid, "DEFAULT")
            mpsshm.unmount(self.shm_dir(claim_uid))
        except (ComputeModeError, mpsshm.ShmError) as e:
            raise MpsError(f"claim {claim_uid}: {e}") from e
        shutil.rmtree(base, ignore_errors=True)
        if self.pods is not None:
            with self._doomed_lock:
                self._doomed.add(claim_uid)
        return running

    # ---- the daemon pod (--mps-daemon=pod): API calls, so never under the node lock ----

    def pod_manifest(self, claim_uid: str, uuids: Sequence[str]) -> mpspod.Obj:
        """The claim's daemon pod: ``<control> -f`` with the tool's preload and PATH, the claim's GPUs."""
        assert self.pods is not None
        if self.driver_root is not None and Path(self.driver_root) == Path("/"):  # a hostPath / over the pod's /
            raise MpsError(f"claim {claim_uid}: an MPS daemon pod needs the driver root at a directory of its own "
                           "(the chart's /driver-root), not /; with the driver at / run the plugin with "
                           "--mps-daemon process")
        t = self._tool()
        env = t.environ({}, {"CUDA_VISIBLE_DEVICES": ",".join(uuids)})
        pipe, logs = self.dirs(claim_uid)
        root = binary = None
        if self.driver_root is not None:
            root = (str(self.host_driver_root or self.driver_root), str(self.driver_root))
        if self.binary or os.environ.get(BINARY_ENV):  # named by the admin or a test, maybe not in the image
            inside_root = root is not None and t.path.is_relative_to(root[1])
            binary = None if inside_root else str(t.path)
        return mpspod.manifest(claim_uid, namespace=self.pods.namespace, node=self.pods.node,
                               image=self.pods.image, argv=[str(t.path), "-f"], env=env, pipe=pipe, logs=logs,
                               shm=self.shm_dir(claim_uid), driver_root=root, binary_file=binary)

    def launch_pod(self, claim_uid: str, uuids: Sequence[str], limits: Sequence[str] = ()) -> None:
        """After ``start``: the claim's daemon pod exists and answers on the pipe, and holds ``limits``.
        Idempotent (a retried prepare finds the pod); MpsError says what is missing."""
        assert self.pods is not None
        if not self.root.joinpath(claim_uid).is_dir():
            raise MpsError(f"claim {claim_uid}: no MPS directories (unprepared meanwhile?)")
        self.pods.ensure(claim_uid, self.pod_manifest(claim_uid, uuids), lambda: self._answers(claim_uid))
        if limits:
            self.control(claim_uid, limits)

    def delete_pods(self) -> dict[str, str]:
        """Delete the pods of the daemons ``stop`` ended; claim UID -> error for those still there (kept for
        the next call)."""
        if self.pods is None:
            return {}
        with self._doomed_lock:
            doomed = sorted(self._doomed)
        errors: dict[str, str] = {}
        for uid in doomed:
            try:
                self.pods.delete(uid)
            except MpsError as e:
                errors[uid] = str(e)
                continue
            with self._doomed_lock:
                self._doomed.discard(uid)
        return errors

    def _answers(self, claim_uid: str) -> bool | None:
        """``alive``, with None for no answer in time (waits keep polling through it)."""
        try:
            return self.alive(claim_uid)
        except MpsError:
            return None

    def claims(self) -> set[str]:
        """Claim UIDs that have MPS directories (running daemon or not)."""
        try:
            return {p.name for p in self.root.iterdir() if p.is_dir()}
        except FileNotFoundError:
            return set()

    def reconcile(self, recorded: Iterable[str]) -> list[str]:
        """Stop the daemons (and drop the dirs) of claims not in ``recorded``; returns their UIDs."""
        keep = set(recorded)
        stopped = []
        for uid in sorted(self.claims() - keep):
            log.warning("claim %s: stopping its MPS daemon: no prepared claim records it", uid)
            try:
                self.stop(uid)
            except MpsError as e:  # the others are still stopped; the next start tries this one again
                log.error("%s", e)
                continue
            stopped.append(uid)
        return stopped

    def _set_mode(self, uuid: str, mode: ComputeMode) -> None:
        if self.compute_mode is None:
            raise ComputeModeError(f"GPU {uuid}: no way to set the compute mode on this node")
        try:
            self.compute_mode.set_compute_mode(uuid, mode)
        except ComputeModeError:
            raise
        except Exception as e:  # the hardware's own error (an NVMLError on mock hardware)
            raise ComputeModeError(f"GPU {uuid}: cannot set compute mode {mode}: {e}") from e
        log.info("GPU %s: compute mode %s", uuid, mode)

    def _write_intent(self, claim_uid: str, exclusive: Sequence[str]) -> None:
        path = self.root / claim_uid / INTENT
        known = set(self._read_intent(claim_uid))
        tmp = path.with_name(INTENT + ".tmp")
        tmp.write_text(json.dumps({"exclusive": sorted(known | set(exclusive))}))
        os.replace(tmp, path)

    def _read_intent(self, claim_uid: str) -> list[str]:
        try:
            return list(json.loads((self.root / claim_uid / INTENT).read_text()).get("exclusive", []))
        except (OSError, ValueError, AttributeError):
            return []

    @staticmethod
    def _wait(done: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + _TIMEOUT_S
        while not done():
            if time.monotonic() > deadline:
                raise MpsError(f"{what} within {_TIMEOUT_S:.0f} s")
            time.sleep(0.05)
