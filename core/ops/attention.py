"""Fused attention (layer 3): attention and its backward, one op over q, k, v and a mask."""
from __future__ import annotations


from ggtrain.core.numerics import EXACT, LLAMA, check_numerics
from ggtrain.core.tensor import Tensor, contiguous_strides
from ggtrain.errors import DTypeError
from ggtrain.native.host import (ACT8_TYPES, HYPER_BC1, HYPER_BC2, HYPER_BETA1, HYPER_BETA2,  # noqa: F401
                                 HYPER_COUNT, HYPER_EPS, HYPER_LR, HYPER_MAX_NORM, HYPER_MOMENTUM, HYPER_WD)
from ggtrain.core.ops.registry import OpDef, _f32, _llama, _need, _no_llama_gradient, apply, register
from ggtrain.core.ops.views import cont, permute, reshape, view
from ggtrain.core.ops.elementwise import mul, sigmoid, sub
from ggtrain.core.ops.norm import _SOFTMAX_MASKS

# attention's masks: softmax's, and the tree mask (segments with a parent each row also sees)
_MASKS = {**_SOFTMAX_MASKS, "tree": 4}
_MASK_INPUTS = {"none": 0, "causal": 0, "pos": 1, "seg": 1, "tree": 2}


# ---- attention (fused) --------------------------------------------------------------


def attention(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool = False, pos: Tensor | None = None,
              seg: Tensor | None = None, with_lse: bool = False, window: int = 0, numerics: str = EXACT,
              scale_q: bool = False, kv_f16: bool = False, parent: Tensor | None = None,
              sinks: Tensor | None = None):
    """softmax(scale * q k^T + mask) v for each query head, fused (gt_attention_fwd_f32):
    no (Tq, Tk) tensor is made, here or in the backward.

    q (B, Tq, H, D), k and v (B, Tk, Hkv, D) with Hkv dividing H (query head h reads KV
    head h // (H / Hkv)), read in place through their strides (a copy only when D is not
    the unit-stride dim). Masks as softmax's: causal, pos (Tq,) i32, or seg (B, T) i32;
    window w > 0 (with a mask): each query sees only the w keys ending at its own (query i
    sees key j when i - j < w; by position with pos), llama.cpp's sliding window. With seg,
    parent (B, T) i32 makes the tree mask: row i sees key j <= i when seg[., j] is seg[., i]
    or parent[., i] (a shared prefix: each continuation's rows see the prefix's keys and their
    own; a prefix row's parent is its own segment); segment values other than -2**31. The
    window counts rows, so with a tree mask it must be 0 or at least T (then it is none).
    Returns O (B, Tq, H, D), or (O, LSE (B, H, Tq)) with with_lse: each row's log-sum-exp
    over the keys it sees (-inf, and O = 0, for a row that sees none). Both are views of
    one node, which is all the backward keeps (besides q, k, v).
    numerics LLAMA: llama.cpp's CPU numbers bit for bit instead (its dot products' order, its vector
    exp, its double sums; key j being cache row j; native/cpu/attention.c says how), and with
    scale_q the scale multiplies q before the dots as some families' graphs do (gemma3, phi3),
    else the dots; with kv_f16 as its F16 KV cache (its default) rounds q, k, v and the weights:
    inference only, CPU only, no gradient, no segment mask. sinks (H,) f32 (llama numerics only):
    a logit a head in each softmax's denominator adding no value, as llama.cpp's soft_max takes
    gpt-oss's attn_sinks (LSE then over the keys and the sink; attention_sinks gives the exact ones).
    Raises ValueError for two masks, ShapeError / DTypeError for bad shapes or types.
    """
    if int(bool(causal)) + (pos is not None) + (seg is not None) > 1:
        raise ValueError("attention: give one of causal, pos and seg")
    if parent is not None and seg is None:
        raise ValueError("attention: a parent (tree mask) goes with seg")
    qkv = [x if x.ndim == 4 and (x.strides[-1] == 1 or x.shape[-1] == 1) else cont(x) for x in (q, k, v)]
    mask = "pos" if pos is not None else "seg" if seg is not None else "causal" if causal else "none"
    extra = [pos] if pos is not None else [seg] if seg is not None else []
    if parent is not None:
        mask, extra = "tree", [seg, parent]
        if window and window < q.shape[1]:
            raise ValueError(f"attention: a window ({window}) shorter than the rows ({q.shape[1]}) with a tree "
                             "mask (it counts rows, not positions)")
        window = 0
    if window and mask == "none":
        raise ValueError("attention: a window needs a mask (causal, pos or seg)")
    llama = check_numerics(numerics) == LLAMA
    if (llama and mask in ("seg", "tree")) or ((scale_q or kv_f16) and not llama):
        raise ValueError("attention: llama numerics take no segment mask; scale_q and kv_f16 need llama numerics")
    if sinks is not None and not llama:
        raise ValueError("attention: sinks in the op need llama numerics (else attention_sinks)")
    y = apply("attention", qkv + extra + ([sinks] if sinks is not None else []), scale=float(scale), mask=mask,
              window=int(window), numerics=numerics, scale_q=bool(scale_q), kv_f16=bool(kv_f16),
              sinks=sinks is not None)
    b, tq, h, _ = q.shape
    o = view(y, q.shape)
    return (o, view(y, (b, h, tq), offset=q.size)) if with_lse else o


