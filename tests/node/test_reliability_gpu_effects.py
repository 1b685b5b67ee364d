"""The GPU-effect crash campaign (bench/reliability/gpueffects.py) at a reduced size: one pass over every crash
point on each of its three nodes (MIG; whole GPUs time-sliced or with MPS; memory shares plain, time-sliced or
with MPS), through the C NVML stand-in and its MPS and nvidia-smi binaries.  MPS mounts a tmpfs per claim and
runs its daemon in a mount namespace of its own, so it needs root: the node tier (the suite runs as root, as
the plugin does).  Full size: ``bench/run reliability --only gpu-effects`` (docs/reliability.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from bench.paths import REPO
from bench.reliability import gpueffects


def test_every_effect_at_every_crash_point_leaks_and_loses_nothing(tmp_path: Path) -> None:
    out = gpueffects.run(1, seed=11, root=tmp_path, timeout=300)
    assert out["lost"] == []
    assert out["runs"] == sum(len(gpueffects.points(k)) for k in gpueffects.NODES)
    cells = {(c["effect"], c["point"]): c for c in out["cells"]}
    for effect in gpueffects.EFFECTS:
        nodes = [k for k, kinds in gpueffects.KINDS.items() if any(effect in gpueffects.effects_of_kind(x)
                                                                    for x in kinds)]
        for point in {p for k in nodes for p in gpueffects.points(k)}:
            cell = cells.get((effect, point))
            assert cell is not None, f"{effect} never in flight at {point}: {sorted(cells)}"
            if point != "sigkill-after-random-delay":  # the kill may come after the run finished
                assert cell["died"] >= 1, (effect, point, cell)
    by_node = {n["node"]: n for n in out["nodes"]}
    assert by_node["mig"]["checked"]["mig"] > 0 and by_node["mig"]["checked"]["mps"] > 0
    assert by_node["whole"]["checked"]["timeslice"] > 0 and by_node["shared"]["checked"]["mps"] > 0


MUTANT = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from topodra.effects import timeslice
    timeslice.TimeSliceIntents.gpus = lambda self: set()  # the intent file as if never written
    from bench.reliability import gpueffects
    print(json.dumps(gpueffects.run_node("whole", 1, 5, Path(sys.argv[1]))))
""")


def test_the_campaign_sees_the_time_slice_leak_it_found(tmp_path: Path) -> None:
    """Without the time-slice intent file (the fix of the leak this campaign found), the levels that killed
    prepares and unprepares set stay behind, and the campaign says so."""
    r = subprocess.run([sys.executable, "-c", MUTANT, str(tmp_path)], capture_output=True, text=True, timeout=300,
                       cwd=REPO, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.splitlines()[-1])
    leaks = [x for x in out["lost"] if "leaked timeslice" in x]
    assert leaks, out["lost"]
    assert any(c["effect"] == "timeslice" and c["leaked"] for c in out["cells"])
