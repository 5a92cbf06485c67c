"""Matrix products (layer 3): matmul (any stored weight type), matmul_lora, llama.cpp's matmul_q8 and matmul_ggml, linear."""
from __future__ import annotations


from ggtrain.core.numerics import LLAMA
from ggtrain.core.tensor import Tensor, numel
from ggtrain.errors import DTypeError
from ggtrain.native.host import (ACT8_TYPES, HYPER_BC1, HYPER_BC2, HYPER_BETA1, HYPER_BETA2,  # noqa: F401
                                 HYPER_COUNT, HYPER_EPS, HYPER_LR, HYPER_MAX_NORM, HYPER_MOMENTUM, HYPER_WD)
from ggtrain.core.ops.registry import (OpDef, _WEIGHT_VARIANTS, _f32, _need, _weight_suffix, apply,
                                       broadcast_shape, check_weight, register)
from ggtrain.core.ops.views import cont, reshape, transpose
from ggtrain.core.ops.elementwise import add, sum_to


# ---- matmul -------------------------------------------------------------------------


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """a (..., M, K) @ b (..., K, N) -> (..., M, N), batch dims broadcast. (f32)

    Transposed operands (views from .T) cost nothing: the kernel packs either layout.
    b may also be a frozen weight in any type kernels read (f16, bf16, Q4_0, ...,
    Q6_K; see Graph.param), 2-D, in its stored layout or transposed: the kernel
    dequantizes it a tile at a time while packing, never all of it.
    """
    return apply("matmul", [a, b])




def _infer_matmul(srcs, params):
    a, b = srcs
    _f32("matmul", a)
    check_weight("matmul", b)
    _need(a.ndim >= 2 and b.ndim >= 2, f"matmul: inputs need >= 2 dims, got {a.shape} and {b.shape}")
    _need(a.shape[-1] == b.shape[-2],
          f"matmul: inner dims differ: {a.shape} @ {b.shape} ({a.shape[-1]} vs {b.shape[-2]})")
    batch = broadcast_shape("matmul", a.shape[:-2], b.shape[:-2])
    return batch + (a.shape[-2], b.shape[-1]), "f32"






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
