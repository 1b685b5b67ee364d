"""The NVIDIA Container Toolkit's ``nvidia-cdi-hook`` hooks in a claim's CDI spec (pure).

Mounting the driver's libraries is not enough for every image: ``libcuda.so`` (what build tools and some
frameworks ``dlopen``) is a symlink only the toolkit creates, the container's ld.so.cache does not list the
mounted directory, and a CUDA forward-compat package in the image is used only when a hook points the loader
at it.  ``nvidia-ctk cdi generate`` (v1.20.2, measured against hack/driver-tree; NVIDIA's DRA driver emits the
same through ``nvcdi``) adds these hooks for the same edits, so topodra emits them too:

- spec level, ``createContainer``: ``create-symlinks`` (``--link target::link`` each), ``enable-cuda-compat``
  (``--host-driver-version=<version>``), ``update-ldcache`` (``--folder`` per library directory),
  ``disable-device-node-modification`` and ``update-application-profile``;
- per whole GPU, ``createRuntime``: ``apply-cuda-memory-limits --driver-root <root> --gpu-id <uuid>`` (a no-op
  unless the container sets ``NVIDIA_GPU_MEMORY_REQUEST``/``_LIMIT``).

Hooks run on the host (runc executes them from the runtime's namespace), so ``HostDriver.cdi_hook`` is a host
path; when no hook binary was found there are no hooks and ``hostdriver`` mounts the sonames instead.
"""

from __future__ import annotations

import posixpath
from typing import Any

from topodra.devices import Device
from topodra.hostdriver import HostDriver

CREATE_CONTAINER = "createContainer"
CREATE_RUNTIME = "createRuntime"
# What the toolkit's hook creator puts in every hook's environment (debug logging off).
HOOK_ENV = ("NVIDIA_CTK_DEBUG=false",)
# OCI lifecycle names a CDI hook may have (CDI spec, "hookName").
HOOK_NAMES = frozenset({"prestart", "createRuntime", "createContainer", "startContainer", "poststart",
                        "poststop"})


def hook(program: str, name: str, *args: str, lifecycle: str = CREATE_CONTAINER) -> dict[str, Any]:
    """One hook as the toolkit writes it: argv[0] the program's basename, then the hook's subcommand
    (``nvidia-ctk`` takes it under ``hook``)."""
    base = posixpath.basename(program)
    argv = [base, "hook", name] if base == "nvidia-ctk" else [base, name]
    return {"hookName": lifecycle, "path": program, "args": [*argv, *args], "env": list(HOOK_ENV)}


def spec_hooks(host: HostDriver) -> list[dict[str, Any]]:
    """The spec-level hooks of a claim with GPUs, in the toolkit's order; none without a hook binary."""
    program = host.cdi_hook
    if program is None:
        return []
    out: list[dict[str, Any]] = []
    links = host.symlinks()
    if links:
        out.append(hook(program, "create-symlinks", *(a for link in links for a in ("--link", link))))
    version = [f"--host-driver-version={host.version}"] if host.version else []
    out.append(hook(program, "enable-cuda-compat", *version))
    folders = host.library_dirs()
    if folders:
        out.append(hook(program, "update-ldcache", *(a for d in folders for a in ("--folder", d))))
    out.append(hook(program, "disable-device-node-modification"))
    out.append(hook(program, "update-application-profile"))
    return out


def device_hooks(device: Device, host: HostDriver | None) -> list[dict[str, Any]]:
    """A whole GPU's own hook (``apply-cuda-memory-limits``), as the toolkit gives each full-GPU device; MIG
    devices and NICs get none, nor does anything without a hook binary."""
    if host is None or host.cdi_hook is None or device.kind != "gpu" or not device.uuid:
        return []
    return [hook(host.cdi_hook, "apply-cuda-memory-limits", "--driver-root", host.host_root or "/",
                 "--gpu-id", device.uuid, lifecycle=CREATE_RUNTIME)]
