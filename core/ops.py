"""The op registry (layer 3): shape/dtype inference, kernel parameters and backward rules.

Each op is one `OpDef` in OPS, registered next to its public function and its backward
rule. A rule receives the forward node `y` (with y.srcs and y.params) and the upstream
gradient `g` (same shape as y) and returns one gradient (or None) per input, written
with the ops of this module, so it runs on every backend that has them.

Kernel names: an op `foo` runs `gt_foo_fwd_<dtypes>`; an op named `foo_bwd` runs
`gt_foo_bwd_<dtypes>`, where <dtypes> is the output's dtype, followed by an input's
where the inputs differ (`matmul_fwd_f32_q4_0`: f32 activations times a Q4_0 weight).
Each OpDef lists the variants it may run (`dtypes`) and picks one per node (`suffix`).
Composite ops (mean, transpose, linear) build other ops and have no kernel.
View ops (reshape, permute, view) have no kernel either: they alias their input's
memory with other strides. What memory a kernel needs besides its tensors (scratch,
work) is asked of the backend when a graph is compiled, never computed here.

Shapes are numpy order everywhere: x: (B, T, C) means batch, time, channels.
"""
from __future__ import annotations

import builtins
import struct
from dataclasses import dataclass, field
from typing import Callable

from ggtrain.core.numerics import EXACT, LLAMA, check_numerics
from ggtrain.core.tensor import Tensor, contiguous_strides, numel
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
            srcs[i] = cont(srcs[i])
    for i in op.unit_stride_2d:
        s = srcs[i]
        if s.ndim >= 2 and s.strides[-1] != 1 and s.strides[-2] != 1 and s.shape[-1] > 1 and s.shape[-2] > 1:
            srcs[i] = cont(s)
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


def sum_to(g: Tensor, shape: tuple) -> Tensor:
    """Sum g over the dims that were broadcast to reach g.shape from `shape`."""
    shape = tuple(shape)
    if g.shape == shape:
        return g
    if numel(shape) == numel(g.shape) and len(shape) < len(g.shape) and \
            g.shape[len(g.shape) - len(shape):] == shape:
        return reshape(g, shape)  # only leading size-1 dims were added
    return repeat_bwd(g, shape)


# ---- elementwise binary --------------------------------------------------------


def _infer_binary(name):
    def infer(srcs, params):
        a, b = srcs
        _f32(name, a, b)
        return broadcast_shape(name, a.shape, b.shape), "f32"
    return infer


def _as_tensors(a, b, name):
    if not isinstance(a, Tensor) and not isinstance(b, Tensor):
        raise TypeError(f"{name}: one input must be a Tensor")
    graph = _graph_of(a, b)
    if not isinstance(a, Tensor):
        a = _scalar_tensor(graph, a)
    if not isinstance(b, Tensor):
        b = _scalar_tensor(graph, b)
    return a, b


def add(a, b) -> Tensor:
    """a + b with numpy broadcasting. (f32)"""
    a, b = _as_tensors(a, b, "add")
    return apply("add", [a, b])


def sub(a, b) -> Tensor:
    """a - b with numpy broadcasting. (f32)"""
    if isinstance(a, Tensor) and not isinstance(b, Tensor):
        return add(a, -float(b))
    a, b = _as_tensors(a, b, "sub")
    return apply("sub", [a, b])


def mul(a, b) -> Tensor:
    """a * b with numpy broadcasting; a Python number becomes `scale`. (f32)"""
    if isinstance(a, Tensor) and not isinstance(b, Tensor):
        return scale(a, float(b))
    if isinstance(b, Tensor) and not isinstance(a, Tensor):
        return scale(b, float(a))
    return apply("mul", [a, b])


def div(a, b) -> Tensor:
    """a / b with numpy broadcasting; division by a number becomes `scale`. (f32)"""
    if isinstance(a, Tensor) and not isinstance(b, Tensor):
        return scale(a, 1.0 / float(b))
    a, b = _as_tensors(a, b, "div")
    return apply("div", [a, b])


register(OpDef("add", _infer_binary("add"), "add_fwd",
               backward=lambda y, g: [sum_to(g, y.srcs[0].shape), sum_to(g, y.srcs[1].shape)]))
register(OpDef("sub", _infer_binary("sub"), "sub_fwd",
               backward=lambda y, g: [sum_to(g, y.srcs[0].shape),
                                      sum_to(scale(g, -1.0), y.srcs[1].shape)]))
register(OpDef("mul", _infer_binary("mul"), "mul_fwd",
               backward=lambda y, g: [sum_to(mul(g, y.srcs[1]), y.srcs[0].shape),
                                      sum_to(mul(g, y.srcs[0]), y.srcs[1].shape)]))


def _div_bwd(y, g):
    a, b = y.srcs
    ga = sum_to(div(g, b), a.shape) if a.requires_grad else None
    gb = sum_to(scale(mul(g, div(y, b)), -1.0), b.shape) if b.requires_grad else None
    return [ga, gb]


register(OpDef("div", _infer_binary("div"), "div_fwd", backward=_div_bwd))


# ---- elementwise unary -----------------------------------------------------------


def _infer_same(name):
    def infer(srcs, params):
        _f32(name, *srcs)
        for s in srcs[1:]:
            _need(s.shape == srcs[0].shape, f"{name}: shapes {srcs[0].shape} and {s.shape} differ")
        return srcs[0].shape, "f32"
    return infer


def scale(x: Tensor, s: float) -> Tensor:
    """s * x for a Python number s. (f32)"""
    return apply("scale", [x], s=float(s))


def relu(x: Tensor) -> Tensor:
    """max(x, 0). (f32)"""
    return apply("relu", [x])


def relu_bwd(x: Tensor, g: Tensor) -> Tensor:
    """g * (x > 0). (f32)"""
    return apply("relu_bwd", [x, g])


def silu(x: Tensor) -> Tensor:
    """x * sigmoid(x). (f32)"""
    return apply("silu", [x])


def silu_bwd(x: Tensor, g: Tensor) -> Tensor:
    """g * d silu(x) / dx. (f32)"""
    return apply("silu_bwd", [x, g])


def swiglu(g: Tensor, u: Tensor) -> Tensor:
    """silu(g) * u, the llama FFN's gate, fused (no silu(g) tensor, forward or backward);
    the bits of mul(silu(g), u) and of its gradients. (f32, one shape)"""
    return apply("swiglu", [g, u])


def with_grad(y: Tensor, x: Tensor, gx: Tensor) -> Tensor:
    """y's value, whose backward gives x the gradient g * gx (g: y's upstream gradient, y
    one element) and nothing to y's own inputs: a gradient computed in the forward (a chunk
    of the loss over a frozen output matrix) handed to the backward, so what made it (the
    chunk's logits) need not be held or recomputed. gx: x's shape. Row-wise: y (N,) where
    y[r] depends on row r of x (N, C) only (per-row losses) and gx holds each row's gradient
    of its own y[r]; x then gets g[:, None] * gx. (f32)"""
    return apply("with_grad", [y, x, gx])


def _infer_with_grad(srcs, params):
    y, x, gx = srcs
    _f32("with_grad", y, x, gx)
    _need((y.size == 1 or (y.ndim == 1 and x.ndim == 2 and y.shape[0] == x.shape[0])) and gx.shape == x.shape,
          f"with_grad: y {y.shape} must hold one element (or one per row of x) and gx {gx.shape} match "
          f"x {x.shape}")
    return y.shape, "f32"


def _with_grad_bwd(y, g):
    rows = y.ndim == 1 and y.shape[0] > 1
    return [None, mul(reshape(g, (y.shape[0], 1) if rows else ()), y.srcs[2]), None]


def geglu(g: Tensor, u: Tensor) -> Tensor:
    """gelu(g) * u with gelu's tanh approximation, x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715
    x^3))): Gemma's FFN gate, fused forward and backward. (f32, one shape)"""
    return apply("geglu", [g, u])


def tanh(x: Tensor) -> Tensor:
    """tanh(x); its gradient g (1 - y^2) from the output. (f32)"""
    return apply("tanh", [x])


def _infer_glu_bwd(name):
    def infer(srcs, params):
        _f32(name, *srcs)
        _need(len(srcs) == 3 and all(s.shape == srcs[0].shape for s in srcs),
              f"{name}: g, u and dy must share a shape, got {[s.shape for s in srcs]}")
        return (2,) + srcs[0].shape, "f32"
    return infer


def _glu_bwd(name):
    def rule(y, gy):
        g, u = y.srcs
        both = apply(name, [g, u, gy])   # [dg | du]
        return [view(both, g.shape), view(both, g.shape, offset=g.size)]
    return rule


def exp(x: Tensor) -> Tensor:
    return apply("exp", [x])


def softplus(x: Tensor) -> Tensor:
    """log(1 + e^x), overflow-free; -log sigmoid(h) is softplus(-h). Its gradient
    sigmoid(x) = exp(x - y) from the output. (f32)"""
    return apply("softplus", [x])


