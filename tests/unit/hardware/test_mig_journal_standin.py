"""Finding 10, second half, on the production path: the plugin's DeviceState over the real pynvml and the C
stand-in (whose MIG instances live in a state file, so they outlive the killed process, as on a GPU).

An admin's instance (made through NVML with no journal entry, as ``nvidia-smi mig -cgi`` would) survives
a plugin restart; the instances of a prepare killed at ``after-mig-created`` are destroyed.  On the code
before the fix, the restart destroyed all three.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from testkit.standin import PRELUDE, clean_env, driver_tree, run_py

from topodra.crashpoints import CRASH_EXIT_CODE
from topodra.hardware.mockprofile import build_tree, load_profile

NODE = "standin-node"
PROFILE = "dgx-a100-80gb-mig"

SETUP = """
from topodra import effects
from topodra.claims import AllocatedClaim, AllocatedDevice, ClaimRef
from topodra.hardware import load_backend
from topodra.inventory import Inventory
from topodra.sharing.instances import MigInstances
from topodra.sharing.mig import placement_of
from topodra.state import DeviceState
TMP = {tmp!r}
devices = load_backend("nvml", {node!r}, sysfs_root=TMP + "/sysfs", nvidia_driver_root=TREE).discover()
by_name = {{d.name: d for d in devices}}
mig = MigInstances(pynvml, proc_root=TREE + "/proc")
def node_state():
    return DeviceState("gpu.topodra.io", {node!r}, Inventory(devices), TMP + "/cdi", TMP + "/state",
                       boot_id_path=TMP + "/boot_id", nvidia_spec_dirs=[],
                       gpu_effects=effects.standard(TMP + "/state", mig=mig))
def instances():
    parents = sorted({{str(d.attributes["parentUUID"].value) for d in devices if d.kind == "mig"}})
    return sorted([i.parent_uuid, i.gpu_instance, i.profile_id, i.start] for i in mig.existing(parents))
"""

KILLED = """
admin = mig.create(placement_of(by_name["gpu-1-mig-3g-40gb-4"]))
st = node_state()
mine = [n for n in by_name if n.startswith("gpu-0-mig-1g-10gb-")][:2]
st.prepare([AllocatedClaim(ref=ClaimRef(namespace="ns", uid="k", name="c"),
                           devices=tuple(AllocatedDevice(request="gpus", device=n, share_id=None,
                                                         access="exclusive") for n in mine))])
"""

RESTART = """
before = instances()
st = node_state()
out({"before": before, "destroyed": st.last_recovery.mig_destroyed, "after": instances(),
     "admin_parent": str(by_name["gpu-1"].uuid), "mine_parent": str(by_name["gpu-0"].uuid)})
"""


def test_restart_destroys_the_killed_prepares_instances_and_leaves_the_admins(tmp_path: Path) -> None:
    tree = driver_tree(tmp_path / "root", PROFILE, node=NODE)
    build_tree(load_profile(PROFILE), frozenset()).materialize(str(tmp_path / "sysfs"))
    (tmp_path / "boot_id").write_text("boot-1\n")
    setup = textwrap.dedent(SETUP.format(tmp=str(tmp_path), node=NODE))
    killed = subprocess.run([sys.executable, "-c", PRELUDE + setup + textwrap.dedent(KILLED), str(tree)],
                            capture_output=True, text=True, timeout=120, check=False,
                            env=clean_env({"TOPODRA_CRASH_POINT": "after-mig-created"}))
    assert killed.returncode == CRASH_EXIT_CODE, killed.stderr
    got = run_py(tree, setup + textwrap.dedent(RESTART), timeout=120)
    assert len(got["before"]) == 3, got  # the admin's 3g.40gb, and the killed prepare's two 1g.10gb
    admin = [i for i in got["before"] if i[0] == got["admin_parent"]]
    assert len(admin) == 1 and admin[0][3] == 4, got
    assert got["after"] == admin, json.dumps(got)
    assert sorted(d.split("/")[0] for d in got["destroyed"]) == [got["mine_parent"]] * 2, got
