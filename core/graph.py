"""Graphs and their compilation into native plans (layer 3).

A Graph records tensors in creation order, which is also the execution order. A
Runtime holds a graph's persistent tensors (parameters, inputs, constants, optimizer
state) in backend buffers and compiles lists of wanted outputs into plans:

1. select the nodes the outputs depend on (plus in-place writers), in creation order;
2. give every intermediate a live range [first write, last read] over that order
   (views extend their root's range; a node's scratch lives for that node only);
3. pack all intermediates into one arena by live range: largest first, each at the
   lowest offset that overlaps no tensor alive at the same time;
4. emit one KernelCall per node and let the backend compile them into one plan.

Running a plan is one native call; Python only copies inputs in and results out.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ggtrain.core import ops as _ops
from ggtrain.core.backend import DTYPE_SIZE, Backend, KernelCall, TensorRef
from ggtrain.core.tensor import PERSISTENT_KINDS, Tensor, as_array
from ggtrain.errors import DTypeError, ShapeError

_ALIGN = 64


class Graph:
    """A static graph under construction: persistent tensors and op nodes in order."""

    def __init__(self):
        self.nodes: list = []
        self.segment = 0
        self.boundaries: set = set()

    def _register(self, t: Tensor) -> int:
        self.nodes.append(t)
        return len(self.nodes) - 1

    def param(self, shape, init=None, name: str = "", trainable: bool = True,
              weight_decay: bool | None = None) -> Tensor:
        """A parameter (f32) with an initial value (numpy array; zeros if None)."""
        t = Tensor(self, shape, "f32", kind="param", name=name)
        t.init = None if init is None else as_array(init, t.shape, "f32")
        t.requires_grad = trainable
        t.weight_decay = weight_decay
        return t

    def input(self, shape, dtype: str = "f32", name: str = "") -> Tensor:
        """A tensor the host fills before each run (data, targets, positions)."""
        return Tensor(self, shape, dtype, kind="input", name=name)

    def const(self, value, name: str = "", dtype: str = "f32") -> Tensor:
        """A constant tensor (a Python number gives a scalar)."""
        arr = np.asarray(value, dtype=np.int32 if dtype == "i32" else np.float32)
        t = Tensor(self, arr.shape, dtype, kind="const", name=name)
        t.init = as_array(arr, t.shape, dtype)
        return t

    def state(self, shape, name: str = "", init=None) -> Tensor:
        """A persistent f32 tensor that is not trained (gradients, optimizer moments)."""
        t = Tensor(self, shape, "f32", kind="state", name=name)
        t.init = None if init is None else as_array(init, t.shape, "f32")
        return t

    def checkpoint(self, x: Tensor) -> Tensor:
        """Mark x as a segment boundary for gradient checkpointing; returns x.

        Nodes made after this call belong to the next segment. With checkpointing,
        backward keeps only boundaries and recomputes each segment's forward.
        """
        self.boundaries.add(x.id)
        self.segment += 1
        return x

    def ancestors(self, outputs) -> list:
        """Every tensor the outputs depend on (including them), in creation order."""
        seen = set()
        stack = list(outputs)
        while stack:
            t = stack.pop()
            if t.id in seen:
                continue
            seen.add(t.id)
            stack.extend(t.srcs)
            if t.out is not None:
                stack.append(t.out)
        return [self.nodes[i] for i in sorted(seen)]


def assign(value: Tensor, target: Tensor) -> Tensor:
    """Make `value` be written into persistent `target` (same shape), copying if needed.

    When value is computed by a kernel (or is a contiguous view covering all of such a
    result), that kernel writes straight into target; otherwise a copy node is added.
    """
    if value.shape != target.shape:
        raise ShapeError(f"assign: value {value.shape} does not fit target {target.shape}")
    root = value.root
    whole = (value.is_contiguous() and value.offset == root.offset == 0 and value.size == root.size)
    if (whole and root.kind == "op" and not root.is_view and root.out is None
            and _ops.OPS[root.op].kernel is not None and root.dtype == target.dtype
            and target.is_contiguous()):
        root.out = target
        return value
    value = _ops.apply("cont", [value])
    value.out = target
    return value


@dataclass
class MemoryReport:
    """Bytes planned for one compiled plan."""

    arena: int          # intermediates, packed by live range
    arena_unpacked: int # what they would take without reuse
    persistent: int     # parameters, state, inputs, constants of the runtime
    scratch: int        # per-thread kernel scratch

    @property
    def peak(self) -> int:
        return self.arena + self.persistent + self.scratch


class CompiledPlan:
    """A native plan plus what is needed to read its results."""

    def __init__(self, runtime, plan, arena, refs: dict, report: MemoryReport, n_nodes: int):
        self.runtime = runtime
        self.plan = plan
        self.arena = arena
        self.refs = refs
        self.report = report
        self.n_nodes = n_nodes

    def read(self, t: Tensor) -> np.ndarray:
        """A copy of an output tensor's value after a run."""
        ref = self.refs.get(t.id)
        if ref is None:
            return self.runtime.get(t)
        return _read_ref(self.runtime.backend, ref)