def log1mexp(x: Tensor) -> Tensor:
    """log(1 - e^x) for x < 0 (log(1 - p) of a log-probability x), accurate near 0; -inf at
    0. Its gradient -e^x / (1 - e^x) = -exp(x - y) from the output. (f32)"""
    return apply("log1mexp", [x])


def log(x: Tensor) -> Tensor:
    return apply("log", [x])


def sqrt(x: Tensor) -> Tensor:
    return apply("sqrt", [x])


def sqr(x: Tensor) -> Tensor:
    return apply("sqr", [x])


def fill(graph, shape: tuple, value: float) -> Tensor:
    """A tensor of `shape` with every element `value` (no inputs)."""
    shape = tuple(shape)
    return Tensor(graph, shape, "f32", op="fill", params={"value": float(value)})


def _fill_infer(srcs, params):  # fill nodes are made directly by fill()
    raise AssertionError("fill has no inputs")


register(OpDef("scale", _infer_same("scale"), "scale_fwd",
               backward=lambda y, g: [scale(g, y.params["s"])],
               lower=lambda y: ((), (y.params["s"],))))
register(OpDef("fill", _fill_infer, "fill_fwd", lower=lambda y: ((), (y.params["value"],))))
register(OpDef("relu", _infer_same("relu"), "relu_fwd",
               backward=lambda y, g: [relu_bwd(y.srcs[0], g)]))
register(OpDef("relu_bwd", _infer_same("relu_bwd"), "relu_bwd", contiguous=(0, 1)))
register(OpDef("silu", _infer_same("silu"), "silu_fwd",
               backward=lambda y, g: [silu_bwd(y.srcs[0], g)]))
register(OpDef("silu_bwd", _infer_same("silu_bwd"), "silu_bwd", contiguous=(0, 1)))
register(OpDef("swiglu", _infer_same("swiglu"), "swiglu_fwd", backward=_glu_bwd("swiglu_bwd"), contiguous=(0, 1)))
register(OpDef("swiglu_bwd", _infer_glu_bwd("swiglu_bwd"), "swiglu_bwd", contiguous=(0, 1, 2)))
register(OpDef("geglu", _infer_same("geglu"), "geglu_fwd", backward=_glu_bwd("geglu_bwd"), contiguous=(0, 1)))
register(OpDef("geglu_bwd", _infer_glu_bwd("geglu_bwd"), "geglu_bwd", contiguous=(0, 1, 2)))


def geglu_f16(g: Tensor, u: Tensor) -> Tensor:
    """llama.cpp's CPU geglu: gelu_tanh of g rounded to f16, the result rounded to f16 (its
    table), times u; 0 for g <= -10, g * u for g >= 10. Inference only (llama.cpp's numbers
    for Gemma: numerics LLAMA); no gradient."""
    return apply("geglu_f16", [g, u])


register(OpDef("geglu_f16", _infer_same("geglu_f16"), "geglu_f16_fwd", contiguous=(0, 1), differentiable=(),
               numerics=LLAMA))


def swiglu_ggml(g: Tensor, u: Tensor) -> Tensor:
    """llama.cpp's CPU swiglu bit for bit: silu(g) * u with its vector exp (16 columns of a
    row at a time; libm's expf for the last C % 16). Inference only (numerics LLAMA:
    llama.cpp's numbers); no gradient."""
    return apply("swiglu_ggml", [g, u])


register(OpDef("swiglu_ggml", _infer_same("swiglu_ggml"), "swiglu_ggml_fwd", contiguous=(0, 1), differentiable=(),
               numerics=LLAMA))
register(OpDef("with_grad", _infer_with_grad, "scale_fwd", lower=lambda y: ((), (1.0,)),   # a copy of y
               backward=_with_grad_bwd, differentiable=(1,)))
register(OpDef("tanh", _infer_same("tanh"), "tanh_fwd",
               backward=lambda y, g: [sub(g, mul(mul(g, y), y))]))
register(OpDef("exp", _infer_same("exp"), "exp_fwd", backward=lambda y, g: [mul(g, y)]))
register(OpDef("softplus", _infer_same("softplus"), "softplus_fwd",
               backward=lambda y, g: [mul(g, exp(sub(y.srcs[0], y)))]))
register(OpDef("log1mexp", _infer_same("log1mexp"), "log1mexp_fwd",
               backward=lambda y, g: [scale(mul(g, exp(sub(y.srcs[0], y))), -1.0)]))
register(OpDef("log", _infer_same("log"), "log_fwd", backward=lambda y, g: [div(g, y.srcs[0])]))
register(OpDef("sqrt", _infer_same("sqrt"), "sqrt_fwd",
               backward=lambda y, g: [scale(div(g, y), 0.5)]))
register(OpDef("sqr", _infer_same("sqr"), "sqr_fwd",
               backward=lambda y, g: [mul(g, scale(y.srcs[0], 2.0))]))


# ---- dropout ----------------------------------------------------------------------


def dropout(x: Tensor, p: float, seed: Tensor, salt: int) -> Tensor:
    """x * keep / (1 - p), each element kept with probability 1 - p. (f32)

    The mask is a hash of (seed, salt, flat index) (see gt_dropout_fwd_f32): seed is an
    i32 tensor of shape () or (1,) the host sets each step, salt an int in [0, 2^32)
    distinct per dropout of a graph (so two dropouts draw different masks). The same
    mask comes back for any thread count, in the backward and when checkpointing
    recomputes the forward. p == 0 returns x itself (no node).
    Raises ValueError for p outside [0, 1) or a bad salt, DTypeError / ShapeError for seed.
    """
    p = float(p)
    if not 0.0 <= p < 1.0 or struct.unpack("f", struct.pack("f", p))[0] >= 1.0:
        raise ValueError(f"dropout: p must be in [0, 1) (as a float32), got {p}")
    if p == 0.0:
        return x
    return apply("dropout", [x, seed], p=p, salt=int(salt))


def _infer_dropout(srcs, params):
    x, seed = srcs
    _f32("dropout", x)
    if seed.dtype != "i32":
        raise DTypeError(f"dropout: seed must be i32, got {seed.dtype} ({seed!r})")
    _need(seed.shape in ((), (1,)), f"dropout: seed must have shape () or (1,), got {seed.shape}")
    _need(0.0 < params["p"] < 1.0, f"dropout: p must be in (0, 1) for a node, got {params['p']}", ValueError)
    _need(0 <= params["salt"] < 2**32, f"dropout: salt must be in [0, 2^32), got {params['salt']}", ValueError)
    return x.shape, "f32"


def _dropout_bwd(y, g):
    # the same mask and scale: dx = g * keep / (1 - p)
    return [dropout(g, y.params["p"], y.srcs[1], y.params["salt"]), None]


register(OpDef("dropout", _infer_dropout, "dropout_fwd", contiguous=(0, 1), backward=_dropout_bwd,
               lower=lambda y: ((y.params["salt"],), (y.params["p"],)), differentiable=(0,)))


# ---- reductions and broadcasting -----------------------------------------------

def sum(x: Tensor) -> Tensor:  # noqa: A001 - the op's name
    """Sum of all elements, a scalar (shape ()). (f32)"""
    return apply("sum", [x])


def sumsq(x: Tensor) -> Tensor:
    """Sum of the squares of all elements, a scalar (shape ()), in one pass (no squared
    copy): a gradient's squared norm. (f32)"""
    return apply("sumsq", [x])


def mean(x: Tensor) -> Tensor:
    """Mean of all elements, a scalar (composite: sum then scale)."""
    return scale(sum(x), 1.0 / max(1, x.size))


def sum_rows(x: Tensor) -> Tensor:
    """Sum over the last dim, kept as size 1: (..., N) -> (..., 1). (f32)"""
    return apply("sum_rows", [x])


def repeat(x: Tensor, shape: tuple) -> Tensor:
    """x broadcast (copied) to `shape`, numpy rules. (f32)"""
    return apply("repeat", [x], shape=tuple(shape))


def repeat_bwd(g: Tensor, shape: tuple) -> Tensor:
    """g summed down to `shape` over the broadcast dims (the backward of repeat)."""
    return apply("repeat_bwd", [g], shape=tuple(shape))


def _infer_total(name):
    def infer(srcs, params):
        _f32(name, srcs[0])
        return (), "f32"
    return infer


def _infer_sum_rows(srcs, params):
    _f32("sum_rows", srcs[0])
    x = srcs[0]
    _need(x.ndim >= 1, "sum_rows: input must have at least 1 dim")
    return x.shape[:-1] + (1,), "f32"


def _infer_repeat(srcs, params):
    x = srcs[0]
    _f32("repeat", x)
    shape = params["shape"]
    _need(broadcast_shape("repeat", x.shape, shape) == shape and len(shape) >= x.ndim,
          f"repeat: {x.shape} does not broadcast to {shape}")
    return shape, "f32"


def _infer_repeat_bwd(srcs, params):
    g = srcs[0]
    _f32("repeat_bwd", g)
    shape = params["shape"]
    _need(len(shape) <= g.ndim and broadcast_shape("repeat_bwd", shape, g.shape) == g.shape,
          f"repeat_bwd: {shape} does not broadcast to {g.shape}")
    return shape, "f32"


