"""The CUDA backend (layer 2): device buffers, copies, and plans run by ggtrain's CUDA library.

The library (`ggtrain/native/_cuda.so`, built by native/build_cuda.py when nvcc is on PATH;
GGTRAIN_CUDA_LIB names another file) is loaded with cffi's ABI mode from its header
(native/gt_core.h, then native/cuda/gtc.h): nothing links against CUDA at install time. It
loads the NVIDIA driver and cuBLAS itself when it starts (and NCCL for a data-parallel run);
each comes from GGTRAIN_CUBLAS / GGTRAIN_NCCL, an NVIDIA wheel (found here and passed on) or
the loader's path.

A plan is the CPU's list of gt_node (core/backend.py fill_node), its tensors pointing into
device memory and each node's fn the CUDA launcher of the same kernel name; the library runs
them in order on one stream. `unavailable_reason()` says in one line why `--backend cuda`
cannot run on this machine, naming every missing piece.
"""
from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
import pathlib
import re
import sys
import weakref

import cffi
import numpy as np

from ggtrain.core.backend import Backend, Buffer, KernelCall, Plan, fill_node
from ggtrain.errors import ShapeError, UnsupportedOpError
from ggtrain.native import error_for

LIB_ENV = "GGTRAIN_CUDA_LIB"
CUBLAS_ENV = "GGTRAIN_CUBLAS"
NCCL_ENV = "GGTRAIN_NCCL"
_NATIVE = pathlib.Path(__file__).resolve().parent.parent / "native"
_HEADERS = (_NATIVE / "gt_core.h", _NATIVE / "cuda" / "gtc.h")


def library_path() -> str | None:
    """Path of ggtrain's CUDA library, or None."""
    env = os.environ.get(LIB_ENV)
    if env:
        return env if os.path.isfile(env) else None
    found = sorted(_NATIVE.glob("_cuda*.so"))
    return str(found[0]) if found else None


def from_nvidia_wheels(stem: str) -> str | None:
    """The newest lib<stem>.so.N an NVIDIA wheel installed (nvidia/<pkg>/lib for CUDA 12,
    nvidia/cu13/lib for CUDA 13), or None."""
    spec = importlib.util.find_spec("nvidia")
    found = []
    for root in (spec.submodule_search_locations or []) if spec else []:
        found += glob.glob(os.path.join(root, "*", "lib", f"lib{stem}.so.*"))
    found = [f for f in found if f.rsplit(".so.", 1)[1].split(".")[0].isdigit()]
    return max(found, key=lambda f: int(f.rsplit(".so.", 1)[1].split(".")[0])) if found else None


_LIB: tuple | None = None     # (ffi, lib) once loaded


def load() -> tuple:
    """(ffi, lib) of the CUDA library; UnsupportedOpError naming what is missing."""
    global _LIB
    if _LIB is None:
        path = library_path()
        if path is None:
            raise UnsupportedOpError(_no_library())
        ffi = cffi.FFI()
        text = "\n".join(h.read_text() for h in _HEADERS)
        ffi.cdef(re.sub(r"/\*.*?\*/", "", text, flags=re.S))   # (as native/build.py's cdef_text)
        try:
            lib = ffi.dlopen(path)
        except OSError as e:
            raise UnsupportedOpError(f"the CUDA library {path} cannot be loaded: {e}") from None
        _LIB = (ffi, lib)
    return _LIB


def _no_library() -> str:
    where = os.environ.get(LIB_ENV) or str(_NATIVE / "_cuda*.so")
    return (f"this build has no CUDA library ({where} not found: nvcc was not on PATH when ggtrain was "
            f"installed; reinstall with nvcc on PATH, or GGTRAIN_CUDA=1 to make that an error)")


def _message(lib, ffi) -> str:
    return ffi.string(lib.gtc_last_error()).decode("utf-8", "replace")


def _check(rc: int, what: str = "") -> None:
    if rc == 0:
        return
    ffi, lib = load()
    msg = _message(lib, ffi) or f"CUDA error {rc}"
    raise error_for(rc, f"{what}: {msg}" if what else msg)


