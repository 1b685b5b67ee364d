"""The real pynvml binding against the C NVML stand-in, loaded from a driver tree by absolute path.

These pin the NVML semantics that topodra's Python FakeNvml gets wrong (issue 19, docs/real-node.md): each
assertion is what nvml.h (NVIDIA/go-nvml pkg/nvml/nvml.h, quoted where a rule rests on it) documents, or,
where the header is silent, what real GPUs answer (`nvidia-smi` transcripts) or NVIDIA's own code does; never
a value the stand-in or a mock profile chose.  A failure here means the stand-in or the loader is wrong, never
that a fake should be changed to agree with topodra.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from testkit.standin import clean_env, driver_tree, lib_dir, run_py, write_faults

from topodra.hardware.base import DiscoveryError
from topodra.hardware.nvmllib import LIBRARY_DIRS, find_library


@pytest.fixture(scope="module")
def h100(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return driver_tree(tmp_path_factory.mktemp("h100"), "dgx-h100")


def test_tree_layout_is_a_driver_root(h100: Path) -> None:
    lib = lib_dir(h100)
    assert os.readlink(lib / "libnvidia-ml.so.1") == "libnvidia-ml.so.580.126.20"
    assert os.readlink(lib / "libcuda.so.1") == "libcuda.so.580.126.20"
    for tool in ("nvidia-smi", "nvidia-cuda-mps-control", "nvidia-cuda-mps-server"):
        assert os.access(h100 / "usr/bin" / tool, os.X_OK)
    devices = (h100 / "proc/devices").read_text().splitlines()
    assert "195 nvidia-frontend" in devices and "510 nvidia-uvm" in devices and "511 nvidia-caps" in devices
    cfg = json.loads((lib / "nvml-standin.json").read_text())
    assert len(cfg["gpus"]) == 8 and cfg["driverVersion"] == "580.126.20"
    assert not (h100 / "dev/nvidia0").exists()  # --no-dev-nodes


def test_driver_tree_refuses_bad_input_and_changes_nothing(tmp_path: Path) -> None:
    import subprocess

    from testkit.standin import DRIVER_TREE

    r = subprocess.run([str(DRIVER_TREE), "--profile", "no-such-profile", str(tmp_path / "t"), "--no-dev-nodes"],
                       capture_output=True, text=True, check=False)  # fmt: skip
    assert r.returncode != 0 and "unknown mock profile 'no-such-profile'" in r.stderr
    assert not (tmp_path / "t").exists()
    r = subprocess.run([str(DRIVER_TREE), str(tmp_path / "t")], capture_output=True, text=True, check=False)
    assert r.returncode == 2 and "usage" in r.stderr


def test_find_library_searches_the_driver_root_only(tmp_path: Path) -> None:
    with pytest.raises(DiscoveryError) as e:
        find_library(tmp_path)
    for d in LIBRARY_DIRS:  # the message names every place looked
        assert str(tmp_path / d / "libnvidia-ml.so.1") in str(e.value)
    with pytest.raises(DiscoveryError, match="is not a directory"):
        find_library(tmp_path / "missing")
    real = tmp_path / "usr/lib/aarch64-linux-gnu/libnvidia-ml.so.570.1"
    real.parent.mkdir(parents=True)
    real.write_bytes(b"")
    (real.parent / "libnvidia-ml.so.1").symlink_to(real.name)
    assert find_library(tmp_path) == real  # the soname link resolved to the versioned file


def test_pynvml_binds_to_the_library_loaded_by_absolute_path(h100: Path) -> None:
    got = run_py(h100, """
        import os
        maps = open("/proc/self/maps").read()
        again = ctypes.CDLL("libnvidia-ml.so.1")  # pynvml's own lookup, by soname
        pynvml.nvmlInit()
        out({"lib": str(LIB), "mapped": str(LIB) in maps, "same": again._handle == pynvml.nvmlLib._handle,
             "ld_path": os.environ.get("LD_LIBRARY_PATH"), "count": pynvml.nvmlDeviceGetCount(),
             "driver": pynvml.nvmlSystemGetDriverVersion(), "cuda": pynvml.nvmlSystemGetCudaDriverVersion_v2()})
    """)
    assert got == {"lib": str(lib_dir(h100) / "libnvidia-ml.so.580.126.20"), "mapped": True, "same": True,
                   "ld_path": None, "count": 8, "driver": "580.126.20", "cuda": 13000}  # fmt: skip


def test_plain_soname_lookup_without_the_loader_fails(h100: Path) -> None:
    """Without the absolute-path load the library is not found: nothing else (LD_LIBRARY_PATH) puts it there."""
    import subprocess
    import sys

    code = "import pynvml\ntry:\n    pynvml.nvmlInit()\nexcept pynvml.NVMLError_LibraryNotFound:\n    print('absent')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean_env(), check=False)
    assert r.stdout.strip() == "absent", r.stderr


@pytest.mark.parametrize(("profile", "enum"), [("dgx-a100-80gb", 5), ("dgx-h100", 6), ("hgx-b200", 7)])
def test_nvlink_version_is_the_nvml_enum(tmp_path: Path, profile: str, enum: int) -> None:
    """nvmlDeviceGetNvLinkVersion answers nvmlNvlinkVersion_t: 3_1 = 5 (A100), 4_0 = 6 (H100), 5_0 = 7 (B200)."""
    tree = driver_tree(tmp_path, profile)
    got = run_py(tree, """
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        out([pynvml.nvmlDeviceGetNvLinkVersion(h, 0), pynvml.NVML_NVLINK_VERSION_3_1, pynvml.NVML_NVLINK_VERSION_4_0,
             pynvml.NVML_NVLINK_VERSION_5_0])
    """)
    assert got == [enum, 5, 6, 7]


def test_mig_calls_are_not_supported_with_mig_off(h100: Path) -> None:
    got = run_py(h100, """
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        out({"mode": pynvml.nvmlDeviceGetMigMode(h),
             "profile": err(pynvml.nvmlDeviceGetGpuInstanceProfileInfo, h, 0),
             "gi": err(pynvml.nvmlDeviceGetGpuInstanceById, h, 0),
             "mig": err(pynvml.nvmlDeviceGetMigDeviceHandleByIndex, h, 0),
             "max": pynvml.nvmlDeviceGetMaxMigDeviceCount(h)})
    """)
    assert got == {"mode": [0, 0], "profile": "NotSupported", "gi": "NotSupported", "mig": "NotSupported", "max": 0}


def test_max_mig_device_count_is_zero_without_mig_support(tmp_path: Path) -> None:
    """nvml.h: "Returns zero if MIG is not supported or enabled" (no NOT_SUPPORTED for this call)."""
    tree = driver_tree(tmp_path, "l40s")
    got = run_py(tree, """
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        out([err(pynvml.nvmlDeviceGetMigMode, h), pynvml.nvmlDeviceGetMaxMigDeviceCount(h)])
    """)
    assert got == ["NotSupported", 0]


def test_lost_gpu_fails_per_device_calls_and_event_waits_at_once(tmp_path: Path) -> None:
    tree = driver_tree(tmp_path, "dgx-h100")
    got = run_py(tree, """
        pynvml.nvmlInit()
        h0, h1 = pynvml.nvmlDeviceGetHandleByIndex(0), pynvml.nvmlDeviceGetHandleByIndex(1)
        es = pynvml.nvmlEventSetCreate()
        pynvml.nvmlDeviceRegisterEvents(h1, pynvml.nvmlEventTypeXidCriticalError, es)
        with open(sys.argv[1] + "/usr/lib/x86_64-linux-gnu/nvml-standin-faults.json.tmp", "w") as f:
            json.dump({"gpus": {"1": {"lost": True}}}, f)
        import os
        os.replace(f.name, f.name.removesuffix(".tmp"))
        t0 = time.monotonic()
        wait = err(pynvml.nvmlEventSetWait_v2, es, 5000)
        elapsed = time.monotonic() - t0
        out({"wait": wait, "fast": elapsed < 1.0, "count": pynvml.nvmlDeviceGetCount(),
             "uuid": err(pynvml.nvmlDeviceGetUUID, h1), "by_index": err(pynvml.nvmlDeviceGetHandleByIndex, 1),
             "pci": err(pynvml.nvmlDeviceGetPciInfo, h1), "other": err(pynvml.nvmlDeviceGetUUID, h0)})
    """)
    assert got == {"wait": "GpuIsLost", "fast": True, "count": 8, "uuid": "GpuIsLost", "by_index": "GpuIsLost",
                   "pci": "GpuIsLost", "other": "ok"}  # fmt: skip


def test_events_carry_gi_and_ci_ids_and_arrive_once(tmp_path: Path) -> None:
    tree = driver_tree(tmp_path, "dgx-a100-80gb-mig")
    write_faults(tree, {"events": [{"gpu": 0, "type": "xid", "data": 13}]})  # before the set: never delivered
    got = run_py(tree, """
        import os
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(2)
        es = pynvml.nvmlEventSetCreate()
        pynvml.nvmlDeviceRegisterEvents(h, XID | DBE, es)
        uuid = pynvml.nvmlDeviceGetUUID(h)
        path = sys.argv[1] + "/usr/lib/x86_64-linux-gnu/nvml-standin-faults.json"
        with open(path + ".tmp", "w") as f:
            json.dump({"events": [{"gpu": 0, "type": "xid", "data": 13}, {"gpu": 0, "type": "xid", "data": 48},
                                  {"gpu": uuid, "type": "xid", "data": 79},
                                  {"gpu": 2, "type": "xid", "data": 94, "gpuInstanceId": 3, "computeInstanceId": 0},
                                  {"gpu": 2, "type": "sbe"}, {"gpu": 2, "type": "dbe"}]}, f)
        os.replace(path + ".tmp", path)
        evs = []
        for _ in range(3):
            e = pynvml.nvmlEventSetWait_v2(es, 2000)
            evs.append([pynvml.nvmlDeviceGetUUID(e.device) == uuid, e.eventType, e.eventData, e.gpuInstanceId,
                        e.computeInstanceId])
        out({"events": evs, "then": err(pynvml.nvmlEventSetWait_v2, es, 100)})
    """)
    whole = 0xFFFFFFFF
    assert got == {"events": [[True, 8, 79, whole, whole], [True, 8, 94, 3, 0], [True, 2, 0, whole, whole]],
                   "then": "Timeout"}  # fmt: skip


def test_event_instance_ids_need_mig_enabled(tmp_path: Path) -> None:
    """nvml.h: GI/CI ids are valid only for an XID attributable to an instance while MIG is on, else 0xFFFFFFFF."""
    tree = driver_tree(tmp_path, "dgx-h100")
    got = run_py(tree, """
        import os
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        es = pynvml.nvmlEventSetCreate()
        pynvml.nvmlDeviceRegisterEvents(h, XID, es)
        path = sys.argv[1] + "/usr/lib/x86_64-linux-gnu/nvml-standin-faults.json"
        with open(path + ".tmp", "w") as f:
            ev = {"gpu": 0, "type": "xid", "data": 43, "gpuInstanceId": 3, "computeInstanceId": 0}
            json.dump({"events": [ev]}, f)
        os.replace(path + ".tmp", path)
        e = pynvml.nvmlEventSetWait_v2(es, 2000)
        out([e.eventData, e.gpuInstanceId, e.computeInstanceId])
    """)
    assert got == [43, 0xFFFFFFFF, 0xFFFFFFFF]


def test_recovery_action_field_follows_the_faults_file(tmp_path: Path) -> None:
    tree = driver_tree(tmp_path, "dgx-h100")
    write_faults(tree, {"gpus": {"3": {"recoveryAction": 1}}})
    got = run_py(tree, """
        pynvml.nvmlInit()
        fid = pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
        def action(i):
            v = pynvml.nvmlDeviceGetFieldValues(pynvml.nvmlDeviceGetHandleByIndex(i), [fid, 999999])
            return [fid, v[0].nvmlReturn, v[0].valueType, v[0].value.uiVal, v[1].nvmlReturn]
        out({"lost": action(3), "fine": action(0)})
    """)
    assert got == {"lost": [230, 0, 1, 1, 3], "fine": [230, 0, 1, 0, 3]}


def test_polled_faults_links_and_clock_reasons(tmp_path: Path) -> None:
    tree = driver_tree(tmp_path, "dgx-h100")
    write_faults(tree, {"gpus": {"0": {"nvlinksDown": [2], "clocksEventReasons": 0x40}}})
    got = run_py(tree, """
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        out([pynvml.nvmlDeviceGetNvLinkState(h, 1), pynvml.nvmlDeviceGetNvLinkState(h, 2),
             pynvml.nvmlDeviceGetCurrentClocksEventReasons(h), err(pynvml.nvmlDeviceGetNvLinkState, h, 18)])
    """)
    assert got == [1, 0, 0x40, "InvalidArgument"]


def test_mig_instances_ids_profiles_and_errors(tmp_path: Path) -> None:
    """Ids are real GPUs': GPU-instance ids as `nvidia-smi mig -lgi` prints them on A100/H100 (3g at 4:4 is GI 1,
    1g at 3:1 is GI 14), and a compute-instance profile's id equals its NVML_COMPUTE_INSTANCE_PROFILE_* index
    (`nvidia-smi mig -cgi 9 -C`: "using profile MIG 3g.20gb (ID  2)"; NVIDIA/go-nvml pkg/nvml/mock/gpus/a100.go)."""
    tree = driver_tree(tmp_path, "dgx-a100-80gb-mig")
    got = run_py(tree, """
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        r = {}
        info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(h, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
        r["profile"] = [info.id, info.name, info.sliceCount, info.memorySizeMB]
        arr = (pynvml.c_nvmlGpuInstancePlacement_t * 16)()
        n = ctypes.c_uint(16)
        pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(h, info.id, arr, ctypes.byref(n))
        r["placements"] = [[arr[i].start, arr[i].size] for i in range(n.value)]
        # nvml.h: callers probe profile indices from 0 until INVALID_ARGUMENT; unoffered ones are NOT_SUPPORTED.
        r["probe"] = [err(pynvml.nvmlDeviceGetGpuInstanceProfileInfo, h, i) for i in (5, 0x11, 0x12)]
        def create(pid, start, size):
            return pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, pid, place(start, size))
        gi = create(19, 3, 1)
        r["gi_id"] = pynvml.nvmlGpuInstanceGetInfo(gi).id
        r["overlap"] = err(create, 14, 2, 2)
        r["bad_placement"] = err(create, 19, 3, 2)
        r["bad_profile"] = err(create, 77, 0, 1)
        big = create(9, 4, 4)  # 3g.40gb in the upper half
        r["big_id"] = pynvml.nvmlGpuInstanceGetInfo(big).id
        ci_info = pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, CI_1,
                                                                      pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
        r["ci_profile"] = [ci_info.id, ci_info.sliceCount]
        ci = pynvml.nvmlGpuInstanceCreateComputeInstance(gi, ci_info.id)
        c = pynvml.nvmlComputeInstanceGetInfo(ci)
        r["ci"] = [c.id, c.profileId, pynvml.nvmlGpuInstanceGetInfo(c.gpuInstance).id]
        r["ci_too_big"] = err(pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo, gi, CI_2, 0)
        m = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
        r["mig"] = [pynvml.nvmlDeviceGetUUID(m).startswith("MIG-"), pynvml.nvmlDeviceGetGpuInstanceId(m),
                    pynvml.nvmlDeviceGetComputeInstanceId(m), pynvml.nvmlDeviceGetMemoryInfo(m).total >> 20,
                    pynvml.nvmlDeviceGetName(m), pynvml.nvmlDeviceGetMaxMigDeviceCount(h)]
        r["second_mig"] = err(pynvml.nvmlDeviceGetMigDeviceHandleByIndex, h, 1)
        # nvml.h, nvmlGpuInstanceDestroy: "NVML_ERROR_IN_USE If the GPU instance is in use. This error would be
        # returned if processes (e.g. CUDA application) or compute instances are active on the GPU instance."
        r["in_use"] = err(pynvml.nvmlGpuInstanceDestroy, gi)
        pynvml.nvmlComputeInstanceDestroy(ci)
        pynvml.nvmlGpuInstanceDestroy(gi)
        r["gone"] = err(pynvml.nvmlDeviceGetGpuInstanceById, h, 14)
        r["kept"] = pynvml.nvmlGpuInstanceGetInfo(pynvml.nvmlDeviceGetGpuInstanceById(h, 1)).profileId
        full = pynvml.nvmlDeviceGetHandleByIndex(1)
        r["whole_gpu_gi"] = pynvml.nvmlGpuInstanceGetInfo(
            pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(full, 0, place(0, 8))).id
        out(r)
    """)
    assert got == {
        "profile": [19, "MIG 1g.10gb", 1, 9728],
        "placements": [[i, 1] for i in range(7)],
        "probe": ["NotSupported", "NotSupported", "InvalidArgument"],
        "gi_id": 14,  # `nvidia-smi mig -lgi` on H100: 1g.10gb at 3:1 is GPU instance 14
        "overlap": "InsufficientResources",
        "bad_placement": "InvalidArgument",
        "bad_profile": "InvalidArgument",
        "big_id": 1,  # the MIG user guide's A100 example: 3g.20gb at 4:4 is GPU instance 1 (and at 0:4 is 2)
        "ci_profile": [0, 1],  # id == NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE (0), as on A100/H100
        "ci": [0, 0, 14],
        "ci_too_big": "NotSupported",
        "mig": [True, 14, 0, 9728, "NVIDIA A100-SXM4-80GB MIG 1g.10gb", 7],
        "second_mig": "NotFound",
        "in_use": "InUse",
        "gone": "NotFound",
        "kept": 9,
        "whole_gpu_gi": 0,
    }


def test_gpu_instance_ids_are_the_ones_real_gpus_give_each_placement(tmp_path: Path) -> None:
    """`nvidia-smi mig -lgi` on an H100 with seven 1g.10gb instances: placements 4:1, 5:1, 6:1 are GI 7, 8, 9 and
    0:1 .. 3:1 are GI 11 .. 14; on an A100 (MIG user guide) 3g.20gb at 0:4 is GI 2 and at 4:4 GI 1; the whole
    GPU (7g, 0:8) is GI 0."""
    tree = driver_tree(tmp_path, "dgx-h100-mig")
    got = run_py(tree, """
        pynvml.nvmlInit()
        def ids(i, pid, starts, size):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            return [pynvml.nvmlGpuInstanceGetInfo(
                pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, pid, place(s, size))).id for s in starts]
        out({"1g": ids(0, 19, range(7), 1), "3g": ids(1, 9, (0, 4), 4), "7g": ids(2, 0, (0,), 8)})
    """)
    assert got == {"1g": [11, 12, 13, 14, 7, 8, 9], "3g": [2, 1], "7g": [0]}


def test_mig_instances_outlive_the_process_that_made_them(tmp_path: Path) -> None:
    tree = driver_tree(tmp_path, "dgx-h100-mig")
    made = run_py(tree, """
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(5)
        gi = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, 19, place(6, 1))
        out(pynvml.nvmlGpuInstanceGetInfo(gi).id)
    """)
    seen = run_py(tree, """
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(5)
        gi = pynvml.nvmlDeviceGetGpuInstanceById(h, 9)
        i = pynvml.nvmlGpuInstanceGetInfo(gi)
        out([i.profileId, i.placement.start, i.placement.size])
    """)
    assert made == 9 and seen == [19, 6, 1]  # 1g at 6:1 is GI 9 on H100 (`nvidia-smi mig -lgi`)
    # The tree builder starts a fresh tree without instances.
    driver_tree(tmp_path, "dgx-h100-mig")
    assert not (lib_dir(tree) / "nvml-standin.state").exists()


def test_a_changed_faults_file_is_reread_and_a_bad_one_keeps_the_last(tmp_path: Path) -> None:
    tree = driver_tree(tmp_path, "l4")
    got = run_py(tree, """
        import os
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        path = sys.argv[1] + "/usr/lib/x86_64-linux-gnu/nvml-standin-faults.json"
        def put(text):
            with open(path + ".tmp", "w") as f:
                f.write(text)
            os.replace(path + ".tmp", path)
        r = [err(pynvml.nvmlDeviceGetUUID, h)]
        put('{"gpus": {"0": {"lost": true}}}')
        r.append(err(pynvml.nvmlDeviceGetUUID, h))
        put('{"gpus": ')  # broken: the previous faults stay
        r.append(err(pynvml.nvmlDeviceGetUUID, h))
        os.unlink(path)
        r.append(err(pynvml.nvmlDeviceGetUUID, h))
        out(r)
    """)
    assert got == ["ok", "GpuIsLost", "GpuIsLost", "ok"]


def test_calls_before_init_are_uninitialized(h100: Path) -> None:
    got = run_py(h100, """
        r = [err(pynvml.nvmlDeviceGetCount)]
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        r.append(err(pynvml.nvmlDeviceGetHandleByIndex, 0))
        out(r)
    """)
    assert got == ["Uninitialized", "Uninitialized"]


def test_wait_times_out_after_the_timeout_when_nothing_happens(h100: Path) -> None:
    got = run_py(h100, """
        pynvml.nvmlInit()
        es = pynvml.nvmlEventSetCreate()
        pynvml.nvmlDeviceRegisterEvents(pynvml.nvmlDeviceGetHandleByIndex(0), pynvml.nvmlEventTypeXidCriticalError, es)
        t0 = time.monotonic()
        e = err(pynvml.nvmlEventSetWait_v2, es, 300)
        out([e, time.monotonic() - t0])
    """)
    assert got[0] == "Timeout" and 0.28 <= got[1] < 3.0


def test_stand_in_without_config_fails_init_cleanly(tmp_path: Path) -> None:
    tree = driver_tree(tmp_path, "l4")
    (lib_dir(tree) / "nvml-standin.json").unlink()
    got = run_py(tree, """
        out(err(pynvml.nvmlInit))
    """)
    assert got == "DriverNotLoaded"


def test_versioned_structs_are_checked_by_the_whole_version_word(tmp_path: Path) -> None:
    """nvml.h: "#define NVML_STRUCT_VERSION(data, ver) (unsigned int)(sizeof(nvml ## data ## _v ## ver ## _t) |
    (ver << 24U))": the version word carries the struct's size, so the right version byte with another size is
    refused, with the error the call documents: "NVML_ERROR_INVALID_ARGUMENT  If device, profile, info, or
    info->version are invalid" (the profile-info V calls), "... plist->version is invalid" (the process detail
    list), and NVML_ERROR_ARGUMENT_VERSION_MISMATCH, "The provided version is invalid/unsupported", where the
    call lists none (memory _v2, fabric V).  The good words are pynvml's constants, i.e. nvml.h's sizes."""
    tree = driver_tree(tmp_path, "dgx-h100-mig")
    got = run_py(tree, """
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        fn = pynvml._nvmlGetFunctionPointer
        def call(name, struct, word, *args):
            s = struct()
            s.version = word
            rc = fn(name)(*args, ctypes.byref(s))
            return "Success" if rc == 0 else type(pynvml.NVMLError(rc)).__name__.removeprefix("NVMLError_")
        gi = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, 19, place(0, 1))
        class Fabric(ctypes.Structure):  # nvmlGpuFabricInfo_v3_t: v2 plus healthSummary
            _fields_ = [("version", ctypes.c_uint), ("clusterUuid", ctypes.c_ubyte * 16), ("status", ctypes.c_uint),
                        ("cliqueId", ctypes.c_uint), ("state", ctypes.c_uint), ("healthMask", ctypes.c_uint),
                        ("healthSummary", ctypes.c_ubyte)]
        def versions(name, struct, good, *args):
            v, size = good >> 24, good & 0xFFFFFF
            return [call(name, struct, w, *args) for w in (good, v << 24 | (size - 4), v << 24 | (size + 8), v << 24)]
        gip, cip = pynvml.c_nvmlGpuInstanceProfileInfo_v2_t, pynvml.c_nvmlComputeInstanceProfileInfo_v2_t
        class Detail(ctypes.Structure):
            _fields_ = pynvml.c_nvmlProcessDetailList_v1_t._fields_
        out({"memory": versions("nvmlDeviceGetMemoryInfo_v2", pynvml.c_nvmlMemory_v2_t, pynvml.nvmlMemory_v2, h),
             "gi_profile": versions("nvmlDeviceGetGpuInstanceProfileInfoV", gip, pynvml.nvmlGpuInstanceProfileInfo_v2,
                                    h, 0),
             "ci_profile": versions("nvmlGpuInstanceGetComputeInstanceProfileInfoV", cip,
                                    pynvml.nvmlComputeInstanceProfileInfo_v2, gi, 0, 0),
             "fabric_v2": versions("nvmlDeviceGetGpuFabricInfoV", Fabric, 0x02000024, h),
             "fabric_v3": call("nvmlDeviceGetGpuFabricInfoV", Fabric, 0x03000028, h),
             "details": versions("nvmlDeviceGetRunningProcessDetailList", Detail, pynvml.nvmlProcessDetailList_v1, h),
             "words": [pynvml.nvmlMemory_v2, pynvml.nvmlGpuInstanceProfileInfo_v2,
                       pynvml.nvmlComputeInstanceProfileInfo_v2, pynvml.nvmlProcessDetailList_v1]})
    """)
    bad_arg, mismatch = ["Success"] + ["InvalidArgument"] * 3, ["Success"] + ["ArgumentVersionMismatch"] * 3
    assert got == {"memory": mismatch, "gi_profile": bad_arg, "ci_profile": bad_arg, "fabric_v2": mismatch,
                   "fabric_v3": "Success", "details": bad_arg,
                   "words": [0x02000028, 0x02000098, 0x02000088, 0x01000018]}  # fmt: skip


def test_placements_are_answered_whatever_the_mig_mode(tmp_path: Path) -> None:
    """nvml.h, nvmlDeviceGetGpuInstancePossiblePlacements_v2: "This API only returns all the possible placements
    for the given profile regardless of whether MIG is enabled or not." and "NVML_ERROR_NOT_SUPPORTED If device
    doesn't support MIG or profileId isn't supported"; the profile-info call still wants MIG on ("If device
    doesn't support MIG or profile isn't supported", and the V call "doesn't have MIG mode enabled")."""
    got = {}
    for profile in ("dgx-h100", "l40s"):
        tree = driver_tree(tmp_path / profile, profile)
        got[profile] = run_py(tree, """
            pynvml.nvmlInit()
            h = pynvml.nvmlDeviceGetHandleByIndex(0)
            arr = (pynvml.c_nvmlGpuInstancePlacement_t * 16)()
            n = ctypes.c_uint(16)
            r = err(pynvml.nvmlDeviceGetGpuInstancePossiblePlacements, h, 9, arr, ctypes.byref(n))
            out({"mode": err(pynvml.nvmlDeviceGetMigMode, h), "placements": r,
                 "got": [[arr[i].start, arr[i].size] for i in range(n.value)] if r == "ok" else None,
                 "info": err(pynvml.nvmlDeviceGetGpuInstanceProfileInfo, h, 2),
                 "create": err(pynvml.nvmlDeviceCreateGpuInstanceWithPlacement, h, 9, place(0, 4))})
        """)
    assert got == {
        "dgx-h100": {"mode": "ok", "placements": "ok", "got": [[0, 4], [4, 4]], "info": "NotSupported",
                     "create": "NotSupported"},
        "l40s": {"mode": "NotSupported", "placements": "NotSupported", "got": None, "info": "NotSupported",
                 "create": "NotSupported"},
    }


