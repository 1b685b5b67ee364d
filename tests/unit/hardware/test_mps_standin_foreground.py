"""The C MPS stand-in's ``-f`` (foreground), as NVIDIA's ``nvidia-cuda-mps-control -f`` and a daemon pod run it.

``-f`` makes the same checks as ``-d`` (its directories, no daemon listening on the pipe directory yet), then
serves the pipe in the calling process until ``quit`` or SIGTERM (a deleted pod).  Replies go to FIFOs named
relative to the pipe directory, since a daemon in a pod sees that directory under another path than the
plugin on the host does.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from testkit.standin import clean_env, driver_tree

PID_FILE = "nvidia-cuda-mps-control.pid"


@pytest.fixture(scope="module")
def control(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(driver_tree(tmp_path_factory.mktemp("fg"), "dgx-h100") / "usr/bin/nvidia-cuda-mps-control")


class Dirs:
    def __init__(self, control: str, base: Path) -> None:
        self.control = control
        self.pipe, self.log = base / "pipe", base / "log"
        self.env = clean_env({"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe), "CUDA_MPS_LOG_DIRECTORY": str(self.log)})

    def foreground(self) -> subprocess.Popen[str]:
        return subprocess.Popen([self.control, "-f"], env=self.env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def send(self, commands: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([self.control], input=commands, capture_output=True, text=True, env=self.env,
                              timeout=10, check=False)

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([self.control, *args], capture_output=True, text=True, env=self.env, timeout=10,
                              check=False)

    def wait_serving(self, proc: subprocess.Popen[str]) -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            if (self.pipe / PID_FILE).exists() and self.send("get_server_list\n").returncode == 0:
                return
            time.sleep(0.05)
        raise AssertionError("the -f daemon did not answer on its pipe within 10 s")


@pytest.fixture
def dirs(control: str, tmp_path: Path) -> Iterator[Dirs]:
    d = Dirs(control, tmp_path)
    yield d
    if (d.pipe / "control").exists():
        d.send("quit\n")


def test_foreground_serves_in_this_process_until_quit(dirs: Dirs) -> None:
    proc = dirs.foreground()
    dirs.wait_serving(proc)
    # No fork: the pid file names the process we started, which is still running.
    assert int((dirs.pipe / PID_FILE).read_text()) == proc.pid and proc.poll() is None
    assert os.path.exists(f"/dev/shm/cuda.shm.standin.control.{proc.pid}")
    limits = dirs.send("set_default_active_thread_percentage 30\nget_default_active_thread_percentage\n")
    assert limits.stdout.split() == ["30.0", "30.0"], limits
    server = int(dirs.send("start_server -uid 0\n").stdout)
    assert dirs.send("get_server_list\n").stdout.split() == [str(server)]
    # The same already-running check as -d, for both forms.
    for form in ("-f", "-d"):
        again = dirs.run(form)
        assert again.returncode == 1 and "An instance of this daemon is already running" in again.stderr, form
    assert proc.poll() is None, "a refused second daemon leaves the first serving"
    assert dirs.send("quit\n").returncode == 0
    _, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    assert "Starting control daemon" in err and "CMD: quit" in err, "the log goes to stderr too (kubectl logs)"
    assert "Starting control daemon" in (dirs.log / "control.log").read_text()
    assert not (dirs.pipe / PID_FILE).exists() and not (dirs.pipe / "control").exists()
    assert not os.path.exists(f"/dev/shm/cuda.shm.standin.control.{proc.pid}")
    assert not os.path.exists(f"/proc/{server}"), "quit stops the daemon's servers"


def test_sigterm_ends_the_foreground_daemon_and_cleans_up(dirs: Dirs) -> None:
    """A deleted daemon pod: the kubelet sends SIGTERM, which must not wait out the grace period."""
    proc = dirs.foreground()
    dirs.wait_serving(proc)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=5)
    assert proc.returncode == 0 and time.monotonic() - t0 < 5, err
    assert "Terminated by signal" in err
    assert not (dirs.pipe / PID_FILE).exists() and not (dirs.pipe / "control").exists()
    gone = dirs.send("get_server_list\n")
    assert gone.returncode == 1 and "Cannot find MPS control daemon process" in gone.stderr


def test_a_stale_pid_file_and_fifo_do_not_block_a_new_daemon(dirs: Dirs) -> None:
    """After a daemon was killed (-9) its pid file and FIFO stay; the pid may be reused, or be another PID
    namespace's.  Only a daemon reading the FIFO counts as running."""
    dirs.pipe.mkdir()
    (dirs.pipe / PID_FILE).write_text(f"{os.getpid()}\n")  # a live process, not a daemon
    os.mkfifo(dirs.pipe / "control")
    proc = dirs.foreground()
    dirs.wait_serving(proc)
    assert int((dirs.pipe / PID_FILE).read_text()) == proc.pid
    assert dirs.send("quit\n").returncode == 0
    assert proc.wait(timeout=10) == 0


