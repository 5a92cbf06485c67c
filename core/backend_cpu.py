"""CPU backend (layer 2): numpy-owned aligned buffers and native plans on a thread pool."""
from __future__ import annotations

import os

import numpy as np

from ggtrain.core.backend import Backend, Buffer, KernelCall, Plan, TensorRef, fill_node
from ggtrain.errors import ShapeError, UnsupportedOpError
from ggtrain.native import _check, ffi, lib
from ggtrain.native.dtypes import dtype as _dtype

_ALIGN = 64


def default_threads() -> int:
    """GGTRAIN_THREADS, else the number of CPUs this process may use."""
    env = os.environ.get("GGTRAIN_THREADS")
    if env:
        return max(1, int(env))
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


class CpuBuffer(Buffer):
    """Host memory, 64-byte aligned, owned by a numpy uint8 array."""

    def __init__(self, nbytes: int):
        self.nbytes = int(nbytes)
        raw = np.zeros(self.nbytes + _ALIGN, dtype=np.uint8)
        start = (-raw.ctypes.data) % _ALIGN
        self._raw = raw
        self.bytes = raw[start:start + self.nbytes]
        self.address = self.bytes.ctypes.data

    def host(self, nbytes: int | None = None) -> np.ndarray:
        return self.bytes if nbytes is None else self.bytes[:nbytes]

    def view(self, offset: int, dtype: str, shape: tuple, strides: tuple | None = None) -> np.ndarray:
        """A numpy view of elements of an element dtype in this buffer (strides in elements)."""
        np_dtype = _dtype(dtype).numpy
        size = _dtype(dtype).itemsize
        if strides is None:
            n = int(np.prod(shape, dtype=np.int64)) if shape else 1
            return self.bytes[offset:offset + n * size].view(np_dtype).reshape(shape)
        return np.lib.stride_tricks.as_strided(
            self.bytes[offset:].view(np_dtype), shape=shape,
            strides=tuple(s * size for s in strides))


class HostArray(Buffer):
    """An existing contiguous host array's memory, for kernels to read in place (no copy);
    keeps the array alive."""

    def __init__(self, array: np.ndarray):
        if not array.flags.c_contiguous:
            raise ValueError("HostArray: the array must be C-contiguous")
        self.array = array
        self.nbytes = array.nbytes
        self.bytes = array.reshape(-1).view(np.uint8)
        self.address = array.ctypes.data

    def host(self, nbytes: int | None = None) -> np.ndarray:
        return self.bytes if nbytes is None else self.bytes[:nbytes]


# gathers of at least this many bytes run on the thread pool (get_rows), smaller ones in numpy
_POOL_GATHER_BYTES = 1 << 16


class CpuPlan(Plan):
    """Native nodes plus the memory they point into; freed with the object."""

    def __init__(self, backend: "CpuBackend", calls: list):
        self.calls = calls
        n_threads = self.n_threads = backend.n_threads
        self.nodes = ffi.new("gt_node[]", max(1, len(calls)))
        keep = []
        work = max([c.work_bytes for c in calls] + [0])
        work = (work + _ALIGN - 1) // _ALIGN * _ALIGN
        self.work = CpuBuffer(work * n_threads) if work else None
        self.work_nbytes = work * n_threads
        for i, call in enumerate(calls):
            _fill_node(self.nodes[i], call, backend.kernel_pointer(call.kernel), keep)
        self._keep = keep
        out = ffi.new("gt_plan **")
        work_ptr = ffi.cast("void *", self.work.address) if self.work else ffi.NULL
        self.pool = backend.pool(n_threads)  # the plan keeps its pool alive
        _check(lib.gt_plan_new(out, self.pool, self.nodes, len(calls), work_ptr, work),
               "compiling plan")
        self.ptr = ffi.gc(out[0], lib.gt_plan_free)
        self._profile = None

    def profile(self, enable: bool = True) -> None:
        """Start (or stop) adding each node's wall time into `node_seconds()`."""
        if enable:
            self._profile = ffi.new("int64_t[]", max(1, len(self.calls)))
            _check(lib.gt_plan_set_profile(self.ptr, self._profile))
        else:
            _check(lib.gt_plan_set_profile(self.ptr, ffi.NULL))
            self._profile = None

    def node_seconds(self) -> list:
        """Accumulated wall time per node (seconds) since profile() was enabled."""
        if self._profile is None:
            return []
        return [self._profile[i] * 1e-9 for i in range(len(self.calls))]


def _fill_node(node, call: KernelCall, fn, keep: list) -> None:
    fill_node(ffi, node, call, fn, keep)


