"""Recovery tears down in the reverse of the prepare order, so an MPS server never blocks a MIG destroy.

nvml.h, nvmlComputeInstanceDestroy: "NVML_ERROR_IN_USE If the compute instance is in use. This error would be
returned if processes (e.g. CUDA application) are active on the compute instance."  The C stand-in answers so
while an MPS server runs on the instance (the server registers as a GPU process).  A plugin killed after an
unprepare's checkpoint write leaves an MPS-over-MIG claim's daemon, its server and its MIG instance, none
recorded.  The restart must stop the daemon before destroying the instance: before the fix it destroyed MIG
first (the effects' prepare order), NVML refused with IN_USE, and the instance stayed until a later restart.
These tests mount the claim's tmpfs: they run as root, as the plugin does.
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
import os, signal
from topodra import effects
from topodra.claims import AllocatedClaim, AllocatedDevice, ClaimRef
from topodra.hardware import load_backend
from topodra.inventory import Inventory
from topodra.sharing.config import Mps, Sharing
from topodra.sharing.instances import MigInstances
from topodra.sharing.mps import MpsDaemons
from topodra.state import DeviceState
TMP = {tmp!r}
devices = load_backend("nvml", {node!r}, sysfs_root=TMP + "/sysfs", nvidia_driver_root=TREE).discover()
mig = MigInstances(pynvml, proc_root=TREE + "/proc")
daemons = MpsDaemons(TMP + "/state", driver_root=TREE)
REF = ClaimRef(namespace="ns", uid="k", name="c")
def node_state():
    return DeviceState("gpu.topodra.io", {node!r}, Inventory(devices), TMP + "/cdi", TMP + "/state",
                       boot_id_path=TMP + "/boot_id", nvidia_spec_dirs=[],
                       gpu_effects=effects.standard(TMP + "/state", mig=mig, mps=daemons))
def instances():
    parents = sorted({{str(d.attributes["parentUUID"].value) for d in devices if d.kind == "mig"}})
    return sorted([i.parent_uuid, i.gpu_instance, i.compute_instance] for i in mig.existing(parents))
def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not open(f"/proc/{{pid}}/stat").read().split(")")[-1].split()[0] == "Z"
"""

PREPARE_AND_SERVE = """
slice_ = next(d.name for d in devices if d.name.startswith("gpu-0-mig-1g-10gb-"))
st = node_state()
sharing = Sharing(strategy="MPS", mps=Mps())
st.prepare([AllocatedClaim(ref=REF, devices=(AllocatedDevice(request="gpus", device=slice_, share_id=None,
                                                             access="exclusive", sharing=sharing),))])
server = int(daemons.control("k", ["start_server -uid 0"]).strip())  # a client came: the daemon's server
mig_uuid = next(d.mig.uuid for d in st._load().claims["k"].devices)
h = pynvml.nvmlDeviceGetHandleByUUID(mig_uuid)
deadline = time.monotonic() + 20
while not pynvml.nvmlDeviceGetComputeRunningProcesses(h) and time.monotonic() < deadline:
    time.sleep(0.02)
procs = [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)]
with open(TMP + "/served.json", "w") as f:
    json.dump({"server": server, "procs": procs, "instances": instances(), "daemon": daemons.pid("k")}, f)
st.unprepare([REF])  # dies at after-unprepare-checkpoint-written: nothing undone, nothing recorded
"""

RESTART = """
served = json.load(open(TMP + "/served.json"))
before = instances()
st = node_state()
out({"before": before, "after": instances(), "destroyed": st.last_recovery.mig_destroyed,
     "server_alive": alive(served["server"]), "daemon_alive": alive(served["daemon"]),
     "claims": sorted(daemons.claims())})
"""


def test_restart_stops_the_stray_mps_daemon_before_destroying_its_mig_instance(tmp_path: Path) -> None:
    tree = driver_tree(tmp_path / "root", PROFILE, node=NODE)
    build_tree(load_profile(PROFILE), frozenset()).materialize(str(tmp_path / "sysfs"))
    (tmp_path / "boot_id").write_text("boot-1\n")
    setup = textwrap.dedent(SETUP.format(tmp=str(tmp_path), node=NODE))
    try:
        killed = subprocess.run([sys.executable, "-c", PRELUDE + setup + textwrap.dedent(PREPARE_AND_SERVE),
                                 str(tree)], capture_output=True, text=True, timeout=120, check=False,
                                env=clean_env({"TOPODRA_CRASH_POINT": "after-unprepare-checkpoint-written"}))
        assert killed.returncode == CRASH_EXIT_CODE, killed.stderr
        served = json.loads((tmp_path / "served.json").read_text())
        assert served["procs"] == [served["server"]], served  # NVML sees the server on the MIG device
        assert len(served["instances"]) == 1, served
        got = run_py(tree, setup + textwrap.dedent(RESTART), timeout=120)
    finally:
        subprocess.run([sys.executable, "-c", PRELUDE + setup + "daemons.reconcile([])\n", str(tree)],
                       capture_output=True, timeout=60, env=clean_env(), check=False)  # fmt: skip
    assert got["before"] == served["instances"], json.dumps(got)
    assert not got["server_alive"] and not got["daemon_alive"] and got["claims"] == [], json.dumps(got)
    assert got["after"] == [], json.dumps(got)  # before the fix: IN_USE left it
    assert len(got["destroyed"]) == 1, json.dumps(got)