def _driver() -> str | None:
    """Why the NVIDIA driver cannot serve (one line), or None."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "no NVIDIA driver (libcuda.so.1 cannot be loaded)"
    if cuda.cuInit(0) != 0:
        return "the NVIDIA driver does not initialise (cuInit failed)"
    count = ctypes.c_int(0)
    if cuda.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value == 0:
        return "no CUDA device"
    return None


def unavailable_reason() -> str | None:
    """Why the CUDA backend cannot run here (one line), or None when it could."""
    reasons = []
    if library_path() is None:
        reasons.append(_no_library())
    driver = _driver()
    if driver:
        reasons.append(driver)
    elif library_path() is not None:
        try:
            ffi, lib = load()
            count = ffi.new("int32_t *")
            _check(lib.gtc_device_count(count), "counting CUDA devices")
            if count[0] == 0:
                reasons.append("no CUDA device")
        except Exception as e:  # noqa: BLE001 - any failure is the reason, in one line
            reasons.append(str(e))
    return "; ".join(reasons) if reasons else None


# ---- buffers and plans ---------------------------------------------------------------------------

def _free(lib, ptr) -> None:
    lib.gtc_free(ptr)


class CudaBuffer(Buffer):
    """Device memory (zero-filled), freed with the object; address: the device pointer."""

    def __init__(self, backend: "CudaBackend", nbytes: int):
        ffi, lib = backend.ffi, backend.lib
        self.nbytes = int(nbytes)
        out = ffi.new("void **")
        _check(lib.gtc_malloc(out, self.nbytes), "allocating GPU memory")
        self.backend = backend
        self.address = int(ffi.cast("uintptr_t", out[0]))
        self._finalizer = weakref.finalize(self, _free, lib, out[0])

    def host(self, nbytes: int | None = None) -> np.ndarray:
        """A host copy of the first nbytes (all by default)."""
        out = np.empty(self.nbytes if nbytes is None else nbytes, np.uint8)
        return self.backend.copy_out(self, 0, out)


class CudaPlan(Plan):
    """gt_node records for the library and the memory they point into; work memory is the
    backend's one shared buffer. math: the precision of its matrix products (the backend's
    when it was compiled; its work sizes were asked under it, so it runs under it)."""

    def __init__(self, backend: "CudaBackend", calls: list):
        ffi = backend.ffi
        self.calls = calls
        self.math = backend.math
        self.nodes = ffi.new("gt_node[]", max(1, len(calls)))
        keep = []
        for i, call in enumerate(calls):
            fill_node(ffi, self.nodes[i], call, backend.kernel_pointer(call.kernel), keep)
        self._keep = keep
        self.work_bytes = self.work_nbytes = max([c.work_bytes for c in calls] + [0])
        backend.reserve_work(self.work_bytes)
        self._ffi = ffi
        self._profile = None

    def profile(self, enable: bool = True) -> None:
        """Start (or stop) adding each node's GPU time (CUDA events) into `node_seconds()`."""
        self._profile = self._ffi.new("int64_t[]", max(1, len(self.calls))) if enable else None

    def node_seconds(self) -> list:
        """Accumulated GPU time per node (seconds) since profile() was enabled."""
        if self._profile is None:
            return []
        return [self._profile[i] * 1e-9 for i in range(len(self.calls))]


