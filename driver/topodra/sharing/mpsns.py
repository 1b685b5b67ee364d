"""``python -m topodra.sharing.mpsns SHM ARGV...``: run ARGV with the claim's tmpfs SHM as its ``/dev/shm``.

The MPS control daemon and the servers it forks must see the same ``/dev/shm`` as the claim's containers.
A launcher process (not ``preexec_fn``: the plugin is multi-threaded) enters a mount namespace of its own,
binds SHM over ``/dev/shm`` there and execs the control program; the daemon it forks keeps the namespace.
"""

from __future__ import annotations

import os
import sys

from topodra.sharing.mpsshm import ShmError, enter_private_namespace_with_shm

PRELOAD_ENV = "TOPODRA_MPSNS_LD_PRELOAD"  # becomes LD_PRELOAD of ARGV only


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: python -m topodra.sharing.mpsns SHM ARGV...", file=sys.stderr)
        return 2
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