def test_the_client_names_its_reply_fifo_relative_to_the_pipe_dir(dirs: Dirs) -> None:
    """Read the client's request off the control FIFO ourselves: the reply name has no directory, and the
    client reads the answer written to that name inside its pipe directory."""
    dirs.pipe.mkdir()
    fifo = dirs.pipe / "control"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a reader, so the client finds a "daemon"
    try:
        client = subprocess.Popen([dirs.control], env=dirs.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        assert client.stdin is not None
        client.stdin.write("get_default_active_thread_percentage\n")
        client.stdin.flush()
        deadline = time.monotonic() + 10
        request = b""
        while not request.endswith(b"\n") and time.monotonic() < deadline:
            try:
                request += os.read(reader, 512)
            except BlockingIOError:
                time.sleep(0.02)
        name, command = request.decode().split(" ", 1)
        assert "/" not in name and command == "get_default_active_thread_percentage\n", request
        with open(dirs.pipe / name, "w") as reply:
            reply.write("42.0\n")
        out, err = client.communicate(timeout=10)
        assert client.returncode == 0 and out == "42.0\n", err
    finally:
        os.close(reader)


def read_reply(fd: int, timeout: float = 10) -> str:
    """The answer on a reply FIFO opened (O_NONBLOCK) before the command was sent: until the daemon closes it."""
    got = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        chunk = os.read(fd, 512)
        if not chunk:  # EOF: select reports it only after a writer came and went (fifo(7), Linux pipe_poll)
            return got.decode()
        got += chunk
    raise AssertionError(f"no complete answer within {timeout} s (got {got!r})")


def send_raw(dirs: Dirs, name: str, command: str) -> None:
    fd = os.open(dirs.pipe / "control", os.O_WRONLY | os.O_NONBLOCK)
    try:
        os.write(fd, f"{name} {command}\n".encode())
    finally:
        os.close(fd)


def test_the_daemon_answers_a_reply_name_relative_to_its_own_pipe_dir(dirs: Dirs) -> None:
    proc = dirs.foreground()
    dirs.wait_serving(proc)
    reply = dirs.pipe / "reply.test.0"
    os.mkfifo(reply)
    fd = os.open(reply, os.O_RDONLY | os.O_NONBLOCK)  # the client's side: reader first, then the command
    try:
        send_raw(dirs, "reply.test.0", "get_default_active_thread_percentage")
        assert read_reply(fd) == "100.0\n"  # it found the relative name
    finally:
        os.close(fd)
    assert dirs.send("quit\n").returncode == 0
    assert proc.wait(timeout=10) == 0


def test_a_client_killed_before_its_answer_does_not_block_the_daemon(dirs: Dirs) -> None:
    """A client killed between its command and reading the answer leaves a reply FIFO nobody reads. A daemon that
    opened it blocking (fopen) would wait forever, and every later client with it: it must drop that answer."""
    proc = dirs.foreground()
    dirs.wait_serving(proc)
    os.mkfifo(dirs.pipe / "reply.dead.0")  # the dead client's FIFO: made, never opened
    send_raw(dirs, "reply.dead.0", "set_default_active_thread_percentage 40")
    later = dirs.send("get_default_active_thread_percentage\n")  # times out (10 s) if the daemon hangs
    assert later.returncode == 0 and later.stdout == "40.0\n", later
    assert "answer dropped" in (dirs.log / "control.log").read_text()
    assert dirs.send("quit\n").returncode == 0
    assert proc.wait(timeout=10) == 0