def _infer_attention(name):
    def infer(srcs, params):
        q, k, v = srcs[:3]
        _f32(name, q, k, v)
        mask = params["mask"]
        sinks = int(params.get("sinks", False))
        _need(mask in _MASKS and len(srcs) == (3 if name == "attention" else 5) + _MASK_INPUTS[mask] + sinks,
              f"{name}: mask {mask!r} with {len(srcs)} inputs", ValueError)
        _need(q.ndim == 4 and k.ndim == 4 and v.shape == k.shape and k.shape[0] == q.shape[0]
              and k.shape[3] == q.shape[3] and k.shape[2] >= 1 and q.shape[2] % k.shape[2] == 0,
              f"{name}: expected q (B, Tq, H, D), k and v (B, Tk, Hkv, D) with Hkv dividing H, got "
              f"{q.shape}, {k.shape}, {v.shape}")
        for x in (q, k, v):
            _need(x.strides[-1] == 1 or x.shape[-1] == 1, f"{name}: {x!r} needs unit stride along D")
        b, tq, h, d = q.shape
        tk = k.shape[1]
        if sinks:
            _f32(name, srcs[-1])
            _need(srcs[-1].shape == (q.shape[2],), f"{name}: sinks {srcs[-1].shape} for {q.shape[2]} heads")
        for m in srcs[len(srcs) - sinks - _MASK_INPUTS[mask]:len(srcs) - sinks]:
            if m.dtype != "i32":
                raise DTypeError(f"{name}: {'positions' if mask == 'pos' else 'segments'} must be i32, got {m.dtype}")
            _need(mask != "pos" or m.shape == (tq,), f"{name}: positions {m.shape} do not match Tq of q {q.shape}")
            _need(mask == "pos" or (tq == tk and m.shape == (b, tq)),
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


_attention_lower = lambda y: ((_MASKS[y.params["mask"]], y.params["window"],  # noqa: E731
                               _llama(y), int(y.params.get("scale_q", False)),
                               int(y.params.get("kv_f16", False)), int(y.params.get("sinks", False))),
                              (y.params["scale"],))
register(OpDef("attention", _infer_attention("attention"), "attention_fwd", backward=_attention_bwd,
               lower=_attention_lower, contiguous=(3, 4), differentiable=(0, 1, 2)))
register(OpDef("attention_bwd", _infer_attention("attention_bwd"), "attention_bwd", lower=_attention_lower,
               contiguous=(3, 5, 6)))


def attention_sinks(o: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """Attention with a sink logit a head (gpt-oss's attn_sinks), from the sink-free attention's
    O (B, T, H, D) and LSE (B, H, T) (attention(..., with_lse=True)) and sinks (H,): softmax
    over a row's keys and its head's sink, which adds no value, is O times the keys' share
    exp(LSE) / (exp(LSE) + exp(sink)) = sigmoid(LSE - sink). A composite: its gradient reaches
    q, k, v through LSE (the attention backward's dLSE) and the sinks through the sigmoid."""
    b, h, t = lse.shape
    _need(o.shape[:3] == (b, t, h) and sinks.shape == (h,),
          f"attention_sinks: O {o.shape}, LSE {lse.shape} and sinks {sinks.shape} do not match")
    share = sigmoid(sub(lse, reshape(sinks, (1, h, 1))))                                # (B, H, T)
    return mul(o, reshape(cont(permute(share, (0, 2, 1))), (b, t, h, 1)))
