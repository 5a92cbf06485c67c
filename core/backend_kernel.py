"""One kernel on numpy arrays, on any backend (layer 2): what tests and direct uses run
without building a graph (run_kernel)."""
from __future__ import annotations

import numpy as np

from ggtrain.core.backend import Backend, Buffer, KernelCall, TensorRef
from ggtrain.core.backend_cpu import CpuBackend
from ggtrain.errors import ShapeError


def run_kernel(kernel: str, dst: np.ndarray, srcs: list, ip=(), fp=(), n_threads: int = 1,
               scratch_bytes: int | None = None, work_bytes: int | None = None,
               backend: Backend | None = None) -> np.ndarray:
    """Run one kernel on numpy arrays (tests and direct use); dst is filled in place.

    Arrays may be strided views of contiguous buffers. A tuple (array, dtype) names the
    dtype where numpy cannot (bf16 as uint16); (array, dtype, shape, strides) also gives
    the logical shape and element strides, as block types need (array: their raw bytes).
    Scratch and work sizes default to what the kernel asks for (Backend.kernel_sizes).
    On a backend whose memory is not the host's (CUDA), each array's contiguous base goes
    to the device and dst's comes back.
    """
    backend = backend or CpuBackend(n_threads)     # (n_threads: of the CPU backend made here)
    host = isinstance(backend, CpuBackend)
    bufs, back = [], []

    def buffer(a: np.ndarray) -> tuple:
        """(buffer, byte offset of a's first element in it)."""
        if host:
            return _ArrayBuffer(a), 0
        root = a
        while isinstance(root.base, np.ndarray):
            root = root.base
        if not root.flags.c_contiguous:
            if not a.flags.c_contiguous:
                raise ShapeError("run_kernel: a strided array must be a view of a contiguous one")
            root = a
        offset = a.__array_interface__["data"][0] - root.__array_interface__["data"][0]
        for buf, known in back:        # one device copy of a base (an in-place kernel's dst is its src)
            if known is root:
                return buf, offset
        buf = backend.alloc(max(1, root.nbytes))
        backend.copy_in(buf, 0, root.reshape(-1).view(np.uint8))
        back.append((buf, root))
        return buf, offset

    def ref(a):
        dtype = shape = strides = None
        if isinstance(a, tuple):
            a, dtype, *rest = a
            if rest:
                shape, strides = rest
        if dtype is None:
            dtype = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16",
                     np.dtype(np.int32): "i32", np.dtype(np.uint16): "bf16"}[a.dtype]
        buf, offset = buffer(a)
        bufs.append(buf)
        if shape is None:
            item = a.dtype.itemsize
            shape, strides = tuple(a.shape), tuple(s // item for s in a.strides)
        return TensorRef(buf, offset, dtype, tuple(shape), tuple(strides))

    call = KernelCall(kernel, ref(dst), tuple(ref(s) for s in srcs), tuple(ip), tuple(fp))
    if scratch_bytes is None or work_bytes is None:
        need_scratch, need_work = backend.kernel_sizes(call)
        scratch_bytes = need_scratch if scratch_bytes is None else scratch_bytes
        work_bytes = need_work if work_bytes is None else work_bytes
    scratch = None
    if scratch_bytes:
        sb = backend.alloc(scratch_bytes)
        bufs.append(sb)
        scratch = TensorRef(sb, 0, "f32", (scratch_bytes,), (1,))
    call = KernelCall(kernel, call.dst, call.srcs, call.ip, call.fp, scratch, work_bytes)
    plan = backend.compile([call])
    backend.run(plan)
    if back:    # dst's base (the first array given) comes back from the device
        buf, root = back[0]
        backend.copy_out(buf, 0, root.reshape(-1).view(np.uint8))
    return dst[0] if isinstance(dst, tuple) else dst


class _ArrayBuffer(Buffer):
    """Wraps an existing numpy array's memory (direct kernel runs)."""

    def __init__(self, array: np.ndarray):
        self.array = array
        self.nbytes = array.nbytes
        self.address = array.ctypes.data

    def host(self, nbytes: int | None = None) -> np.ndarray:
        return self.array.reshape(-1).view(np.uint8)[:nbytes]
