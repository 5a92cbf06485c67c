"""Rotary embeddings and row gathers (layer 3): rope, get_rows and their backward."""
from __future__ import annotations


import numpy as np

from ggtrain.core.numerics import EXACT, check_numerics
from ggtrain.core.tensor import Tensor
from ggtrain.errors import DTypeError
from ggtrain.native.host import (ACT8_TYPES, HYPER_BC1, HYPER_BC2, HYPER_BETA1, HYPER_BETA2,  # noqa: F401
                                 HYPER_COUNT, HYPER_EPS, HYPER_LR, HYPER_MAX_NORM, HYPER_MOMENTUM, HYPER_WD)
from ggtrain.core.ops.registry import (OpDef, _WEIGHT_VARIANTS, _f32, _llama, _need, _no_llama_gradient,
                                       _weight_suffix, apply, check_weight, register)


# ---- rope, embeddings -------------------------------------------------------------


ROPE_MODES = {"norm": 0, "neox": 2}   # ggml's numbers: 0 adjacent pairs, 2 pairs n_dims/2 apart


def yarn_corr_dims(n_dims: int, n_ctx_orig: int, freq_base: float, beta_fast: float = 32.0,
                   beta_slow: float = 1.0) -> tuple:
    """YaRN's (low, high) correction dims as ggml_rope_yarn_corr_dims computes them (in f32):
    the pairs that turn beta_fast (beta_slow) times over n_ctx_orig positions, floored (ceiled),
    clamped to 0..n_dims - 1. Pairs below low keep their frequency (extrapolate), pairs above
    high are divided by the scaling factor (interpolate), a linear ramp between."""
    f = np.float32

    def dim(rot):
        return f(n_dims) * np.log(f(n_ctx_orig) / (f(rot) * f(2) * f(np.pi))) / (f(2) * np.log(f(freq_base)))
    low, high = np.floor(dim(beta_fast)), np.ceil(dim(beta_slow))
    return float(max(f(0), low)), float(min(f(n_dims - 1), high))


def rope(x: Tensor, pos: Tensor, n_dims: int | None = None, freq_base: float = 10000.0, mode: str = "norm",
         freq_scale: float = 1.0, factors: Tensor | None = None, attn_factor: float = 1.0,
         numerics: str = EXACT, ext_factor: float = 0.0, corr_dims: tuple = (0.0, 0.0)) -> Tensor:
    """Rotary embedding as llama.cpp's ggml_rope_ext: x (..., T, H, D), pos i32 (T,)
    shared by every row, or x's leading dims (..., T), e.g. (B, T): each row its own positions
    (packed samples restart at 0). mode "norm" rotates adjacent pairs (x[2i], x[2i+1]) (llama),
    "neox" the pairs (x[i], x[i + n_dims/2]) (qwen2, qwen3, gemma3, phi3); pair i turns by
    freq_scale * pos * freq_base^(-2i/n_dims) / factors[i] (factors (n_dims/2,) f32: llama 3's
    rope_freqs; freq_scale: linear rope scaling); the rotated pairs are scaled by attn_factor
    (phi3's longrope attention factor; the dims past n_dims are not). numerics LLAMA:
    llama.cpp's CPU numbers bit for bit (f32 angles theta *= powf(base, -2/n_dims) pair after
    pair, libm's cosf / sinf, an fma'd rotation) instead of exact angles rounded once:
    inference only, CPU only, no gradient. YaRN (ext_factor > 0, ggml's rope_yarn): pair i
    turns by theta_interp (1 - m) + theta_extrap m, theta_extrap its angle without freq_scale,
    theta_interp with it, m = ext_factor (1 - clip((i - low) / max(0.001, high - low), 0, 1))
    for corr_dims (low, high) (yarn_corr_dims), and attn_factor is multiplied by
    1 + 0.1 ln(1 / freq_scale). Raises ShapeError / DTypeError."""
    n_dims = x.shape[-1] if n_dims is None else int(n_dims)
    srcs = [x, pos] if factors is None else [x, pos, factors]
    return apply("rope", srcs, n_dims=n_dims, freq_base=float(freq_base), mode=mode, freq_scale=float(freq_scale),
                 attn_factor=float(attn_factor), numerics=check_numerics(numerics), ext_factor=float(ext_factor),
                 corr_dims=tuple(float(c) for c in corr_dims))


def rope_bwd(g: Tensor, pos: Tensor, n_dims: int, freq_base: float, mode: str = "norm", freq_scale: float = 1.0,
             factors: Tensor | None = None, attn_factor: float = 1.0, ext_factor: float = 0.0,
             corr_dims: tuple = (0.0, 0.0)) -> Tensor:
    srcs = [g, pos] if factors is None else [g, pos, factors]
    return apply("rope_bwd", srcs, n_dims=n_dims, freq_base=float(freq_base), mode=mode,
                 freq_scale=float(freq_scale), attn_factor=float(attn_factor), ext_factor=float(ext_factor),
                 corr_dims=tuple(float(c) for c in corr_dims))


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
    low, high = params.get("corr_dims", (0.0, 0.0))
    _need(params.get("ext_factor", 0.0) >= 0 and 0 <= low <= high,
          f"rope: ext_factor {params.get('ext_factor')} must be >= 0, corr_dims {(low, high)} 0 <= low <= high")
    if len(srcs) == 3:
        _f32("rope", srcs[2])
        _need(srcs[2].shape == (nd // 2,), f"rope: factors {srcs[2].shape} must be (n_dims / 2,) = ({nd // 2},)")
    return x.shape, "f32"


def _rope_backward(y, g):
    factors = y.srcs[2] if len(y.srcs) == 3 else None
    p = y.params
    _no_llama_gradient(y, "rope")
    return [rope_bwd(g, y.srcs[1], p["n_dims"], p["freq_base"], p["mode"], p["freq_scale"], factors,
                     p["attn_factor"], p["ext_factor"], p["corr_dims"]), None, None]


_rope_lower = lambda y: ((y.params["n_dims"], ROPE_MODES[y.params["mode"]],  # noqa: E731
                          _llama(y)),
                         (y.params["freq_base"], y.params["freq_scale"], y.params["attn_factor"],
                          y.params["ext_factor"]) + tuple(y.params["corr_dims"]))
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