def _read_ref(backend: Backend, ref: TensorRef) -> np.ndarray:
    np_dtype = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16, "i32": np.int32}[ref.dtype]
    size = DTYPE_SIZE[ref.dtype]
    n = 1
    for d in ref.shape:
        n *= d
    span = 1 + sum((d - 1) * s for d, s in zip(ref.shape, ref.strides)) if n else 0
    flat = np.empty(span, dtype=np_dtype)
    if span:
        backend.copy_out(ref.buffer, ref.offset, flat)
    out = np.lib.stride_tricks.as_strided(flat, shape=ref.shape,
                                          strides=tuple(s * size for s in ref.strides)) if n else \
        np.empty(ref.shape, dtype=np_dtype)
    out = np.array(out)
    if ref.dtype == "bf16":
        out = (out.astype(np.uint32) << 16).view(np.float32)
    return out


class Runtime:
    """Persistent tensors of one graph on one backend, and the plans compiled over them."""

    def __init__(self, graph: Graph, backend: Backend):
        self.graph = graph
        self.backend = backend
        self._buffers: dict = {}   # root tensor id -> Buffer

    # ---- persistent storage ----------------------------------------------------

    def buffer(self, t: Tensor):
        """The buffer of persistent tensor t's root (allocated and initialised on first use)."""
        root = t.root
        if root.kind not in PERSISTENT_KINDS:
            raise ValueError(f"{root!r} is not persistent")
        buf = self._buffers.get(root.id)
        if buf is None:
            buf = self.backend.alloc(max(1, root.size * DTYPE_SIZE[root.dtype]))
            self._buffers[root.id] = buf
            if root.init is not None:
                self._copy_in(buf, root, root.init)
        return buf

    def _copy_in(self, buf, t: Tensor, value: np.ndarray) -> None:
        if t.dtype == "bf16":
            f = np.ascontiguousarray(value, dtype=np.float32)
            value = ((f.view(np.uint32) + 0x7FFF + ((f.view(np.uint32) >> 16) & 1)) >> 16).astype(np.uint16)
        self.backend.copy_in(buf, 0, value)

    def set(self, t: Tensor, value) -> None:
        """Copy a numpy value into persistent tensor t (shape and dtype checked)."""
        if t.is_view or t.kind not in PERSISTENT_KINDS:
            raise ValueError(f"set: {t!r} is not a persistent tensor")
        arr = as_array(value, t.shape, t.dtype)
        self._copy_in(self.buffer(t), t, arr)

    def get(self, t: Tensor) -> np.ndarray:
        """A copy of persistent tensor t's value."""
        root = t.root
        ref = TensorRef(self.buffer(root), t.offset * DTYPE_SIZE[t.dtype], t.dtype, t.shape, t.strides)
        return _read_ref(self.backend, ref)

    @property
    def persistent_bytes(self) -> int:
        return sum(b.nbytes for b in self._buffers.values())

    # ---- compilation -------------------------------------------------------------

    def compile(self, outputs: list, n_threads: int | None = None) -> CompiledPlan:
        """Lower the nodes `outputs` need (in creation order) into one native plan."""
        outputs = [t for t in outputs if t is not None]
        tensors = self.graph.ancestors(outputs)
        execs = [t for t in tensors if t.kind == "op" and _ops.OPS[t.op].kernel is not None]
        for t in tensors:
            if t.kind == "op" and t.op not in _ops.OPS:
                raise ValueError(f"unknown op {t.op}")
            if t.kind in PERSISTENT_KINDS:
                self.buffer(t)
            if t.out is not None:
                self.buffer(t.out)
        # live ranges of arena roots
        start, end, size = {}, {}, {}
        for i, t in enumerate(execs):
            if t.out is None:
                start[t.id] = i
                end[t.id] = i
                size[t.id] = t.size * DTYPE_SIZE[t.dtype]
        for i, t in enumerate(execs):
            for s in t.srcs:
                r = s.root
                if r.id in end:
                    end[r.id] = max(end[r.id], i)
        last = len(execs)
        for t in outputs:
            if t.root.id in end:
                end[t.root.id] = last
        scratch_need = {}
        for i, t in enumerate(execs):
            opdef = _ops.OPS[t.op]
            if opdef.scratch is not None:
                key = ("scratch", t.id)
                scratch_need[t.id] = key
                start[key], end[key], size[key] = i, i, int(opdef.scratch(t))
        offsets, arena_size = _pack(start, end, size)
        arena = self.backend.alloc(max(arena_size, 1))
        n_threads = n_threads or getattr(self.backend, "n_threads", 1)

        def ref(t: Tensor) -> TensorRef:
            r = t.root
            if r.kind in PERSISTENT_KINDS:
                base, buf = 0, self.buffer(r)
            elif r.out is not None:
                out = r.out
                base, buf = out.offset * DTYPE_SIZE[out.dtype], self.buffer(out)
            else:
                base, buf = offsets[r.id], arena
            return TensorRef(buf, base + t.offset * DTYPE_SIZE[t.dtype], t.dtype, t.shape, t.strides)

        calls = []
        work_max = 0
        for t in execs:
            opdef = _ops.OPS[t.op]
            ip, fp = opdef.lower(t) if opdef.lower is not None else ((), ())
            dtype = t.dtype if t.op in ("cast", "cont") else "f32"
            kernel = f"{opdef.kernel}_{dtype}"
            if not self.backend.supports(kernel):
                raise DTypeError(f"{t.op}: backend {self.backend.name} has no kernel gt_{kernel}")
            work = opdef.work(t) if callable(opdef.work) else int(opdef.work)
            work_max = max(work_max, work)
            scratch = None
            if t.id in scratch_need:
                key = scratch_need[t.id]
                scratch = TensorRef(arena, offsets[key], "f32", (size[key],), (1,))
            label = f"{t.op} #{t.id}" + (f" ({t.name})" if t.name else "")
            calls.append(KernelCall(kernel, ref(t), tuple(ref(s) for s in t.srcs), tuple(ip),
                                    tuple(fp), scratch, work, label))
        plan = self.backend.compile(calls, n_threads)
        refs = {t.id: ref(t) for t in outputs}
        report = MemoryReport(arena=arena_size, arena_unpacked=sum(_align(v) for v in size.values()),
                              persistent=self.persistent_bytes, scratch=work_max * n_threads)
        return CompiledPlan(self, plan, arena, refs, report, len(calls))

    def run(self, plan: CompiledPlan, n_threads: int | None = None) -> None:
        """Execute a compiled plan (one native call)."""
        self.backend.run(plan.plan, n_threads)


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _pack(start: dict, end: dict, size: dict) -> tuple:
    """Offsets for tensors with live ranges [start, end] so that tensors alive at the same
    time never overlap; greedy by size (largest first, lowest free offset)."""
    order = sorted(size, key=lambda k: (-size[k], start[k]))
    placed = []      # (offset, end_offset, start, end)
    offsets = {}
    total = 0
    for k in order:
        n = _align(max(size[k], 1))
        s, e = start[k], end[k]
        busy = sorted((o, oe) for o, oe, ps, pe in placed if ps <= e and s <= pe)
        off = 0
        for o, oe in busy:
            if off + n <= o:
                break
            off = max(off, oe)
        offsets[k] = off
        placed.append((off, off + n, s, e))
        total = max(total, off + n)
    return offsets, total
