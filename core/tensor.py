"""Symbolic tensors (layer 3): a node of a static graph, with shape, dtype and storage view.

A Tensor is created by a Graph (parameters, inputs, constants, state) or by applying
an op (core/ops/) to other tensors. Nothing is computed when a tensor is made:
graphs are compiled into native plans (core/graph.py) and run many times.

Storage: every tensor has a `root` (the tensor that owns its memory) plus an element
`offset` and `strides` into the root's contiguous layout. Views (reshape, permute,
view) share their source's root; everything else is its own root.
"""
from __future__ import annotations

import numpy as np

from ggtrain.errors import DTypeError, ShapeError
from ggtrain.native.dtypes import DTYPES, ELEMENT_TYPES, WEIGHT_TYPES, dtype as _dtype, nbytes

# what a graph tensor may hold: the element types kernels compute in, and (frozen
# weights only, see Graph.weight) the types kernels read weights in
TENSOR_DTYPES = tuple(dict.fromkeys(ELEMENT_TYPES + WEIGHT_TYPES))
# Tensor kinds: persistent ones live in their own buffers across steps.
PERSISTENT_KINDS = ("param", "input", "const", "state")


def is_contiguous(shape: tuple, strides: tuple) -> bool:
    """Row-major with no gaps (the strides of size-1 dims do not matter)."""
    s = 1
    for n, st in zip(reversed(shape), reversed(strides)):
        if n != 1 and st != s:
            return False
        s *= n
    return True


def contiguous_strides(shape: tuple) -> tuple:
    """Row-major strides in elements for `shape`."""
    strides = []
    s = 1
    for n in reversed(shape):
        strides.append(s)
        s *= n
    return tuple(reversed(strides))


def numel(shape: tuple) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class Tensor:
    """One node of a graph. Build with Graph methods or ops; do not construct directly."""

    __slots__ = ("graph", "id", "shape", "dtype", "op", "srcs", "params", "kind", "name",
                 "requires_grad", "root", "offset", "strides", "segment", "out", "init",
                 "weight_decay", "__weakref__")

    def __init__(self, graph, shape, dtype, op=None, srcs=(), params=None, kind="op", name=""):
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise ShapeError(f"{op or kind}: negative dimension in shape {shape}")
        if dtype not in TENSOR_DTYPES:
            what = "a dtype no kernel reads" if dtype in DTYPES else "an unknown dtype"
            raise DTypeError(f"{op or kind}: {dtype!r} is {what} (tensors hold {', '.join(TENSOR_DTYPES)})")
        self.graph = graph
        self.shape = shape
        self.dtype = dtype
        self.op = op
        self.srcs = tuple(srcs)
        self.params = dict(params or {})
        self.kind = kind
        self.name = name
        self.requires_grad = False
        self.root = self
        self.offset = 0
        self.strides = contiguous_strides(shape)
        self.segment = graph.segment if graph is not None else 0
        self.out = None          # persistent tensor this op writes into (in-place / assign)
        self.init = None         # initial value of a persistent tensor
        self.weight_decay = None # per-parameter override (None: decay iff ndim >= 2)
        self.id = graph._register(self) if graph is not None else -1

    # ---- facts -------------------------------------------------------------

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return numel(self.shape)

    @property
    def is_view(self) -> bool:
        return self.root is not self

    @property
    def nbytes(self) -> int:
        """Bytes of this tensor's elements laid out contiguously (block types: whole rows)."""
        return nbytes(self.shape, self.dtype)

    def is_contiguous(self) -> bool:
        return is_contiguous(self.shape, self.strides)

    def __repr__(self) -> str:
        what = self.op or self.kind
        name = f" {self.name!r}" if self.name else ""
        return f"Tensor#{self.id}({what}{name}, {self.shape}, {self.dtype})"

    __hash__ = object.__hash__

    def __eq__(self, other):  # identity; tensors are graph nodes, not values
        return self is other

    # ---- operators (thin sugar over core.ops) -----------------------------------

    def _ops(self):
        from ggtrain.core import ops  # same layer; imported late to avoid a cycle
        return ops

    def __add__(self, other):
        return self._ops().add(self, other)

    def __radd__(self, other):
        return self._ops().add(other, self)

    def __sub__(self, other):
        return self._ops().sub(self, other)

    def __rsub__(self, other):
        return self._ops().sub(other, self)

    def __mul__(self, other):
        return self._ops().mul(self, other)

    def __rmul__(self, other):
        return self._ops().mul(other, self)

    def __truediv__(self, other):
        return self._ops().div(self, other)

    def __neg__(self):
        return self._ops().scale(self, -1.0)

    def __matmul__(self, other):
        return self._ops().matmul(self, other)

    @property
    def T(self):
        """Swap the last two dims (a view, no copy)."""
        return self._ops().transpose(self, -1, -2)

    def reshape(self, *shape):
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        return self._ops().reshape(self, shape)

    def permute(self, *axes):
        if len(axes) == 1 and isinstance(axes[0], (tuple, list)):
            axes = tuple(axes[0])
        return self._ops().permute(self, axes)

    def sum(self):
        return self._ops().sum(self)

    def mean(self):
        return self._ops().mean(self)


def as_array(value, shape: tuple, dtype: str) -> np.ndarray:
    """Validate an initial/input value against a tensor's shape and dtype.

    Element types take numbers of `shape` (bf16 as f32 values, rounded when copied in);
    a block type takes its raw bytes (uint8, nbytes(shape, dtype) of them, any shape).
    """
    if _dtype(dtype).is_block:
        arr = np.asarray(value)
        need = nbytes(shape, dtype)
        if arr.dtype != np.uint8 or arr.size != need:
            raise DTypeError(f"a {dtype} tensor of shape {tuple(shape)} takes its {need} raw bytes "
                             f"(uint8), got {arr.dtype} of {arr.size} elements")
        return np.ascontiguousarray(arr).reshape(-1)
    np_dtype = {"f32": np.float32, "f16": np.float16, "bf16": np.float32, "i32": np.int32}[dtype]
    arr = np.asarray(value)
    if arr.shape != tuple(shape):
        raise ShapeError(f"value of shape {arr.shape} does not match tensor shape {tuple(shape)}")
    if dtype == "i32" and arr.dtype.kind not in "iu":
        raise DTypeError(f"value of dtype {arr.dtype} given for an i32 tensor")
    return np.ascontiguousarray(arr, dtype=np_dtype)