def test_mig_changes_and_placements_need_a_privileged_user(tmp_path: Path) -> None:
    """nvml.h marks the MIG create, destroy, placement and capacity calls "Requires privileged user." with
    "NVML_ERROR_NO_PERMISSION If user doesn't have permission to perform the operation".  An unprivileged
    caller (not root and, as the driver makes it, unable to read the MIG config capability) is refused, and
    nothing changes; root is served."""
    tree = driver_tree(tmp_path, "dgx-a100-80gb-mig")
    config = tree / "proc/driver/nvidia/capabilities/mig/config"
    assert oct(config.stat().st_mode & 0o777) == "0o400"  # the driver's mode for it
    got = run_py(tree, """
        import os
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        gi = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, 19, place(0, 1))
        ci = pynvml.nvmlGpuInstanceCreateComputeInstance(gi, 0)
        gi2 = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, 19, place(1, 1))
        config = sys.argv[1] + "/proc/driver/nvidia/capabilities/mig/config"
        if os.geteuid() == 0:
            os.seteuid(65534)  # root reads any file: drop root instead
        else:
            os.chmod(config, 0)
        arr = (pynvml.c_nvmlGpuInstancePlacement_t * 16)()
        n = ctypes.c_uint(16)
        r = {"placements": err(pynvml.nvmlDeviceGetGpuInstancePossiblePlacements, h, 19, arr, ctypes.byref(n)),
             "capacity": err(pynvml.nvmlDeviceGetGpuInstanceRemainingCapacity, h, 19),
             "create_gi": err(pynvml.nvmlDeviceCreateGpuInstanceWithPlacement, h, 19, place(2, 1)),
             "create_any": err(pynvml.nvmlDeviceCreateGpuInstance, h, 19),
             "create_ci": err(pynvml.nvmlGpuInstanceCreateComputeInstance, gi2, 0),
             "destroy_ci": err(pynvml.nvmlComputeInstanceDestroy, ci),
             "destroy_gi": err(pynvml.nvmlGpuInstanceDestroy, gi2)}
        if os.getuid() == 0:
            os.seteuid(0)
        else:
            os.chmod(config, 0o400)
        r["after"] = sorted(pynvml.nvmlGpuInstanceGetInfo(pynvml.nvmlDeviceGetGpuInstanceById(h, i)).id
                            for i in (11, 12))
        r["ci_kept"] = pynvml.nvmlComputeInstanceGetInfo(ci).id
        r["root_capacity"] = pynvml.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 19)
        pynvml.nvmlComputeInstanceDestroy(ci)
        pynvml.nvmlGpuInstanceDestroy(gi)
        pynvml.nvmlGpuInstanceDestroy(gi2)
        out(r)
    """)
    assert got == {"placements": "NoPermission", "capacity": "NoPermission", "create_gi": "NoPermission",
                   "create_any": "NoPermission", "create_ci": "NoPermission", "destroy_ci": "NoPermission",
                   "destroy_gi": "NoPermission", "after": [11, 12], "ci_kept": 0, "root_capacity": 5}  # fmt: skip


