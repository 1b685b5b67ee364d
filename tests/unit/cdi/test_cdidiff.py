"""topodra.cdidiff: resolving a container's edits from a spec and diffing two of them."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from topodra.cdidiff import SpecShapeError, diff, resolve

HOOK = "/usr/bin/nvidia-cdi-hook"

# Shaped like `nvidia-ctk cdi generate` output: control nodes, libraries and hooks at spec level.
TOOLKIT: dict[str, Any] = {
    "cdiVersion": "0.5.0",
    "kind": "nvidia.com/gpu",
    "containerEdits": {
        "env": ["NVIDIA_VISIBLE_DEVICES=void"],
        "deviceNodes": [{"path": "/dev/nvidiactl", "hostPath": "/tree/dev/nvidiactl"},
                        {"path": "/dev/nvidia-uvm", "hostPath": "/tree/dev/nvidia-uvm"}],
        "mounts": [{"hostPath": "/tree/usr/lib/x86_64-linux-gnu/libcuda.so.1",
                    "containerPath": "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
                    "options": ["ro", "nosuid", "nodev", "rbind", "rprivate"]}],
        "hooks": [{"hookName": "createContainer", "path": HOOK,
                   "args": ["nvidia-cdi-hook", "update-ldcache", "--folder", "/usr/lib/x86_64-linux-gnu"]}],
    },
    "devices": [
        {"name": "0", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0", "hostPath": "/tree/dev/nvidia0"}]}},
        {"name": "1", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia1", "hostPath": "/tree/dev/nvidia1"}]}},
    ],
}


def ours_like(spec: dict[str, Any]) -> dict[str, Any]:
    """The same edits under topodra's names: one claim device per GPU."""
    s = copy.deepcopy(spec)
    s["kind"] = "gpu.topodra.io/claim"
    for d in s["devices"]:
        d["name"] = f"uid-gpu-{d['name']}"
    return s


def test_equal_edits_under_other_names_are_the_same() -> None:
    d = diff(resolve(ours_like(TOOLKIT), ["uid-gpu-1"]), resolve(TOOLKIT, ["1"]))
    assert d.same and d.lines() == []


def test_only_the_named_devices_count() -> None:
    e = resolve(TOOLKIT, ["1"])
    assert set(e.device_nodes) == {"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia1"}
    d = diff(resolve(ours_like(TOOLKIT), ["uid-gpu-0", "uid-gpu-1"]), resolve(TOOLKIT, ["1"]))
    assert d.lines() == ["extra device node /dev/nvidia0"]


