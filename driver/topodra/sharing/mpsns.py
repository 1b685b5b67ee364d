"""``python -m topodra.sharing.mpsns SHM ARGV...``: run ARGV with the claim's tmpfs SHM as its ``/dev/shm``.

The MPS control daemon and the servers it forks must see the same ``/dev/shm`` as the claim's containers.
A launcher process (not ``preexec_fn``: the plugin is multi-threaded) enters a mount namespace of its own,
binds SHM over ``/dev/shm`` there and execs the control program; the daemon it forks keeps the namespace.

The launcher dies with the plugin (``PR_SET_PDEATHSIG``, kept across the exec): a launch a killed plugin left
running would otherwise bring a daemon up after the restarted plugin's recovery had looked, and no checkpoint
entry would ever record it (found by the GPU-effect crash campaign, docs/reliability.md).  The daemon the
control program forks is not the launcher's: once forked it is up within milliseconds, before a restart looks.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

from topodra.sharing.mpsshm import ShmError, enter_private_namespace_with_shm

PRELOAD_ENV = "TOPODRA_MPSNS_LD_PRELOAD"  # becomes LD_PRELOAD of ARGV only
PARENT_ENV = "TOPODRA_MPSNS_PARENT"  # the plugin's pid: the launcher ends if that process is gone
PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> bool:
    """SIGKILL this process when its parent dies (the thread that started it: the plugin's ``subprocess.run`` waits
    in it until the launch is done); False if ``parent`` is already gone (reparented)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    return os.getppid() == parent


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: python -m topodra.sharing.mpsns SHM ARGV...", file=sys.stderr)
        return 2
    parent = os.environ.pop(PARENT_ENV, "")
    if parent and not die_with_parent(int(parent)):
        print("mpsns: the plugin that started this launch is gone", file=sys.stderr)
        return 1
    try:
        enter_private_namespace_with_shm(argv[0])
    except ShmError as e:
        print(f"mpsns: {e}", file=sys.stderr)
        return 1
    env = dict(os.environ)
    preload = env.pop(PRELOAD_ENV, None)  # the control program's, not this python's
    if preload:
        env["LD_PRELOAD"] = preload
    try:
        os.execve(argv[1], argv[1:], env)
    except OSError as e:
        print(f"mpsns: cannot run {argv[1]}: {e}", file=sys.stderr)
    return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
