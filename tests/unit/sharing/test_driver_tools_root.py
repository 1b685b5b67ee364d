"""Time slicing and MPS run the driver root's own tools (issue 19, findings 12-13): found under the root with
PATH empty, run with the root's libraries preloaded (as NVIDIA's DRA driver runs nvidia-smi), and a clear
error naming every path looked in when a tool is missing.  The tools are the driver tree's stand-ins, which
find their libraries by soname only, so they run only when the preload is right.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from testkit.standin import clean_env, driver_tree, lib_dir, run_py

from topodra.sharing import driverbins
from topodra.sharing.mps import MpsDaemons, MpsError
from topodra.sharing.timeslice import NvidiaSmiTimeSlice, TimeSliceError


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return driver_tree(tmp_path_factory.mktemp("bins"), "dgx-h100")


@pytest.fixture
def no_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plugin pod with NVIDIA_VISIBLE_DEVICES=void: no driver tool on PATH, no loader variables."""
    monkeypatch.setenv("PATH", "")
    for k in ("LD_PRELOAD", "LD_LIBRARY_PATH", "TOPODRA_MPS_CONTROL"):
        monkeypatch.delenv(k, raising=False)


def gpu_uuid(tree: Path, index: int) -> str:
    code = f"pynvml.nvmlInit()\nout(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex({index})))"
    return str(run_py(tree, code))


def listed_level(tree: Path, uuid: str) -> str:
    env = clean_env({"LD_PRELOAD": str(lib_dir(tree) / "libnvidia-ml.so.1")})
    r = subprocess.run([str(tree / "usr/bin/nvidia-smi"), "compute-policy", "-i", uuid, "-l"], capture_output=True,
                       text=True, env=env, timeout=30, check=False)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_timeslice_runs_the_roots_nvidia_smi_with_its_nvml_preloaded(tree: Path, no_path: None) -> None:
    uuid = gpu_uuid(tree, 2)
    smi = NvidiaSmiTimeSlice(driver_root=tree)
    argv, env = smi.command(uuid, 3)
    nvml = os.path.realpath(lib_dir(tree) / "libnvidia-ml.so.1")
    assert argv == [str(tree / "usr/bin/nvidia-smi"), "compute-policy", "-i", uuid, "--set-timeslice", "3"]
    assert env["LD_PRELOAD"] == nvml and "LD_LIBRARY_PATH" not in env
    smi.set_timeslice(uuid, 3)
    assert listed_level(tree, uuid) == f"GPU {uuid}: Timeslice: 3"
    assert "LD_PRELOAD" not in os.environ, "only the child gets the preload"