def test_topodra_spec_without_driver_edits_reports_each_missing_piece() -> None:
    """Finding 2 as the diff shows it: only /dev/nvidiaN plus env."""
    ours = {"cdiVersion": "0.6.0", "kind": "gpu.topodra.io/claim",
            "containerEdits": {"env": ["NVIDIA_VISIBLE_DEVICES=GPU-1"]},
            "devices": [{"name": "g1", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia1"}]}}]}
    d = diff(resolve(ours, ["g1"]), resolve(TOOLKIT, ["1"]))
    assert d.missing == ["device node /dev/nvidia-uvm", "device node /dev/nvidiactl",
                         "mount /usr/lib/x86_64-linux-gnu/libcuda.so.1",
                         "hook createContainer: nvidia-cdi-hook update-ldcache --folder /usr/lib/x86_64-linux-gnu"]
    assert d.differing == ["device node /dev/nvidia1: hostPath '/dev/nvidia1' != '/tree/dev/nvidia1'",
                           "env NVIDIA_VISIBLE_DEVICES: 'GPU-1' != 'void'"]
    assert not d.extra and not d.same


def test_hook_binary_location_does_not_matter_but_its_arguments_do() -> None:
    ours = ours_like(TOOLKIT)
    ours["containerEdits"]["hooks"] = [{"hookName": "createContainer", "path": "/opt/topodra/nvidia-cdi-hook",
                                        "args": ["/opt/topodra/nvidia-cdi-hook", "update-ldcache", "--folder",
                                                 "/usr/lib/x86_64-linux-gnu"]}]
    assert diff(resolve(ours, ["uid-gpu-0"]), resolve(TOOLKIT, ["0"])).same
    ours["containerEdits"]["hooks"][0]["args"][-1] = "/usr/lib64"
    d = diff(resolve(ours, ["uid-gpu-0"]), resolve(TOOLKIT, ["0"]))
    assert d.differing == ["hook createContainer: nvidia-cdi-hook update-ldcache --folder /usr/lib64 != "
                           "nvidia-cdi-hook update-ldcache --folder /usr/lib/x86_64-linux-gnu"]
    assert not d.missing and not d.extra


def test_a_second_copy_of_a_hook_is_extra() -> None:
    ours = ours_like(TOOLKIT)
    ours["devices"][0]["containerEdits"]["hooks"] = copy.deepcopy(TOOLKIT["containerEdits"]["hooks"])
    d = diff(resolve(ours, ["uid-gpu-0"]), resolve(TOOLKIT, ["0"]))
    assert d.extra == ["hook createContainer: nvidia-cdi-hook update-ldcache --folder /usr/lib/x86_64-linux-gnu"]


def test_mount_options_are_a_set_and_host_path_matters() -> None:
    ours = ours_like(TOOLKIT)
    m = ours["containerEdits"]["mounts"][0]
    m["options"] = list(reversed(m["options"]))
    assert diff(resolve(ours, ["uid-gpu-0"]), resolve(TOOLKIT, ["0"])).same
    m["options"] = ["rbind", "rw"]
    m["hostPath"] = "/elsewhere/libcuda.so.1"
    (line,) = diff(resolve(ours, ["uid-gpu-0"]), resolve(TOOLKIT, ["0"])).differing
    assert line.startswith("mount /usr/lib/x86_64-linux-gnu/libcuda.so.1:") and "/elsewhere" in line


def test_node_numbers_differ_only_when_both_state_them() -> None:
    """A MIG caps node with type/major/minor (finding 3) against a toolkit node the runtime would stat."""
    theirs = copy.deepcopy(TOOLKIT)
    theirs["devices"][0]["containerEdits"]["deviceNodes"].append({"path": "/dev/nvidia-caps/nvidia-cap12"})
    ours = ours_like(theirs)
    ours["devices"][0]["containerEdits"]["deviceNodes"][1].update(type="c", major=511, minor=12)
    d = diff(resolve(ours, ["uid-gpu-0"]), resolve(theirs, ["0"]))
    assert d.same
    assert "device node /dev/nvidia-caps/nvidia-cap12: major unstated in theirs" in d.unstated_nodes
    theirs["devices"][0]["containerEdits"]["deviceNodes"][1].update(type="c", major=510, minor=12)
    d = diff(resolve(ours, ["uid-gpu-0"]), resolve(theirs, ["0"]))
    assert d.differing == ["device node /dev/nvidia-caps/nvidia-cap12: major 511 != 510"]


def test_ignored_env_is_left_out() -> None:
    ours = ours_like(TOOLKIT)
    ours["containerEdits"]["env"] = ["NVIDIA_VISIBLE_DEVICES=void", "TOPODRA_VISIBLE_DEVICES=gpu-0"]
    assert diff(resolve(ours, ["uid-gpu-0"]), resolve(TOOLKIT, ["0"])).extra == ["env TOPODRA_VISIBLE_DEVICES"]
    assert diff(resolve(ours, ["uid-gpu-0"]), resolve(TOOLKIT, ["0"]),
                ignore_env=["TOPODRA_VISIBLE_DEVICES"]).same


def test_device_edits_win_over_spec_edits_for_the_same_env() -> None:
    ours = ours_like(TOOLKIT)
    ours["devices"][0]["containerEdits"]["env"] = ["NVIDIA_VISIBLE_DEVICES=GPU-0"]
    assert resolve(ours, ["uid-gpu-0"]).env["NVIDIA_VISIBLE_DEVICES"] == "GPU-0"


@pytest.mark.parametrize(("spec", "names", "message"), [
    ({"kind": "x"}, [], "no devices list"),
    (TOOLKIT, ["7"], "has no device ['7']"),
    ({"devices": [{"containerEdits": {}}]}, [], "without a name"),
    ({"devices": [{"name": "a", "containerEdits": {"deviceNodes": {"path": "/dev/x"}}}]}, ["a"],
     "deviceNodes must be a list"),
    ({"devices": [{"name": "a", "containerEdits": {"mounts": [{"hostPath": "/x"}]}}]}, ["a"], "containerPath"),
    ({"devices": [{"name": "a", "containerEdits": {"hooks": [{"path": "/x"}]}}]}, ["a"], "hookName"),
    ({"devices": [{"name": "a", "containerEdits": {"env": [3]}}]}, ["a"], "NAME=VALUE"),
    ({"devices": [], "containerEdits": ["env"]}, [], "must be an object"),
])
def test_malformed_specs_fail_clearly(spec: dict[str, Any], names: list[str], message: str) -> None:
    with pytest.raises(SpecShapeError, match=None) as e:
        resolve(spec, names)
    assert message in str(e.value)
