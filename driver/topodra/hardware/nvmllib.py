"""Load ``libnvidia-ml.so.1`` from the NVIDIA driver root by absolute path, the way NVIDIA's plugins do.

The plugin image's own loader and libc must stay in charge: putting the host's library directory on
``LD_LIBRARY_PATH`` would make the image's ``ld.so`` take the host's ``libc.so.6`` too, which is fatal when
the two glibc versions differ.  So the one library is found under the driver root (``/`` on a plain host,
``/run/nvidia/driver`` with the GPU Operator, mounted at ``/driver-root`` in the pod) and handed to pynvml
as its library handle before ``nvmlInit``.  pynvml 13.615.71 keeps that handle in ``pynvml.nvmlLib`` and
only calls ``CDLL("libnvidia-ml.so.1")`` while it is None; ``RTLD_GLOBAL`` and the library's soname also
make any later soname lookup in this process bind to the same object.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from pathlib import Path
from typing import Any

from topodra.hardware.base import DiscoveryError

log = logging.getLogger(__name__)

LIBRARY = "libnvidia-ml.so.1"
# Where distributions and NVIDIA's driver containers put it, in the order NVIDIA's DRA driver searches.
LIBRARY_DIRS = ("usr/lib64", "usr/lib/x86_64-linux-gnu", "usr/lib/aarch64-linux-gnu", "lib64",
                "lib/x86_64-linux-gnu")  # fmt: skip

_lock = threading.Lock()
_loaded: Path | None = None


def find_library(driver_root: str | os.PathLike[str]) -> Path:
    """The absolute path of ``libnvidia-ml.so.1`` under ``driver_root``; DiscoveryError naming every place looked."""
    root = Path(driver_root)
    if not root.is_dir():
        raise DiscoveryError(f"NVIDIA driver root {str(root)!r} is not a directory (--nvidia-driver-root)")
    tried = []
    for d in LIBRARY_DIRS:
        p = root / d / LIBRARY
        tried.append(str(p))
        if p.exists():
            return Path(os.path.realpath(p))
    raise DiscoveryError(
        f"{LIBRARY} not found under NVIDIA driver root {str(root)!r} (--nvidia-driver-root); looked in: "
        + ", ".join(tried)
    )


def _same_object(path: Path, lib: Any) -> bool:
    """True when ``path`` is already loaded in this process as the object behind ``lib``."""
    try:
        mine = ctypes.CDLL(str(path), mode=os.RTLD_NOLOAD | ctypes.RTLD_GLOBAL)
    except OSError:  # not loaded at all: pynvml's library is another file
        return False
    return bool(mine._handle == getattr(lib, "_handle", None))


def load(driver_root: str | os.PathLike[str], nvml: Any) -> Path:
    """Give the ``pynvml`` module ``nvml`` the driver root's library; returns its path.

    Loading twice from the same file is a no-op, and so is a binding that already loaded this very file
    (by soname, on a host with the driver installed).  A process can hold one NVML only, so a second
    driver root, or a binding holding another file, raises DiscoveryError.
    """
    global _loaded
    path = find_library(driver_root)
    with _lock:
        if _loaded is not None:
            if _loaded != path:
                raise DiscoveryError(f"NVML already loaded from {_loaded}; cannot switch to {path} in one process")
            return path
        existing = getattr(nvml, "nvmlLib", None)
        if existing is not None:  # pynvml loaded it by soname first (a host with the driver installed)
            if not _same_object(path, existing):
                raise DiscoveryError(f"pynvml already holds an NVML library other than {path} (the driver root's)")
            _loaded = path
            return path
        try:
            lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            raise DiscoveryError(f"cannot load {path}: {e}") from e
        load_lock = getattr(nvml, "libLoadLock", None)
        if load_lock is not None:
            with load_lock:
                nvml.nvmlLib = lib
        else:
            nvml.nvmlLib = lib
        _loaded = path
    log.info("NVML library loaded from %s", path)
    return path
