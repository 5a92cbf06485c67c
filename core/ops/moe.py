"""Mixture-of-experts ops (layer 3): the router's top-k selection (moe_topk), the gate weights of
the selected experts (moe_weights) and the grouped expert product (moe_matmul, ggml's
mul_mat_id), as llama.cpp's build_moe_ffn computes them."""
from __future__ import annotations

from ggtrain.core.numerics import EXACT, check_numerics
from ggtrain.core.ops.registry import (OpDef, _WEIGHT_VARIANTS, _f32, _llama, _need, _no_llama_gradient,
                                       _weight_suffix, apply, register)
from ggtrain.core.tensor import Tensor
from ggtrain.errors import DTypeError
from ggtrain.native.dtypes import WEIGHT_TYPES, dtype
from ggtrain.native.host import ACT8_TYPES


# ---- routing ----------------------------------------------------------------------------------


# the router's gating functions (llama.cpp's expert_gating_func: 1 softmax, 2 sigmoid, 3
# softmax_weight: the softmax of the k chosen logits, gpt-oss's), by the flag the kernels take
GATINGS = ("softmax", "sigmoid", "softmax_weight")


def _gating(op: str, gating: str) -> str:
    _need(gating in GATINGS, f"{op}: gating {gating!r} (one of {', '.join(GATINGS)})")
    return gating


def moe_topk(logits: Tensor, k: int, gating: str = "softmax", bias: Tensor | None = None) -> Tensor:
    """The ids of the k experts of largest score in logits (..., E) along the last dim, largest
    first (of equal ones the lower index first): (..., k) i32, llama.cpp's argsort_top_k of its
    selection probabilities. The score: the logit (softmax gatings, which keep the order), or
    sigmoid(logit) plus bias (E,) f32 where given (sigmoid gating: llama.cpp's exp_probs_b,
    which moves the selection, not the weights), in llama.cpp's f32. No gradient (the selection
    is piecewise constant)."""
    _gating("moe_topk", gating)
    _need(bias is None or gating == "sigmoid", "moe_topk: a selection bias with sigmoid gating only")
    return apply("moe_topk", [logits] + ([bias] if bias is not None else []), k=int(k),
                 gating="softmax" if gating == "softmax_weight" else gating)


def _infer_topk(srcs, params):
    z, k = srcs[0], params["k"]
    _f32("moe_topk", z)
    _need(z.ndim >= 1 and 1 <= k <= z.shape[-1], f"moe_topk: k = {k} of logits {z.shape} (1 <= k <= experts)")
    if len(srcs) > 1:
        _f32("moe_topk", srcs[1])
        _need(srcs[1].shape == z.shape[-1:], f"moe_topk: bias {srcs[1].shape} for logits {z.shape} (one an expert)")
    return z.shape[:-1] + (k,), "i32"


register(OpDef("moe_topk", _infer_topk, "moe_topk_fwd", contiguous=(0, 1), differentiable=(), dtypes=("i32",),
               lower=lambda y: ((y.params["k"], GATINGS.index(y.params["gating"])), ())))


def moe_weights(logits: Tensor, ids: Tensor, norm: bool, numerics: str = EXACT, gating: str = "softmax") -> Tensor:
    """The gate weights of the selected experts: softmax(logits)[..., ids] (..., k), or
    sigmoid(logits)[..., ids] (gating "sigmoid"), or softmax(logits[..., ids]) over the k
    (gating "softmax_weight", llama.cpp's SOFTMAX_WEIGHT: softmax's renormalised over the
    chosen), divided by their sum over the k (clamped below at 2^-14, as llama.cpp does) when
    norm. logits (..., E) f32, ids (..., k) i32 (moe_topk's). The gradient flows to the logits
    through the softmax or sigmoid and the renormalisation; none to ids. numerics LLAMA:
    llama.cpp's CPU numbers (its soft_max's exp and sums over the E logits or, softmax_weight,
    the k chosen; its sigmoid; inference only)."""
    return apply("moe_weights", [logits, ids], norm=bool(norm), numerics=check_numerics(numerics),
                 gating=_gating("moe_weights", gating))


def _infer_weights(name):
    def infer(srcs, params):
        z, ids = srcs[0], srcs[1]
        _f32(name, z)
        if ids.dtype != "i32":
            raise DTypeError(f"{name}: expert ids must be i32, got {ids.dtype}")
        _need(z.ndim >= 1 and ids.shape[:-1] == z.shape[:-1] and 1 <= ids.shape[-1] <= z.shape[-1],
              f"{name}: ids {ids.shape} do not select from logits {z.shape}")
        if name == "moe_weights_bwd":
            _f32(name, srcs[2])
            _need(srcs[2].shape == ids.shape, f"{name}: g {srcs[2].shape} does not match ids {ids.shape}")
            return z.shape, "f32"
        return ids.shape, "f32"
    return infer


def _weights_bwd(y, g):
    _no_llama_gradient(y, "moe_weights")
    z, ids = y.srcs
    chosen = y.params["gating"] == "softmax_weight"   # (softmax's, renormalised)
    return [apply("moe_weights_bwd", [z, ids, g], norm=y.params["norm"] or chosen,
                  gating="softmax" if chosen else y.params["gating"]), None]


register(OpDef("moe_weights", _infer_weights("moe_weights"), "moe_weights_fwd", contiguous=(0, 1),
               differentiable=(0,), backward=_weights_bwd,
               lower=lambda y: ((int(y.params["norm"]), _llama(y), GATINGS.index(y.params["gating"])), ())))
register(OpDef("moe_weights_bwd", _infer_weights("moe_weights_bwd"), "moe_weights_bwd", contiguous=(0, 1, 2),
               lower=lambda y: ((int(y.params["norm"]), GATINGS.index(y.params.get("gating", "softmax"))), ())))