class CudaBackend(Backend):
    """Runs plans on one GPU with ggtrain's CUDA library (one stream; f32 tensors, the matrix
    products exact unless `math` names a tensor-core precision: maths() lists them)."""

    name = "cuda"

    def __init__(self, device: int = 0, math: str = "f32"):
        why = unavailable_reason()
        if why:
            raise UnsupportedOpError(f"the CUDA backend cannot run here: {why}")
        for env, stem in ((CUBLAS_ENV, "cublas"), (NCCL_ENV, "nccl")):   # the libraries the wheels bring
            if env not in os.environ and (wheel := from_nvidia_wheels(stem)):
                os.environ[env] = wheel
        self.ffi, self.lib = load()
        _check(self.lib.gtc_init(device), f"starting CUDA device {device}")
        _check(self.lib.gtc_set_math(math.encode()), "choosing the matrix products' precision")
        self.math = math
        self.kernels = {self.ffi.string(self.lib.gtc_kernel_name(i)).decode()
                        for i in range(self.lib.gtc_kernel_count())}
        name = self.ffi.new("char[]", 256)
        memory = self.ffi.new("int64_t *")
        major, minor = self.ffi.new("int32_t *"), self.ffi.new("int32_t *")
        _check(self.lib.gtc_device_info(device, name, 256, memory, major, minor), "reading the device")
        self.device = (self.ffi.string(name).decode(), int(memory[0]), (int(major[0]), int(minor[0])))
        self._work: CudaBuffer | None = None   # one work buffer for every plan (they run in turn)
        self._nccl: bool | None = None         # NCCL joined (True), unavailable (False), not tried

    def reserve_work(self, nbytes: int) -> None:
        """Grow the shared work buffer to at least nbytes (a stored weight's product decodes the
        weight into it: R x C floats)."""
        if nbytes and (self._work is None or self._work.nbytes < nbytes):
            self._work = None          # (the old one goes first: the GPU may not hold both)
            self._work = CudaBuffer(self, nbytes)

    def alloc(self, nbytes: int) -> CudaBuffer:
        return CudaBuffer(self, nbytes)

    def free(self, buffer: Buffer) -> None:
        buffer._finalizer()

    def _host_ptr(self, array: np.ndarray):
        return self.ffi.cast("void *", array.ctypes.data)

    def copy_in(self, buffer: CudaBuffer, offset: int, array: np.ndarray) -> None:
        data = np.ascontiguousarray(array)
        if offset < 0 or offset + data.nbytes > buffer.nbytes:
            raise ShapeError(f"copy_in of {data.nbytes} bytes at {offset} overflows a {buffer.nbytes}-byte buffer")
        dst = self.ffi.cast("void *", buffer.address + offset)
        _check(self.lib.gtc_copy_in(dst, self._host_ptr(data), data.nbytes), "copying to the GPU")

    def copy_out(self, buffer: CudaBuffer, offset: int, out: np.ndarray) -> np.ndarray:
        if not out.flags.c_contiguous:
            raise ShapeError("copy_out needs a contiguous array")
        if offset < 0 or offset + out.nbytes > buffer.nbytes:
            raise ShapeError(f"copy_out of {out.nbytes} bytes at {offset} overflows a {buffer.nbytes}-byte buffer")
        src = self.ffi.cast("void *", buffer.address + offset)
        _check(self.lib.gtc_copy_out(self._host_ptr(out), src, out.nbytes), "copying from the GPU")
        return out

    def allreduce(self, buffer: CudaBuffer, count: int, world) -> None:
        """NCCL on the device buffer (its unique id sent from rank 0 over MPI on first use); where
        NCCL cannot be loaded, a one-line warning and the staged all-reduce through host memory."""
        if self._nccl is None:
            try:
                _check(self.lib.gtc_nccl_load(), "loading NCCL")
                uid = self.ffi.new("char[]", 128)
                if world.rank == 0:
                    _check(self.lib.gtc_nccl_unique_id(uid), "NCCL's unique id")
                raw = world.broadcast(bytes(self.ffi.buffer(uid)))
                self.ffi.memmove(uid, raw, 128)
                _check(self.lib.gtc_nccl_init(world.size, world.rank, uid), "joining the NCCL communicator")
                self._nccl = True
            except UnsupportedOpError as e:
                if world.rank == 0:
                    print(f"warning: {e}; the gradient all-reduce goes through host memory", file=sys.stderr)
                self._nccl = False
        if not self._nccl:
            super().allreduce(buffer, count, world)
            return
        _check(self.lib.gtc_nccl_allreduce_f32(self.ffi.cast("void *", buffer.address), count),
               "the gradient all-reduce")

    def supports(self, kernel: str) -> bool:
        return kernel in self.kernels

    def kernel_pointer(self, kernel: str):
        fn = self.lib.gtc_kernel(kernel.encode())
        if fn == self.ffi.NULL:
            raise UnsupportedOpError(f"cuda backend has no kernel {kernel}")
        return fn

    def kernel_sizes(self, call: KernelCall) -> tuple:
        node = self.ffi.new("gt_node *")
        fill_node(self.ffi, node, call, None, [])
        scratch, work = self.ffi.new("int64_t *"), self.ffi.new("int64_t *")
        # (a product's work memory depends on the precision: bf16 operands are staged in it)
        _check(self.lib.gtc_set_math(self.math.encode()), "choosing the matrix products' precision")
        _check(self.lib.gtc_kernel_sizes(call.kernel.encode(), node, scratch, work),
               f"sizing {call.label or call.kernel}")
        return int(scratch[0]), int(work[0])

    def compile(self, calls: list) -> CudaPlan:
        return CudaPlan(self, list(calls))

    def describe(self) -> str:
        return f"GPU {self.device[0]}, {self.math} products"

    def work_memory(self, plans: list) -> int:
        """Plans run in turn over the backend's one work buffer: the largest one's."""
        return max([p.work_nbytes for p in plans] + [0])

    def run(self, plan: CudaPlan) -> None:
        failed = self.ffi.new("int64_t *")
        self.reserve_work(plan.work_bytes)
        work = self.ffi.cast("void *", self._work.address) if plan.work_bytes else self.ffi.NULL
        size = self._work.nbytes if plan.work_bytes else 0
        # (the library holds one precision for its stream; a plan runs under its own)
        _check(self.lib.gtc_set_math(plan.math.encode()), "choosing the matrix products' precision")
        self.lib.gtc_set_profile(plan._profile if plan._profile is not None else self.ffi.NULL)
        rc = self.lib.gtc_run(plan.nodes, len(plan.calls), work, size, failed)
        if rc != 0:
            idx = int(failed[0])
            label = (plan.calls[idx].label or plan.calls[idx].kernel) if 0 <= idx < len(plan.calls) else "?"
            _check(rc, f"running {label} on the GPU")

    def sync(self) -> None:
        _check(self.lib.gtc_sync(), "waiting for the GPU")
