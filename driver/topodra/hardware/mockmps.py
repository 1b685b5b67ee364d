#!/usr/bin/env python3
"""Mock hardware: a stand-in ``nvidia-cuda-mps-control`` for nodes without NVIDIA's (standard library only).

It behaves like the real control program as topodra and NVIDIA's drivers use it (the C stand-in of the
driver tree, ``hack/nvml-standin/mps.c``, speaks the same protocol):

* ``nvidia-cuda-mps-control -d`` daemonizes, closes the stdio it inherited and returns.  The daemon takes
  ``CUDA_MPS_PIPE_DIRECTORY`` (default ``/tmp/nvidia-mps``) and ``CUDA_MPS_LOG_DIRECTORY`` (default
  ``/var/log/nvidia-mps``), writes ``nvidia-cuda-mps-control.pid`` and a ``control`` FIFO into the pipe
  directory, logs to ``control.log`` and keeps a file in ``/dev/shm`` (which is how tests see that the
  daemon and the claim's containers share one ``/dev/shm``).  A second ``-d`` on a live pipe directory fails:
  "An instance of this daemon is already running".  ``-f`` does the same in the foreground (no fork, stdio
  kept), as the daemon pod runs it.
* ``nvidia-cuda-mps-control`` without ``-d`` sends each stdin line to the daemon of that pipe directory and
  prints its answer ("Cannot find MPS control daemon process", exit 1, when none listens):
  ``get_server_list`` (no servers: nothing), ``set_default_active_thread_percentage N``,
  ``set_default_device_pinned_mem_limit DEV VALUE`` (DEV an index or UUID), their ``get_`` forms, ``quit``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import sys
import time

PID_FILE = "nvidia-cuda-mps-control.pid"
FIFO = "control"
SHM_PREFIX = "cuda.shm.standin.control."


def _dirs() -> tuple[str, str]:
    return (os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps",
            os.environ.get("CUDA_MPS_LOG_DIRECTORY") or "/var/log/nvidia-mps")


def _log(logs: str, line: str) -> None:
    with open(os.path.join(logs, "control.log"), "a") as f:
        f.write(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {line}\n")


def _listening(pipe: str) -> bool:
    """Whether a daemon holds the control FIFO open for reading (a writer's open then succeeds)."""
    try:
        fd = os.open(os.path.join(pipe, FIFO), os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return False
    os.close(fd)
    return True


class _Daemon:
    def __init__(self, pipe: str, logs: str) -> None:
        self.pipe, self.logs = pipe, logs
        self.thread_pct = "100.0"
        self.mem_limits: dict[str, str] = {}
        self.shm = f"/dev/shm/{SHM_PREFIX}{os.getpid()}"

    def answer(self, cmd: list[str]) -> tuple[str, bool]:
        """The reply to one command, and whether it was quit."""
        name, args = cmd[0], cmd[1:]
        if name == "get_server_list" and not args:
            return "", False
        if name == "set_default_active_thread_percentage" and len(args) == 1:
            self.thread_pct = f"{float(args[0]):.1f}"
            return self.thread_pct + "\n", False
        if name == "get_default_active_thread_percentage" and not args:
            return self.thread_pct + "\n", False
        if name == "set_default_device_pinned_mem_limit" and len(args) == 2:
            self.mem_limits[args[0]] = args[1]
            return "", False
        if name == "get_default_device_pinned_mem_limit" and len(args) == 1:
            return self.mem_limits.get(args[0], "0") + "\n", False
        if name == "quit" and not args:
            return "", True
        return f"Unrecognized command {name}\n", False

    def serve(self) -> None:
        fifo = os.path.join(self.pipe, FIFO)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(fifo)
        os.mkfifo(fifo, 0o600)
        fd = os.open(fifo, os.O_RDWR)  # a reader always, and never EOF
        with open(self.shm, "w") as f:
            f.write(f"{os.getpid()}\n")
        with open(os.path.join(self.pipe, PID_FILE), "w") as f:
            f.write(f"{os.getpid()}\n")
        _log(self.logs, f"startup: CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')}")
        quit_ = False
        with os.fdopen(fd, "r") as requests:
            while not quit_:
                line = requests.readline()
                reply_path, _, cmd = line.strip().partition(" ")
                if not cmd.split():
                    continue
                _log(self.logs, f"command: {cmd}")
                out, quit_ = self.answer(cmd.split())
                # A name relative to the pipe dir: a daemon pod sees that dir under another path.
                with contextlib.suppress(OSError), open(os.path.join(self.pipe, reply_path), "w") as reply:
                    reply.write(out)
        for path in (fifo, os.path.join(self.pipe, PID_FILE), self.shm):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        _log(self.logs, "exit")


def _claim_dirs() -> tuple[str, str] | None:
    """The pipe and log directories, made if missing; None (and NVIDIA's message) when a daemon already serves."""
    pipe, logs = _dirs()
    for d in (pipe, logs):
        os.makedirs(d, exist_ok=True)
    if _listening(pipe):
        print("An instance of this daemon is already running", file=sys.stderr)
        return None
    return pipe, logs


def daemonize() -> int:
    dirs = _claim_dirs()
    if dirs is None:
        return 1
    pipe, logs = dirs
    if os.fork() > 0:
        return 0
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    _Daemon(pipe, logs).serve()
    os._exit(0)


def foreground() -> int:
    """``-f``: serve in this process (the daemon pod's main process, as NVIDIA's DRA driver runs it)."""
    dirs = _claim_dirs()
    if dirs is None:
        return 1
    _Daemon(*dirs).serve()
    return 0


def _ask(control_fd: int, reply: str, line: str) -> str:
    """Send one command and read its answer, as the C stand-in's client does (hack/nvml-standin/mps.c): the reply
    FIFO is opened for reading before the command goes out, so a daemon that opens it non-blocking finds a reader;
    select reports it readable once the daemon has written and closed (Linux: a FIFO reader sees EOF only after a
    writer came and went)."""
    rfd = os.open(reply, os.O_RDONLY | os.O_NONBLOCK)
    try:
        os.write(control_fd, f"{os.path.basename(reply)} {line}\n".encode())
        os.close(control_fd)
        chunks: list[bytes] = []
        while True:
            select.select([rfd], [], [])
            try:
                chunk = os.read(rfd, 4096)
            except BlockingIOError:
                continue
            if not chunk:
                return b"".join(chunks).decode()
            chunks.append(chunk)
    finally:
        os.close(rfd)


def client() -> int:
    pipe, _ = _dirs()
    for n, line in enumerate(raw.strip() for raw in sys.stdin):
        if not line:
            continue
        try:
            fd = os.open(os.path.join(pipe, FIFO), os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:
            if e.errno not in (errno.ENXIO, errno.ENOENT):
                raise
            print("Cannot find MPS control daemon process", file=sys.stderr)
            return 1
        reply = os.path.join(pipe, f"reply.{os.getpid()}.{n}")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(reply)
        os.mkfifo(reply, 0o600)
        try:
            sys.stdout.write(_ask(fd, reply, line))
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(reply)
        if line.split()[0] == "quit":
            break
    return 0


def main(argv: list[str]) -> int:
    if "-f" in argv:
        return foreground()
    return daemonize() if "-d" in argv else client()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
