#!/usr/bin/env python3
"""Mock hardware: a stand-in ``nvidia-cuda-mps-control`` for nodes without NVIDIA's (standard library only).

It behaves like the real control program as topodra uses it:

* ``nvidia-cuda-mps-control -d`` daemonizes and returns at once.  The daemon takes
  ``CUDA_MPS_PIPE_DIRECTORY`` (default ``/tmp/nvidia-mps``) and ``CUDA_MPS_LOG_DIRECTORY``
  (default ``/var/log/nvidia-mps``), writes ``nvidia-cuda-mps-control.pid`` and a ``control``
  FIFO into the pipe directory and logs to ``control.log``.  A second ``-d`` on the same pipe
  directory fails: "An instance of this daemon is already running".
* ``nvidia-cuda-mps-control`` without ``-d`` sends its stdin's commands to the daemon of that
  pipe directory ("Cannot find MPS control daemon process" when there is none); ``quit`` makes
  the daemon clean up and exit, and the client waits for that.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
import time

PID_FILE = "nvidia-cuda-mps-control.pid"
FIFO = "control"


def _dirs() -> tuple[str, str]:
    return (os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"),
            os.environ.get("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps"))


def _alive(pipe: str) -> int | None:
    try:
        with open(os.path.join(pipe, PID_FILE)) as f:
            pid = int(f.read().strip())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    return pid


def _log(logs: str, line: str) -> None:
    with open(os.path.join(logs, "control.log"), "a") as f:
        f.write(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {line}\n")


def _serve(pipe: str, logs: str) -> None:
    fifo = os.path.join(pipe, FIFO)

    def cleanup(*_: object) -> None:
        for name in (FIFO, PID_FILE):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(pipe, name))
        _log(logs, "exit")
        os._exit(0)

    signal.signal(signal.SIGTERM, cleanup)
    if os.path.exists(fifo):
        os.unlink(fifo)
    os.mkfifo(fifo, 0o600)
    with open(os.path.join(pipe, PID_FILE), "w") as f:
        f.write(f"{os.getpid()}\n")
    _log(logs, f"startup: CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')}")
    while True:
        with open(fifo) as f:  # blocks until a client writes
            for raw in f:
                cmd = raw.strip()
                if not cmd:
                    continue
                _log(logs, f"command: {cmd}")
                if cmd == "quit":
                    cleanup()


def daemonize() -> int:
    pipe, logs = _dirs()
    for d in (pipe, logs):
        os.makedirs(d, exist_ok=True)
    if _alive(pipe) is not None:
        print("An instance of this daemon is already running", file=sys.stderr)
        return 1
    if os.fork() > 0:
        return 0
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    _serve(pipe, logs)
    return 0


def client() -> int:
    pipe, _ = _dirs()
    fd = -1
    deadline = time.monotonic() + 2  # the daemon re-opens its FIFO between clients: retry briefly
    while fd < 0 and _alive(pipe) is not None and time.monotonic() < deadline:
        try:
            fd = os.open(os.path.join(pipe, FIFO), os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:
            if e.errno not in (errno.ENXIO, errno.ENOENT):
                raise
            time.sleep(0.01)
    if fd < 0:
        print("Cannot find MPS control daemon process", file=sys.stderr)
        return 1
    commands = [line.strip() for line in sys.stdin if line.strip()]
    with os.fdopen(fd, "w") as f:
        f.write("".join(c + "\n" for c in commands))
    if "quit" in commands:
        deadline = time.monotonic() + 10
        while _alive(pipe) is not None:
            if time.monotonic() > deadline:
                print("the daemon did not quit", file=sys.stderr)
                return 1
            time.sleep(0.01)
    return 0


def main(argv: list[str]) -> int:
    return daemonize() if "-d" in argv else client()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
