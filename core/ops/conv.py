"""Convolution and pooling (layer 3): conv2d over NHWC (fused bias, relu, pool), max_pool2d, and the
causal depthwise convolution over time (causal_conv1d, LFM2's short convolution)."""
from __future__ import annotations


from ggtrain.core.tensor import Tensor
from ggtrain.errors import DTypeError
from ggtrain.native.host import (ACT8_TYPES, HYPER_BC1, HYPER_BC2, HYPER_BETA1, HYPER_BETA2,  # noqa: F401
                                 HYPER_COUNT, HYPER_EPS, HYPER_LR, HYPER_MAX_NORM, HYPER_MOMENTUM, HYPER_WD)
from ggtrain.core.numerics import EXACT, check_numerics
from ggtrain.core.ops.registry import OpDef, _f32, _llama, _need, _no_llama_gradient, apply, register
from ggtrain.core.ops.views import view


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


# ---- causal depthwise convolution over time (LFM2's short convolution) --------------------


def causal_conv1d(x: Tensor, w: Tensor, seg: Tensor | None = None, numerics: str = EXACT) -> Tensor:
    """y[b, t, c] = sum over k < L of w[c, k] x[b, t - L + 1 + k, c]: each channel convolved
    over time with its own kernel of L taps, the last tap on the current row, rows before
    the first zero (llama.cpp's ssm_conv after its conv state, as LFM2 runs it).

    x (B, T, C) f32, w (C, L) f32 (the layout of shortconv.conv.weight), seg (B, T) i32 or
    None: with packed samples a row sees only the rows of its own segment. Returns (B, T, C).
    numerics LLAMA: llama.cpp's CPU bits (each tap a fused multiply-add; inference only, CPU
    only, no gradient). Raises ShapeError / DTypeError for bad shapes or types.
    """
    return apply("causal_conv1d", [x, w] + ([seg] if seg is not None else []), numerics=check_numerics(numerics))


def _infer_causal_conv1d(name):
    def infer(srcs, params):
        _f32(name, srcs[0], srcs[1])
        _need(len(srcs) in (2, 3), f"{name}: expected 2 or 3 inputs, got {len(srcs)}")
        w = srcs[1] if name != "causal_conv1d_input_bwd" else srcs[0]
        x = srcs[0] if name != "causal_conv1d_input_bwd" else srcs[1]
        if name == "causal_conv1d_weight_bwd":
            w = None
            c, taps = params["w_shape"]
            _need(srcs[1].shape == x.shape, f"{name}: g {srcs[1].shape} does not match x {x.shape}")
        else:
            _need(w.ndim == 2, f"{name}: the kernel must be (C, L), got {w.shape}")
            c, taps = w.shape
        _need(x.ndim == 3 and x.shape[2] == c and taps >= 1,
              f"{name}: expected x (B, T, {c}) for a kernel ({c}, {taps}), got {x.shape}")
        if len(srcs) == 3:
            seg = srcs[2]
            if seg.dtype != "i32":
                raise DTypeError(f"{name}: segments must be i32, got {seg.dtype}")
            _need(seg.shape == x.shape[:2], f"{name}: segments {seg.shape} do not match (B, T) of {x.shape}")
        return ((c, taps) if name == "causal_conv1d_weight_bwd" else x.shape), "f32"
    return infer


def _causal_conv1d_bwd(y, g):
    _no_llama_gradient(y, "causal_conv1d")
    x, w = y.srcs[0], y.srcs[1]
    seg = list(y.srcs[2:])
    gx = apply("causal_conv1d_input_bwd", [w, g] + seg) if x.requires_grad else None
    gw = apply("causal_conv1d_weight_bwd", [x, g] + seg, w_shape=w.shape) if w.requires_grad else None
    return [gx, gw] + [None] * len(seg)


register(OpDef("causal_conv1d", _infer_causal_conv1d("causal_conv1d"), "causal_conv1d_fwd", contiguous=(0, 1, 2),
               backward=_causal_conv1d_bwd, differentiable=(0, 1), lower=lambda y: ((_llama(y),), ())))
for _name in ("causal_conv1d_input_bwd", "causal_conv1d_weight_bwd"):
    register(OpDef(_name, _infer_causal_conv1d(_name), _name, contiguous=(0, 1, 2)))
