"""Elementwise, dropout and reduction ops (layer 3): add ... div, unary functions, GLUs, dropout, sum, mean, repeat."""
from __future__ import annotations

import struct

from ggtrain.core.numerics import LLAMA
from ggtrain.core.tensor import Tensor, numel
from ggtrain.errors import DTypeError
from ggtrain.native.host import (ACT8_TYPES, HYPER_BC1, HYPER_BC2, HYPER_BETA1, HYPER_BETA2,  # noqa: F401
                                 HYPER_COUNT, HYPER_EPS, HYPER_LR, HYPER_MAX_NORM, HYPER_MOMENTUM, HYPER_WD)
from ggtrain.core.ops.registry import (OpDef, _f32, _graph_of, _need, _scalar_tensor, apply, broadcast_shape,
                                       register)
from ggtrain.core.ops.views import reshape, view


# ---- broadcasting ---------------------------------------------------------------------


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


def sigmoid(x: Tensor) -> Tensor:
    """1 / (1 + e^-x) as exp(-softplus(-x)) (a composite: overflow-free both ways). (f32)"""
    return exp(scale(softplus(scale(x, -1.0)), -1.0))


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


def swiglu_oai(g: Tensor, u: Tensor, alpha: float = 1.702, limit: float = 7.0) -> Tensor:
    """gpt-oss's clamped SwiGLU, as ggml_swiglu_oai: x = min(g, limit), y = clip(u, -limit,
    limit), x sigmoid(alpha x) (y + 1) (llama.cpp's alpha 1.702 and limit 7 by default). No
    gradient flows through a clamped side. (f32, g and u of one shape)"""
    return apply("swiglu_oai", [g, u], alpha=float(alpha), limit=float(limit))


def _swiglu_oai_bwd(y, gy):
    g, u = y.srcs
    both = apply("swiglu_oai_bwd", [g, u, gy], **y.params)   # [dg | du]
    return [view(both, g.shape), view(both, g.shape, offset=g.size)]


_swiglu_oai_lower = lambda y: ((), (y.params["alpha"], y.params["limit"]))  # noqa: E731
register(OpDef("swiglu_oai", _infer_same("swiglu_oai"), "swiglu_oai_fwd", backward=_swiglu_oai_bwd,
               lower=_swiglu_oai_lower, contiguous=(0, 1)))
register(OpDef("swiglu_oai_bwd", _infer_glu_bwd("swiglu_oai_bwd"), "swiglu_oai_bwd", lower=_swiglu_oai_lower,
               contiguous=(0, 1, 2)))


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


def swiglu_oai_ggml(g: Tensor, u: Tensor, alpha: float = 1.702, limit: float = 7.0) -> Tensor:
    """llama.cpp's CPU swiglu_oai bit for bit: x = min(g, limit), y = clip(u, -limit, limit),
    x / (1 + expf(alpha * -x)) * (y + 1) with libm's expf (swiglu_oai's value, its own float
    order). Inference only (numerics LLAMA: llama.cpp's numbers); no gradient."""
    return apply("swiglu_oai_ggml", [g, u], alpha=float(alpha), limit=float(limit))


register(OpDef("swiglu_oai_ggml", _infer_same("swiglu_oai_ggml"), "swiglu_oai_ggml_fwd", lower=_swiglu_oai_lower,
               contiguous=(0, 1), differentiable=(), numerics=LLAMA))
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