def test_an_existing_preload_is_kept_after_the_drivers(tree: Path, no_path: None,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setenv("LD_PRELOAD", "/opt/other.so")
    _argv, env = NvidiaSmiTimeSlice(driver_root=tree).command("GPU-x", 1)
    assert env["LD_PRELOAD"] == os.path.realpath(lib_dir(tree) / "libnvidia-ml.so.1") + ":/opt/other.so"


def test_mps_daemon_runs_from_the_root_with_libcuda_and_nvml_preloaded(tree: Path, no_path: None,
                                                                       tmp_path: Path) -> None:  # fmt: skip
    daemons = MpsDaemons(tmp_path / "state", driver_root=tree)
    argv, env = daemons.command("c1", {"CUDA_VISIBLE_DEVICES": "GPU-a"})
    assert argv == [str(tree / "usr/bin/nvidia-cuda-mps-control")]
    lib = lib_dir(tree)
    cuda, nvml = (os.path.realpath(lib / n) for n in ("libcuda.so.1", "libnvidia-ml.so.1"))
    assert env["LD_PRELOAD"] == f"{cuda}:{nvml}"
    assert env["PATH"] == str(tree / "usr/bin"), "its servers come from the same driver's directory"
    pipe, logs = daemons.dirs("c1")
    assert (env["CUDA_MPS_PIPE_DIRECTORY"], env["CUDA_MPS_LOG_DIRECTORY"], env["CUDA_VISIBLE_DEVICES"]) == (
        str(pipe), str(logs), "GPU-a")
    daemons.start("c1", [gpu_uuid(tree, 0)])
    pid = daemons.pid("c1")
    assert pid is not None
    assert Path(f"/proc/{pid}/exe").resolve() == (tree / "usr/bin/nvidia-cuda-mps-control").resolve()
    assert daemons.stop("c1") and daemons.pid("c1") is None and not pipe.exists()


def test_mps_binary_env_still_wins(tree: Path, no_path: None, tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    other = tmp_path / "elsewhere" / "nvidia-cuda-mps-control"
    other.parent.mkdir()
    other.write_bytes((tree / "usr/bin/nvidia-cuda-mps-control").read_bytes())
    other.chmod(0o755)
    monkeypatch.setenv("TOPODRA_MPS_CONTROL", str(other))
    argv, env = MpsDaemons(tmp_path / "state", driver_root=tree).command("c")
    assert argv == [str(other)] and "libcuda.so" in env["LD_PRELOAD"]


def test_lookup_order_root_dirs_then_path(tmp_path: Path) -> None:
    root, on_path = tmp_path / "root", tmp_path / "path"
    for p in (root / "usr/sbin/nvidia-smi", root / "bin/nvidia-smi", on_path / "nvidia-smi"):
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("#!/bin/sh\n")
        p.chmod(0o755)
    assert driverbins.find_binary("nvidia-smi", root, str(on_path)) == root / "bin/nvidia-smi"
    (root / "bin/nvidia-smi").chmod(0o644)  # not executable: skipped
    assert driverbins.find_binary("nvidia-smi", root, str(on_path)) == root / "usr/sbin/nvidia-smi"
    assert driverbins.find_binary("nvidia-smi", tmp_path / "empty", str(on_path)) == on_path / "nvidia-smi"
    assert driverbins.find_binary("nvidia-smi", None, str(on_path)) == on_path / "nvidia-smi"


def test_missing_tools_name_every_path_searched(tmp_path: Path, no_path: None) -> None:
    root = tmp_path / "bare"
    root.mkdir()
    with pytest.raises(TimeSliceError) as e:
        NvidiaSmiTimeSlice(driver_root=root).set_timeslice("GPU-x", 1)
    for d in ("usr/bin", "bin", "usr/sbin"):
        assert str(root / d / "nvidia-smi") in str(e.value)
    daemons = MpsDaemons(tmp_path / "state", driver_root=root)
    with pytest.raises(MpsError) as m:
        daemons.start("c1", ["GPU-x"])
    assert str(root / "usr/sbin/nvidia-cuda-mps-control") in str(m.value) and "TOPODRA_MPS_CONTROL" in str(m.value)
    assert daemons.claims() == set(), "a failed start leaves no directories"


def test_a_tool_without_its_library_under_the_root_is_refused(tree: Path, tmp_path: Path, no_path: None) -> None:
    root = tmp_path / "binsonly"
    (root / "usr/bin").mkdir(parents=True)
    (root / "usr/bin/nvidia-smi").write_bytes((tree / "usr/bin/nvidia-smi").read_bytes())
    (root / "usr/bin/nvidia-smi").chmod(0o755)
    with pytest.raises(TimeSliceError, match=r"libnvidia-ml\.so\.1 not found under NVIDIA driver root") as e:
        NvidiaSmiTimeSlice(driver_root=root).set_timeslice("GPU-x", 1)
    assert str(root / "usr/lib64/libnvidia-ml.so.1") in str(e.value)


def test_without_a_driver_root_nothing_is_preloaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Mock and replay hardware: the stand-in from PATH or TOPODRA_MPS_CONTROL, run as before."""
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    argv, env = MpsDaemons(tmp_path / "state", binary="/opt/mps").command("c")
    assert argv == ["/opt/mps"] and "LD_PRELOAD" not in env and env["PATH"] == os.environ["PATH"]


def test_the_plugin_passes_its_driver_root_to_time_slicing_and_mps(tree: Path, tmp_path: Path,
                                                                   no_path: None) -> None:  # fmt: skip
    """``--nvidia-driver-root`` reaches both tools on real hardware; mock hardware keeps its stand-ins."""
    import argparse

    from topodra import effects
    from topodra.effects.mps import MpsEffect
    from topodra.hardware import load_backend
    from topodra.plugin import config
    from topodra.plugin.main import driver_root
    from topodra.sharing.timeslice import control_for

    parser = argparse.ArgumentParser()
    config.configure(parser)

    def cfg(*argv: str) -> config.PluginConfig:
        return config.from_args(parser.parse_args(["--node-name", "n", "--plugin-dir", str(tmp_path), *argv]), {})

    real = cfg("--hardware", "nvml", "--nvidia-driver-root", str(tree))
    assert driver_root(real) == tree and driver_root(cfg("--hardware", "mock:dgx-h100")) is None
    smi = control_for(object(), driver_root=driver_root(real))
    assert isinstance(smi, NvidiaSmiTimeSlice) and smi.command("GPU-x", 1)[0][0] == str(tree / "usr/bin/nvidia-smi")
    mps = [e for e in effects.standard(tmp_path, driver_root=driver_root(real)) if isinstance(e, MpsEffect)]
    assert mps[0].daemons.command("c")[0] == [str(tree / "usr/bin/nvidia-cuda-mps-control")]
    nvml = load_backend("mock:dgx-h100", "n").nvml  # mock hardware answers time slicing itself
    assert control_for(nvml, driver_root=None) is nvml
