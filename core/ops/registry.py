"""The op registry's machinery (layer 3): OpDef, OPS, register, apply, and the checks and helpers every section shares."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ggtrain.core.numerics import EXACT, LLAMA
from ggtrain.core.tensor import Tensor
from ggtrain.errors import DTypeError, ShapeError
from ggtrain.native.dtypes import WEIGHT_TYPES
from ggtrain.native.host import (ACT8_TYPES, HYPER_BC1, HYPER_BC2, HYPER_BETA1, HYPER_BETA2,  # noqa: F401
                                 HYPER_COUNT, HYPER_EPS, HYPER_LR, HYPER_MAX_NORM, HYPER_MOMENTUM, HYPER_WD)


@dataclass(frozen=True)
class OpDef:
    """How the graph treats one op (see the module docstring)."""

    name: str
    infer: Callable                     # (srcs, params) -> (shape, dtype)
    kernel: str | None = None           # e.g. "add_fwd"; None for views and composites
    backward: Callable | None = None    # (y, g) -> list of grads, one per src
    lower: Callable | None = None       # (y) -> (ip tuple, fp tuple)
    contiguous: tuple = ()              # srcs the kernel needs contiguous (cont inserted)
    unit_stride_2d: tuple = ()          # srcs whose last 2 dims need one unit stride
    view: Callable | None = None        # (y) -> (offset, strides) into the src's root
    composite: bool = False
    differentiable: tuple = field(default=(0, 1, 2, 3))
    dtypes: tuple = ("f32",)            # kernel variants: gt_<kernel>_<one of these>
    inplace: tuple = ()                 # srcs whose memory dst may take when they die here
    suffix: Callable | None = None      # (y) -> the variant a node runs (default dtypes[0])
    # the numerics the op exists for (core/numerics.py): LLAMA for llama.cpp's CPU numbers
    # only (its rounding of activations, its float orders, its f16 tables): only the CPU
    # backend has these kernels, and a GPU has no reason to copy a CPU's rounding
    # (inference.llama_numerics_available asks the backend); EXACT for the rest
    numerics: str = EXACT

    def kernel_name(self, y) -> str:
        """The kernel node `y` runs, e.g. "matmul_fwd_f32_q4_0" (without the gt_ prefix)."""
        return f"{self.kernel}_{self.suffix(y) if self.suffix else self.dtypes[0]}"

    def kernel_name_for(self, w) -> str:
        """The kernel a node of this op with stored weight w runs (ops whose variant is
        their weight's type: matmul, get_rows, linear_cross_entropy)."""
        return f"{self.kernel}_{_weight_suffix(w)}"


OPS: dict = {}


def register(op: OpDef) -> OpDef:
    if op.name in OPS:
        raise ValueError(f"op {op.name} registered twice")
    OPS[op.name] = op
    return op


# ---- graph plumbing ---------------------------------------------------------------


def _graph_of(*xs):
    for x in xs:
        if isinstance(x, Tensor):
            return x.graph
    raise TypeError("an op needs at least one Tensor input")


def _cont(x: Tensor) -> Tensor:
    """A contiguous copy of x (views.cont; the views section registers its ops through this
    module, so it is imported when first needed, not at import)."""
    from ggtrain.core.ops.views import cont
    return cont(x)


def apply(name: str, srcs: list, **params) -> Tensor:
    """Create the node of op `name` on `srcs` (inserting `cont` where a kernel needs it)."""
    op = OPS[name]
    graph = _graph_of(*srcs)
    for s in srcs:
        if not isinstance(s, Tensor):
            raise TypeError(f"{name}: inputs must be Tensors, got {type(s).__name__}")
        if s.graph is not graph:
            raise ValueError(f"{name}: inputs belong to different graphs")
    srcs = list(srcs)
    for i in op.contiguous:
        if i < len(srcs) and not srcs[i].is_contiguous():
            srcs[i] = _cont(srcs[i])
    for i in op.unit_stride_2d:
        s = srcs[i]
        if s.ndim >= 2 and s.strides[-1] != 1 and s.strides[-2] != 1 and s.shape[-1] > 1 and s.shape[-2] > 1:
            srcs[i] = _cont(s)
    shape, dtype = op.infer(srcs, params)
    y = Tensor(graph, shape, dtype, op=name, srcs=srcs, params=params)
    if op.view is not None:
        root = srcs[0].root
        y.root = root
        y.offset, y.strides = op.view(y)
    y.requires_grad = any(s.requires_grad for s in srcs)
    return y


def _scalar_tensor(graph, value: float) -> Tensor:
    return graph.const(float(value), name=f"const {value:g}")


def _need(cond: bool, msg: str, exc=ShapeError):
    if not cond:
        raise exc(msg)


def _llama(y) -> int:
    """1 where node y computes in llama.cpp's numbers (its kernel's flag), else 0."""
    return int(y.params.get("numerics", EXACT) == LLAMA)


def _no_llama_gradient(y, name: str) -> None:
    if _llama(y):
        raise ValueError(f"{name}: llama.cpp's numbers (numerics llama) are for inference: no gradient")


def _f32(op, *xs):
    for x in xs:
        if x.dtype != "f32":
            raise DTypeError(f"{op}: expected f32 input, got {x.dtype} ({x!r})")


def broadcast_shape(op: str, a: tuple, b: tuple) -> tuple:
    """numpy broadcasting of two shapes; ShapeError naming the op otherwise."""
    out = []
    for i in range(1, max(len(a), len(b)) + 1):
        da = a[-i] if i <= len(a) else 1
        db = b[-i] if i <= len(b) else 1
        if da != db and da != 1 and db != 1:
            raise ShapeError(f"{op}: shapes {a} and {b} do not broadcast (dim -{i}: {da} vs {db})")
        out.append(db if da == 1 else da)
    return tuple(reversed(out))






def check_weight(op: str, w: Tensor) -> None:
    """A tensor kernels read in a stored weight type (f16, bf16, block types) must be
    2-D, frozen, and its whole stored matrix or that matrix transposed."""
    if w.dtype == "f32":
        return
    _need(w.dtype in WEIGHT_TYPES, f"{op}: no kernel reads {w.dtype} tensors ({w!r})", DTypeError)
    _need(not w.requires_grad, f"{op}: a {w.dtype} weight is frozen storage; train an f32 copy "
          f"instead ({w!r})", DTypeError)
    root = w.root
    _need(w.ndim == 2 and root.ndim == 2 and w.offset == 0 and root.is_contiguous()
          and w.strides in ((root.shape[1], 1), (1, root.shape[1])),
          f"{op}: a {w.dtype} weight must be a whole stored matrix or its transpose, got "
          f"shape {w.shape} strides {w.strides} of {root!r}")


def _weight_suffix(w: Tensor) -> str:
    """Kernel variant for f32 activations with weight w: "f32", or "f32_<w's dtype>"."""
    return "f32" if w.dtype == "f32" else f"f32_{w.dtype}"


# matmul and get_rows variants: f32, and f32 activations with a weight in each stored type
_WEIGHT_VARIANTS = ("f32",) + tuple(f"f32_{w}" for w in WEIGHT_TYPES if w != "f32")
