"""The CUDA backend's availability probe (layer 2).

The CUDA backend itself (device buffers, kernels for every op, cuBLAS loaded at run time) is
issue 11 and does not exist yet: this module says why `--backend cuda` cannot run, naming
every missing piece: the library ggtrain's CUDA kernels would be built into (nvcc-built,
loaded at run time from next to the package or GGTRAIN_CUDA_LIB), the NVIDIA driver
(libcuda), and a device.
"""
from __future__ import annotations

import ctypes
import os
import pathlib

LIB_ENV = "GGTRAIN_CUDA_LIB"
_NATIVE = pathlib.Path(__file__).resolve().parent.parent / "native"


def _library() -> str | None:
    """Path of ggtrain's CUDA library, or None."""
    env = os.environ.get(LIB_ENV)
    if env:
        return env if os.path.isfile(env) else None
    found = sorted(_NATIVE.glob("_cuda*.so"))
    return str(found[0]) if found else None


def _driver() -> tuple:
    """(devices, None) from the NVIDIA driver, or (0, why not)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0, "no NVIDIA driver (libcuda.so.1 cannot be loaded)"
    if cuda.cuInit(0) != 0:
        return 0, "the NVIDIA driver does not initialise (cuInit failed)"
    count = ctypes.c_int(0)
    if cuda.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value == 0:
        return 0, "no CUDA device"
    return count.value, None


def unavailable_reason() -> str | None:
    """Why the CUDA backend cannot run here (one line), or None when it could."""
    reasons = []
    lib = _library()
    if lib is None:
        where = os.environ.get(LIB_ENV) or str(_NATIVE / "_cuda*.so")
        reasons.append(f"this build has no CUDA library ({where} not found: ggtrain's CUDA kernels are not "
                       f"written yet, so no build has one)")
    devices, why = _driver()
    if why:
        reasons.append(why)
    return "; ".join(reasons) if reasons else None
