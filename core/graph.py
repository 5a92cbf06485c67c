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

import weakref
from dataclasses import dataclass

import numpy as np

from ggtrain.core import ops as _ops
from ggtrain.core.backend import Backend, KernelCall, TensorRef
from ggtrain.core.tensor import PERSISTENT_KINDS, Tensor, as_array, contiguous_strides
from ggtrain.errors import DTypeError, ShapeError
from ggtrain.native.dtypes import dtype as _dtype, nbytes

_ALIGN = 64
# Tensor.init of a parameter whose value a Runtime has moved into its own buffer
MOVED = object()


@dataclass(frozen=True)
class Rows:
    """An input value given as the rows source[index] of a dataset array (see
    Runtime.gather_rows): a batch gathered straight into the input's buffer."""
    source: np.ndarray
    index: np.ndarray


class Graph:
    """A static graph under construction: persistent tensors and op nodes in order."""

    def __init__(self):
        self.nodes: list = []
        self.segment = 0
        self.boundaries: set = set()
        self.kept: set = set()

    def _register(self, t: Tensor) -> int:
        self.nodes.append(t)
        return len(self.nodes) - 1

    def param(self, shape, init=None, name: str = "", trainable: bool = True,
              weight_decay: bool | None = None, dtype: str = "f32") -> Tensor:
        """A parameter with an initial value (numpy array; zeros if None).

        Trainable parameters are f32. A frozen one (trainable=False) may be stored in
        any type kernels read weights in (f16, bf16, Q4_0, ..., Q6_K): its init is then
        its raw bytes, or it is bound to a buffer already holding them (Runtime.bind).
        """
        if trainable and dtype != "f32":
            raise DTypeError(f"param {name!r}: trainable parameters are f32, got {dtype}")
        t = Tensor(self, shape, dtype, kind="param", name=name)
        t.init = None if init is None else as_array(init, t.shape, dtype)
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

    def keep(self, x: Tensor) -> Tensor:
        """Mark x (an op node) as kept under gradient checkpointing: backward reads its
        forward output instead of recomputing it (selective checkpointing, for outputs
        that cost much more to recompute than to hold). Returns x."""
        if x.kind != "op":
            raise ValueError(f"keep: {x!r} is not an op node")
        self.kept.add(x.id)
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
    """Bytes planned for a runtime once a plan is compiled: every plan of the runtime
    shares one arena (sized for the largest) and the persistent buffers."""

    arena: int          # intermediates of the runtime's plans, packed by live range (shared)
    arena_unpacked: int # what this plan's intermediates would take without reuse
    persistent: int     # parameters, state, inputs, constants of the runtime
    scratch: int        # the kernels' work memory of every plan of the runtime (Backend.work_memory)

    @property
    def peak(self) -> int:
        return self.arena + self.persistent + self.scratch


class CompiledPlan:
    """A native plan plus what is needed to read its results.

    Its intermediates live in the runtime's shared arena, so an output is read after
    this plan's run and before another plan of the same runtime runs.
    """

    def __init__(self, runtime, emit, arena_size: int, report: MemoryReport, n_nodes: int):
        self.runtime = runtime
        self._emit = emit              # arena -> (kernel calls, {output id: TensorRef})
        self.arena_size = arena_size
        self.work_nbytes = 0           # the work memory its native plan holds (the backend's answer)
        self.report = report
        self.n_nodes = n_nodes
        self.flops = 0                 # FLOPs of its products and convolutions (ops.product_flops)
        self.row_flops = 0             # the part of flops that only counted loss rows take (ops.row_flops)
        self.plan = None
        self.refs: dict = {}
        self.inputs: list = []         # the graph inputs it reads (each must be set before a run)

    def _lower(self, arena) -> None:
        calls, self.refs = self._emit(arena)
        self.plan = self.runtime.backend.compile(calls)
        self.work_nbytes = self.plan.work_nbytes

    def read(self, t: Tensor) -> np.ndarray:
        """A copy of an output tensor's value after a run.

        Raises RuntimeError for an output in the shared arena when another plan of the
        runtime has run since this one (it may have overwritten the value).
        """
        if self.plan is None:
            raise RuntimeError(f"reading {t!r}: a later plan of the runtime grew the arena, and this one has "
                               f"not run since")
        ref = self.refs.get(t.id)
        if ref is None:
            return self.runtime.get(t)
        if ref.buffer is self.runtime._arena and self.runtime._last_run is not self:
            raise RuntimeError(f"reading {t!r}: another plan of the runtime ran after this one "
                               f"(or this one never ran), and the arena they share was reused")
        return _read_ref(self.runtime.backend, ref)


