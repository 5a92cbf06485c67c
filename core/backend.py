"""Backend interface (layer 2): device buffers, copies, and running compiled plans.

A backend knows bytes and kernels, not graphs: layer 3 lowers a graph into a list
of KernelCall (kernel name, tensor references into buffers, parameters) and the
backend compiles that list into a native plan it can run many times.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from ggtrain.errors import ShapeError
from ggtrain.native.dtypes import dtype

MAX_DIMS = 6


class Buffer(ABC):
    """A block of bytes on a backend's device; address: where the kernels see it (a host or
    a device pointer)."""

    nbytes: int
    address: int

    @abstractmethod
    def host(self, nbytes: int | None = None) -> np.ndarray:
        """The first nbytes (all by default) as host bytes (uint8): a view of host memory,
        a copy of device memory."""


@dataclass(frozen=True)
class TensorRef:
    """Where a tensor's elements lie: buffer, byte offset, dtype, shape, strides (elements).

    A block-typed tensor (ggtrain.native.dtypes) is rows of whole blocks along its
    stride-1 dim; its strides count elements as if it were unpacked. buffer None
    describes a tensor without memory yet (what Backend.kernel_sizes looks at).
    """

    buffer: Buffer | None
    offset: int
    dtype: str
    shape: tuple
    strides: tuple


@dataclass(frozen=True)
class StoredTensor:
    """A tensor's bytes already in a backend buffer, in its stored dtype and numpy-order
    shape (a weight read from a GGUF file straight into memory): Runtime.bind adopts it
    without a copy."""

    buffer: Buffer
    dtype: str
    shape: tuple


@dataclass(frozen=True)
class KernelCall:
    """One node of a lowered graph: `kernel` is the op name plus direction and dtype,
    e.g. "rms_norm_fwd_f32"; ip/fp are the kernel's integer/float parameters;
    scratch is node-private memory shared by its threads."""

    kernel: str
    dst: TensorRef
    srcs: tuple
    ip: tuple = ()
    fp: tuple = ()
    scratch: TensorRef | None = None
    work_bytes: int = 0
    label: str = ""


class Plan(ABC):
    """A compiled list of kernel calls, run by Backend.run. work_nbytes: the work memory the
    plan's kernels are given (the CPU: each call's per-thread work times its threads)."""

    calls: list
    work_nbytes: int = 0


class Backend(ABC):
    """Allocation, copies and plan execution on one device. How a backend spreads a plan over
    its device (the CPU's threads, a GPU's stream) is its own state, set when it is made."""

    name: str
    # whether its linear_cross_entropy leaves the rows after the last counted one (a plan's
    # loss-row padding) out of its products; what ops.row_flops counts on
    skips_uncounted_rows: bool = False

    @abstractmethod
    def alloc(self, nbytes: int) -> Buffer: ...

    @abstractmethod
    def free(self, buffer: Buffer) -> None: ...

    @abstractmethod
    def copy_in(self, buffer: Buffer, offset: int, array: np.ndarray) -> None: ...

    @abstractmethod
    def copy_out(self, buffer: Buffer, offset: int, out: np.ndarray) -> np.ndarray: ...

    def gather_in(self, buffer: Buffer, offset: int, source: np.ndarray, index: np.ndarray) -> None:
        """Copy the rows source[index] (a batch drawn from a dataset) into buffer at offset.
        This default gathers on the host, then copies in; a backend that can write its
        buffers from numpy gathers straight into them (one copy, not two)."""
        self.copy_in(buffer, offset, np.ascontiguousarray(source[index]))

    @abstractmethod
    def supports(self, kernel: str) -> bool:
        """Whether this backend has the kernel `<op>_<fwd|bwd>_<dtypes>`."""

    @abstractmethod
    def kernel_sizes(self, call: KernelCall) -> tuple:
        """(node scratch bytes, per-thread work bytes) the kernel of `call` needs for its
        tensors' dtypes, shapes and strides and its params (buffers may be None)."""

    @abstractmethod
    def compile(self, calls: list) -> Plan: ...

    @abstractmethod
    def run(self, plan: Plan) -> None: ...

    @abstractmethod
    def describe(self) -> str:
        """What runs the plans, in a few words for a run's summary line ("2 threads")."""

    def work_memory(self, plans: list) -> int:
        """The work memory `plans` (graph.CompiledPlan, or backend Plans) hold together: each
        its own by default."""
        return sum(p.work_nbytes for p in plans)

    def allreduce(self, buffer: Buffer, count: int, world) -> None:
        """Sum the first `count` f32 elements of `buffer` over the processes of a data-parallel
        run (core/distributed.py World), in place. This one stages through host memory (copy
        out, world.reduce_host, copy in): right on any backend; the CPU's reduces its host
        memory in place, the CUDA one uses NCCL on the device buffer."""
        host = np.empty(count, np.float32)
        self.copy_out(buffer, 0, host)
        world.reduce_host(host)
        self.copy_in(buffer, 0, host)

    def sync(self) -> None:
        """Wait for queued work (the CPU backend runs synchronously)."""


_ONES, _ZEROS = (1,) * MAX_DIMS, (0,) * MAX_DIMS   # fill_tensor's padding


def fill_tensor(ffi, desc, ref: TensorRef) -> None:
    """A gt_tensor (native/gt_core.h) of `ffi` describing ref (data NULL without a buffer).
    Shape and strides go in as one slice each (padded with 1s and 0s): lowering fills about
    three of these a node, and field by field (12 cffi stores) they were most of its time: a
    SmolLM2 decoder plan compiled in 31-32 ms before, 28-29 after."""
    n = len(ref.shape)
    if n > MAX_DIMS:
        raise ShapeError(f"tensor of shape {ref.shape} has more than {MAX_DIMS} dims")
    desc.data = ffi.NULL if ref.buffer is None else ffi.cast("void *", ref.buffer.address + ref.offset)
    desc.dtype = dtype(ref.dtype).id
    desc.ndim = n
    desc.shape[0:MAX_DIMS] = tuple(ref.shape) + _ONES[n:]
    desc.strides[0:MAX_DIMS] = tuple(ref.strides) + _ZEROS[len(ref.strides):]


def fill_node(ffi, node, call: KernelCall, fn, keep: list) -> None:
    """A gt_node of `ffi` for call, its kernel fn (NULL for None); keep: what must outlive it."""
    if len(call.srcs) > len(node.src) or len(call.ip) > len(node.ip) or len(call.fp) > len(node.fp):
        raise ShapeError(f"{call.kernel}: too many inputs or parameters")
    node.fn = ffi.NULL if fn is None else fn
    node.n_src = len(call.srcs)
    fill_tensor(ffi, node.dst, call.dst)
    for i, src in enumerate(call.srcs):
        fill_tensor(ffi, node.src[i], src)
    for i, v in enumerate(call.ip):
        node.ip[i] = int(v)
    for i, v in enumerate(call.fp):
        node.fp[i] = float(v)
    if call.scratch is not None:
        node.scratch = ffi.cast("void *", call.scratch.buffer.address + call.scratch.offset)
        node.scratch_size = call.scratch.shape[0]
    keep.append(call)