register(OpDef("sum", _infer_total("sum"), "sum_fwd",
               backward=lambda y, g: [repeat(g, y.srcs[0].shape)]))
register(OpDef("sumsq", _infer_total("sumsq"), "sumsq_fwd",
               backward=lambda y, g: [mul(scale(y.srcs[0], 2.0), repeat(g, y.srcs[0].shape))]))
register(OpDef("sum_rows", _infer_sum_rows, "sum_rows_fwd",
               backward=lambda y, g: [repeat(g, y.srcs[0].shape)]))
register(OpDef("repeat", _infer_repeat, "repeat_fwd",
               backward=lambda y, g: [repeat_bwd(g, y.srcs[0].shape)]))
register(OpDef("repeat_bwd", _infer_repeat_bwd, "repeat_bwd",
               backward=lambda y, g: [repeat(g, y.srcs[0].shape)]))


# ---- matmul -------------------------------------------------------------------------


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """a (..., M, K) @ b (..., K, N) -> (..., M, N), batch dims broadcast. (f32)

    Transposed operands (views from .T) cost nothing: the kernel packs either layout.
    b may also be a frozen weight in any type kernels read (f16, bf16, Q4_0, ...,
    Q6_K; see Graph.param), 2-D, in its stored layout or transposed: the kernel
    dequantizes it a tile at a time while packing, never all of it.
    """
    return apply("matmul", [a, b])


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


def _infer_matmul(srcs, params):
    a, b = srcs
    _f32("matmul", a)
    check_weight("matmul", b)
    _need(a.ndim >= 2 and b.ndim >= 2, f"matmul: inputs need >= 2 dims, got {a.shape} and {b.shape}")
    _need(a.shape[-1] == b.shape[-2],
          f"matmul: inner dims differ: {a.shape} @ {b.shape} ({a.shape[-1]} vs {b.shape[-2]})")
    batch = broadcast_shape("matmul", a.shape[:-2], b.shape[:-2])
    return batch + (a.shape[-2], b.shape[-1]), "f32"


def _weight_suffix(w: Tensor) -> str:
    """Kernel variant for f32 activations with weight w: "f32", or "f32_<w's dtype>"."""
    return "f32" if w.dtype == "f32" else f"f32_{w.dtype}"


# matmul and get_rows variants: f32, and f32 activations with a weight in each stored type
_WEIGHT_VARIANTS = ("f32",) + tuple(f"f32_{w}" for w in WEIGHT_TYPES if w != "f32")


def _matmul_bwd(y, g):
    return _product_grads(*y.srcs, g)


def _product_grads(a, b, g):
    """The gradients of a @ b (with respect to a and b, None where not needed) from g."""
    ga = gb = None
    if a.requires_grad:
        ga = sum_to(matmul(g, transpose(b, -1, -2)), a.shape)
    if b.requires_grad:
        if b.ndim == 2 and a.ndim >= 2:
            # b shared across the batch: one (K, B*M) @ (B*M, N) product, no batch sum
            a2 = a if a.ndim == 2 else reshape(a if a.is_contiguous() else cont(a),
                                               (numel(a.shape[:-1]), a.shape[-1]))
            g2 = g if g.ndim == 2 else reshape(g if g.is_contiguous() else cont(g),
                                               (numel(g.shape[:-1]), g.shape[-1]))
            # in b's own layout, so that its gradient needs no transposing copy or add:
            # (g2.T @ a2).T when b is a transposed weight (x @ W.T), else a2.T @ g2 (the
            # same bits: one in-order FMA chain over the rows per element either way)
            if b.strides[-1] != 1 and b.shape[-1] > 1:
                gb = transpose(matmul(transpose(g2, 0, 1), a2), 0, 1)
            else:
                gb = matmul(transpose(a2, 0, 1), g2)
        else:
            gb = sum_to(matmul(transpose(a, -1, -2), g), b.shape)
    return [ga, gb]


register(OpDef("matmul", _infer_matmul, "matmul_fwd", backward=_matmul_bwd,
               unit_stride_2d=(0, 1), dtypes=_WEIGHT_VARIANTS, suffix=lambda y: _weight_suffix(y.srcs[1])))


def matmul_lora(x: Tensor, w: Tensor, h: Tensor, b: Tensor) -> Tensor:
    """x @ w.T + h @ b.T in one pass over the output: a frozen linear layer w (N, K), f32 or a
    stored weight, with its rank-r adapter's update, h (..., r) its scaled x A^T and b (N, r)
    its B. The same values as add(linear(x, w), linear(h, b)) up to rounding (the adapter's
    products are summed onto the frozen product's instead of apart), without the temporary
    of the output's size or the add. K, r > 0. (f32)"""
    return apply("matmul_lora", [x, transpose(w, -1, -2), h, transpose(b, -1, -2)])


def _infer_matmul_lora(srcs, params):
    x, wt, h, bt = srcs
    shape, dtype = _infer_matmul([x, wt], params)
    _f32("matmul_lora", h)
    _f32("matmul_lora", bt)
    _need(bt.ndim == 2 and bt.shape[1] == shape[-1] and h.shape == shape[:-1] + (bt.shape[0],),
          f"matmul_lora: expected h {shape[:-1] + ('r',)} and b ({shape[-1]}, r), got {h.shape} and {bt.shape[::-1]}")
    _need(x.shape[-1] > 0 and bt.shape[0] > 0, f"matmul_lora: both products need k > 0, got {x.shape[-1]} "
          f"and r = {bt.shape[0]}")
    return shape, dtype


def _matmul_lora_bwd(y, g):
    x, wt, h, bt = y.srcs
    return _product_grads(x, wt, g) + _product_grads(h, bt, g)


register(OpDef("matmul_lora", _infer_matmul_lora, "matmul_lora_fwd", backward=_matmul_lora_bwd,
               contiguous=(2,), unit_stride_2d=(0, 1, 3), dtypes=_WEIGHT_VARIANTS,
               suffix=lambda y: _weight_suffix(y.srcs[1])))


# (ACT8_TYPES: the weight types whose product with 8-bit activations has a kernel, native/host.py)


def matmul_q8(a: Tensor, b: Tensor) -> Tensor:
    """a (..., M, K) @ b, b the transposed view W.T of a stored weight W (N, K) of an
    ACT8_TYPES type, with a's rows first quantized to 8 bits in blocks of 32 and the block
    products summed in integers: llama.cpp's numerics for a quantized weight (native/cpu/
    qdot8.c). Forward only: generation and evaluation, never training."""
    return apply("matmul_q8", [a, b])


def _infer_matmul_q8(srcs, params):
    a, b = srcs
    _need(b.dtype in ACT8_TYPES, f"matmul_q8: the weight must be stored in one of {', '.join(ACT8_TYPES)}, "
          f"got {b.dtype} ({b!r})", DTypeError)
    shape, dtype = _infer_matmul(srcs, params)
    _need(b.strides[-2] == 1, f"matmul_q8: the weight must be the view W.T (x @ W.T), got strides {b.strides}")
    return shape, dtype


register(OpDef("matmul_q8", _infer_matmul_q8, "matmul_q8_fwd", unit_stride_2d=(0,), differentiable=(),
               dtypes=tuple(f"f32_{w}" for w in ACT8_TYPES), suffix=lambda y: _weight_suffix(y.srcs[1]),
               numerics=LLAMA))


# the weight types matmul_ggml takes (native/cpu/matmul_ggml.c)
GGML_FLOAT_TYPES = ("f32", "f16")


def matmul_ggml(a: Tensor, b: Tensor) -> Tensor:
    """a (..., M, K) @ b, b the view W.T of a weight W (N, K) in f32 or stored in f16, in
    llama.cpp's CPU float order for such weights (its tinyBLAS GEMM's 16 lanes when M >= 2,
    N % 4 == 0 and K % 16 == 0, else its vec_dot's 64; a rounded to f16 against an f16 W;
    native/cpu/matmul_ggml.c): llama numerics for weights that are not quantized and for
    LoRA factors. a's rows, batch dims folded, are one llama.cpp ubatch. Forward only."""
    return apply("matmul_ggml", [a, b])


def _infer_matmul_ggml(srcs, params):
    a, b = srcs
    _need(b.dtype in GGML_FLOAT_TYPES, f"matmul_ggml: the weight must be f32 or stored in f16, got {b.dtype} "
          f"({b!r})", DTypeError)
    _need(b.ndim == 2 and (b.shape[0] <= 1 or b.strides[0] == 1),
          f"matmul_ggml: the weight must be the 2-D view W.T (x @ W.T), got shape {b.shape} strides {b.strides}")
    return _infer_matmul(srcs, params)


register(OpDef("matmul_ggml", _infer_matmul_ggml, "matmul_ggml_fwd", contiguous=(0,), differentiable=(),
               dtypes=("f32", "f32_f16"), suffix=lambda y: _weight_suffix(y.srcs[1]), numerics=LLAMA))


