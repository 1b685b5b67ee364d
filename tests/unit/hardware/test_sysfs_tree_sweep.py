"""Shared mock sysfs trees of processes that died without atexit (SIGKILL) are removed by the next process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from topodra.hardware.facts import TREE_PREFIX, sweep_dead_trees


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_trees_of_dead_processes_go_and_live_ones_and_foreign_names_stay(tmp_path: Path) -> None:
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead = tmp_path / f"{TREE_PREFIX}{_dead_pid()}-abc123"
        alive = tmp_path / f"{TREE_PREFIX}{live.pid}-def456"
        mine = tmp_path / f"{TREE_PREFIX}{os.getpid()}-ghi789"
        old_style = tmp_path / f"{TREE_PREFIX}k3j4_x9a"  # written before trees carried a pid: unknown owner
        other = tmp_path / "something-else-1-2"
        for d in (dead, alive, mine, old_style, other):
            (d / "bus" / "pci").mkdir(parents=True)
        assert sweep_dead_trees(str(tmp_path)) == [dead.name]
        assert not dead.exists()
        assert all(d.is_dir() for d in (alive, mine, old_style, other))
    finally:
        live.send_signal(signal.SIGKILL)
        live.wait()


def test_a_killed_process_leaves_a_tree_that_the_next_one_removes(tmp_path: Path) -> None:
    """The real path: a process writes its shared tree, dies by SIGKILL (no atexit), the next one sweeps it."""
    code = ("import os; from topodra.hardware.facts import SysfsTree, shared_root; "
            "print(shared_root(SysfsTree(files={'x': '1'})), flush=True); "
            "os.kill(os.getpid(), 9)")
    # /dev/shm where writable, else $TMPDIR (pointed at tmp_path so a non-root run leaves nothing behind)
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    assert out.returncode == -signal.SIGKILL
    root = Path(out.stdout.strip())
    parent = root.parent
    assert parent.name.startswith(TREE_PREFIX) and parent.is_dir()  # the killed process's tree is still there
    assert parent.name in sweep_dead_trees(str(parent.parent))  # (with any other dead process's tree there)
    assert not parent.exists()
