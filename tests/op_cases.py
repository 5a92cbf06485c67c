"""Test cases for every op: inputs, a float64 numpy reference, and tolerances (STYLE §8).

A case builds its op from graph inputs with `build(*tensors)` and computes the same
thing in numpy with `ref(*arrays)`. Inputs are drawn from `lo..hi` (kept away from
kinks and singularities); integer inputs come from `ints`. `view` cases reach the op
through a non-contiguous view (transpose, slice) to test strided inputs.
tests/test_ops.py runs every case forward, and backward against finite differences.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ggtrain.core import ops
from tests import np_decoder, refs


@dataclass
class In:
    shape: tuple
    lo: float = -1.0
    hi: float = 1.0
    ints: tuple | None = None       # (low, high) for an i32 input (not differentiated)
    grad: bool = True
    values: np.ndarray | None = None  # fixed values (e.g. distinct for max_pool)


@dataclass
class Case:
    op: str
    inputs: list
    build: Callable
    ref: Callable
    name: str = ""
    rtol: float = 1e-4
    atol: float = 1e-5
    grad_rtol: float = 1e-3
    grad_atol: float = 1e-4
    backward: bool = True
    ops_covered: tuple = field(default=())  # registry ops this case exercises besides `op`

    @property
    def id(self) -> str:
        return f"{self.op}-{self.name}" if self.name else self.op


def _distinct(shape, seed=7):
    """Values with no ties (max_pool2d's gradient is only defined without ties)."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    return (rng.permutation(n).astype(np.float64) / n * 2 - 1).reshape(shape)


def _sum_to(g, shape):
    while g.ndim > len(shape):
        g = g.sum(axis=0)
    for i, n in enumerate(shape):
        if n == 1 and g.shape[i] != 1:
            g = g.sum(axis=i, keepdims=True)
    return g


def _sig(x):
    return 1.0 / (1.0 + np.exp(-x))


def _conv1d_input_grad(w, g, seg):
    """d/dx of sum(causal_conv1d(x, w, seg) * g): the forward's transpose, column by column."""
    b, t, c = g.shape
    cols = [refs.causal_conv1d(np.eye(b * t * c)[i].reshape(b, t, c), w, seg) for i in range(b * t * c)]
    return np.array([np.sum(y * g) for y in cols]).reshape(b, t, c)


def _conv1d_weight_grad(x, g, seg, taps):
    """d/dw of sum(causal_conv1d(x, w, seg) * g): the forward is linear in w."""
    c = x.shape[2]
    return np.array([np.sum(refs.causal_conv1d(x, np.eye(c * taps)[i].reshape(c, taps), seg) * g)
                     for i in range(c * taps)]).reshape(c, taps)


def _moe_weights_grad(z, ids, g, norm, gating="softmax"):
    """d/dz of sum(moe_weights(z, ids) * g), column by column by central differences in float64
    (the function is smooth in z for fixed ids)."""
    z = np.asarray(z, np.float64)
    out, h = np.zeros_like(z), 1e-6
    for i in np.ndindex(z.shape):
        e = np.zeros_like(z)
        e[i] = h
        diff = refs.moe_weights(z + e, ids, norm, gating) - refs.moe_weights(z - e, ids, norm, gating)
        out[i] = np.sum(diff * g) / (2 * h)
    return out


def _moe_weight_grad(x, ids, g, experts):
    """dw of sum(moe_matmul(x, w, ids) * g): each routed (n, s) adds the outer product g x."""
    n, k = ids.shape
    dw = np.zeros((experts, g.shape[2], x.shape[2]))
    for i in range(n):
        for s in range(k):
            dw[ids[i, s]] += np.outer(g[i, s], x[i, 0 if x.shape[1] == 1 else s])
    return dw


CASES: list = []


def case(*args, **kwargs):
    CASES.append(Case(*args, **kwargs))


# ---- elementwise binary: broadcasting, size-1 dims, odd sizes, strided views -----------
for name, fn, npf, lo_b in [("add", ops.add, np.add, -1.0), ("sub", ops.sub, np.subtract, -1.0),
                            ("mul", ops.mul, np.multiply, -1.0), ("div", ops.div, np.divide, 0.5)]:
    case(name, [In((3, 7)), In((3, 7), lo_b, 2.0)], fn, npf, name="same")
    case(name, [In((2, 3, 33)), In((33,), lo_b, 2.0)], fn, npf, name="bcast-row")
    case(name, [In((1, 7)), In((5, 1), lo_b, 2.0)], fn, npf, name="bcast-both")
    case(name, [In((4, 1, 3)), In((1, 5, 1), lo_b, 2.0)], fn, npf, name="bcast-3d")
    case(name, [In((7, 3)), In((3, 7), lo_b, 2.0)], lambda a, b, fn=fn: fn(ops.transpose(a), b),
         lambda a, b, npf=npf: npf(a.T, b), name="strided", ops_covered=("permute",))
    case(name, [In(()), In((3,), lo_b, 2.0)], fn, npf, name="scalar")

# ---- unary ---------------------------------------------------------------------------------
case("scale", [In((3, 5))], lambda x: ops.scale(x, -2.5), lambda x: -2.5 * x)
case("scale", [In((5, 3))], lambda x: ops.scale(ops.transpose(x), 0.5), lambda x: 0.5 * x.T, name="strided")
case("relu", [In((7, 9))], ops.relu, lambda x: np.maximum(x, 0))
case("relu", [In((9, 7))], lambda x: ops.relu(ops.transpose(x)), lambda x: np.maximum(x.T, 0), name="strided")
case("silu", [In((3, 33), -4, 4)], ops.silu, lambda x: x * _sig(x))
case("swiglu", [In((3, 33), -4, 4), In((3, 33))], ops.swiglu, lambda g, u: g * _sig(g) * u)
case("geglu", [In((3, 33), -4, 4), In((3, 33))], ops.geglu, lambda g, u: refs.gelu_tanh(g) * u)
# gpt-oss's clamped gate: both clamps reached (|x| up to 9 > limit 7; a smaller limit for the
# backward's zeros), away from the kinks (finite differences across them would disagree)
case("swiglu_oai", [In((3, 33), -9, 9), In((3, 33), -9, 9)], ops.swiglu_oai, refs.swiglu_oai)
case("swiglu_oai", [In((2, 40), -3, 3), In((2, 40), -3, 3)], lambda g, u: ops.swiglu_oai(g, u, 0.9, 1.5),
     lambda g, u: refs.swiglu_oai(g, u, 0.9, 1.5), name="limit-1.5")
case("geglu", [In((2, 20), -12, 12), In((2, 20))], ops.geglu, lambda g, u: refs.gelu_tanh(g) * u, name="tails",
     grad_atol=2e-4)
# llama.cpp's table gelu (inference only): within an f16 rounding of the f16 table's value
case("geglu_f16", [In((3, 40), -12, 12), In((3, 40))], ops.geglu_f16,
     lambda g, u: np_decoder.ggml_gelu_f16(g) * u, rtol=2e-3, atol=1e-3,
     backward=False)
# llama.cpp's swiglu (inference only; its bits: test_ggml_numbers): silu to its exp's error
case("swiglu_ggml", [In((3, 40), -8, 8), In((3, 40))], ops.swiglu_ggml, lambda g, u: g * _sig(g) * u,
     rtol=1e-5, atol=1e-6, backward=False)
# llama.cpp's swiglu_oai (inference only; its bits: test_ggml_numbers)
case("swiglu_oai_ggml", [In((3, 33), -9, 9), In((3, 33), -9, 9)], ops.swiglu_oai_ggml, refs.swiglu_oai,
     rtol=1e-5, atol=1e-6, backward=False)
case("tanh", [In((4, 9), -3, 3)], ops.tanh, np.tanh)
# its backward is injected, not y's derivative (test_decoder's chunked loss checks it)
case("with_grad", [In(()), In((3, 4)), In((3, 4))], ops.with_grad, lambda y, x, gx: y, backward=False)
case("with_grad", [In((3,)), In((3, 4)), In((3, 4))], ops.with_grad, lambda y, x, gx: y, name="rows",
     backward=False)
case("exp", [In((2, 7), -2, 2)], ops.exp, np.exp)
case("log", [In((2, 7), 0.5, 3)], ops.log, np.log)
case("softplus", [In((3, 11), -30, 30)], ops.softplus, refs.softplus)
case("softplus", [In((2, 9), -2, 2)], ops.softplus, refs.softplus, name="small")
# away from 0, where it is -inf; near it (1e-6) log(-expm1) keeps its digits
case("log1mexp", [In((3, 11), -20, -0.05)], ops.log1mexp, refs.log1mexp)
case("log1mexp", [In((2, 5), -1e-5, -1e-6)], ops.log1mexp, refs.log1mexp, name="near0", backward=False)
case("sqrt", [In((2, 7), 0.5, 3)], ops.sqrt, np.sqrt)
case("sqr", [In((1, 257))], ops.sqr, np.square)
case("relu_bwd", [In((3, 7)), In((3, 7))], ops.relu_bwd, lambda x, g: g * (x > 0), backward=False)
case("silu_bwd", [In((3, 7), -4, 4), In((3, 7))], ops.silu_bwd,
     lambda x, g: g * _sig(x) * (1 + x * (1 - _sig(x))), backward=False)
case("swiglu_bwd", [In((2, 37), -4, 4), In((2, 37)), In((2, 37))],
     lambda g, u, dy: ops.apply("swiglu_bwd", [g, u, dy]),
     lambda g, u, dy: np.stack([dy * u * _sig(g) * (1 + g * (1 - _sig(g))), dy * g * _sig(g)]), backward=False)
case("swiglu_oai_bwd", [In((2, 37), -9, 9), In((2, 37), -9, 9), In((2, 37))],
     lambda g, u, dy: ops.apply("swiglu_oai_bwd", [g, u, dy], alpha=1.702, limit=7.0),
     lambda g, u, dy: np.stack(refs.swiglu_oai_grads(g, u, dy)), backward=False)
case("geglu_bwd", [In((2, 37), -5, 5), In((2, 37)), In((2, 37))],
     lambda g, u, dy: ops.apply("geglu_bwd", [g, u, dy]),
     lambda g, u, dy: np.stack([dy * u * refs.gelu_tanh_grad(g), dy * refs.gelu_tanh(g)]), backward=False)
# dropout: the reference draws the same mask (a hash of seed, salt, flat index), so the
# forward is compared exactly and finite differences see the mask fixed
case("dropout", [In((3, 7)), In((), values=np.array(12345, np.int32), grad=False)],
     lambda x, s: ops.dropout(x, 0.3, s, 7), lambda x, s: refs.dropout(x, 0.3, s, 7))
case("dropout", [In((7, 3, 5)), In((1,), values=np.array([-9], np.int32), grad=False)],
     lambda x, s: ops.dropout(ops.permute(x, (2, 0, 1)), 0.5, s, 2**32 - 1),
     lambda x, s: refs.dropout(x.transpose(2, 0, 1), 0.5, s[0], 2**32 - 1), name="strided",
     ops_covered=("permute", "cont"))
CASES.append(Case("fill", [In((3,))], lambda x: ops.add(x, ops.fill(x.graph, (2, 3), 1.5)),
                  lambda x: np.broadcast_to(x + 1.5, (2, 3)), ops_covered=("add",)))

# ---- reductions ------------------------------------------------------------------------------
case("sum", [In((3, 7))], ops.sum, np.sum)
case("sum", [In((5000,))], ops.sum, np.sum, name="chunks", backward=False)
case("sum", [In((7, 3))], lambda x: ops.sum(ops.transpose(x)), lambda x: x.T.sum(), name="strided")
case("sumsq", [In((3, 7))], ops.sumsq, lambda x: np.sum(np.square(x)))
case("sumsq", [In((5003,))], ops.sumsq, lambda x: np.sum(np.square(x)), name="chunks", backward=False)
case("sumsq", [In((7, 3))], lambda x: ops.sumsq(ops.transpose(x)), lambda x: np.sum(np.square(x)),
     name="strided", ops_covered=("permute",))
case("mean", [In((4, 5))], ops.mean, np.mean, ops_covered=("sum", "scale"))
case("sum_rows", [In((2, 3, 33))], ops.sum_rows, lambda x: x.sum(-1, keepdims=True))
case("sum_rows", [In((5, 3))], lambda x: ops.sum_rows(ops.transpose(x)),
     lambda x: x.T.sum(-1, keepdims=True), name="strided")
case("repeat", [In((1, 3))], lambda x: ops.repeat(x, (4, 3)), lambda x: np.broadcast_to(x, (4, 3)))
case("repeat", [In((2, 1, 3))], lambda x: ops.repeat(x, (5, 2, 4, 3)),
     lambda x: np.broadcast_to(x, (5, 2, 4, 3)), name="3d")
case("repeat_bwd", [In((6, 33))], lambda g: ops.repeat_bwd(g, (33,)), lambda g: _sum_to(g, (33,)))
case("repeat_bwd", [In((4, 3, 5))], lambda g: ops.repeat_bwd(g, (4, 1, 5)),
     lambda g: _sum_to(g, (4, 1, 5)), name="middle")
case("repeat_bwd", [In((2, 3, 4))], lambda g: ops.repeat_bwd(g, (1, 3, 1)),
     lambda g: _sum_to(g, (1, 3, 1)), name="outer")
case("repeat_bwd", [In((5, 3))], lambda g: ops.repeat_bwd(ops.transpose(g), (1, 5)),
     lambda g: _sum_to(g.T, (1, 5)), name="strided")

# ---- matmul in every layout training uses ---------------------------------------------------
case("matmul", [In((3, 7)), In((7, 5))], ops.matmul, np.matmul, name="nn")
case("matmul", [In((3, 7)), In((5, 7))], lambda a, w: ops.matmul(a, ops.transpose(w)),
     lambda a, w: a @ w.T, name="nt")
case("matmul", [In((7, 3)), In((7, 5))], lambda a, b: ops.matmul(ops.transpose(a), b),
     lambda a, b: a.T @ b, name="tn")
case("matmul", [In((2, 3, 4, 7)), In((1, 3, 7, 5))], ops.matmul, np.matmul, name="batch-bcast")
case("matmul", [In((2, 3, 7)), In((5, 7))], lambda x, w: ops.linear(x, w), lambda x, w: x @ w.T,
     name="linear-3d", ops_covered=("permute", "reshape"))
case("matmul", [In((1, 1)), In((1, 33))], ops.matmul, np.matmul, name="k1")
case("matmul", [In((33, 65)), In((65, 17))], ops.matmul, np.matmul, name="odd", atol=1e-4)
# a frozen product with a rank-r adapter's summed onto it (x @ w.T + h @ b.T), every input's
# gradient: narrow (skinny kernels) and wide, batch dims
case("matmul_lora", [In((2, 3, 7)), In((5, 7)), In((2, 3, 4)), In((5, 4))], ops.matmul_lora,
     lambda x, w, h, b: x @ w.T + h @ b.T, name="narrow", ops_covered=("permute",))
case("matmul_lora", [In((37, 65)), In((130, 65)), In((37, 16)), In((130, 16))], ops.matmul_lora,
     lambda x, w, h, b: x @ w.T + h @ b.T, name="wide", atol=1e-4)

# ---- normalisation, softmax, loss ------------------------------------------------------------
case("rms_norm", [In((3, 33))], lambda x: ops.rms_norm(x, 1e-5), lambda x: refs.rms_norm(x, 1e-5))
case("rms_norm", [In((1, 2, 7))], lambda x: ops.rms_norm(x, 1e-6), lambda x: refs.rms_norm(x, 1e-6), name="3d")
case("rms_norm_bwd", [In((3, 33)), In((3, 33))], lambda x, g: ops.rms_norm_bwd(x, g, 1e-5),
     lambda x, g: refs.rms_norm_bwd(x, g, 1e-5), backward=False)
case("softmax", [In((3, 7), -3, 3)], ops.softmax, lambda x: refs.softmax(x, 1.0, False))
case("softmax", [In((2, 5, 5), -3, 3)], lambda x: ops.softmax(x, 0.7, causal=True),
     lambda x: refs.softmax(x, 0.7, True), name="causal")
case("softmax", [In((2, 3, 6), -3, 3)], lambda x: ops.softmax(x, 1.3, causal=True),
     lambda x: refs.softmax(x, 1.3, True), name="causal-tq<tk")
# a KV cache of 6 positions read by 4 queries at positions 3, 0, 5, 2 (with a repeat and
# a query at 0, seeing one key)
case("softmax", [In((2, 4, 6), -3, 3), In((4,), values=np.array([3, 0, 5, 2], np.int32), grad=False)],
     lambda x, p: ops.softmax(x, 0.8, pos=p), lambda x, p: refs.softmax(x, 0.8, pos=p), name="pos")
# packed rows: row 0 holds 3 samples then 2 padding tokens (seg -1), row 1 two samples
_SEG = np.array([[0, 0, 0, 1, 1, 2, -1, -1], [0, 0, 0, 0, 0, 1, 1, 1]], np.int32)
case("softmax", [In((2, 3, 8, 8), -3, 3), In((2, 8), values=_SEG, grad=False)],
     lambda x, s: ops.softmax(x, 0.6, seg=s), lambda x, s: refs.softmax(x, 0.6, seg=s), name="seg")
# a segment that comes back after another (not a packing, but a valid mask: the kernel's
# column-by-column path)
case("softmax", [In((1, 5, 5), -3, 3), In((1, 5), values=np.array([[0, 1, 0, 1, 1]], np.int32), grad=False)],
     lambda x, s: ops.softmax(x, 1.1, seg=s), lambda x, s: refs.softmax(x, 1.1, seg=s), name="seg-interleaved")
case("softmax_bwd", [In((3, 7), 0.05, 1), In((3, 7))], lambda y, g: ops.softmax_bwd(y, g, 0.5),
     lambda y, g: refs.softmax_bwd(y, g, 0.5), backward=False)
case("cross_entropy", [In((5, 7), -3, 3), In((5,), ints=(0, 7))], ops.cross_entropy,
     refs.cross_entropy)
case("cross_entropy", [In((6, 33), -3, 3), In((6,), values=np.array([3, -1, 0, 32, -1, 5]))],
     ops.cross_entropy, refs.cross_entropy, name="ignore")
case("cross_entropy_bwd", [In((5, 7), -3, 3), In((5,), ints=(0, 7)), In((), 0.5, 2)],
     ops.cross_entropy_bwd, refs.cross_entropy_bwd, backward=False)
case("cross_entropy_rows", [In((6, 33), -3, 3), In((6,), values=np.array([3, -1, 0, 32, -1, 5]))],
     ops.cross_entropy_rows, refs.cross_entropy_rows)
# the loss over a frozen output matrix, logits never held: vocabularies of one and several
# blocks of the kernel's 256 (the last one short), ignored rows inside and at the end
case("linear_cross_entropy", [In((6, 33), -2, 2), In((40, 33)), In((6,), values=np.array([3, -1, 0, 39, 5, -1]))],
     ops.linear_cross_entropy, refs.linear_cross_entropy, backward=False)
case("linear_cross_entropy", [In((7, 20), -2, 2), In((600, 20)), In((7,), values=np.array([599, 0, -1, 256, 255, 3, -1]))],
     lambda x, w, t: ops.linear_cross_entropy(x, w, t, scale=0.5, softcap=3.0, mean=False),
     lambda x, w, t: refs.linear_cross_entropy(x, w, t, 0.5, 3.0, mean=False), name="blocks-softcap-rows",
     backward=False)
case("linear_cross_entropy", [In((5, 16), -2, 2), In((300, 16)), In((5,), values=np.array([1, 299, -1, 7, 8]))],
     lambda x, w, t: ops.linear_cross_entropy(x, w, t, grad=False),
     lambda x, w, t: refs.linear_cross_entropy(x, w, t, grad=False), name="loss-only", backward=False)
case("cross_entropy_bwd", [In((6, 33), -3, 3), In((6,), values=np.array([3, -1, 0, 32, -1, 5])), In((6,), -2, 2)],
     lambda x, t, g: ops.cross_entropy_bwd(x, t, g, rows=True), refs.cross_entropy_rows_bwd, name="rows",
     backward=False)

# ---- attention (fused): O, LSE and the backward kernel, against refs.attention -------------------
def _att_in(b, tq, h, hkv, d, tk=None):
    return [In((b, tq, h, d)), In((b, tk or tq, hkv, d)), In((b, tk or tq, hkv, d))]


# grouped heads (4 query heads on 2 KV heads), causal; the backward reads dO itself
case("attention", _att_in(2, 7, 4, 2, 8), lambda q, k, v: ops.attention(q, k, v, 0.35, causal=True),
     lambda q, k, v: refs.attention(q, k, v, 0.35, causal=True)[0], name="causal-gqa")
case("attention", _att_in(1, 33, 4, 1, 8), lambda q, k, v: ops.attention(q, k, v, 0.5, causal=True),
     lambda q, k, v: refs.attention(q, k, v, 0.5, causal=True)[0], name="causal-t33")
case("attention", _att_in(1, 3, 2, 1, 4), lambda q, k, v: ops.attention(q, k, v, 0.9, causal=True),
     lambda q, k, v: refs.attention(q, k, v, 0.9, causal=True)[0], name="tiny")
case("attention", _att_in(1, 3, 2, 1, 4, tk=5), lambda q, k, v: ops.attention(q, k, v, 0.7),
     lambda q, k, v: refs.attention(q, k, v, 0.7)[0], name="no-mask-tq<tk")
# packed rows (samples and padding, _SEG above) and a segment that comes back
case("attention", _att_in(2, 8, 2, 1, 4) + [In((2, 8), values=_SEG, grad=False)],
     lambda q, k, v, s: ops.attention(q, k, v, 0.6, seg=s),
     lambda q, k, v, s: refs.attention(q, k, v, 0.6, seg=s)[0], name="seg")
case("attention", _att_in(1, 5, 2, 2, 4) + [In((1, 5), values=np.array([[0, 1, 0, 1, 1]], np.int32), grad=False)],
     lambda q, k, v, s: ops.attention(q, k, v, 1.1, seg=s),
     lambda q, k, v, s: refs.attention(q, k, v, 1.1, seg=s)[0], name="seg-interleaved")
# a KV cache of 6 positions read at positions 3, 0, 5, 2
# the tree mask: a prefix (segment 0) and two continuations (1, 2) that see it; padding (-1)
_TREE_SEG = np.array([[0, 0, 1, 1, 2, 2, 2, -1], [0, 0, 0, 1, 2, 3, 3, 1]], np.int32)
_TREE_PAR = np.array([[0, 0, 0, 0, 0, 0, 0, -1], [0, 0, 0, 0, 0, 1, 2, 3]], np.int32)
case("attention", _att_in(2, 8, 2, 1, 4) + [In((2, 8), values=_TREE_SEG, grad=False),
                                            In((2, 8), values=_TREE_PAR, grad=False)],
     lambda q, k, v, s, p: ops.attention(q, k, v, 0.6, seg=s, parent=p),
     lambda q, k, v, s, p: refs.attention(q, k, v, 0.6, seg=s, parent=p)[0], name="tree")
case("attention", _att_in(1, 4, 2, 1, 4, tk=6) + [In((4,), values=np.array([3, 0, 5, 2], np.int32), grad=False)],
     lambda q, k, v, p: ops.attention(q, k, v, 0.8, pos=p),
     lambda q, k, v, p: refs.attention(q, k, v, 0.8, pos=p)[0], name="pos")
# gpt-oss's sinks (a composite over O and LSE): against softmax with the sink column itself,
# gradients to q, k, v through LSE and to the sinks; sinks around the rows' LSE (both shares
# matter), with a window (a key sees few keys: the sink weighs more) and at a KV cache's positions
case("attention", _att_in(2, 6, 4, 2, 4) + [In((4,), -1, 2)],
     lambda q, k, v, s: ops.attention_sinks(*ops.attention(q, k, v, 0.6, causal=True, with_lse=True), s),
     lambda q, k, v, s: refs.attention_sinks(q, k, v, 0.6, s, causal=True), name="sinks")
case("attention", _att_in(1, 9, 2, 1, 4) + [In((2,), 0, 2)],
     lambda q, k, v, s: ops.attention_sinks(*ops.attention(q, k, v, 0.9, causal=True, window=3, with_lse=True), s),
     lambda q, k, v, s: refs.attention_sinks(q, k, v, 0.9, s, causal=True, window=3), name="sinks-window")
case("attention", _att_in(1, 3, 2, 2, 4, tk=5) + [In((3,), values=np.array([4, 0, 2], np.int32), grad=False),
                                                  In((2,), -1, 1)],
     lambda q, k, v, p, s: ops.attention_sinks(*ops.attention(q, k, v, 0.8, pos=p, with_lse=True), s),
     lambda q, k, v, p, s: refs.attention_sinks(q, k, v, 0.8, s, pos=p), name="sinks-pos")
# the log-sum-exp, alone and with O: gradients through LSE (the kernel's dLSE path)
case("attention", _att_in(1, 5, 2, 1, 4), lambda q, k, v: ops.attention(q, k, v, 0.8, causal=True, with_lse=True)[1],
     lambda q, k, v: refs.attention(q, k, v, 0.8, causal=True)[1], name="lse")
case("attention", _att_in(2, 4, 2, 2, 4),
     lambda q, k, v: ops.mul(*_o_times_lse(ops.attention(q, k, v, 0.5, causal=True, with_lse=True))),
     lambda q, k, v: _o_times_lse_ref(*refs.attention(q, k, v, 0.5, causal=True)), name="o-and-lse",
     ops_covered=("view", "permute", "cont", "reshape", "mul"))


def _o_times_lse(o_lse):
    o, lse = o_lse                                         # (B, T, H, D), (B, H, T)
    b, t, h, _ = o.shape
    return o, ops.reshape(ops.permute(lse, (0, 2, 1)), (b, t, h, 1))


def _o_times_lse_ref(o, lse):
    return o * lse.transpose(0, 2, 1)[..., None]


def _attention_bwd(q, k, v, g, window=0):
    y = ops.apply("attention", [q, k, v], scale=0.45, mask="causal", window=window)
    return ops.apply("attention_bwd", [q, k, v, y, g], scale=0.45, mask="causal", window=window)


# the backward kernel as an op: [dq | dk | dv] for dO g
case("attention_bwd", _att_in(2, 7, 4, 2, 8) + [In((2, 7, 4, 8))], _attention_bwd,
     lambda q, k, v, g: np.concatenate([x.reshape(-1) for x in refs.attention_bwd(q, k, v, g, 0.45, causal=True)]),
     backward=False)

# sliding windows (gemma3's local layers): causal over 70 queries (blocks of 64 skipped,
# taken whole and cut by the window's edge), packed segments, a KV cache read by position
case("attention", _att_in(1, 70, 2, 1, 4), lambda q, k, v: ops.attention(q, k, v, 0.7, causal=True, window=5),
     lambda q, k, v: refs.attention(q, k, v, 0.7, causal=True, window=5)[0], name="window-causal")
case("attention", _att_in(2, 9, 2, 2, 4) + [In((2, 9), values=np.array([[0] * 6 + [1] * 3, [2] * 9]), grad=False)],
     lambda q, k, v, s: ops.attention(q, k, v, 0.9, seg=s, window=3),
     lambda q, k, v, s: refs.attention(q, k, v, 0.9, seg=s, window=3)[0], name="window-seg")
case("attention", _att_in(1, 4, 2, 1, 4, tk=8) + [In((4,), values=np.array([3, 0, 7, 2], np.int32), grad=False)],
     lambda q, k, v, p: ops.attention(q, k, v, 0.8, pos=p, window=3),
     lambda q, k, v, p: refs.attention(q, k, v, 0.8, pos=p, window=3)[0], name="window-pos")
case("attention_bwd", _att_in(1, 70, 2, 1, 8) + [In((1, 70, 2, 8))], lambda q, k, v, g: _attention_bwd(q, k, v, g, 6),
     lambda q, k, v, g: np.concatenate([x.reshape(-1) for x in refs.attention_bwd(q, k, v, g, 0.45, causal=True,
                                                                                  window=6)]),
     name="window", backward=False)

# ---- rope, rows ------------------------------------------------------------------------------
case("rope", [In((2, 5, 3, 8)), In((5,), values=np.array([0, 1, 2, 7, 40]))],
     lambda x, p: ops.rope(x, p, 8, 10000.0), lambda x, p: refs.rope(x, p, 8, 10000.0))
case("rope", [In((3, 2, 6)), In((3,), values=np.array([5, 100, 2047]))],
     lambda x, p: ops.rope(x, p, 4, 500.0), lambda x, p: refs.rope(x, p, 4, 500.0), name="partial")
case("rope_bwd", [In((2, 5, 3, 8)), In((5,), ints=(0, 64))], lambda g, p: ops.rope_bwd(g, p, 8, 10000.0),
     lambda g, p: refs.rope_bwd(g, p, 8, 10000.0), backward=False)
# per-row positions (B, T): packed samples restarting at 0 in each row
_ROW_POS = np.array([[0, 1, 2, 0, 1], [3, 0, 1, 2, 40]], np.int32)
case("rope", [In((2, 5, 3, 8)), In((2, 5), values=_ROW_POS, grad=False)],
     lambda x, p: ops.rope(x, p, 6, 10000.0), lambda x, p: refs.rope(x, p, 6, 10000.0), name="per-row")
case("rope_bwd", [In((2, 5, 3, 8)), In((2, 5), values=_ROW_POS, grad=False)],
     lambda g, p: ops.rope_bwd(g, p, 8, 10000.0), lambda g, p: refs.rope_bwd(g, p, 8, 10000.0),
     name="per-row", backward=False)
# NEOX pairs (qwen2/3, gemma3, phi3), llama 3's frequency factors, linear scaling, partial rotation
_FACTORS = np.array([1.0, 1.5, 4.0, 8.0, 32.0])
case("rope", [In((2, 5, 3, 10)), In((5,), values=np.array([0, 1, 2, 7, 900]))],
     lambda x, p: ops.rope(x, p, 10, 10000.0, "neox"), lambda x, p: refs.rope(x, p, 10, 10000.0, "neox"),
     name="neox")
case("rope", [In((2, 5, 3, 12)), In((2, 5), values=_ROW_POS, grad=False), In((5,), values=_FACTORS, grad=False)],
     lambda x, p, f: ops.rope(x, p, 10, 500000.0, "neox", 0.25, f),
     lambda x, p, f: refs.rope(x, p, 10, 500000.0, "neox", 0.25, f), name="neox-factors-partial")
case("rope", [In((2, 5, 3, 12)), In((5,), values=np.array([3, 1, 2, 7, 60])), In((5,), values=_FACTORS, grad=False)],
     lambda x, p, f: ops.rope(x, p, 10, 10000.0, "neox", 1.0, f, attn_factor=1.19),
     lambda x, p, f: refs.rope(x, p, 10, 10000.0, "neox", 1.0, f, attn_factor=1.19), name="longrope")
case("rope", [In((2, 5, 3, 10)), In((5,), values=np.array([3, 1, 2, 7, 2000])), In((5,), values=_FACTORS, grad=False)],
     lambda x, p, f: ops.rope(x, p, 10, 500000.0, "norm", 1.0, f),
     lambda x, p, f: refs.rope(x, p, 10, 500000.0, "norm", 1.0, f), name="factors")
# YaRN (gpt-oss's rope scaling, ggml's rope_yarn): the correction dims as ggml computes them in
# f32 (ops.yarn_corr_dims) against refs' float64 ones; 32 dims, base 150000, factor 32 over 4096
# original positions put the ramp mid-way (low 4, high 9 of 16 pairs)
_YARN = dict(ext_factor=1.0, corr_dims=ops.yarn_corr_dims(32, 4096, 150000.0))
_YARN_REF = dict(ext_factor=1.0, corr_dims=refs.yarn_corr_dims(32, 4096, 150000.0))
case("rope", [In((2, 5, 3, 32)), In((5,), values=np.array([0, 1, 2, 7, 3000]))],
     lambda x, p: ops.rope(x, p, 32, 150000.0, "neox", 1 / 32, **_YARN),
     lambda x, p: refs.rope(x, p, 32, 150000.0, "neox", 1 / 32, **_YARN_REF), name="yarn")
case("rope", [In((1, 4, 2, 12)), In((1, 4), values=np.array([[3, 1, 40, 9]]), grad=False),
              In((5,), values=_FACTORS, grad=False)],
     lambda x, p, f: ops.rope(x, p, 10, 10000.0, "norm", 0.25, f, 1.1, ext_factor=0.5, corr_dims=(1.0, 3.0)),
     lambda x, p, f: refs.rope(x, p, 10, 10000.0, "norm", 0.25, f, 1.1, ext_factor=0.5, corr_dims=(1.0, 3.0)),
     name="yarn-partial-factors")
case("rope_bwd", [In((2, 5, 3, 32)), In((5,), ints=(0, 64))],
     lambda g, p: ops.rope_bwd(g, p, 32, 150000.0, "neox", 1 / 32, **_YARN),
     lambda g, p: refs.rope_bwd(g, p, 32, 150000.0, "neox", 1 / 32, **_YARN_REF), name="yarn", backward=False)
case("rope_bwd", [In((2, 5, 3, 12)), In((5,), ints=(0, 64)), In((5,), values=_FACTORS, grad=False)],
     lambda g, p, f: ops.rope_bwd(g, p, 10, 10000.0, "neox", 0.5, f),
     lambda g, p, f: refs.rope_bwd(g, p, 10, 10000.0, "neox", 0.5, f), name="neox-factors", backward=False)
case("get_rows", [In((7, 5)), In((2, 3), ints=(0, 7))], ops.get_rows, refs.get_rows)
case("get_rows_bwd", [In((4, 5)), In((4,), values=np.array([1, 6, 1, 0]))],
     lambda g, i: ops.get_rows_bwd(g, i, 7), lambda g, i: refs.get_rows_bwd(g, i, 7), backward=False)

# ---- convolution, pooling (NHWC) ------------------------------------------------------------
case("im2col", [In((2, 5, 4, 3))], lambda x: ops.im2col(x, 3, 3, 1, 1),
     lambda x: refs.im2col(x, 3, 3, 1, 1))
case("im2col", [In((1, 7, 6, 2))], lambda x: ops.im2col(x, 3, 2, 2, 0),
     lambda x: refs.im2col(x, 3, 2, 2, 0), name="stride2")
case("im2col_bwd", [In((2, 5, 4, 27))], lambda g: ops.im2col_bwd(g, (2, 5, 4, 3), 3, 3, 1, 1),
     lambda g: refs.im2col_bwd(g, (2, 5, 4, 3), 3, 3, 1, 1), backward=False)
# the im2col convolution (what conv2d computes in one pass)
case("im2col", [In((2, 6, 5, 2)), In((3, 2, 3, 3)), In((3,))],
     lambda x, k, b: ops.add(ops.reshape(ops.matmul(ops.reshape(ops.im2col(x, 3, 3, 1, 1), (60, 18)),
                                                    ops.transpose(ops.reshape(k, (3, 18)))), (2, 6, 5, 3)), b),
     lambda x, k, b: refs.im2col(x, 3, 3, 1, 1) @ k.reshape(3, -1).T + b, name="conv2d",
     ops_covered=("matmul", "reshape", "permute", "add"))
# causal depthwise convolution over time (LFM2's short convolution, L = 3 as its models have;
# a kernel longer than the window; packed segments and padding, one segment coming back)
case("causal_conv1d", [In((2, 7, 5)), In((5, 3))], ops.causal_conv1d, refs.causal_conv1d)
case("causal_conv1d", [In((1, 3, 33)), In((33, 4))], ops.causal_conv1d, refs.causal_conv1d, name="long-kernel")
case("causal_conv1d", [In((2, 8, 3)), In((3, 3)), In((2, 8), values=_SEG, grad=False)], ops.causal_conv1d,
     refs.causal_conv1d, name="seg")
case("causal_conv1d", [In((1, 5, 4)), In((4, 2)), In((1, 5), values=np.array([[0, 1, 0, 1, 1]], np.int32),
                                                     grad=False)],
     ops.causal_conv1d, refs.causal_conv1d, name="seg-interleaved")
# through a strided view (the B | C | x columns of in_proj's output are views)
case("causal_conv1d", [In((2, 6, 9)), In((3, 3))],
     lambda x, w: ops.causal_conv1d(ops.view(x, (2, 6, 3), (54, 9, 1), 6), w),
     lambda x, w: refs.causal_conv1d(x[..., 6:], w), name="strided", ops_covered=("view", "cont"))
# the gated delta rule (Qwen3.5's gated DeltaNet): V heads sharing a K head, Dv != Dk;
# packed samples (the state restarts where the segment changes); a window longer than the
# backward's checkpoint interval (GT_DR_CHUNK = 32); from a carried state (generation)
_DR = dict(ops_covered=("delta_rule_bwd", "view"))
case("delta_rule", [In((2, 5, 1, 3)), In((2, 5, 1, 3)), In((2, 5, 2, 4)), In((2, 5, 2), -1.0, -0.05),
                    In((2, 5, 2), 0.1, 0.9)], ops.delta_rule, refs.delta_rule, **_DR)
case("delta_rule", [In((2, 8, 2, 3)), In((2, 8, 2, 3)), In((2, 8, 2, 3)), In((2, 8, 2), -1.0, -0.05),
                    In((2, 8, 2), 0.1, 0.9), In((2, 8), values=_SEG, grad=False)],
     ops.delta_rule, refs.delta_rule, name="seg", **_DR)
case("delta_rule", [In((1, 70, 1, 2)), In((1, 70, 1, 2)), In((1, 70, 1, 2)), In((1, 70, 1), -0.3, -0.01),
                    In((1, 70, 1), 0.1, 0.9)], ops.delta_rule, refs.delta_rule, name="long", **_DR)
# the chunked form (chunks of GT_DR_BLOCK = 64 rows): two chunks, the second short; segments
# starting inside the first chunk and at the second's first row; weak to strong decays
_SEG67 = np.repeat(np.array([[0, 1, 2, 3]], np.int32), [20, 44, 1, 2], axis=1)
case("delta_rule", [In((1, 67, 1, 2)), In((1, 67, 1, 2)), In((1, 67, 2, 3)), In((1, 67, 2), -5.0, -0.01),
                    In((1, 67, 2), 0.1, 0.9)], lambda *a: ops.delta_rule(*a, chunked=True), refs.delta_rule,
     name="chunked", **_DR)
case("delta_rule", [In((1, 67, 1, 2)), In((1, 67, 1, 2)), In((1, 67, 2, 3)), In((1, 67, 2), -5.0, -0.01),
                    In((1, 67, 2), 0.1, 0.9), In((1, 67), values=_SEG67, grad=False)],
     lambda *a: ops.delta_rule(*a[:5], seg=a[5], chunked=True), refs.delta_rule, name="chunked-seg", **_DR)
case("delta_rule", [In((2, 4, 1, 3)), In((2, 4, 1, 3)), In((2, 4, 2, 3)), In((2, 4, 2), -1.0, -0.05),
                    In((2, 4, 2), 0.1, 0.9), In((2, 2, 3, 3))],
     lambda q, k, v, g, b, s: ops.delta_rule_state(q, k, v, g, b, s)[0],
     lambda q, k, v, g, b, s: refs.delta_rule(q, k, v, g, b, s0=s)[0], name="state-o", backward=False,
     ops_covered=("view",))
case("delta_rule", [In((2, 4, 1, 3)), In((2, 4, 1, 3)), In((2, 4, 2, 3)), In((2, 4, 2), -1.0, -0.05),
                    In((2, 4, 2), 0.1, 0.9), In((2, 2, 3, 3))],
     lambda q, k, v, g, b, s: ops.delta_rule_state(q, k, v, g, b, s)[1],
     lambda q, k, v, g, b, s: refs.delta_rule(q, k, v, g, b, s0=s)[1], name="state-last", backward=False,
     ops_covered=("view",))
case("causal_conv1d_input_bwd", [In((5, 3)), In((2, 7, 5)), In((2, 7), ints=(0, 2))],
     lambda w, g, s: ops.apply("causal_conv1d_input_bwd", [w, g, s]),
     lambda w, g, s: _conv1d_input_grad(w, g, s), backward=False)
case("causal_conv1d_weight_bwd", [In((2, 7, 5)), In((2, 7, 5)), In((2, 7), ints=(0, 2))],
     lambda x, g, s: ops.apply("causal_conv1d_weight_bwd", [x, g, s], w_shape=(5, 3)),
     lambda x, g, s: _conv1d_weight_grad(x, g, s, 3), backward=False)
# conv2d: (x shape, kernel shape, bias?, stride, pad, relu, pool); covers 8, 16, 20 and 70
# output channels (one masked vector, one full, two, five), strides, pools with floor
_CONV = {"mnist1": ((2, 6, 6, 1), (8, 1, 3, 3), True, 1, 1, True, 2),
         "mnist2": ((2, 6, 4, 8), (16, 8, 3, 3), True, 1, 1, True, 2),
         "c20-pool3": ((1, 9, 8, 2), (20, 2, 2, 3), True, 1, 0, True, 3),
         "stride2-nobias": ((1, 7, 6, 2), (3, 2, 3, 2), False, 2, 0, False, 1),
         "relu-nopool": ((2, 5, 4, 3), (5, 3, 3, 3), True, 1, 1, True, 1),
         "pool-norelu": ((1, 5, 7, 2), (4, 2, 3, 3), True, 1, 1, False, 2),
         "c70-pad2": ((1, 4, 5, 2), (70, 2, 3, 3), True, 1, 2, True, 1)}
for _name, (_xs, _ks, _hb, _st, _pad, _relu, _pool) in _CONV.items():
    _ins = [In(_xs), In(_ks)] + ([In((_ks[0],))] if _hb else [])
    case("conv2d", _ins,
         lambda x, k, b=None, p=(_st, _pad, _relu, _pool): ops.conv2d(x, k, b, *p),
         lambda x, k, b=None, p=(_st, _pad, _relu, _pool): refs.conv2d(x, k, b, *p), name=_name,
         ops_covered=("view",))
case("conv2d", [In((6, 6, 2, 1)), In((8, 1, 3, 3)), In((8,))],
     lambda x, k, b: ops.conv2d(ops.permute(x, (2, 0, 1, 3)), k, b, 1, 1, True, 2),
     lambda x, k, b: refs.conv2d(x.transpose(2, 0, 1, 3), k, b, 1, 1, True, 2), name="strided",
     ops_covered=("permute", "cont"))


def _conv_raw(x, k, b, p):
    """The conv2d node itself (values and codes when pooled) and its parameters."""
    y = ops.conv2d(x, k, b, *p)
    return (y.srcs[0] if y.op == "view" else y), y.shape


def _conv_bwd_case(name, xs, ks, p):
    ins = [In(xs), In(ks), In((ks[0],))]
    g_shape = refs.conv2d(np.zeros(xs), np.zeros(ks), None, *p).shape
    ins.append(In(g_shape))
    params = dict(stride=p[0], pad=p[1], relu=p[2], pool=p[3])

    def gx(x, k, b, g):
        raw, _ = _conv_raw(x, k, b, p)
        return ops.apply("conv2d_input_bwd", [k, raw, g], x_shape=x.shape, **params)

    def gw(x, k, b, g):
        raw, _ = _conv_raw(x, k, b, p)
        return ops.apply("conv2d_weight_bwd", [x, raw, g], kernel_shape=k.shape, **params)

    def gw_ref(x, k, b, g):
        _, dk, db = refs.conv2d_bwd(x, k, b, *p, g)
        return np.concatenate([dk.reshape(ks[0], -1).T, db[None, :]])

    case("conv2d_input_bwd", ins, gx, lambda x, k, b, g: refs.conv2d_bwd(x, k, b, *p, g)[0], name=name,
         backward=False)
    case("conv2d_weight_bwd", ins, gw, gw_ref, name=name, backward=False)


_conv_bwd_case("mnist2", (3, 6, 4, 8), (16, 8, 3, 3), (1, 1, True, 2))
_conv_bwd_case("c20-stride2", (1, 9, 8, 3), (20, 3, 3, 2), (2, 1, False, 1))
_conv_bwd_case("relu-pad3", (2, 4, 5, 2), (6, 2, 3, 3), (1, 3, True, 1))
case("max_pool2d", [In((2, 4, 6, 3), values=_distinct((2, 4, 6, 3)))], lambda x: ops.max_pool2d(x, 2),
     lambda x: refs.max_pool2d(x, 2))
case("max_pool2d", [In((1, 7, 5, 2), values=_distinct((1, 7, 5, 2), 3))], lambda x: ops.max_pool2d(x, 2),
     lambda x: refs.max_pool2d(x, 2), name="floor")
case("max_pool2d_bwd", [In((1, 4, 4, 2), values=_distinct((1, 4, 4, 2))), In((1, 2, 2, 2))],
     lambda x, g: ops.max_pool2d_bwd(x, g, 2), lambda x, g: refs.max_pool2d_bwd(x, g, 2), backward=False)

# ---- views and copies ------------------------------------------------------------------------
case("reshape", [In((3, 4))], lambda x: ops.reshape(x, (2, 6)), lambda x: x.reshape(2, 6))
case("reshape", [In((4, 3))], lambda x: ops.reshape(ops.transpose(x), (12,)), lambda x: x.T.reshape(12),
     name="strided", ops_covered=("cont",))
case("permute", [In((2, 3, 4))], lambda x: ops.mul(ops.permute(x, (2, 0, 1)), 1.0),
     lambda x: x.transpose(2, 0, 1), ops_covered=("scale",))
case("view", [In((4, 6))], lambda x: ops.view(x, (3, 2), (6, 2), 7), 
     lambda x: np.lib.stride_tricks.as_strided(x.reshape(-1)[7:], (3, 2), (48, 16)))
case("view_bwd", [In((3, 2))], lambda g: ops.view_bwd(g, (4, 6), (6, 2), 7),
     lambda g: _view_bwd_ref(g, (4, 6), (6, 2), 7), backward=False)
case("cont", [In((3, 5))], lambda x: ops.cont(ops.transpose(x)), lambda x: x.T)


def _set_rows_ref(target, values, idx):
    out = np.array(target, dtype=np.float64)
    for t, row in enumerate(idx):
        out[row] = values[t]
    return out


# rows 4, 1, 4 of a (5, 33) target: a repeated index keeps the last row; rows 0, 2, 3 untouched
case("set_rows", [In((5, 33), grad=False), In((3, 33)), In((3,), values=np.array([4, 1, 4], np.int32))],
     ops.set_rows, _set_rows_ref, backward=False)
case("cast", [In((3, 5), -100, 100)], lambda x: ops.cast(ops.cast(x, "f16"), "f32"),
     lambda x: x.astype(np.float16).astype(np.float64), name="f16", rtol=1e-3, atol=1e-3,
     backward=False)  # rounding: finite differences are 0 or huge; cont covers the rule
case("cast", [In((3, 5), -100, 100)], lambda x: ops.cast(ops.cast(ops.transpose(x), "bf16"), "f32"),
     lambda x: _bf16_round(x.T), name="bf16", rtol=8e-3, atol=1e-3,
     backward=False)


def _view_bwd_ref(g, base_shape, strides, offset):
    out = np.zeros(int(np.prod(base_shape)))
    v = np.lib.stride_tricks.as_strided(out[offset:], g.shape, tuple(s * 8 for s in strides))
    v[...] = g
    return out.reshape(base_shape)


def _bf16_round(x):
    return refs.rounded(x, 16).astype(np.float64)


# ---- optimizer steps: one update from given state, against the closed form -------------------
_H_ADAM = np.array([0.01, 0.9, 0.99, 1e-8, 0.1, 1 - 0.9 ** 3, 1 - 0.99 ** 3, 0.0, 0.0])
_H_SGD = np.array([0.1, 0, 0, 0, 0.05, 1, 1, 0.0, 0.9])


def _in_place(step):
    step.out = step.srcs[0]  # the step kernels update the parameter where it lies
    return step


def _adamw_ref(p, g, h, norm, m, v):
    m = h[1] * m + (1 - h[1]) * g
    v = h[2] * v + (1 - h[2]) * g * g
    return p - h[0] * h[4] * p - h[0] * (m / h[5]) / (np.sqrt(v / h[6]) + h[3])


def _sgd_ref(p, g, h, norm, buf):
    g = g + h[4] * p
    buf = h[8] * buf + g
    return p - h[0] * buf


case("adamw_step", [In((3, 4)), In((3, 4)), In((9,), values=_H_ADAM), In((), 1, 2), In((3, 4)), In((3, 4), 0.01, 1)],
     lambda p, g, h, n, m, v: _in_place(ops.adamw_step(p, g, h, n, m, v, True)), _adamw_ref, backward=False)
case("sgd_step", [In((5,)), In((5,)), In((9,), values=_H_SGD), In((), 1, 2), In((5,))],
     lambda p, g, h, n, b: _in_place(ops.sgd_step(p, g, h, n, b, True)), _sgd_ref, backward=False)

# ---- mixture of experts (qwen3moe, olmoe, lfm2moe) -------------------------------------------------
# router logits a tenth or more apart (a finite-difference step never changes the selection)
_ROUTER = _distinct((5, 8)) * 4
_IDS = np.array([[3, 0], [3, 5], [0, 3], [6, 5], [3, 0]], np.int32)    # experts 1, 2, 4, 7 get no token
case("moe_topk", [In((5, 8), values=_ROUTER)], lambda z: ops.moe_topk(z, 2), lambda z: refs.moe_topk(z, 2),
     backward=False)
case("moe_topk", [In((2, 3, 16))], lambda z: ops.moe_topk(z, 16), lambda z: refs.moe_topk(z, 16), name="all",
     backward=False)
# lfm2moe's selection: sigmoid scores plus a bias that reorders them (rows 0, 2 and 3 take
# other experts than by the logits alone)
_BIAS = np.array([0.3, -0.2, 0.25, -0.1, 0.05, 0.35, -0.3, 0.15])
case("moe_topk", [In((5, 8), values=_ROUTER), In((8,), values=_BIAS)],
     lambda z, b: ops.moe_topk(z, 2, "sigmoid", b), lambda z, b: refs.moe_topk(z, 2, "sigmoid", b),
     name="sigmoid-bias", backward=False)
for _norm in (True, False):
    case("moe_weights", [In((5, 8), values=_ROUTER), In((5, 2), values=_IDS)],
         lambda z, i, n=_norm: ops.moe_weights(z, i, n), lambda z, i, n=_norm: refs.moe_weights(z, i, n),
         name="norm" if _norm else "raw")
    case("moe_weights", [In((5, 8), values=_ROUTER), In((5, 2), values=_IDS)],
         lambda z, i, n=_norm: ops.moe_weights(z, i, n, gating="sigmoid"),
         lambda z, i, n=_norm: refs.moe_weights(z, i, n, "sigmoid"), name="sigmoid-" + ("norm" if _norm else "raw"))
    # the router as the decoder composes it: the selection from the same logits
    case("moe_weights", [In((2, 3, 8), values=_distinct((2, 3, 8), seed=3) * 4)],
         lambda z, n=_norm: ops.moe_weights(z, ops.moe_topk(z, 3), n),
         lambda z, n=_norm: refs.moe_weights(z, refs.moe_topk(z, 3), n), name="topk-" + ("norm" if _norm else "raw"),
         ops_covered=("moe_topk",))
# gpt-oss's: the softmax of the chosen (its gradient: softmax's renormalised)
case("moe_weights", [In((5, 8), values=_ROUTER), In((5, 2), values=_IDS)],
     lambda z, i: ops.moe_weights(z, i, False, gating="softmax_weight"),
     lambda z, i: refs.moe_weights(z, i, False, "softmax_weight"), name="softmax-weight")
case("moe_weights_bwd", [In((5, 8)), In((5, 2), values=_IDS), In((5, 2))],
     lambda z, i, g: ops.apply("moe_weights_bwd", [z, i, g], norm=True),
     lambda z, i, g: _moe_weights_grad(z, i, g, True), backward=False)
case("moe_weights_bwd", [In((5, 8)), In((5, 2), values=_IDS), In((5, 2))],
     lambda z, i, g: ops.apply("moe_weights_bwd", [z, i, g], norm=True, gating="sigmoid"),
     lambda z, i, g: _moe_weights_grad(z, i, g, True, "sigmoid"), backward=False, name="sigmoid")
# gate/up (every slot reads the token's row) and down (slot s reads its own row)
case("moe_matmul", [In((5, 1, 6)), In((8, 7, 6)), In((5, 2), values=_IDS)], ops.moe_matmul, refs.moe_matmul,
     name="shared-row")
case("moe_matmul", [In((5, 2, 7)), In((8, 6, 7)), In((5, 2), values=_IDS)], ops.moe_matmul, refs.moe_matmul,
     name="slot-rows")
case("moe_matmul", [In((3, 1, 70)), In((4, 33, 70)), In((3, 4), values=np.array([[1, 0, 3, 2]] * 3, np.int32))],
     ops.moe_matmul, refs.moe_matmul, name="all-experts")
case("moe_matmul_input_bwd", [In((8, 7, 6)), In((5, 2), values=_IDS), In((5, 2, 7))],
     lambda w, i, g: ops.apply("moe_matmul_input_bwd", [w, i, g], x_shape=(5, 1, 6)),
     lambda w, i, g: np.einsum("nsm,nsmk->nk", g, w[i])[:, None], backward=False)
case("moe_matmul_weight_bwd", [In((5, 2, 7)), In((5, 2), values=_IDS), In((5, 2, 6))],
     lambda x, i, g: ops.apply("moe_matmul_weight_bwd", [x, i, g], w_shape=(8, 6, 7)),
     lambda x, i, g: _moe_weight_grad(x, i, g, 8), backward=False)
