"""The MIG-UUID row of hack/gpu-check (issue 19, finding 22): what ``nvmlComputeInstanceGetInfo(ci).device`` is on
a real driver, for the compute instance the ``mig`` step just made.

NVIDIA's DRA driver takes that handle as the MIG device (its UUID without walking the MIG devices); nvml.h
documents it as the parent device. The answer is recorded raw, next to the parent's UUID and the UUID the walk
finds, so it settles which one topodra's ``MigInstances`` gets. ``probe`` takes any pynvml-shaped module.

    python hack/gpu_check_mig_uuid.py GPU_INDEX GI_ID CI_ID OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from gpu_check_nvml import _call


def probe(nvml: Any, gpu: int, gi_id: int, ci_id: int) -> dict[str, Any]:
    """Raw answers about compute instance ``ci_id`` of GPU instance ``gi_id`` on GPU ``gpu`` (call nvmlInit first)."""
    h = nvml.nvmlDeviceGetHandleByIndex(gpu)
    gi = nvml.nvmlDeviceGetGpuInstanceById(h, gi_id)
    ci = nvml.nvmlGpuInstanceGetComputeInstanceById(gi, ci_id)
    device = nvml.nvmlComputeInstanceGetInfo(ci).device
    walked = None
    for i in range(int(nvml.nvmlDeviceGetMaxMigDeviceCount(h))):
        try:
            m = nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, i)
            ids = (int(nvml.nvmlDeviceGetGpuInstanceId(m)), int(nvml.nvmlDeviceGetComputeInstanceId(m)))
            if ids == (gi_id, ci_id):
                walked = str(nvml.nvmlDeviceGetUUID(m))
                break
        except nvml.NVMLError:
            continue
    return {"gpu": gpu, "gpu_instance": gi_id, "compute_instance": ci_id,
            "parent_uuid": _call(lambda: nvml.nvmlDeviceGetUUID(h)),
            "ci_info_device_is_mig": _call(lambda: bool(nvml.nvmlDeviceIsMigDeviceHandle(device))),
            "ci_info_device_uuid": _call(lambda: nvml.nvmlDeviceGetUUID(device)),
            "walked_mig_uuid": walked}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gpu", type=int)
    ap.add_argument("gi", type=int)
    ap.add_argument("ci", type=int)
    ap.add_argument("out", help="JSON report to write")
    args = ap.parse_args(argv)
    import pynvml

    pynvml.nvmlInit()
    try:
        report = probe(pynvml, args.gpu, args.gi, args.ci)
    finally:
        pynvml.nvmlShutdown()
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