# ---- the grouped expert product -----------------------------------------------------------------


def moe_matmul(x: Tensor, w: Tensor, ids: Tensor, numerics: str = EXACT) -> Tensor:
    """ggml's mul_mat_id: y[n, s] = w[ids[n, s]] @ x[n, 0 or s] (N, k, M), each expert's
    product over only the tokens routed to it. x (N, X, K) f32 with X = 1 (every slot reads the
    token's row: the gate and up products) or X = k (slot s reads its own row: the down
    product); w (E, M, K) the experts' weights (a GGUF file's ffn_*_exps), f32 or frozen in a
    stored type (f16, bf16, Q4_0 ... Q6_K, MXFP4: each expert's slice through the matmul's row-dot
    kernel); ids (N, k) i32. Gradients to x (any w) and to an f32 w. numerics LLAMA: llama.cpp's
    CPU numbers (f32, f16 and the 32-element block types' experts, these with the activations in
    8 bits as its mul_mat_id multiplies them; inference only)."""
    return apply("moe_matmul", [x, w, ids], numerics=check_numerics(numerics))


# the expert types moe_matmul has llama.cpp's numbers for: f32, f16, and the 32-element blocks
# whose products with 8-bit activations have a kernel (native/cpu/moe.c)
_LLAMA_EXPERT_TYPES = ("f32", "f16") + tuple(w for w in ACT8_TYPES if dtype(w).block == 32)


def _check_experts(op: str, w: Tensor) -> None:
    """Expert weights (E, M, K): f32, or a whole stored tensor of a weight type, frozen."""
    _need(w.ndim == 3, f"{op}: expert weights must be (experts, rows, K), got {w.shape}")
    if w.dtype == "f32":
        return
    _need(w.dtype in WEIGHT_TYPES, f"{op}: no kernel reads {w.dtype} tensors ({w!r})", DTypeError)
    _need(not w.requires_grad, f"{op}: a {w.dtype} weight is frozen storage; train an f32 copy instead ({w!r})",
          DTypeError)
    _need(w.offset == 0 and w.root is w and w.is_contiguous(),
          f"{op}: {w.dtype} expert weights must be a whole stored tensor, got {w!r}")


def _infer_moe_matmul(name):
    def infer(srcs, params):
        if name == "moe_matmul_input_bwd":
            w, ids, g = srcs
            x_shape = params["x_shape"]
        else:
            x, w_or_ids = srcs[0], srcs[1]
            _f32(name, x)
            x_shape = x.shape
            w, ids = (srcs[1], srcs[2]) if name == "moe_matmul" else (None, srcs[1])
            g = srcs[2] if name == "moe_matmul_weight_bwd" else None
            del w_or_ids
        w_shape = w.shape if w is not None else params["w_shape"]
        if w is not None:
            _check_experts(name, w)
            _need(params.get("numerics", EXACT) == EXACT or w.dtype in _LLAMA_EXPERT_TYPES,
                  f"{name}: llama.cpp's numbers (numerics llama) for {w.dtype} experts are not implemented "
                  f"({', '.join(_LLAMA_EXPERT_TYPES)} ones are)", DTypeError)
        if ids.dtype != "i32":
            raise DTypeError(f"{name}: expert ids must be i32, got {ids.dtype}")
        _need(len(x_shape) == 3 and len(w_shape) == 3 and ids.ndim == 2 and x_shape[0] == ids.shape[0]
              and x_shape[1] in (1, ids.shape[1]) and w_shape[2] == x_shape[2] and 1 <= ids.shape[1] <= w_shape[0],
              f"{name}: x {tuple(x_shape)}, experts {tuple(w_shape)} and ids {ids.shape} do not fit (N, 1 or k, K), "
              f"(E, M, K), (N, k <= E)")
        out = (ids.shape[0], ids.shape[1], w_shape[1])
        if g is not None:
            _f32(name, g)
            _need(g.shape == out, f"{name}: g {g.shape} does not match the product {out}")
        return {"moe_matmul": out, "moe_matmul_input_bwd": tuple(x_shape),
                "moe_matmul_weight_bwd": tuple(w_shape)}[name], "f32"
    return infer


def _moe_matmul_bwd(y, g):
    _no_llama_gradient(y, "moe_matmul")
    x, w, ids = y.srcs
    gx = apply("moe_matmul_input_bwd", [w, ids, g], x_shape=x.shape) if x.requires_grad else None
    gw = apply("moe_matmul_weight_bwd", [x, ids, g], w_shape=w.shape) if w.requires_grad else None
    return [gx, gw, None]


register(OpDef("moe_matmul", _infer_moe_matmul("moe_matmul"), "moe_matmul_fwd", contiguous=(0, 1, 2),
               differentiable=(0, 1), backward=_moe_matmul_bwd, dtypes=_WEIGHT_VARIANTS,
               suffix=lambda y: _weight_suffix(y.srcs[1]), lower=lambda y: ((_llama(y),), ())))
register(OpDef("moe_matmul_input_bwd", _infer_moe_matmul("moe_matmul_input_bwd"), "moe_matmul_input_bwd",
               contiguous=(0, 1, 2), dtypes=_WEIGHT_VARIANTS, suffix=lambda y: _weight_suffix(y.srcs[0])))
register(OpDef("moe_matmul_weight_bwd", _infer_moe_matmul("moe_matmul_weight_bwd"), "moe_matmul_weight_bwd",
               contiguous=(0, 1, 2)))

__all__ = ["GATINGS", "moe_topk", "moe_weights", "moe_matmul"]
