"""Normalisation, softmax and losses (layer 3): rms_norm, softmax, cross_entropy, linear_cross_entropy."""
from __future__ import annotations


from ggtrain.core.numerics import EXACT, check_numerics
from ggtrain.core.tensor import Tensor
from ggtrain.errors import DTypeError
from ggtrain.native.host import (ACT8_TYPES, HYPER_BC1, HYPER_BC2, HYPER_BETA1, HYPER_BETA2,  # noqa: F401
                                 HYPER_COUNT, HYPER_EPS, HYPER_LR, HYPER_MAX_NORM, HYPER_MOMENTUM, HYPER_WD)
from ggtrain.core.ops.registry import (OpDef, _WEIGHT_VARIANTS, _f32, _llama, _need, _no_llama_gradient,
                                       _weight_suffix, apply, check_weight, register)


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