class CpuBackend(Backend):
    """Runs plans on the native CPU core with a persistent thread pool."""

    name = "cpu"
    skips_uncounted_rows = True

    def __init__(self, n_threads: int | None = None):
        self.n_threads = n_threads or default_threads()   # every plan of this backend runs on as many
        self._pool = None
        self._pool_size = 0
        self._gather = None   # (key, plan, index buffer, source, destination) of the last big gather_in

    def pool(self, n_threads: int):
        """The thread pool (at least n_threads). A bigger request starts a new pool;
        plans made on the old one keep it alive until they are freed."""
        if self._pool is None or self._pool_size < n_threads:
            size = max(n_threads, self.n_threads)
            out = ffi.new("gt_pool **")
            _check(lib.gt_pool_new(out, size), "starting thread pool")
            self._pool = ffi.gc(out[0], lib.gt_pool_free)
            self._pool_size = size
        return self._pool

    def alloc(self, nbytes: int) -> CpuBuffer:
        return CpuBuffer(nbytes)

    def free(self, buffer: Buffer) -> None:
        buffer.bytes = None  # memory goes with the last reference

    def copy_in(self, buffer: CpuBuffer, offset: int, array: np.ndarray) -> None:
        data = np.ascontiguousarray(array).view(np.uint8).reshape(-1)
        if offset < 0 or offset + data.size > buffer.nbytes:
            raise ShapeError(f"copy_in of {data.size} bytes at {offset} overflows a {buffer.nbytes}-byte buffer")
        buffer.bytes[offset:offset + data.size] = data

    def gather_in(self, buffer: CpuBuffer, offset: int, source: np.ndarray, index: np.ndarray) -> None:
        """source[index] into buffer: f32 batches of 64 KiB and more by the thread pool
        (get_rows reading source in place: a random row gather is bound by memory latency,
        which two threads overlap), smaller ones or other types by numpy."""
        n = len(index)
        shape = (n,) + source.shape[1:]
        size = int(np.prod(shape)) * source.itemsize
        if offset < 0 or offset + size > buffer.nbytes:
            raise ShapeError(f"gather_in of {size} bytes at {offset} overflows a {buffer.nbytes}-byte buffer")
        if n and (int(np.min(index)) < -len(source) or int(np.max(index)) >= len(source)):
            raise IndexError(f"gather_in: an index is out of range for {len(source)} rows")
        if (size < _POOL_GATHER_BYTES or source.dtype != np.float32 or not source.flags.c_contiguous
                or self.n_threads < 2 or len(source) >= 2**31):
            dest = buffer.bytes[offset:offset + size].view(source.dtype).reshape(shape)
            np.take(source, index, axis=0, out=dest)
            return
        key = (source.ctypes.data, source.shape, id(buffer), offset, n)
        if self._gather is None or self._gather[0] != key:
            cols = size // (n * 4)
            src, idx = HostArray(source), CpuBuffer(4 * n)
            call = KernelCall("get_rows_fwd_f32", TensorRef(buffer, offset, "f32", (n, cols), (cols, 1)),
                              (TensorRef(src, 0, "f32", (len(source), cols), (cols, 1)),
                               TensorRef(idx, 0, "i32", (n,), (1,))), label="gather_in")
            self._gather = (key, self.compile([call]), idx, src, buffer)
        _, plan, idx, _, _ = self._gather
        idx.bytes[:] = np.ascontiguousarray(np.where(index < 0, index + len(source), index),
                                            dtype=np.int32).view(np.uint8)
        self.run(plan)

    def copy_out(self, buffer: CpuBuffer, offset: int, out: np.ndarray) -> np.ndarray:
        flat = out.reshape(-1).view(np.uint8)
        if offset < 0 or offset + flat.size > buffer.nbytes:
            raise ShapeError(f"copy_out of {flat.size} bytes at {offset} overflows a {buffer.nbytes}-byte buffer")
        flat[:] = buffer.bytes[offset:offset + flat.size]
        return out

    def allreduce(self, buffer: CpuBuffer, count: int, world) -> None:
        world.reduce_host(buffer.view(0, "f32", (count,)))   # host memory: MPI reads and writes it in place

    def supports(self, kernel: str) -> bool:
        return hasattr(lib, "gt_" + kernel)

    def describe(self) -> str:
        return f"{self.n_threads} thread{'s' if self.n_threads != 1 else ''}"

    def kernel_sizes(self, call: KernelCall) -> tuple:
        sizer = getattr(lib, f"gt_{call.kernel}_sizes", None)
        if sizer is None:
            return 0, 0
        node = ffi.new("gt_node *")
        _fill_node(node, call, None, [])
        scratch, work = ffi.new("int64_t *"), ffi.new("int64_t *")
        _check(sizer(node, scratch, work), f"sizing {call.label or call.kernel}")
        return int(scratch[0]), int(work[0])

    def kernel_pointer(self, kernel: str):
        """The native function pointer of kernel `gt_<kernel>`, looked up by name."""
        if not self.supports(kernel):
            raise UnsupportedOpError(f"cpu backend has no kernel gt_{kernel}")
        return ffi.cast("gt_kernel", ffi.addressof(lib, "gt_" + kernel))

    def compile(self, calls: list) -> CpuPlan:
        return CpuPlan(self, list(calls))

    def run(self, plan: CpuPlan) -> None:
        rc = lib.gt_plan_compute(plan.ptr, plan.n_threads)
        if rc != 0:
            idx = lib.gt_plan_failed_node(plan.ptr)
            label = plan.calls[idx].label or plan.calls[idx].kernel if 0 <= idx < len(plan.calls) else "?"
            _check(rc, f"running {label}")
