"""The controller runs as the Deployment's non-root uid with no passwd entry, as in its container.

The pod once crash-looped: kopf names itself through ``getpass.getuser()``, which raises KeyError for
uid 65532 (no /etc/passwd line). Here the real ``topodra controller`` runs under ``setpriv`` as that uid,
with no USER/LOGNAME/HOME in its environment, against the real apiserver as its ServiceAccount.

Split by tier; the rest: tests/cluster/test_install_controller_uid_cluster.py.
"""

from __future__ import annotations

import subprocess
import sys

from testkit.paths import REPO

UID = 65532


def test_repo_is_readable_by_the_unprivileged_uid() -> None:
    """The test above imports topodra from this checkout as uid 65532: fail clearly if it cannot."""
    r = subprocess.run(["setpriv", f"--reuid={UID}", f"--regid={UID}", "--clear-groups", "--", sys.executable,
                        "-c", "import topodra.controller.main"], capture_output=True, text=True, cwd="/",
                       env={"PATH": "/usr/bin:/bin"}, check=False)
    assert r.returncode == 0, f"uid {UID} cannot import topodra from {REPO}: {r.stderr}"