def _read_ref(backend: Backend, ref: TensorRef) -> np.ndarray:
    """A copy of a tensor's value: numbers (bf16 as f32) for element types, the raw
    bytes (uint8, (rows, bytes per row)) of a block-typed tensor's whole rows."""
    dt = _dtype(ref.dtype)
    if dt.is_block:
        if ref.strides != contiguous_strides(ref.shape):
            raise ShapeError(f"reading a {ref.dtype} view (strides {ref.strides}) is not supported")
        raw = np.empty(nbytes(ref.shape, dt), dtype=np.uint8)
        backend.copy_out(ref.buffer, ref.offset, raw)
        return raw.reshape(tuple(ref.shape[:-1]) + (-1,)) if ref.shape else raw
    np_dtype = dt.numpy
    size = dt.itemsize
    if ref.strides == contiguous_strides(ref.shape):   # the common case (losses, logits): one copy
        out = np.empty(ref.shape, dtype=np_dtype)
        if out.size:
            backend.copy_out(ref.buffer, ref.offset, out)
    else:
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
        self._arena = None         # intermediates of every plan (the largest plan's size)
        self._plans: list = []     # weak references to the compiled plans
        self._last_run = None      # the plan whose intermediates the arena holds
        self._given: set = set()   # ids of the inputs a value was set for (set, gather_rows)

    # ---- persistent storage ----------------------------------------------------

    def buffer(self, t: Tensor):
        """The buffer of persistent tensor t's root (allocated and initialised on first use)."""
        root = t.root
        if root.kind not in PERSISTENT_KINDS:
            raise ValueError(f"{root!r} is not persistent")
        buf = self._buffers.get(root.id)
        if buf is None:
            if root.init is MOVED:
                raise ValueError(f"{root!r}: its initial value went into another runtime's memory "
                                 f"(build the graph again for a second runtime)")
            buf = self.backend.alloc(max(1, root.nbytes))
            self._buffers[root.id] = buf
            if root.init is not None:
                self._copy_in(buf, root, root.init)
                if root.kind == "param":   # the buffer holds it now: no second copy of a weight
                    root.init = MOVED
        return buf

    def bind(self, t: Tensor, buffer) -> None:
        """Make `buffer`, which already holds persistent tensor t's bytes in t's dtype (e.g.
        a weight read from a file straight into backend memory), t's storage: no copy.

        Raises ValueError when t is a view, not persistent, already has storage or an
        initial value; ShapeError when the buffer is too small.
        """
        if t.is_view or t.kind not in PERSISTENT_KINDS:
            raise ValueError(f"bind: {t!r} is not a persistent tensor")
        if t.id in self._buffers or t.init is not None:
            raise ValueError(f"bind: {t!r} already has storage or an initial value")
        if buffer.nbytes < t.nbytes:
            raise ShapeError(f"bind: a {buffer.nbytes}-byte buffer cannot hold {t!r} ({t.nbytes} bytes)")
        self._buffers[t.id] = buffer

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
        self._given.add(t.id)

    def gather_rows(self, t: Tensor, source: np.ndarray, index) -> None:
        """Set persistent tensor t to the rows source[index] (a batch drawn from a dataset
        array), gathered straight into t's buffer: no intermediate batch array. source
        must already hold t's element type (f32 or i32); (len(index),) + source.shape[1:]
        must be t's shape."""
        if t.is_view or t.kind not in PERSISTENT_KINDS:
            raise ValueError(f"gather_rows: {t!r} is not a persistent tensor")
        source, index = np.asarray(source), np.asarray(index)
        want = {"f32": np.float32, "i32": np.int32}.get(t.dtype)
        if want is None or source.dtype != want:
            raise DTypeError(f"gather_rows: a {t.dtype} tensor cannot take rows of a {source.dtype} array "
                             f"(f32 or i32 arrays of the tensor's own type)")
        if index.ndim != 1 or index.dtype.kind not in "iu":
            raise ShapeError(f"gather_rows: index must be a 1-D integer array, got {index.dtype} {index.shape}")
        if (len(index),) + source.shape[1:] != t.shape:
            raise ShapeError(f"gather_rows: {len(index)} rows of {source.shape[1:]} do not make shape {t.shape}")
        self.backend.gather_in(self.buffer(t), 0, source, index)
        self._given.add(t.id)

    def get(self, t: Tensor) -> np.ndarray:
        """A copy of persistent tensor t's value."""
        root = t.root
        ref = TensorRef(self.buffer(root), _byte_offset(t), t.dtype, t.shape, t.strides)
        return _read_ref(self.backend, ref)

    @property
    def persistent_bytes(self) -> int:
        return sum(b.nbytes for b in self._buffers.values())

    # ---- compilation -------------------------------------------------------------

    def compile(self, outputs: list) -> CompiledPlan:
        """Lower the nodes `outputs` need (in creation order) into one native plan.

        Its intermediates go in the runtime's one arena, shared by every plan (grown when
        this one needs more; an earlier plan is then lowered again when it next runs).
        """
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
        # what each node runs, and the memory its kernel needs besides its tensors
        nodes = []
        for t in execs:
            opdef = _ops.OPS[t.op]
            kernel = opdef.kernel_name(t)
            if not self.backend.supports(kernel):
                raise DTypeError(f"{t.op}: backend {self.backend.name} has no kernel gt_{kernel}")
            ip, fp = opdef.lower(t) if opdef.lower is not None else ((), ())
            label = f"{t.op} #{t.id}" + (f" ({t.name})" if t.name else "")
            probe = KernelCall(kernel, _desc(t), tuple(_desc(s) for s in t.srcs), tuple(ip), tuple(fp),
                               label=label)
            scratch, work = self.backend.kernel_sizes(probe)
            nodes.append((t, probe, scratch, work))
        # live ranges of arena roots and of node scratch
        start, end, size = {}, {}, {}
        for i, (t, _, scratch, _) in enumerate(nodes):
            if t.out is None:
                start[t.id] = end[t.id] = i
                size[t.id] = t.nbytes
            if scratch:
                key = ("scratch", t.id)
                start[key], end[key], size[key] = i, i, scratch
        for i, t in enumerate(execs):
            for s in t.srcs:
                r = s.root
                if r.id in end:
                    end[r.id] = max(end[r.id], i)
        last = len(execs)
        for t in outputs:
            if t.root.id in end:
                end[t.root.id] = last
        alias = self._inplace(nodes, start, end, size)
        offsets, arena_size = _pack(start, end, size)

        def emit(arena) -> tuple:
            def ref(t: Tensor) -> TensorRef:
                r = t.root
                if r.kind in PERSISTENT_KINDS:
                    base, buf = 0, self.buffer(r)
                elif r.out is not None:
                    base, buf = _byte_offset(r.out), self.buffer(r.out)
                else:
                    base, buf = offsets[alias.get(r.id, r.id)], arena
                return TensorRef(buf, base + _byte_offset(t), t.dtype, t.shape, t.strides)

            calls = []
            for t, probe, scratch, work in nodes:
                scratch_ref = None
                if scratch:
                    scratch_ref = TensorRef(arena, offsets[("scratch", t.id)], "f32", (scratch,), (1,))
                calls.append(KernelCall(probe.kernel, ref(t), tuple(ref(s) for s in t.srcs), probe.ip,
                                        probe.fp, scratch_ref, work, probe.label))
            return calls, {t.id: ref(t) for t in outputs}

        plan = CompiledPlan(self, emit, arena_size, None, len(nodes))
        plan.inputs = [t for t in tensors if t.kind == "input"]
        plan.flops = sum(_ops.product_flops(t) for t, *_ in nodes)
        plan.row_flops = sum(_ops.row_flops(t) for t, *_ in nodes)
        self._plans = [p for p in self._plans if p() is not None] + [weakref.ref(plan)]
        if self._arena is None or self._arena.nbytes < arena_size:
            self._arena = self.backend.alloc(max(arena_size, 1))
            # every other plan moves to the new arena when it next runs (lowering each one
            # here made n plans of growing size, a decoder's one per prompt length, cost n^2
            # lowerings: 65 for 10 plans); dropping its native plan frees the old arena
            for other in self._plans:
                if other() is not None and other() is not plan:
                    other().plan, other().refs = None, {}
        plan._lower(self._arena)
        plan.report = MemoryReport(
            arena=self._arena.nbytes, arena_unpacked=sum(_align(v) for v in size.values()),
            persistent=self.persistent_bytes,
            scratch=self.backend.work_memory([p() for p in self._plans if p() is not None]))
        return plan

    @staticmethod
    def _inplace(nodes: list, start: dict, end: dict, size: dict) -> dict:
        """Let a node whose op allows it (OpDef.inplace) write over an input that dies there:
        an arena tensor read last by this node, whole and of the same dtype and size. The node
        then takes that tensor's slot (its range joins the slot's). Returns {node id: the id
        of the tensor whose slot it uses}; start/end/size are updated to match."""
        alias = {}
        for i, (t, *_) in enumerate(nodes):
            opdef = _ops.OPS[t.op]
            if t.out is not None or t.id not in size:
                continue
            for k in opdef.inplace:
                s = t.srcs[k]
                r = s.root
                slot = alias.get(r.id, r.id)
                if (r.kind == "op" and r.out is None and slot in end and end[slot] == i and s.offset == 0
                        and s.is_contiguous() and s.size == r.size and r.dtype == t.dtype
                        and r.nbytes == t.nbytes):
                    alias[t.id] = slot
                    end[slot] = max(end[slot], end.pop(t.id))
                    del start[t.id], size[t.id]
                    break
        return alias

    def run(self, plan: CompiledPlan) -> None:
        """Execute a compiled plan (one native call). ValueError when an input it reads
        was never set (it would read zeros: a batch fed without one of its inputs)."""
        missing = [t for t in plan.inputs if t.id not in self._given]
        if missing:
            raise ValueError(f"run: the plan reads {', '.join(repr(t.name or t) for t in missing)}, "
                             f"never set (Runtime.set)")
        self._last_run = None
        if plan.plan is None:       # the arena grew since it was lowered
            plan._lower(self._arena)
        self.backend.run(plan.plan)
        self._last_run = plan

    @property
    def memory(self) -> MemoryReport:
        """What the runtime holds now: its arena, persistent buffers and every live plan's work."""
        plans = [p() for p in self._plans if p() is not None]
        return MemoryReport(arena=self._arena.nbytes if self._arena is not None else 0,
                            arena_unpacked=max([p.report.arena_unpacked for p in plans] + [0]),
                            persistent=self.persistent_bytes,
                            scratch=self.backend.work_memory(plans))


