"""A daemon launch dies with the plugin that started it (``sharing.mpsns``, PR_SET_PDEATHSIG).

Found by the GPU-effect crash campaign (bench/reliability/gpueffects.py): a plugin killed while its launcher was
starting an MPS daemon left the launcher running; the restarted plugin's recovery found no daemon to stop, then
the launch finished and a daemon that no checkpoint entry records served for good.  Here the "daemon" is a
shell that writes a file after a while; the plugin dies right after starting the launch.  Needs root (the
launcher enters a mount namespace), as every MPS test.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

PLUGIN = textwrap.dedent("""
    import os, subprocess, sys
    shm, marker = sys.argv[1], sys.argv[2]
    env = {**os.environ, "TOPODRA_MPSNS_PARENT": str(os.getpid())}  # what MpsDaemons._launch passes
    p = subprocess.Popen([sys.executable, "-m", "topodra.sharing.mpsns", shm, "/bin/sh", "-c",
                          f"sleep 1; touch {marker}"], env=env)
    print(p.pid, flush=True)
    os._exit(137)  # kill -9 of the plugin mid-launch
""")


def test_a_launch_dies_with_the_plugin_that_started_it(tmp_path: Path) -> None:
    shm, marker = tmp_path / "shm", tmp_path / "daemon-started"
    shm.mkdir()
    r = subprocess.run([sys.executable, "-c", PLUGIN, str(shm), str(marker)], capture_output=True, text=True,
                       timeout=30, check=False)
    assert r.returncode == 137, r.stderr
    launcher = int(r.stdout.split()[0])
    deadline = time.monotonic() + 10
    while Path(f"/proc/{launcher}").exists() and "Z" not in _state(launcher):  # the positive signal: it ended
        assert time.monotonic() < deadline, "the launcher outlived its plugin by 10 s"
        time.sleep(0.05)
    assert not marker.exists(), "the launch went on after the plugin died: its daemon would be recorded nowhere"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def test_the_plugin_names_itself_under_the_variable_the_launcher_reads() -> None:
    from topodra.sharing import mpsns

    assert mpsns.PARENT_ENV == "TOPODRA_MPSNS_PARENT"