def linear(x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
    """x (..., K) @ w.T + b for a weight w (N, K) stored like ggml/PyTorch (composite)."""
    y = matmul(x, transpose(w, -1, -2))
    return add(y, b) if b is not None else y


# ---- normalisation, softmax, loss ---------------------------------------------------


def rms_norm(x: Tensor, eps: float = 1e-5, numerics: str = EXACT) -> Tensor:
    """x / sqrt(mean(x^2, last dim) + eps); no weight (multiply it after). (f32) numerics
    LLAMA: llama.cpp's CPU bits (the squares summed in double; inference only, no gradient)."""
    return apply("rms_norm", [x], eps=float(eps), numerics=check_numerics(numerics))


def _rms_norm_backward(y, g):
    _no_llama_gradient(y, "rms_norm")
    return [rms_norm_bwd(y.srcs[0], g, y.params["eps"])]


def rms_norm_bwd(x: Tensor, g: Tensor, eps: float) -> Tensor:
    return apply("rms_norm_bwd", [x, g], eps=float(eps))


# softmax masks: the kernel's ip[0] for each (see gt_softmax_fwd_f32)
_SOFTMAX_MASKS = {"none": 0, "causal": 1, "pos": 2, "seg": 3}


def softmax(x: Tensor, scale: float = 1.0, causal: bool = False, pos: Tensor | None = None,
            seg: Tensor | None = None) -> Tensor:
    """softmax(scale * x (+ mask)) over the last dim of x (..., Tq, Tk). (f32)

    At most one mask: causal: query i sees keys j <= i + (Tk - Tq). pos (Tq,) i32: query i
    sees keys j <= pos[i] (keys are a KV cache of positions 0..Tk-1). seg (B, T) i32 for
    x (B, ..., T, T) (packed samples, seg = a token's sample in its row): query i of batch
    row b sees keys j <= i with seg[b, j] == seg[b, i]. Masked entries are 0.
    Raises ValueError for two masks, ShapeError / DTypeError for a bad pos or seg.
    """
    if int(bool(causal)) + (pos is not None) + (seg is not None) > 1:
        raise ValueError("softmax: give one of causal, pos and seg")
    if pos is not None:
        return apply("softmax", [x, pos], scale=float(scale), mask="pos")
    if seg is not None:
        return apply("softmax", [x, seg], scale=float(scale), mask="seg")
    return apply("softmax", [x], scale=float(scale), mask="causal" if causal else "none")


def softmax_bwd(y: Tensor, g: Tensor, scale: float) -> Tensor:
    return apply("softmax_bwd", [y, g], scale=float(scale))


def cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean over rows of -log softmax(logits)[row, target]; logits (N, V) f32, targets (N,) i32.

    Rows with a negative target are ignored. Returns a scalar.
    """
    return apply("cross_entropy", [logits, targets])


def cross_entropy_rows(logits: Tensor, targets: Tensor) -> Tensor:
    """Each row's -log softmax(logits)[row, target], (N,): 0 where the target is negative.
    The per-sequence log-probabilities of preference losses are sums of these. (f32)"""
    return apply("cross_entropy_rows", [logits, targets])


def cross_entropy_bwd(logits: Tensor, targets: Tensor, g: Tensor, rows: bool = False) -> Tensor:
    """dlogits of cross_entropy (g a scalar), or of cross_entropy_rows with rows (g (N,))."""
    return apply("cross_entropy_bwd", [logits, targets, g], rows=bool(rows))


def _infer_ce(srcs, params):
    logits, targets = srcs[0], srcs[1]
    _f32("cross_entropy", logits)
    _need(logits.ndim == 2, f"cross_entropy: logits must be (N, V), got {logits.shape}")
    if targets.dtype != "i32":
        raise DTypeError(f"cross_entropy: targets must be i32, got {targets.dtype}")
    _need(targets.shape == logits.shape[:1],
          f"cross_entropy: targets {targets.shape} do not match logits {logits.shape}")
    if len(srcs) == 3:
        _f32("cross_entropy_bwd", srcs[2])
        if params.get("rows"):
            _need(srcs[2].shape == logits.shape[:1],
                  f"cross_entropy_bwd: g {srcs[2].shape} must hold one value per row of {logits.shape}")
        else:
            _need(srcs[2].size == 1, "cross_entropy_bwd: g must be a scalar")
        return logits.shape, "f32"
    return (logits.shape[0],) if params.get("rows") else (), "f32"


def _infer_softmax_bwd(srcs, params):
    y, g = srcs
    _f32("softmax_bwd", y, g)
    _need(y.shape == g.shape, f"softmax_bwd: shapes {y.shape} and {g.shape} differ")
    return y.shape, "f32"


def _infer_softmax(srcs, params):
    x = srcs[0]
    mask = params["mask"]
    _f32("softmax", x)
    _need(x.ndim >= 1, "softmax: input must have at least 1 dim")
    _need(mask in _SOFTMAX_MASKS and len(srcs) == (2 if mask in ("pos", "seg") else 1),
          f"softmax: mask {mask!r} with {len(srcs) - 1} mask inputs", ValueError)
    if mask == "pos":
        pos = srcs[1]
        if pos.dtype != "i32":
            raise DTypeError(f"softmax: positions must be i32, got {pos.dtype}")
        _need(x.ndim >= 2 and pos.shape == (x.shape[-2],),
              f"softmax: positions {pos.shape} do not match Tq of {x.shape}")
    if mask == "seg":
        seg = srcs[1]
        if seg.dtype != "i32":
            raise DTypeError(f"softmax: segments must be i32, got {seg.dtype}")
        _need(x.ndim >= 3 and x.shape[-2] == x.shape[-1],
              f"softmax: the segment mask needs x (B, ..., T, T), got {x.shape}")
        _need(seg.shape == (x.shape[0], x.shape[-1]),
              f"softmax: segments {seg.shape} do not match (B, T) = {(x.shape[0], x.shape[-1])} of {x.shape}")
    if mask == "causal":
        _need(x.ndim >= 2, f"softmax: causal mask needs (..., Tq, Tk), got {x.shape}")
        _need(x.shape[-2] <= x.shape[-1], f"softmax: causal mask needs Tq <= Tk, got {x.shape}")
    return x.shape, "f32"


def _infer_rms_norm(srcs, params):
    _f32("rms_norm", *srcs)
    for s in srcs[1:]:
        _need(s.shape == srcs[0].shape, f"rms_norm_bwd: shapes {srcs[0].shape} and {s.shape} differ")
    _need(srcs[0].ndim >= 1, "rms_norm: input must have at least 1 dim")
    return srcs[0].shape, "f32"


register(OpDef("rms_norm", _infer_rms_norm, "rms_norm_fwd", contiguous=(0,), backward=_rms_norm_backward,
               lower=lambda y: ((_llama(y),), (y.params["eps"],))))
register(OpDef("rms_norm_bwd", _infer_rms_norm, "rms_norm_bwd", contiguous=(0, 1),
               lower=lambda y: ((), (y.params["eps"],))))
register(OpDef("softmax", _infer_softmax, "softmax_fwd", contiguous=(0, 1),
               backward=lambda y, g: [softmax_bwd(y, g, y.params["scale"]), None],
               lower=lambda y: ((_SOFTMAX_MASKS[y.params["mask"]],), (y.params["scale"],)),
               differentiable=(0,)))
register(OpDef("softmax_bwd", _infer_softmax_bwd, "softmax_bwd", contiguous=(0, 1),
               lower=lambda y: ((), (y.params["scale"],))))
register(OpDef("cross_entropy", _infer_ce, "cross_entropy_fwd", contiguous=(0, 1),
               backward=lambda y, g: [cross_entropy_bwd(y.srcs[0], y.srcs[1], g), None],
               lower=lambda y: ((0,), ()), differentiable=(0,)))
register(OpDef("cross_entropy_bwd", _infer_ce, "cross_entropy_bwd", contiguous=(0, 1, 2),
               lower=lambda y: ((0, int(y.params.get("rows", False))), ()), inplace=(0,)))
# the kernels of cross_entropy with ip[1] = 1: per-row losses, per-row upstream gradients
register(OpDef("cross_entropy_rows", lambda srcs, params: _infer_ce(srcs, {"rows": True}), "cross_entropy_fwd",
               contiguous=(0, 1), backward=lambda y, g: [cross_entropy_bwd(y.srcs[0], y.srcs[1], g, rows=True), None],
               lower=lambda y: ((0, 1), ()), differentiable=(0,)))


def linear_cross_entropy(x: Tensor, w: Tensor, targets: Tensor, scale: float = 1.0, softcap: float = 0.0,
                         mean: bool = True, grad: bool = True) -> Tensor:
    """Cross-entropy over the logits x @ w.T (times scale, then soft-capped to softcap *
    tanh(l / softcap) when softcap > 0) against targets, with its gradient with respect to
    x, never holding the (N, V) logits: (N C + N,) f32, first dx (N, C), row r = d nll[r] /
    d x[r], then nll (N,), each row's -log softmax[target] (0, and a zero row, where the
    target is negative); with mean, both divided by the number of rows counted; without
    grad, dx is zeros (losses only, at half the work: evaluation). x (N, C)
    f32, w (V, C) f32 or a frozen stored weight (whole, as stored), targets (N,) i32. The
    loss of a fine-tune whose output matrix is frozen (LoRA): its gradient is handed to the
    backward with with_grad (see losses.chunked_loss), so the op itself has none."""
    return apply("linear_cross_entropy", [x, w, targets], scale=float(scale), softcap=float(softcap),
                 mean=bool(mean), grad=bool(grad))


def _infer_linear_ce(srcs, params):
    x, w, targets = srcs
    _f32("linear_cross_entropy", x)
    check_weight("linear_cross_entropy", w)
    _need(x.ndim == 2 and w.ndim == 2 and w.shape[1] == x.shape[1] and w.strides[-1] == 1,
          f"linear_cross_entropy: expected x (N, C) and w (V, C) as stored, got {x.shape} and {w!r}")
    if targets.dtype != "i32":
        raise DTypeError(f"linear_cross_entropy: targets must be i32, got {targets.dtype}")
    _need(targets.shape == x.shape[:1],
          f"linear_cross_entropy: targets {targets.shape} do not match x {x.shape}")
    _need(params["softcap"] >= 0, f"linear_cross_entropy: softcap must be >= 0, got {params['softcap']}")
    return (x.shape[0] * (x.shape[1] + 1),), "f32"


register(OpDef("linear_cross_entropy", _infer_linear_ce, "linear_cross_entropy_fwd", contiguous=(0, 1, 2),
               differentiable=(), dtypes=_WEIGHT_VARIANTS, suffix=lambda y: _weight_suffix(y.srcs[1]),
               lower=lambda y: ((int(y.params["mean"]), int(y.params["grad"])),
                                (y.params["scale"], y.params["softcap"]))))


# ---- attention (fused) --------------------------------------------------------------


def attention(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool = False, pos: Tensor | None = None,
              seg: Tensor | None = None, with_lse: bool = False, window: int = 0, numerics: str = EXACT,
              scale_q: bool = False, kv_f16: bool = False):
    """softmax(scale * q k^T + mask) v for each query head, fused (gt_attention_fwd_f32):
    no (Tq, Tk) tensor is made, here or in the backward.

    q (B, Tq, H, D), k and v (B, Tk, Hkv, D) with Hkv dividing H (query head h reads KV
    head h // (H / Hkv)), read in place through their strides (a copy only when D is not
    the unit-stride dim). Masks as softmax's: causal, pos (Tq,) i32, or seg (B, T) i32;
    window w > 0 (with a mask): each query sees only the w keys ending at its own (query i
    sees key j when i - j < w; by position with pos), llama.cpp's sliding window.
    Returns O (B, Tq, H, D), or (O, LSE (B, H, Tq)) with with_lse: each row's log-sum-exp
    over the keys it sees (-inf, and O = 0, for a row that sees none). Both are views of
    one node, which is all the backward keeps (besides q, k, v).
    numerics LLAMA: llama.cpp's CPU numbers bit for bit instead (its dot products' order, its vector
    exp, its double sums; key j being cache row j; native/cpu/attention.c says how), and with
    scale_q the scale multiplies q before the dots as some families' graphs do (gemma3, phi3),
    else the dots; with kv_f16 as its F16 KV cache (its default) rounds q, k, v and the weights:
    inference only, CPU only, no gradient, no segment mask.
    Raises ValueError for two masks, ShapeError / DTypeError for bad shapes or types.
    """
    if int(bool(causal)) + (pos is not None) + (seg is not None) > 1:
        raise ValueError("attention: give one of causal, pos and seg")
    qkv = [x if x.ndim == 4 and (x.strides[-1] == 1 or x.shape[-1] == 1) else cont(x) for x in (q, k, v)]
    mask = "pos" if pos is not None else "seg" if seg is not None else "causal" if causal else "none"
    extra = [pos] if pos is not None else [seg] if seg is not None else []
    if window and mask == "none":
        raise ValueError("attention: a window needs a mask (causal, pos or seg)")
    llama = check_numerics(numerics) == LLAMA
    if (llama and mask == "seg") or ((scale_q or kv_f16) and not llama):
        raise ValueError("attention: llama numerics take no segment mask; scale_q and kv_f16 need llama numerics")
    y = apply("attention", qkv + extra, scale=float(scale), mask=mask, window=int(window), numerics=numerics,
              scale_q=bool(scale_q), kv_f16=bool(kv_f16))
    b, tq, h, _ = q.shape
    o = view(y, q.shape)
    return (o, view(y, (b, h, tq), offset=q.size)) if with_lse else o


def _infer_attention(name):
    def infer(srcs, params):
        q, k, v = srcs[:3]
        _f32(name, q, k, v)
        mask = params["mask"]
        n_in = (3 if name == "attention" else 5) + (mask in ("pos", "seg"))
        _need(mask in _SOFTMAX_MASKS and len(srcs) == n_in, f"{name}: mask {mask!r} with {len(srcs)} inputs",
              ValueError)
        _need(q.ndim == 4 and k.ndim == 4 and v.shape == k.shape and k.shape[0] == q.shape[0]
              and k.shape[3] == q.shape[3] and k.shape[2] >= 1 and q.shape[2] % k.shape[2] == 0,
              f"{name}: expected q (B, Tq, H, D), k and v (B, Tk, Hkv, D) with Hkv dividing H, got "
              f"{q.shape}, {k.shape}, {v.shape}")
        for x in (q, k, v):
            _need(x.strides[-1] == 1 or x.shape[-1] == 1, f"{name}: {x!r} needs unit stride along D")
        b, tq, h, d = q.shape
        tk = k.shape[1]
        if mask in ("pos", "seg"):
            m = srcs[-1]
            if m.dtype != "i32":
                raise DTypeError(f"{name}: {'positions' if mask == 'pos' else 'segments'} must be i32, got {m.dtype}")
            _need(mask != "pos" or m.shape == (tq,), f"{name}: positions {m.shape} do not match Tq of q {q.shape}")
            _need(mask != "seg" or (tq == tk and m.shape == (b, tq)),
                  f"{name}: segments {m.shape} need q and k of one length T and shape (B, T) = {(b, tq)}")
        _need(mask != "causal" or tq <= tk, f"{name}: causal mask needs Tq <= Tk, got q {q.shape} and k {k.shape}")
        n_out = q.size + b * h * tq    # O, then LSE
        if name == "attention":
            return (n_out,), "f32"
        y, g = srcs[3], srcs[4]
        _f32(name, y, g)
        _need(y.shape == (n_out,), f"{name}: y {y.shape} is not the forward's ({n_out},)")
        _need(g.shape in (q.shape, (n_out,)), f"{name}: g {g.shape} is neither dO {q.shape} nor of y {y.shape}")
        return (q.size + 2 * k.size,), "f32"
    return infer


def _attention_bwd(y, g):
    _no_llama_gradient(y, "attention")
    q, k, v = y.srcs[:3]
    extra = list(y.srcs[3:])
    if (g.op == "view_bwd" and g.params["voffset"] == 0 and g.srcs[0].shape == q.shape
            and g.params["vstrides"] == contiguous_strides(q.shape)):
        g = g.srcs[0]   # only O was read: its gradient itself, not zeros around it
    # the kernel reads dO rows with unit stride along D, or all of y's gradient contiguous
    if not (g.strides[-1] == 1 or q.shape[-1] == 1 if g.shape == q.shape else g.is_contiguous()):
        g = cont(g)
    grads = apply("attention_bwd", [q, k, v, y, g] + extra, **y.params)   # [dq | dk | dv]
    return [view(grads, q.shape), view(grads, k.shape, offset=q.size),
            view(grads, v.shape, offset=q.size + k.size)] + [None] * len(extra)


_attention_lower = lambda y: ((_SOFTMAX_MASKS[y.params["mask"]], y.params["window"],  # noqa: E731
                               _llama(y), int(y.params.get("scale_q", False)),
                               int(y.params.get("kv_f16", False))),
                              (y.params["scale"],))
register(OpDef("attention", _infer_attention("attention"), "attention_fwd", backward=_attention_bwd,
               lower=_attention_lower, contiguous=(3,), differentiable=(0, 1, 2)))
register(OpDef("attention_bwd", _infer_attention("attention_bwd"), "attention_bwd", lower=_attention_lower,
               contiguous=(3, 5)))


def row_flops(t: Tensor) -> int:
    """The part of product_flops(t) that is done only for the rows whose target counts
    (linear_cross_entropy's: its kernel leaves the rows after the last counted one out of
    both products, the padding of a plan's loss rows); 0 for other ops."""
    return product_flops(t) if t.op == "linear_cross_entropy" else 0


def product_flops(t: Tensor) -> int:
    """FLOPs (2 per multiply-add) of node t's matrix products: a matmul's (matmul_lora's
    two), or those inside fused attention (forward: q k^T and p v; backward: q k^T again and
    four more) over the (query, key) pairs its mask lets through; a position or segment mask
    counts as causal, a bound; or conv2d's (forward, and each gradient: the same count); or
    linear_cross_entropy's (the logits, and with grad their product with the matrix again;
    every row counted, a bound: the kernel skips ignored rows after the last counted one,
    see row_flops).
    0 for other ops."""
    if t.op == "matmul":
        return 2 * t.size * t.srcs[0].shape[-1]
    if t.op == "matmul_lora":       # the frozen product and the adapter's
        return 2 * t.size * (t.srcs[0].shape[-1] + t.srcs[2].shape[-1])
    if t.op == "linear_cross_entropy":
        (n, c), v = t.srcs[0].shape, t.srcs[1].shape[0]
        return 2 * n * v * c * (2 if t.params["grad"] else 1)
    if t.op == "conv2d":
        return _conv2d_flops(t.srcs[0].shape, t.srcs[1].shape, t.params)
    if t.op == "conv2d_input_bwd":
        return _conv2d_flops(t.shape, t.srcs[0].shape, t.params)
    if t.op == "conv2d_weight_bwd":
        return _conv2d_flops(t.srcs[0].shape, t.params["kernel_shape"], t.params)
    if t.op not in ("attention", "attention_bwd"):
        return 0
    b, tq, h, d = t.srcs[0].shape
    tk = t.srcs[1].shape[1]
    # causal: query i sees min(tk, i + 1 + tk - tq) keys
    pairs = tq * tk if t.params["mask"] == "none" else tq * (tk - tq) + tq * (tq + 1) // 2 if tq <= tk else \
        builtins.sum(min(tk, max(0, i + 1 + tk - tq)) for i in range(tq))
    return 2 * (2 if t.op == "attention" else 5) * b * h * d * pairs


# ---- rope, embeddings -------------------------------------------------------------


ROPE_MODES = {"norm": 0, "neox": 2}   # ggml's numbers: 0 adjacent pairs, 2 pairs n_dims/2 apart


def rope(x: Tensor, pos: Tensor, n_dims: int | None = None, freq_base: float = 10000.0, mode: str = "norm",
         freq_scale: float = 1.0, factors: Tensor | None = None, attn_factor: float = 1.0,
         numerics: str = EXACT) -> Tensor:
    """Rotary embedding as llama.cpp's ggml_rope_ext without YaRN: x (..., T, H, D), pos i32 (T,)
    shared by every row, or x's leading dims (..., T), e.g. (B, T): each row its own positions
    (packed samples restart at 0). mode "norm" rotates adjacent pairs (x[2i], x[2i+1]) (llama),
    "neox" the pairs (x[i], x[i + n_dims/2]) (qwen2, qwen3, gemma3, phi3); pair i turns by
    freq_scale * pos * freq_base^(-2i/n_dims) / factors[i] (factors (n_dims/2,) f32: llama 3's
    rope_freqs; freq_scale: linear rope scaling); the rotated pairs are scaled by attn_factor
    (phi3's longrope attention factor; the dims past n_dims are not). numerics LLAMA:
    llama.cpp's CPU numbers bit for bit (f32 angles theta *= powf(base, -2/n_dims) pair after
    pair, libm's cosf / sinf, an fma'd rotation) instead of exact angles rounded once:
    inference only, CPU only, no gradient. Raises ShapeError / DTypeError."""
    n_dims = x.shape[-1] if n_dims is None else int(n_dims)
    srcs = [x, pos] if factors is None else [x, pos, factors]
    return apply("rope", srcs, n_dims=n_dims, freq_base=float(freq_base), mode=mode, freq_scale=float(freq_scale),
                 attn_factor=float(attn_factor), numerics=check_numerics(numerics))


def rope_bwd(g: Tensor, pos: Tensor, n_dims: int, freq_base: float, mode: str = "norm", freq_scale: float = 1.0,
             factors: Tensor | None = None, attn_factor: float = 1.0) -> Tensor:
    srcs = [g, pos] if factors is None else [g, pos, factors]
    return apply("rope_bwd", srcs, n_dims=n_dims, freq_base=float(freq_base), mode=mode,
                 freq_scale=float(freq_scale), attn_factor=float(attn_factor))


def _infer_rope(srcs, params):
    x, pos = srcs[:2]
    _f32("rope", x)
    if pos.dtype != "i32":
        raise DTypeError(f"rope: positions must be i32, got {pos.dtype}")
    _need(x.ndim >= 3, f"rope: x must be (..., T, H, D), got {x.shape}")
    _need(pos.shape in ((x.shape[-3],), x.shape[:-2]),
          f"rope: positions {pos.shape} match neither T = {x.shape[-3]} nor {x.shape[:-2]} of {x.shape}")
    nd = params["n_dims"]
    _need(0 < nd <= x.shape[-1] and nd % 2 == 0, f"rope: n_dims {nd} must be even and <= D={x.shape[-1]}")
    _need(params["mode"] in ROPE_MODES, f"rope: mode {params['mode']!r} is not one of {', '.join(ROPE_MODES)}")
    _need(params["freq_scale"] > 0 and params["attn_factor"] > 0,
          f"rope: freq_scale {params['freq_scale']} and attn_factor {params['attn_factor']} must be > 0")
    if len(srcs) == 3:
        _f32("rope", srcs[2])
        _need(srcs[2].shape == (nd // 2,), f"rope: factors {srcs[2].shape} must be (n_dims / 2,) = ({nd // 2},)")
    return x.shape, "f32"


def _rope_backward(y, g):
    factors = y.srcs[2] if len(y.srcs) == 3 else None
    p = y.params
    _no_llama_gradient(y, "rope")
    return [rope_bwd(g, y.srcs[1], p["n_dims"], p["freq_base"], p["mode"], p["freq_scale"], factors,
                     p["attn_factor"]), None, None]


_rope_lower = lambda y: ((y.params["n_dims"], ROPE_MODES[y.params["mode"]],  # noqa: E731
                          _llama(y)),
                         (y.params["freq_base"], y.params["freq_scale"], y.params["attn_factor"]))
register(OpDef("rope", _infer_rope, "rope_fwd", contiguous=(0, 1), lower=_rope_lower, backward=_rope_backward,
               differentiable=(0,)))
register(OpDef("rope_bwd", _infer_rope, "rope_bwd", contiguous=(0, 1), lower=_rope_lower))


def get_rows(table: Tensor, idx: Tensor) -> Tensor:
    """table (V, C)[idx] -> idx.shape + (C,); idx i32 (embedding lookup)."""
    return apply("get_rows", [table, idx])


def get_rows_bwd(g: Tensor, idx: Tensor, n_rows: int) -> Tensor:
    """Scatter-add of g's rows into a (n_rows, C) zero tensor at idx."""
    return apply("get_rows_bwd", [g, idx], n_rows=int(n_rows))


def _infer_get_rows(srcs, params):
    table, idx = srcs
    check_weight("get_rows", table)
    _need(table.dtype == "f32" or table.strides[-1] == 1,
          f"get_rows: a {table.dtype} table must be read in its stored layout, got {table!r}")
    if idx.dtype != "i32":
        raise DTypeError(f"get_rows: indices must be i32, got {idx.dtype}")
    _need(table.ndim == 2, f"get_rows: table must be (V, C), got {table.shape}")
    return idx.shape + (table.shape[1],), "f32"


def _infer_get_rows_bwd(srcs, params):
    g, idx = srcs
    _f32("get_rows_bwd", g)
    if idx.dtype != "i32":
        raise DTypeError(f"get_rows_bwd: indices must be i32, got {idx.dtype}")
    _need(g.shape[:-1] == idx.shape, f"get_rows_bwd: g {g.shape} does not match indices {idx.shape}")
    return (params["n_rows"], g.shape[-1]), "f32"


register(OpDef("get_rows", _infer_get_rows, "get_rows_fwd", contiguous=(0, 1),
               backward=lambda y, g: [get_rows_bwd(g, y.srcs[1], y.srcs[0].shape[0]), None],
               differentiable=(0,), dtypes=_WEIGHT_VARIANTS, suffix=lambda y: _weight_suffix(y.srcs[0])))
register(OpDef("get_rows_bwd", _infer_get_rows_bwd, "get_rows_bwd", contiguous=(0, 1)))


# ---- convolution and pooling (NHWC) -------------------------------------------------


def _conv_out(n, k, stride, pad):
    return (n + 2 * pad - k) // stride + 1


def im2col(x: Tensor, kh: int, kw: int, stride: int = 1, pad: int = 0) -> Tensor:
    """x (N, H, W, C) -> patches (N, OH, OW, C*KH*KW), column c*KH*KW + kh*KW + kw."""
    return apply("im2col", [x], kh=int(kh), kw=int(kw), stride=int(stride), pad=int(pad))


def im2col_bwd(g: Tensor, x_shape: tuple, kh: int, kw: int, stride: int, pad: int) -> Tensor:
    return apply("im2col_bwd", [g], x_shape=tuple(x_shape), kh=kh, kw=kw, stride=stride, pad=pad)


def _infer_im2col(srcs, params):
    x = srcs[0]
    _f32("im2col", x)
    kh, kw, st, pad = params["kh"], params["kw"], params["stride"], params["pad"]
    _need(x.ndim == 4, f"im2col: x must be (N, H, W, C), got {x.shape}")
    _need(kh > 0 and kw > 0 and st > 0 and pad >= 0, f"im2col: bad kernel/stride/pad {kh, kw, st, pad}")
    n, h, w, c = x.shape
    oh, ow = _conv_out(h, kh, st, pad), _conv_out(w, kw, st, pad)
    _need(oh > 0 and ow > 0, f"im2col: kernel {kh}x{kw} larger than padded input {x.shape}")
    return (n, oh, ow, c * kh * kw), "f32"


def _infer_im2col_bwd(srcs, params):
    g = srcs[0]
    _f32("im2col_bwd", g)
    n, h, w, c = params["x_shape"]
    kh, kw, st, pad = params["kh"], params["kw"], params["stride"], params["pad"]
    expect = (n, _conv_out(h, kh, st, pad), _conv_out(w, kw, st, pad), c * kh * kw)
    _need(g.shape == expect, f"im2col_bwd: g {g.shape} does not match patches {expect}")
    return (n, h, w, c), "f32"


_conv_lower = lambda y: ((y.params["kh"], y.params["kw"], y.params["stride"], y.params["pad"]), ())  # noqa: E731
register(OpDef("im2col", _infer_im2col, "im2col_fwd", contiguous=(0,), lower=_conv_lower,
               backward=lambda y, g: [im2col_bwd(g, y.srcs[0].shape, y.params["kh"], y.params["kw"],
                                                 y.params["stride"], y.params["pad"])]))
register(OpDef("im2col_bwd", _infer_im2col_bwd, "im2col_bwd", contiguous=(0,), lower=_conv_lower))


def conv2d(x: Tensor, kernel: Tensor, bias: Tensor | None = None, stride: int = 1, pad: int = 0,
           relu: bool = False, pool: int = 1) -> Tensor:
    """2-D convolution over NHWC, direct (no im2col buffer), with relu and max-pool fused.

    x (N, H, W, Cin), kernel (Cout, Cin, KH, KW) as ggml stores it, bias (Cout,) or None.
    Returns relu?(conv + bias) (N, OH, OW, Cout), max-pooled over pool x pool windows
    (stride pool, floor) when pool > 1: the same values as im2col, matmul, add, relu and
    max_pool2d. With pool > 1 the node holds (2, N, OH/pool, OW/pool, Cout), the values
    and the window index of each maximum (what the backward routes g by), and this returns
    a view of the values.
    """
    srcs = [x, kernel] if bias is None else [x, kernel, bias]
    y = apply("conv2d", srcs, stride=int(stride), pad=int(pad), relu=bool(relu), pool=int(pool))
    return view(y, y.shape[1:]) if y.params["pool"] > 1 else y


def _infer_conv2d(srcs, params):
    x, kernel = srcs[0], srcs[1]
    _f32("conv2d", *srcs)
    _need(kernel.ndim == 4, f"conv2d: kernel must be (Cout, Cin, KH, KW), got {kernel.shape}")
    cout, cin, kh, kw = kernel.shape
    _need(x.ndim == 4 and x.shape[3] == cin,
          f"conv2d: x {x.shape} must be (N, H, W, {cin}) for kernel {kernel.shape}")
    if len(srcs) == 3:
        _need(srcs[2].shape == (cout,), f"conv2d: bias {srcs[2].shape} must be ({cout},) for kernel {kernel.shape}")
    st, pad, pool = params["stride"], params["pad"], params["pool"]
    _need(st > 0 and pad >= 0 and pool > 0, f"conv2d: bad stride/pad/pool {st, pad, pool}")
    n, h, w, _ = x.shape
    oh, ow = _conv_out(h, kh, st, pad), _conv_out(w, kw, st, pad)
    _need(oh > 0 and ow > 0, f"conv2d: kernel {kh}x{kw} larger than padded input {x.shape} (pad {pad})")
    _need(pool <= min(oh, ow), f"conv2d: pool window {pool} does not fit the output {oh}x{ow}")
    if pool == 1:
        return (n, oh, ow, cout), "f32"
    return (2, n, oh // pool, ow // pool, cout), "f32"


def _conv2d_ip(y, kernel_shape):
    p = y.params
    return (kernel_shape[2], kernel_shape[3], p["stride"], p["pad"], int(p["relu"]), p["pool"])


def _conv2d_bwd(y, g):
    x, kernel = y.srcs[0], y.srcs[1]
    bias = y.srcs[2] if len(y.srcs) == 3 else None
    params = dict(y.params)
    if params["pool"] > 1:
        g = view(g, y.shape[1:])   # the values' gradient (the codes have none)
    gx = gk = gb = None
    if x.requires_grad:
        gx = apply("conv2d_input_bwd", [kernel, y, g], x_shape=x.shape, **params)
    if kernel.requires_grad or (bias is not None and bias.requires_grad):
        cout, cin, kh, kw = kernel.shape
        k = cin * kh * kw
        gw = apply("conv2d_weight_bwd", [x, y, g], kernel_shape=kernel.shape, **params)  # (K + 1, Cout)
        gk = view(gw, kernel.shape, (1, kh * kw * cout, kw * cout, cout))
        gb = view(gw, (cout,), (1,), k * cout)
    return [gx, gk, gb]


def _infer_conv2d_input_bwd(srcs, params):
    _f32("conv2d_input_bwd", *srcs)
    return tuple(params["x_shape"]), "f32"


def _infer_conv2d_weight_bwd(srcs, params):
    _f32("conv2d_weight_bwd", *srcs)
    cout, cin, kh, kw = params["kernel_shape"]
    return (cin * kh * kw + 1, cout), "f32"


def _conv2d_flops(x_shape, kernel_shape, p):
    """2 N OH OW Cout Cin KH KW: the forward's products, and each gradient's."""
    n, h, w, _ = x_shape
    cout, cin, kh, kw = kernel_shape
    oh, ow = _conv_out(h, kh, p["stride"], p["pad"]), _conv_out(w, kw, p["stride"], p["pad"])
    return 2 * n * oh * ow * cout * cin * kh * kw


register(OpDef("conv2d", _infer_conv2d, "conv2d_fwd", contiguous=(0, 1, 2), backward=_conv2d_bwd,
               lower=lambda y: (_conv2d_ip(y, y.srcs[1].shape), ())))
register(OpDef("conv2d_input_bwd", _infer_conv2d_input_bwd, "conv2d_input_bwd", contiguous=(0, 1, 2),
               lower=lambda y: (_conv2d_ip(y, y.srcs[0].shape), ())))
register(OpDef("conv2d_weight_bwd", _infer_conv2d_weight_bwd, "conv2d_weight_bwd", contiguous=(0, 1, 2),
               lower=lambda y: (_conv2d_ip(y, y.params["kernel_shape"]), ())))


def max_pool2d(x: Tensor, k: int = 2) -> Tensor:
    """Max over k x k windows with stride k (floor): (N, H, W, C) -> (N, H//k, W//k, C)."""
    return apply("max_pool2d", [x], k=int(k))


def max_pool2d_bwd(x: Tensor, g: Tensor, k: int) -> Tensor:
    return apply("max_pool2d_bwd", [x, g], k=int(k))


def _infer_pool(srcs, params):
    x = srcs[0]
    _f32("max_pool2d", x)
    k = params["k"]
    _need(x.ndim == 4, f"max_pool2d: x must be (N, H, W, C), got {x.shape}")
    _need(0 < k <= min(x.shape[1], x.shape[2]), f"max_pool2d: window {k} does not fit {x.shape}")
    n, h, w, c = x.shape
    out = (n, h // k, w // k, c)
    if len(srcs) == 2:
        _need(srcs[1].shape == out, f"max_pool2d_bwd: g {srcs[1].shape} does not match {out}")
        return x.shape, "f32"
    return out, "f32"


register(OpDef("max_pool2d", _infer_pool, "max_pool2d_fwd", contiguous=(0,),
               lower=lambda y: ((y.params["k"],), ()),
               backward=lambda y, g: [max_pool2d_bwd(y.srcs[0], g, y.params["k"])]))
register(OpDef("max_pool2d_bwd", _infer_pool, "max_pool2d_bwd", contiguous=(0, 1),
               lower=lambda y: ((y.params["k"],), ())))


# ---- views and copies ------------------------------------------------------------------


def reshape(x: Tensor, shape: tuple) -> Tensor:
    """Same elements, new shape (a view; a non-contiguous x is copied first). One dim may be -1."""
    shape = tuple(int(d) for d in shape)
    if shape.count(-1) == 1:
        known = numel(tuple(d for d in shape if d != -1))
        if known == 0 or x.size % known:
            raise ShapeError(f"reshape: cannot infer -1 in {shape} for {x.size} elements")
        shape = tuple(x.size // known if d == -1 else d for d in shape)
    if numel(shape) != x.size or any(d < 0 for d in shape):
        raise ShapeError(f"reshape: {x.shape} ({x.size} elements) cannot become {shape}")
    if shape == x.shape:
        return x
    return apply("reshape", [x], shape=shape)


def _infer_reshape(srcs, params):
    return params["shape"], srcs[0].dtype


def _view_reshape(y):
    return y.srcs[0].offset, contiguous_strides(y.shape)


register(OpDef("reshape", _infer_reshape, contiguous=(0,), view=_view_reshape,
               backward=lambda y, g: [reshape(g, y.srcs[0].shape)]))


def permute(x: Tensor, axes: tuple) -> Tensor:
    """Reorder dims: output dim i is input dim axes[i] (a view, numpy's transpose)."""
    axes = tuple(int(a) % max(1, x.ndim) for a in axes)
    if sorted(axes) != list(range(x.ndim)):
        raise ShapeError(f"permute: {axes} is not a permutation of {x.ndim} dims")
    if axes == tuple(range(x.ndim)):
        return x
    return apply("permute", [x], axes=axes)


def transpose(x: Tensor, a: int = -1, b: int = -2) -> Tensor:
    """Swap two dims (a view; composite of permute)."""
    if x.ndim < 2:
        raise ShapeError(f"transpose: needs >= 2 dims, got {x.shape}")
    axes = list(range(x.ndim))
    a, b = a % x.ndim, b % x.ndim
    axes[a], axes[b] = axes[b], axes[a]
    return permute(x, tuple(axes))


def _infer_permute(srcs, params):
    x = srcs[0]
    return tuple(x.shape[a] for a in params["axes"]), x.dtype


def _view_permute(y):
    x = y.srcs[0]
    return x.offset, tuple(x.strides[a] for a in y.params["axes"])


def _permute_bwd(y, g):
    axes = y.params["axes"]
    inverse = [0] * len(axes)
    for i, a in enumerate(axes):
        inverse[a] = i
    return [permute(g, tuple(inverse))]


register(OpDef("permute", _infer_permute, view=_view_permute, backward=_permute_bwd))


def view(x: Tensor, shape: tuple, strides: tuple | None = None, offset: int = 0) -> Tensor:
    """A window into contiguous x: `shape`, element `strides` and `offset` in x's layout.

    E.g. the k part of a fused qkv projection. Checked to stay inside x.
    """
    shape = tuple(int(d) for d in shape)
    strides = contiguous_strides(shape) if strides is None else tuple(int(s) for s in strides)
    if len(strides) != len(shape) or any(s < 0 for s in strides) or offset < 0:
        raise ShapeError(f"view: bad strides {strides} / offset {offset} for shape {shape}")
    reach = offset + builtins.sum((d - 1) * s for d, s in zip(shape, strides)) if numel(shape) else offset
    if numel(shape) and reach >= x.size:
        raise ShapeError(f"view: shape {shape} strides {strides} offset {offset} reaches element "
                         f"{reach} of a {x.size}-element tensor {x.shape}")
    if (x.op == "view_bwd" and x.srcs[0].shape == shape and x.params["vstrides"] == strides
            and x.params["voffset"] == offset):
        return x.srcs[0]   # the window view_bwd wrote g into: g itself, and view_bwd never runs
    return apply("view", [x], shape=shape, vstrides=strides, voffset=int(offset))


def _infer_view(srcs, params):
    return params["shape"], srcs[0].dtype


def _view_view(y):
    return y.srcs[0].offset + y.params["voffset"], y.params["vstrides"]


def view_bwd(g: Tensor, base_shape: tuple, strides: tuple, offset: int) -> Tensor:
    """Zeros of base_shape with g written where the view lay (the backward of view)."""
    return apply("view_bwd", [g], base_shape=tuple(base_shape), vstrides=tuple(strides), voffset=int(offset))


def _infer_view_bwd(srcs, params):
    _f32("view_bwd", srcs[0])
    return params["base_shape"], "f32"


register(OpDef("view", _infer_view, contiguous=(0,), view=_view_view,
               backward=lambda y, g: [view_bwd(g, y.srcs[0].shape, y.params["vstrides"], y.params["voffset"])]))
register(OpDef("view_bwd", _infer_view_bwd, "view_bwd", contiguous=(0,),
               lower=lambda y: ((y.params["voffset"],) + y.params["vstrides"], ())))


def set_rows(target: Tensor, values: Tensor, idx: Tensor) -> Tensor:
    """Row idx[t] of persistent target (S, C) becomes values[t] (T, C), in place, at run time
    (a KV cache written at the positions being decoded). Returns the updated target: read
    the rows through it, so that readers run after the write. (f32, not differentiable)"""
    y = apply("set_rows", [target, values, idx])
    y.out = target
    return y


def _infer_set_rows(srcs, params):
    target, values, idx = srcs
    _f32("set_rows", target, values)
    _need(target.kind in ("state", "param", "input") and not target.is_view and target.out is None,
          f"set_rows: the target must be a persistent tensor, got {target!r}")
    _need(target.ndim == 2 and values.ndim == 2 and values.shape[1] == target.shape[1],
          f"set_rows: values {values.shape} do not fit rows of target {target.shape}")
    if idx.dtype != "i32":
        raise DTypeError(f"set_rows: indices must be i32, got {idx.dtype}")
    _need(idx.shape == values.shape[:1], f"set_rows: indices {idx.shape} do not match values {values.shape}")
    return target.shape, "f32"


register(OpDef("set_rows", _infer_set_rows, "set_rows_fwd", contiguous=(1, 2), differentiable=()))


def cont(x: Tensor) -> Tensor:
    """A contiguous copy of x (any strides)."""
    return apply("cont", [x])


def cast(x: Tensor, dtype: str) -> Tensor:
    """x converted to dtype (f32, f16 or bf16), contiguous; f32 -> f16/bf16 rounds to nearest even."""
    if dtype == x.dtype and x.is_contiguous():
        return x
    return apply("cast", [x], dtype=dtype)


def _infer_cont(srcs, params):
    x = srcs[0]
    if x.dtype not in _CAST_TYPES:
        raise DTypeError(f"cont: {x.dtype} tensors are not copied by kernels ({x!r})")
    return x.shape, x.dtype


def _infer_cast(srcs, params):
    x = srcs[0]
    dtype = params["dtype"]
    if dtype not in ("f32", "f16", "bf16") or x.dtype not in ("f32", "f16", "bf16"):
        raise DTypeError(f"cast: cannot convert {x.dtype} to {dtype}")
    return x.shape, dtype


_CAST_TYPES = ("f32", "f16", "bf16")
register(OpDef("cont", _infer_cont, "copy_fwd", backward=lambda y, g: [g],
               dtypes=_CAST_TYPES, suffix=lambda y: y.dtype))
register(OpDef("cast", _infer_cast, "copy_fwd",
               backward=lambda y, g: [cast(g, y.srcs[0].dtype)], dtypes=_CAST_TYPES, suffix=lambda y: y.dtype))


# ---- optimizer steps (in place; built by core/optim.py) -----------------------------------


def _infer_step(name, n_src):
    def infer(srcs, params):
        _need(len(srcs) == n_src, f"{name}: needs {n_src} inputs")
        _f32(name, *srcs)
        p = srcs[0]
        for i, s in enumerate(srcs):
            if i == 2:
                _need(s.shape == (HYPER_COUNT,), f"{name}: hyper must be ({HYPER_COUNT},), got {s.shape}")
            elif i == 3:
                _need(s.size == 1, f"{name}: grad norm must be a scalar, got {s.shape}")
            else:
                _need(s.shape == p.shape, f"{name}: input {i} {s.shape} does not match param {p.shape}")
        return p.shape, "f32"
    return infer


# (the layout of the hyper vector the step kernels read: native/host.py, HYPER_*)


def adamw_step(p, grad, hyper, grad_norm, m, v, decay: bool) -> Tensor:
    """AdamW update of p in place (and of m, v); decay: apply weight decay to p."""
    return apply("adamw_step", [p, grad, hyper, grad_norm, m, v], decay=bool(decay))


def sgd_step(p, grad, hyper, grad_norm, buf, decay: bool) -> Tensor:
    """SGD (momentum optional) update of p in place (and of buf)."""
    return apply("sgd_step", [p, grad, hyper, grad_norm, buf], decay=bool(decay))


_step_lower = lambda y: ((), (1.0 if y.params["decay"] else 0.0,))  # noqa: E731
register(OpDef("adamw_step", _infer_step("adamw_step", 6), "adamw_step_fwd",
               contiguous=(0, 1, 2, 3, 4, 5), lower=_step_lower, differentiable=()))
register(OpDef("sgd_step", _infer_step("sgd_step", 5), "sgd_step_fwd",
               contiguous=(0, 1, 2, 3, 4), lower=_step_lower, differentiable=()))