def _desc(t: Tensor) -> TensorRef:
    """t's dtype, shape and strides, without memory (what kernel sizes depend on)."""
    return TensorRef(None, 0, t.dtype, t.shape, t.strides)


def _byte_offset(t: Tensor) -> int:
    """Byte offset of view t's first element in its root (whole blocks for block types)."""
    return nbytes((t.offset,), t.dtype) if t.offset else 0


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _pack(start: dict, end: dict, size: dict) -> tuple:
    """Offsets for tensors with live ranges [start, end] so that tensors alive at the same
    time never overlap; greedy by size (largest first, lowest free offset).

    The placed tensors' (offset, end offset, start, end) live in numpy arrays, so finding
    the ones whose ranges overlap a new tensor's is one vectorized test (plans of a few
    thousand nodes: a Python scan per tensor was quadratic and took most of a second).
    """
    order = sorted(size, key=lambda k: (-size[k], start[k]))
    cap = max(1, len(order))
    p_off, p_end = np.zeros(cap, np.int64), np.zeros(cap, np.int64)
    p_s, p_e = np.zeros(cap, np.int64), np.zeros(cap, np.int64)
    offsets = {}
    total = 0
    for i, k in enumerate(order):
        n = _align(max(size[k], 1))
        s, e = start[k], end[k]
        live = (p_s[:i] <= e) & (s <= p_e[:i])
        lo, hi = p_off[:i][live], p_end[:i][live]
        sort = np.argsort(lo, kind="stable")
        off = 0
        for o, oe in zip(lo[sort].tolist(), hi[sort].tolist()):
            if off + n <= o:
                break
            off = max(off, oe)
        offsets[k] = off
        p_off[i], p_end[i], p_s[i], p_e[i] = off, off + n, s, e
        total = max(total, off + n)
    return offsets, total