def test_a_user_granted_the_mig_config_capability_is_privileged(tmp_path: Path) -> None:
    """The other half of "Requires privileged user.": a non-root user who can read the MIG config capability
    (an admin granted it) gets the placements.  Run as root, the child drops to nobody with the capability made
    world-readable; run as a user, the tree is theirs and the capability readable by them."""
    import stat
    import tempfile

    tree = driver_tree(tmp_path, "dgx-a100-80gb-mig")
    caps = Path(tempfile.mkdtemp(prefix="topodra-caps-"))  # reachable by nobody, unlike tmp_path
    try:
        caps.chmod(0o755)
        (caps / "mig").mkdir(mode=0o755)
        (caps / "mig/config").write_text("DeviceFileMinor: 1\nDeviceFileMode: 256\nDeviceFileModify: 1\n")
        (caps / "mig/config").chmod(stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
        got = run_py(tree, """
            import os
            pynvml.nvmlInit()
            h = pynvml.nvmlDeviceGetHandleByIndex(0)
            if os.geteuid() == 0:
                os.seteuid(65534)
            arr = (pynvml.c_nvmlGpuInstancePlacement_t * 16)()
            n = ctypes.c_uint(16)
            pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(h, 9, arr, ctypes.byref(n))
            out([os.geteuid() != 0, [[arr[i].start, arr[i].size] for i in range(n.value)]])
        """, env={"TOPODRA_NVML_STANDIN_CAPS": str(caps)})
    finally:
        import shutil

        shutil.rmtree(caps)
    assert got == [True, [[0, 4], [4, 4]]]


def test_mig_device_indices_keep_their_holes_after_a_destroy(tmp_path: Path) -> None:
    """nvml.h, nvmlDeviceGetMigDeviceHandleByIndex: "NVML_ERROR_NOT_FOUND if no valid MIG device was found at
    index"; NVIDIA's walk over them skips such indices up to the max count (NVIDIA/go-nvlib
    pkg/nvlib/device/device.go, VisitMigDevices), because a destroyed MIG device leaves its index empty."""
    tree = driver_tree(tmp_path, "dgx-h100-mig")
    got = run_py(tree, """
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        made = []
        for start in (0, 1, 2):
            gi = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, 19, place(start, 1))
            made.append((gi, pynvml.nvmlGpuInstanceCreateComputeInstance(gi, 0)))
        def walk():
            found = {}
            for i in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(h)):
                try:
                    found[i] = pynvml.nvmlDeviceGetGpuInstanceId(pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, i))
                except pynvml.NVMLError_NotFound:
                    pass
            return found
        r = {"before": walk()}
        pynvml.nvmlComputeInstanceDestroy(made[1][1])
        pynvml.nvmlGpuInstanceDestroy(made[1][0])
        r["hole"] = walk()
        r["at_1"] = err(pynvml.nvmlDeviceGetMigDeviceHandleByIndex, h, 1)
        gi = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, 19, place(5, 1))
        pynvml.nvmlGpuInstanceCreateComputeInstance(gi, 0)
        r["refilled"] = walk()
        r["past_max"] = err(pynvml.nvmlDeviceGetMigDeviceHandleByIndex, h, 7)
        out({k: {str(i): g for i, g in v.items()} if isinstance(v, dict) else v for k, v in r.items()})
    """)
    assert got == {"before": {"0": 11, "1": 12, "2": 13}, "hole": {"0": 11, "2": 13}, "at_1": "NotFound",
                   "refilled": {"0": 11, "1": 8, "2": 13}, "past_max": "InvalidArgument"}  # fmt: skip


def test_a_compute_instance_an_mps_server_runs_on_is_in_use(tmp_path: Path) -> None:
    """nvml.h, nvmlComputeInstanceDestroy: "NVML_ERROR_IN_USE If the compute instance is in use. This error would
    be returned if processes (e.g. CUDA application) are active on the compute instance." (and the GPU instance
    then still has it: "processes ... or compute instances are active").  The MPS server is such a process
    until it exits, however it exits (kill -9 here); NVML lists it among the compute processes meanwhile."""
    tree = driver_tree(tmp_path, "dgx-h100-mig")
    got = run_py(tree, """
        import os, signal, subprocess
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        gi = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, 9, place(0, 4))
        ci = pynvml.nvmlGpuInstanceCreateComputeInstance(gi, 2)
        mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
        uuid = pynvml.nvmlDeviceGetUUID(mig)
        server = subprocess.Popen([sys.argv[1] + "/usr/bin/nvidia-cuda-mps-server"], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, env={"CUDA_VISIBLE_DEVICES": uuid})
        try:
            deadline = time.monotonic() + 20
            procs = []
            while not procs and time.monotonic() < deadline:  # the positive signal: NVML sees it
                procs = pynvml.nvmlDeviceGetComputeRunningProcesses(mig)
                time.sleep(0.02)
            by_uuid = pynvml.nvmlDeviceGetHandleByUUID(uuid)  # nvml.h: "The UUID of the target GPU or MIG instance"
            r = {"listed": [[p.pid == server.pid, p.gpuInstanceId, p.computeInstanceId, p.usedGpuMemory]
                            for p in procs],
                 "by_uuid": [pynvml.nvmlDeviceIsMigDeviceHandle(by_uuid).value,
                             pynvml.nvmlDeviceGetGpuInstanceId(by_uuid),
                             len(pynvml.nvmlDeviceGetComputeRunningProcesses(by_uuid))],
                 "on_parent": [p.pid == server.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)],
                 "destroy_ci": err(pynvml.nvmlComputeInstanceDestroy, ci),
                 "destroy_gi": err(pynvml.nvmlGpuInstanceDestroy, gi)}
        finally:
            server.send_signal(signal.SIGKILL)  # kill -9: its registration must go with it
            server.wait()
        r["after_exit"] = pynvml.nvmlDeviceGetComputeRunningProcesses(mig)
        r["destroy_ci_after"] = err(pynvml.nvmlComputeInstanceDestroy, ci)
        r["destroy_gi_after"] = err(pynvml.nvmlGpuInstanceDestroy, gi)
        out(r)
    """)
    assert got == {"listed": [[True, 2, 0, None]], "by_uuid": [1, 2, 1], "on_parent": [True], "destroy_ci": "InUse",
                   "destroy_gi": "InUse", "after_exit": [], "destroy_ci_after": "ok",
                   "destroy_gi_after": "ok"}  # fmt: skip


def test_instance_lists_take_count_as_output_only(tmp_path: Path) -> None:
    """nvml.h, nvmlDeviceGetGpuInstances: "the buffer must be large enough to accommodate the instances supported
    by the profile" and count is "The count of returned GPU instances" (the same for
    nvmlGpuInstanceGetComputeInstances): nothing on entry is a capacity, so a caller passing 0 with a buffer of
    the profile's instanceCount (go-nvml passes instanceCount, pkg/nvml/device.go GetGpuInstances) gets them all."""
    tree = driver_tree(tmp_path, "dgx-h100-mig")
    got = run_py(tree, """
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(h, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
        gis = [pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, info.id, place(s, 1)) for s in (0, 1)]
        for gi in gis:
            pynvml.nvmlGpuInstanceCreateComputeInstance(gi, 0)
        buf = (pynvml.c_nvmlGpuInstance_t * info.instanceCount)()
        n = ctypes.c_uint(0)
        pynvml.nvmlDeviceGetGpuInstances(h, info.id, buf, ctypes.byref(n))
        r = {"gis": sorted(pynvml.nvmlGpuInstanceGetInfo(buf[i]).id for i in range(n.value))}
        ci_info = pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(gis[0], 0, 0)
        cbuf = (pynvml.c_nvmlComputeInstance_t * ci_info.instanceCount)()
        m = ctypes.c_uint(0)
        pynvml.nvmlGpuInstanceGetComputeInstances(gis[0], ci_info.id, cbuf, ctypes.byref(m))
        r["cis"] = m.value
        out(r)
    """)
    assert got == {"gis": [11, 12], "cis": 1}  # placements 0:1 and 1:1 are GI 11 and 12 on an H100
