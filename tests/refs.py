"""float64 numpy references of the fused kernels (norm, softmax, attention, cross_entropy,
rope, get_rows, im2col, max_pool2d, dropout), forward and backward.

Plain loops and formulas, written to be obviously right rather than fast; the
op tests compare the native kernels against them, and tests/test_kernels.py
checks every backward here against finite differences of its forward.
"""
from __future__ import annotations

import numpy as np


def _f64(a):
    return np.asarray(a, dtype=np.float64)


def rounded(x, drop: int):
    """f32 x rounded to nearest even with its lowest `drop` fraction bits cleared (bf16: 16,
    TF32: 13), as f32."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    u = (u + (1 << (drop - 1)) - 1 + ((u >> drop) & 1)) & ~np.uint64((1 << drop) - 1)
    return u.astype(np.uint32).view(np.float32)


def act8_quantize(x):
    """llama.cpp's 8-bit activations of rows x (..., K): q (..., K/32, 32) int, d and s (..., K/32) as f32."""
    x = np.asarray(x, np.float32)
    xb = x.reshape(x.shape[:-1] + (x.shape[-1] // 32, 32))
    amax = np.abs(xb).max(-1)
    with np.errstate(divide="ignore"):
        idv = np.where(amax != 0, np.float32(127) / np.where(amax != 0, amax, 1), np.float32(0)).astype(np.float32)
    q = np.rint(xb * idv[..., None]).astype(np.int32)
    d = (amax / np.float32(127)).astype(np.float32)
    s = (d * q.sum(-1).astype(np.float32)).astype(np.float32)
    return q, d.astype(np.float16).astype(np.float32), s.astype(np.float16).astype(np.float32)

# MXFP4's E2M1 codes' values, doubled (the OCP microscaling spec's FP4: sign, 2 exponent bits of bias 1, 1 mantissa bit)
_E2M1_X2 = [int(np.ldexp(1 + (c & 1) / 2, ((c >> 1) & 3) - 1) * 2) if c & 6 else (c & 1) for c in range(8)]
MXFP4_VALUES = np.array(_E2M1_X2 + [-v for v in _E2M1_X2], np.int32)


def weight_blocks(raw, wtype, R, C):
    """(q (R, C/32, 32) int, d, m (R, C/32)) of a stored q4_0 / q4_1 / q5_0 / q5_1 / q8_0 / mxfp4
    matrix (mxfp4: q the doubled E2M1 values, d the E8M0 scale halved, 2^(e - 128))."""
    nb = C // 32
    if wtype == "mxfp4":
        b = np.frombuffer(raw, np.uint8).reshape(R, nb, 17)
        qs = b[..., 1:]
        q = MXFP4_VALUES[np.concatenate([qs & 15, qs >> 4], -1)]
        d = np.ldexp(1.0, b[..., 0].astype(np.int32) - 128).astype(np.float32)
        return q, d, np.zeros_like(d)
    bb = {"q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24, "q8_0": 34}[wtype]
    b = np.frombuffer(raw, np.uint8).reshape(R, nb, bb)
    d = b[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    has_min = wtype in ("q4_1", "q5_1")
    m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if has_min else np.zeros_like(d)
    if wtype == "q8_0":
        return b[..., 2:].view(np.int8).astype(np.int32), d, m
    qs = b[..., bb - 16:]
    q = np.concatenate([qs & 15, qs >> 4], -1).astype(np.int32)
    if wtype.startswith("q5"):
        at = 4 if has_min else 2
        qh = b[..., at:at + 4].copy().view(np.uint32)[..., 0].astype(np.int64)
        q = q | (((qh[..., None] >> np.arange(32)) & 1) << 4).astype(np.int32)
    return q - {"q4_0": 8, "q5_0": 16}.get(wtype, 0), d, m


def weight_blocks_f64(raw, wtype, R, C):
    """The stored q4_0 / q4_1 / q8_0 / mxfp4 matrix (R, C) in float64: d * q (+ m)."""
    q, d, m = weight_blocks(raw, wtype, R, C)
    return (q * d[..., None].astype(np.float64) + m[..., None]).reshape(R, C)


def act8_matmul(x, raw, wtype, R, C):
    """float64 x @ W^T as llama.cpp computes it with 8-bit activations."""
    qx, dx, sx = act8_quantize(x)
    qw, dw, mw = weight_blocks(raw, wtype, R, C)
    isum = np.einsum("...bk,rbk->...rb", qx.astype(np.int64), qw.astype(np.int64)).astype(np.float64)
    return (isum * (dw.astype(np.float64) * dx[..., None, :].astype(np.float64))).sum(-1) + \
           (mw.astype(np.float64) * sx[..., None, :].astype(np.float64)).sum(-1)


def act8k_quantize(x):
    """llama.cpp's Q8_K activations of rows x (..., K): q (..., K/256, 256) int, d (..., K/256) f32
    (1 / iscale, iscale = -127 / the first element of largest magnitude), bsums (..., K/256, 16)."""
    x = np.asarray(x, np.float32)
    xb = x.reshape(x.shape[:-1] + (x.shape[-1] // 256, 256))
    at = np.abs(xb).argmax(-1)
    mx = np.take_along_axis(xb, at[..., None], -1)[..., 0]
    with np.errstate(divide="ignore"):
        iscale = np.where(mx != 0, np.float32(-127) / np.where(mx != 0, mx, 1), np.float32(0)).astype(np.float32)
    q = np.minimum(127, np.rint((xb * iscale[..., None]).astype(np.float32))).astype(np.int32)
    with np.errstate(divide="ignore"):
        d = np.where(iscale != 0, np.float32(1) / np.where(iscale != 0, iscale, 1), 0).astype(np.float32)
    return q, d, q.reshape(q.shape[:-1] + (16, 16)).sum(-1)


def kquant_blocks(raw, wtype, R, C):
    """The integer parts of a stored q4_k / q5_k / q6_k matrix (R, C): q (R, C/256, 256) (q4_k:
    0..15; q5_k: 0..31; q6_k: -32..31), the scale of each element's sub-block sc (R, C/256, 256),
    and d, and for q4_k and q5_k the sub-blocks' mins mn (R, C/256, 256) and dmin, per
    super-block (R, C/256)."""
    nb = C // 256
    if wtype in ("q4_k", "q5_k"):
        five = wtype == "q5_k"
        b = np.frombuffer(raw, np.uint8).reshape(R, nb, 176 if five else 144).astype(np.int64)
        d = b[..., :2].astype(np.uint8).copy().view(np.float16)[..., 0].astype(np.float32)
        dmin = b[..., 2:4].astype(np.uint8).copy().view(np.float16)[..., 0].astype(np.float32)
        s = b[..., 4:16]
        sc = np.empty((R, nb, 8), np.int64)
        mn = np.empty((R, nb, 8), np.int64)
        for j in range(8):
            if j < 4:
                sc[..., j], mn[..., j] = s[..., j] & 63, s[..., j + 4] & 63
            else:
                sc[..., j] = (s[..., j + 4] & 15) | ((s[..., j - 4] >> 6) << 4)
                mn[..., j] = (s[..., j + 4] >> 4) | ((s[..., j] >> 6) << 4)
        qs = b[..., 48 if five else 16:].reshape(R, nb, 4, 32)
        q = np.stack([qs & 15, qs >> 4], 3).reshape(R, nb, 256)
        if five:    # element 32 s + l (sub-block s) takes bit s of qh[l] as its 16
            qh = b[..., 16:48]
            q = q | (((qh[..., None, :] >> np.arange(8)[:, None]) & 1) << 4).reshape(R, nb, 256)
        return q, np.repeat(sc, 32, -1), d, np.repeat(mn, 32, -1), dmin
    b = np.frombuffer(raw, np.uint8).reshape(R, nb, 210).astype(np.int64)
    ql, qh = b[..., :128], b[..., 128:192]
    sc = b[..., 192:208].astype(np.uint8).view(np.int8).astype(np.int64)
    d = b[..., 208:210].astype(np.uint8).copy().view(np.float16)[..., 0].astype(np.float32)
    q = np.empty((R, nb, 256), np.int64)
    for h in range(2):
        l_, h_ = ql[..., 64 * h:64 * h + 64], qh[..., 32 * h:32 * h + 32]
        for part in range(4):
            lo = (l_[..., :32] if part % 2 == 0 else l_[..., 32:])
            lo = lo & 15 if part < 2 else lo >> 4
            q[..., 128 * h + 32 * part:128 * h + 32 * part + 32] = lo | (((h_ >> (2 * part)) & 3) << 4)
    return q - 32, np.repeat(sc, 16, -1), d, None, None


def kquant_f64(raw, wtype, R, C):
    """The stored q4_k / q5_k / q6_k matrix (R, C) in float64."""
    q, sc, d, mn, dmin = kquant_blocks(raw, wtype, R, C)
    w = d[..., None].astype(np.float64) * sc * q
    if mn is not None:
        w = w - dmin[..., None].astype(np.float64) * mn
    return w.reshape(R, C)


def act8k_matmul(x, raw, wtype, R, C):
    """float64 x @ W^T as llama.cpp computes it with Q8_K activations."""
    qx, dx, _ = act8k_quantize(x)
    q, sc, d, mn, dmin = kquant_blocks(raw, wtype, R, C)
    dx = dx.astype(np.float64)
    isum = np.einsum("...bk,rbk->...rb", qx.astype(np.int64), sc * q).astype(np.float64)
    out = (isum * d.astype(np.float64) * dx[..., None, :]).sum(-1)
    if mn is not None:
        msum = np.einsum("...bk,rbk->...rb", qx.astype(np.int64), mn).astype(np.float64)
        out = out - (msum * dmin.astype(np.float64) * dx[..., None, :]).sum(-1)
    return out


def rms_norm(x, eps):
    """x / sqrt(mean(x^2, last dim) + eps)."""
    x = _f64(x)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def rms_norm_bwd(x, g, eps):
    """dx of rms_norm for upstream gradient g."""
    x, g = _f64(x), _f64(g)
    r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    c = x.shape[-1]
    return r * g - x * r**3 * np.sum(x * g, axis=-1, keepdims=True) / c


def _causal_mask(tq, tk):
    """(tq, tk) bool, True where row i sees column j <= i + (tk - tq)."""
    return np.arange(tk)[None, :] <= np.arange(tq)[:, None] + (tk - tq)


def seg_mask(seg, parent=None):
    """(B, T, T) bool from seg (B, T): query i sees key j iff j <= i and seg[j] == seg[i],
    or (tree mask, parent (B, T)) seg[j] == parent[i]."""
    seg = np.asarray(seg)
    t = seg.shape[-1]
    same = seg[:, None, :] == seg[:, :, None]
    if parent is not None:
        same = same | (seg[:, None, :] == np.asarray(parent)[:, :, None])
    return _causal_mask(t, t)[None] & same


def softmax(x, scale=1.0, causal=False, pos=None, seg=None):
    """softmax(scale * x) over the last dim; causal masks (..., T_q, T_k) to 0, and so
    does pos (T_q,): query i sees keys j <= pos[i], and seg (B, T) for x (B, ..., T, T):
    query i of batch b sees keys j <= i of its own segment (seg[b, j] == seg[b, i]).
    A row that sees no column is all 0."""
    z = _f64(x) * scale
    if causal:
        mask = _causal_mask(z.shape[-2], z.shape[-1])
        z = np.where(mask, z, -np.inf)
    if pos is not None:
        mask = np.arange(z.shape[-1])[None, :] <= np.asarray(pos)[:, None]
        z = np.where(mask, z, -np.inf)
    if seg is not None:
        mask = seg_mask(seg)
        mask = mask.reshape(mask.shape[:1] + (1,) * (z.ndim - 3) + mask.shape[1:])
        z = np.where(mask, z, -np.inf)
    m = np.max(z, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(z - m)
    s = np.sum(e, axis=-1, keepdims=True)
    return np.divide(e, s, out=np.zeros_like(e), where=s > 0)


def softmax_bwd(y, g, scale=1.0):
    """dx of softmax(scale * x) given its output y and upstream gradient g."""
    y, g = _f64(y), _f64(g)
    return scale * y * (g - np.sum(g * y, axis=-1, keepdims=True))


def attention_mask(tq, tk, b, causal=False, pos=None, seg=None, window=0, parent=None):
    """(B, 1, Tq, Tk) bool: which keys each query row sees (at most one mask given); with
    window w > 0 only keys less than w back from the query's own (i - j < w, by position
    with pos; with causal the query's own key is i + Tk - Tq)."""
    keys = np.arange(tk)[None, :]
    if seg is not None:
        m = seg_mask(seg, parent)[:, None]
        if window:
            m = m & (np.arange(tq)[:, None] - keys < window)
        return m
    if pos is not None:
        m = keys <= np.asarray(pos)[:, None]
        own = np.asarray(pos)[:, None]
    elif causal:
        m = _causal_mask(tq, tk)
        own = np.arange(tq)[:, None] + (tk - tq)
    else:
        m, own = np.ones((tq, tk), bool), None
    if window:
        m = m & (own - keys < window)
    return np.broadcast_to(m, (b, 1, tq, tk))


def _attention_probs(q, k, scale, mask):
    """(B, H, Tq, Tk) probabilities and (B, H, Tq) log-sum-exp of scale * q.k over the
    keys seen (grouped heads: query head h reads KV head h // (H / Hkv)); a row that sees
    nothing has probabilities 0 and LSE -inf."""
    q, k = _f64(q), _f64(k)
    g = q.shape[2] // k.shape[2]
    kk = np.repeat(k, g, axis=2)                                    # (B, Tk, H, D)
    z = np.einsum("bihd,bjhd->bhij", q, kk) * scale
    z = np.where(mask, z, -np.inf)
    m = np.max(z, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(z - m)
    s = np.sum(e, axis=-1, keepdims=True)
    p = np.divide(e, s, out=np.zeros_like(e), where=s > 0)
    with np.errstate(divide="ignore"):
        lse = np.where(s[..., 0] > 0, m[..., 0] + np.log(s[..., 0]), -np.inf)
    return p, lse


def attention(q, k, v, scale, causal=False, pos=None, seg=None, window=0, parent=None):
    """(O (B, Tq, H, D), LSE (B, H, Tq)) of softmax(scale q k^T + mask) v per head, for
    q (B, Tq, H, D), k and v (B, Tk, Hkv, D)."""
    b, tq, h, _ = np.shape(q)
    mask = attention_mask(tq, np.shape(k)[1], b, causal, pos, seg, window, parent)
    p, lse = _attention_probs(q, k, scale, mask)
    vv = np.repeat(_f64(v), h // np.shape(v)[2], axis=2)
    return np.einsum("bhij,bjhd->bihd", p, vv), lse


def attention_bwd(q, k, v, g_o, scale, causal=False, pos=None, seg=None, g_lse=None, window=0, parent=None):
    """(dq, dk, dv) of attention for upstream gradients g_o of O and g_lse of LSE."""
    q, k, v, g_o = _f64(q), _f64(k), _f64(v), _f64(g_o)
    b, tq, h, _ = q.shape
    hkv = k.shape[2]
    g = h // hkv
    mask = attention_mask(tq, k.shape[1], b, causal, pos, seg, window, parent)
    p, _ = _attention_probs(q, k, scale, mask)                    # (B, H, Tq, Tk)
    kk, vv = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    dp = np.einsum("bihd,bjhd->bhij", g_o, vv)
    dz = p * (dp - np.sum(dp * p, axis=-1, keepdims=True))        # d(scaled logits)
    if g_lse is not None:
        dz = dz + p * _f64(g_lse)[..., None]
    dq = scale * np.einsum("bhij,bjhd->bihd", dz, kk)
    dk = scale * np.einsum("bhij,bihd->bjhd", dz, q)
    dv = np.einsum("bhij,bihd->bjhd", p, g_o)
    fold = lambda x: x.reshape(x.shape[:2] + (hkv, g) + x.shape[3:]).sum(axis=3)  # noqa: E731
    return dq, fold(dk), fold(dv)


def _ce_count(targets):
    return int(np.sum(np.asarray(targets) >= 0))


def cross_entropy(logits, targets):
    """Mean over rows with target >= 0 of -log softmax(logits)[target]; 0 if none."""
    x = _f64(logits)
    t = np.asarray(targets)
    keep = t >= 0
    if not keep.any():
        return np.float64(0.0)
    m = np.max(x, axis=-1, keepdims=True)
    logp = x - m - np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True))
    rows = np.nonzero(keep)[0]
    return -np.sum(logp[rows, t[rows]]) / len(rows)


def cross_entropy_rows(logits, targets):
    """Each row's -log softmax(logits)[target], 0 where the target is negative."""
    x = _f64(logits)
    t = np.asarray(targets)
    m = np.max(x, axis=-1, keepdims=True)
    logp = x - m - np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True))
    return np.where(t >= 0, -logp[np.arange(len(t)), np.maximum(t, 0)], 0.0)


def cross_entropy_rows_bwd(logits, targets, g):
    """d cross_entropy_rows / d logits with row r's upstream gradient g[r]."""
    x = _f64(logits)
    t = np.asarray(targets)
    out = softmax(x)
    out[np.arange(len(t)), np.maximum(t, 0)] -= 1.0
    return np.where((t >= 0)[:, None], out * _f64(g)[:, None], 0.0)


def linear_cross_entropy(x, w, targets, scale=1.0, softcap=0.0, mean=True, grad=True):
    """ops.linear_cross_entropy in float64: (N C + N,) = each row's gradient of its loss with
    respect to x (N, C), then the per-row losses, over the logits scale x @ w.T (soft-capped
    to softcap tanh(l / softcap) when softcap > 0); both divided by the rows counted when mean;
    without grad, zeros for the gradient."""
    x, w, t = _f64(x), _f64(w), np.asarray(targets)
    z = scale * (x @ w.T)
    dz = np.full_like(z, scale)
    if softcap:
        u = np.tanh(z / softcap)
        z, dz = softcap * u, scale * (1.0 - u * u)
    nll = cross_entropy_rows(z, t)
    dl = cross_entropy_rows_bwd(z, t, np.ones(len(t)))
    dx = (dl * dz) @ w
    if mean:
        n = max(_ce_count(t), 1)
        dx, nll = dx / n, nll / n
    if not grad:
        dx = np.zeros_like(dx)
    return np.concatenate([dx.reshape(-1), nll])


def softplus(x):
    return np.logaddexp(0.0, _f64(x))


def log1mexp(x):
    x = _f64(x)
    return np.where(x > -np.log(2), np.log(-np.expm1(x)), np.log1p(-np.exp(x)))


def cross_entropy_bwd(logits, targets, g):
    """d cross_entropy / d logits times the scalar g; ignored rows are 0."""
    x = _f64(logits)
    t = np.asarray(targets)
    count = _ce_count(t)
    out = np.zeros_like(x)
    if count == 0:
        return out
    p = softmax(x)
    for r in np.nonzero(t >= 0)[0]:
        out[r] = p[r]
        out[r, t[r]] -= 1.0
    return out * (float(g) / count)


def gelu_tanh(x):
    """gelu's tanh approximation, x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    x = _f64(x)
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def gelu_tanh_grad(x):
    """d gelu_tanh / dx."""
    x = _f64(x)
    k = np.sqrt(2.0 / np.pi)
    t = np.tanh(k * (x + 0.044715 * x**3))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3 * 0.044715 * x * x)


def yarn_corr_dims(n_dims, n_ctx_orig, base, beta_fast=32.0, beta_slow=1.0):
    """YaRN's correction dims (ggml_rope_yarn_corr_dims) in float64: the pair that turns beta
    times over n_ctx_orig positions, n_dims ln(n_ctx_orig / (2 pi beta)) / (2 ln base), low
    floored, high ceiled, clamped to 0..n_dims - 1."""
    def dim(beta):
        return n_dims * np.log(n_ctx_orig / (beta * 2 * np.pi)) / (2 * np.log(base))
    return max(0.0, np.floor(dim(beta_fast))), min(n_dims - 1.0, np.ceil(dim(beta_slow)))


def _yarn_scale(n_dims, freq_scale, ext_factor, corr_dims):
    """Each pair's share of freq_scale under YaRN: freq_scale (1 - m) + m, m = ext_factor times
    the ramp (1 below corr_dims' low, 0 above high, linear between)."""
    i = np.arange(n_dims // 2, dtype=np.float64)
    low, high = corr_dims
    mix = (1 - np.clip((i - low) / max(0.001, high - low), 0, 1)) * ext_factor
    return freq_scale * (1 - mix) + mix


def _rope_angles(pos, n_dims, base, freq_scale=1.0, factors=None, ext_factor=0.0, corr_dims=(0.0, 0.0)):
    """(..., T, n_dims/2) angles freq_scale * pos[..., t] * base^(-2i/n_dims) / factors[i] for
    pos (T,) or (..., T) (freq_scale per pair under YaRN: _yarn_scale)."""
    i = np.arange(n_dims // 2, dtype=np.float64)
    freq = _yarn_scale(n_dims, freq_scale, ext_factor, corr_dims) * base ** (-2.0 * i / n_dims)
    if factors is not None:
        freq = freq / _f64(factors)
    return np.asarray(pos, dtype=np.float64)[..., None] * freq


def _rotate(x, theta, n_dims, mode="norm"):
    """Rotate the pairs of x (..., T, H, D) by theta (T, n_dims/2), shared by every row, or
    (..., T, n_dims/2) with x's leading dims (per-row positions): adjacent pairs (x[2i],
    x[2i+1]) in mode "norm", (x[i], x[i + n_dims/2]) in mode "neox"."""
    x = _f64(x)
    out = x.copy()
    c = np.cos(theta)[..., None, :]   # (..., T, 1, n_dims/2), broadcast over heads
    s = np.sin(theta)[..., None, :]
    half = n_dims // 2
    first, second = (slice(0, n_dims, 2), slice(1, n_dims, 2)) if mode == "norm" else \
        (slice(0, half), slice(half, n_dims))
    x0, x1 = x[..., first], x[..., second]
    out[..., first] = x0 * c - x1 * s
    out[..., second] = x0 * s + x1 * c
    return out


def _scaled(y, x, n_dims, m):
    """y with its first n_dims of the last axis times m (the rest as x)."""
    y = y.copy()
    y[..., :n_dims] *= m
    return y


def _yarn_mscale(attn_factor, freq_scale, ext_factor):
    return attn_factor * (1 + 0.1 * np.log(1 / freq_scale)) if ext_factor else attn_factor


def rope(x, pos, n_dims, base, mode="norm", freq_scale=1.0, factors=None, attn_factor=1.0, ext_factor=0.0,
         corr_dims=(0.0, 0.0)):
    """llama.cpp rope (mode "norm" or "neox") on x (..., T, H, D) at positions pos (T,) or
    (..., T) (one per row), the rotated dims scaled by attn_factor; dims >= n_dims unchanged.
    YaRN (ext_factor > 0, ggml's rope_yarn): each pair's angle theta_interp (1 - m) +
    theta_extrap m (_yarn_scale), attn_factor times 1 + 0.1 ln(1 / freq_scale)."""
    theta = _rope_angles(pos, n_dims, base, freq_scale, factors, ext_factor, corr_dims)
    return _scaled(_rotate(x, theta, n_dims, mode), x, n_dims, _yarn_mscale(attn_factor, freq_scale, ext_factor))


def rope_bwd(g, pos, n_dims, base, mode="norm", freq_scale=1.0, factors=None, attn_factor=1.0, ext_factor=0.0,
             corr_dims=(0.0, 0.0)):
    """dx of rope: g rotated by -theta (and scaled alike)."""
    theta = _rope_angles(pos, n_dims, base, freq_scale, factors, ext_factor, corr_dims)
    return _scaled(_rotate(g, -theta, n_dims, mode), g, n_dims, _yarn_mscale(attn_factor, freq_scale, ext_factor))


def get_rows(table, idx):
    """table (V, C)[idx] -> idx.shape + (C,)."""
    return _f64(table)[np.asarray(idx)]


def get_rows_bwd(g, idx, V):
    """(V, C) scatter-add of g (idx.shape + (C,)) into rows idx."""
    g = _f64(g)
    out = np.zeros((V, g.shape[-1]))
    np.add.at(out, np.asarray(idx).reshape(-1), g.reshape(-1, g.shape[-1]))
    return out


def _out_size(n, k, stride, pad):
    return (n + 2 * pad - k) // stride + 1


def im2col(x, kh, kw, stride, pad):
    """x (N, H, W, C) -> (N, OH, OW, C*kh*kw), column c*kh*kw + i*kw + j, zero padding."""
    x = _f64(x)
    n, h, w, c = x.shape
    oh, ow = _out_size(h, kh, stride, pad), _out_size(w, kw, stride, pad)
    xp = np.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    out = np.zeros((n, oh, ow, c, kh, kw))
    for i in range(kh):
        for j in range(kw):
            out[:, :, :, :, i, j] = xp[:, i:i + stride * oh:stride, j:j + stride * ow:stride, :]
    return out.reshape(n, oh, ow, c * kh * kw)


def im2col_bwd(g, x_shape, kh, kw, stride, pad):
    """dx (x_shape = (N, H, W, C)) of im2col for upstream gradient g."""
    n, h, w, c = x_shape
    oh, ow = _out_size(h, kh, stride, pad), _out_size(w, kw, stride, pad)
    g = _f64(g).reshape(n, oh, ow, c, kh, kw)
    dxp = np.zeros((n, h + 2 * pad, w + 2 * pad, c))
    for i in range(kh):
        for j in range(kw):
            dxp[:, i:i + stride * oh:stride, j:j + stride * ow:stride, :] += g[:, :, :, :, i, j]
    return dxp[:, pad:pad + h, pad:pad + w, :]


def _windows(x, k):
    """x (N, H, W, C) -> (N, H//k, W//k, C, k*k) windows in row-major (kh, kw) order."""
    n, h, w, c = x.shape
    oh, ow = h // k, w // k
    v = x[:, :oh * k, :ow * k, :].reshape(n, oh, k, ow, k, c)
    return v.transpose(0, 1, 3, 5, 2, 4).reshape(n, oh, ow, c, k * k)


def max_pool2d(x, k):
    """Max over k x k windows with stride k (floor), NHWC."""
    return _windows(_f64(x), k).max(axis=-1)


def max_pool2d_bwd(x, g, k):
    """dx of max_pool2d: g to the first maximum of each window, 0 elsewhere."""
    x, g = _f64(x), _f64(g)
    n, h, w, c = x.shape
    oh, ow = h // k, w // k
    first = _windows(x, k).argmax(axis=-1)          # (N, OH, OW, C), first max
    onehot = np.arange(k * k) == first[..., None]   # (N, OH, OW, C, k*k)
    win = (onehot * g[..., None]).reshape(n, oh, ow, c, k, k).transpose(0, 1, 4, 2, 5, 3)
    dx = np.zeros_like(x)
    dx[:, :oh * k, :ow * k, :] = win.reshape(n, oh * k, ow * k, c)
    return dx


_M32 = 0xFFFFFFFF


def _rotl32(x, r):
    return ((x << np.uint32(r)) | (x >> np.uint32(32 - r))) & np.uint32(_M32)


def murmur3_32(words, seed):
    """MurmurHash3_x86_32 (Austin Appleby, SMHasher) of keys made of whole 4-byte words,
    vectorised over keys: words (..., n) uint32 (each a little-endian block), seed uint32.
    Returns (...) uint32. Written from the definition; checked against published values."""
    words = np.asarray(words, dtype=np.uint32)
    h = np.broadcast_to(np.uint32(seed), words.shape[:-1]).astype(np.uint32)
    with np.errstate(over="ignore"):
        for j in range(words.shape[-1]):
            k = words[..., j] * np.uint32(0xCC9E2D51)
            k = _rotl32(k, 15) * np.uint32(0x1B873593)
            h = _rotl32(h ^ k, 13) * np.uint32(5) + np.uint32(0xE6546B64)
        h = h ^ np.uint32(4 * words.shape[-1])
        h ^= h >> np.uint32(16)
        h = h * np.uint32(0x85EBCA6B)
        h ^= h >> np.uint32(13)
        h = h * np.uint32(0xC2B2AE35)
        h ^= h >> np.uint32(16)
    return h


def dropout_keep(shape, p, seed, salt):
    """The dropout mask (bool, shape): element of flat index i is kept iff
    murmur3_32((salt, i & 0xffffffff, i >> 32), seed) >= floor(p * 2^32), p as float32."""
    i = np.arange(int(np.prod(shape)), dtype=np.uint64)
    words = np.stack([np.full(i.shape, salt, np.uint64), i & np.uint64(_M32), i >> np.uint64(32)], -1)
    h = murmur3_32(words.astype(np.uint32), np.uint32(np.int64(seed) & _M32))
    thr = int(float(np.float32(p)) * 2.0**32)
    return (h >= thr).reshape(shape)


def dropout_scale(p):
    """The factor kept elements are multiplied by: float32(1 / (1 - p)), p as float32."""
    return np.float32(1.0 / (1.0 - float(np.float32(p))))


def dropout(x, p, seed, salt):
    """x * keep / (1 - p) with dropout_keep's mask; dropped elements exactly 0."""
    x = _f64(x)
    return np.where(dropout_keep(x.shape, p, seed, salt), x * float(dropout_scale(p)), 0.0)


def conv2d_parts(x, k, b, stride, pad, relu):
    """The pieces of conv2d in float64: patches (N, OH, OW, K), pre-activation v and relu?(v)."""
    x, k = _f64(x), _f64(k)
    cout, cin, kh, kw = k.shape
    cols = im2col(x, kh, kw, stride, pad)
    v = cols @ k.reshape(cout, -1).T + (0.0 if b is None else _f64(b))
    return cols, v, (np.maximum(v, 0) if relu else v)


def conv2d(x, k, b, stride, pad, relu=False, pool=1):
    """relu?(convolution + bias) over NHWC, then max over pool x pool windows (pool > 1)."""
    r = conv2d_parts(x, k, b, stride, pad, relu)[2]
    return max_pool2d(r, pool) if pool > 1 else r


def conv2d_bwd(x, k, b, stride, pad, relu, pool, g):
    """(dx, dkernel, dbias) of conv2d for the gradient g of its values (the unfused chain:
    max_pool2d_bwd, relu_bwd, then the products of im2col and matmul)."""
    cols, v, r = conv2d_parts(x, k, b, stride, pad, relu)
    cout, cin, kh, kw = k.shape
    gv = max_pool2d_bwd(r, g, pool) if pool > 1 else _f64(g)
    if relu:
        gv = gv * (v > 0)
    dk = (gv.reshape(-1, cout).T @ cols.reshape(-1, cols.shape[-1])).reshape(k.shape)
    dx = im2col_bwd(gv @ _f64(k).reshape(cout, -1), np.shape(x), kh, kw, stride, pad)
    return dx, dk, gv.sum(axis=(0, 1, 2))


# ---- llama.cpp's CPU numbers (its AVX-512 build), emulated in float32 ------------------------
# What the decoder's act8 mode must reproduce bit for bit (native/cpu/attention.c, rope.c,
# norm.c, elementwise.c say where each order comes from). An f32 fma is emulated in float64:
# the product of two f32 is exact there; the sum rounds twice (float64, then f32), which
# differs from one rounding once in ~2^29 sums.

_F32 = np.float32


def _libm():
    import ctypes
    import ctypes.util
    m = ctypes.CDLL(ctypes.util.find_library("m"))
    for name, n in (("powf", 2), ("cosf", 1), ("sinf", 1), ("expf", 1), ("logf", 1)):
        f = getattr(m, name)
        f.restype = ctypes.c_float
        f.argtypes = [ctypes.c_float] * n
    return m


def fma32(a, b, c):
    return (np.asarray(a, np.float64) * np.asarray(b, np.float64) + np.asarray(c, np.float64)).astype(_F32)


def ggml_expf(x):
    """ggml_v_expf (AVX-512), lane by lane."""
    x = np.asarray(x, _F32)
    h = lambda s: _F32(float.fromhex(s))    # noqa: E731
    r = h("0x1.8p23")
    with np.errstate(invalid="ignore", over="ignore"):
        n = (fma32(x, h("0x1.715476p+0"), r) - r).astype(_F32)
        b = fma32(-n, h("0x1.7f7d1cp-20"), fma32(-n, h("0x1.62e4p-1"), x))
        u = (b * b).astype(_F32)
        j = fma32(fma32(fma32(h("0x1.0e4020p-7"), b, h("0x1.573e2ep-5")), u, fma32(h("0x1.555e66p-3"), b,
                                                                                  h("0x1.fffdb6p-2"))),
                  u, fma32(h("0x1.ffffecp-1"), b, _F32(1)))
        res = np.ldexp(j.astype(np.float64), np.where(np.isfinite(n), n, 0).astype(np.int64)).astype(_F32)
        return np.where(np.abs(n) > 192, np.where(n <= 0, _F32(0), _F32(np.inf)), res).astype(_F32)


def ggml_soft_max(x):
    """llama.cpp's CPU soft_max of each row of x (no mask, scale 1): e = exp(x - max) by
    ggml_expf 16 at a time, each 16's sum by ggml_reduce16 added in double, the rest by libm's
    expf added one by one; the row times (float)(1 / sum)."""
    x = np.asarray(x, _F32)
    n = x.shape[-1]
    out = np.empty_like(x)
    m = _libm()
    for r in np.ndindex(x.shape[:-1]):
        row = x[r]
        mx = row.max()
        e = np.empty(n, _F32)
        total, i = 0.0, 0
        for i in range(0, n - n % 16, 16):
            e[i:i + 16] = ggml_expf((row[i:i + 16] - mx).astype(_F32))
            total += float(ggml_reduce16(e[i:i + 16]))
        for i in range(n - n % 16, n):
            e[i] = m.expf(float(row[i] - mx))
            total += float(e[i])
        out[r] = e * _F32(1.0 / total)
    return out


def ggml_reduce16(v):
    """_mm512_reduce_add_ps over the last axis (16): halves, then quarters, then pairs."""
    v = np.asarray(v, _F32)
    t = v[..., 8:] + v[..., :8]
    t = t[..., 4:] + t[..., :4]
    return ((t[..., 0] + t[..., 2]) + (t[..., 1] + t[..., 3])).astype(_F32)


def ggml_dot(x, y):
    """ggml_vec_dot_f32 (AVX-512) of the last axes: 64 fma lanes, (l0 + l2) + (l1 + l3), reduce16,
    then the leftover elements: the first whole 8s' products rounded and added in order, the last
    n % 8 fma'd (its compiled code)."""
    x, y = np.asarray(x, _F32), np.asarray(y, _F32)
    n = x.shape[-1]
    np_ = n - n % 64
    acc = np.zeros(np.broadcast_shapes(x.shape[:-1], y.shape[:-1]) + (64,), _F32)
    for i in range(0, np_, 64):
        acc = fma32(x[..., i:i + 64], y[..., i:i + 64], acc)
    s = ggml_reduce16((acc[..., 0:16] + acc[..., 32:48]) + (acc[..., 16:32] + acc[..., 48:64]))
    n8 = np_ + (n - np_) // 8 * 8
    for i in range(np_, n8):
        s = (s + (x[..., i] * y[..., i]).astype(_F32)).astype(_F32)
    for i in range(n8, n):
        s = fma32(x[..., i], y[..., i], s)
    return s


def ggml_rms_norm(x, eps):
    """x * (1 / sqrtf(mean + eps)), mean = (float)(the double sum of the f32 squares / C)."""
    x = np.asarray(x, _F32)
    mean = ((x * x).astype(np.float64).sum(-1, keepdims=True) / x.shape[-1]).astype(_F32)
    return (x * (_F32(1) / np.sqrt(mean + _F32(eps)))).astype(_F32)


def ggml_swiglu(g, u):
    """x / (1 + ggml_expf(0 - x)) * u, the last C % 16 columns with libm's expf."""
    g, u = np.asarray(g, _F32), np.asarray(u, _F32)
    c = g.shape[-1]
    e = ggml_expf(_F32(0) - g)
    if c % 16:
        m = _libm()
        tail = np.vectorize(lambda v: m.expf(-float(v)), otypes=[_F32])(g[..., c - c % 16:])
        e = np.concatenate([e[..., :c - c % 16], tail], -1)
    return (g / (_F32(1) + e) * u).astype(_F32)


def ggml_rope(x, pos, n_dims, base, mode="norm", freq_scale=1.0, factors=None, attn_factor=1.0, ext_factor=0.0,
              corr_dims=(0.0, 0.0)):
    """ggml_rope_ext of x (T, H, D) at pos (T,): theta *= powf(base, -2 / n_dims) pair
    after pair from (float)pos, cosf / sinf of freq_scale * theta / factor, times attn_factor;
    pairs (fma(x0, c, -(x1 s)), fma(x0, s, x1 c)). YaRN (ext_factor != 0, rope_yarn): the angle
    theta_interp (1 - m) + theta_extrap m with m = ext_factor * rope_yarn_ramp, attn_factor
    times 1 + 0.1 logf(1 / freq_scale), all in f32."""
    m = _libm()
    x = np.asarray(x, _F32)
    out = x.copy()
    half = n_dims // 2
    ts = _F32(m.powf(_F32(base), _F32(-2.0) / _F32(n_dims)))
    low, high = _F32(corr_dims[0]), _F32(corr_dims[1])
    mscale = _F32(attn_factor)
    if ext_factor:
        mscale = _F32(mscale * _F32(_F32(1.0) + _F32(0.1) * _F32(m.logf(_F32(1.0) / _F32(freq_scale)))))
    for t, p in enumerate(pos):
        th, c, s = _F32(p), np.empty(half, _F32), np.empty(half, _F32)
        for i in range(half):
            te = _F32(th / _F32(factors[i])) if factors is not None else th
            ti = _F32(_F32(freq_scale) * te)
            if ext_factor:
                y = _F32((_F32(i) - low) / max(_F32(0.001), _F32(high - low)))
                mix = _F32(_F32(1 - min(_F32(1), max(_F32(0), y))) * _F32(ext_factor))
                ti = _F32(_F32(ti * _F32(1 - mix)) + _F32(te * mix))
            c[i] = _F32(m.cosf(ti)) * mscale
            s[i] = _F32(m.sinf(ti)) * mscale
            th = _F32(th * ts)
        i0, i1 = (np.arange(half), np.arange(half) + half) if mode == "neox" else \
            (2 * np.arange(half), 2 * np.arange(half) + 1)
        x0, x1 = x[t][:, i0], x[t][:, i1]
        out[t][:, i0] = fma32(x0, c, -(x1 * s))
        out[t][:, i1] = fma32(x0, s, (x1 * c).astype(_F32))
    return out


def _f16(a):
    return np.asarray(a, _F32).astype(np.float16).astype(_F32)


def _dot_f16(x, y):
    """ggml_vec_dot_f16: ggml_dot's 64 lanes, the leftover products added in double."""
    n = x.shape[-1]
    np_ = n - n % 64
    s = float(ggml_dot(x[:np_], y[:np_])) if np_ else 0.0
    for i in range(np_, n):
        s += float(_F32(x[i] * y[i]))
    return _F32(s)


def _dot16(x, y):
    """tinyBLAS's dot: 16 fma lanes, reduce16."""
    acc = np.zeros(16, _F32)
    for i in range(0, x.shape[-1], 16):
        acc = fma32(x[i:i + 16], y[i:i + 16], acc)
    return ggml_reduce16(acc)


def ggml_matmul(x, w, f16=False):
    """llama.cpp's CPU mul_mat of a weight w (N, K) in f32 (or f16: x rounded to f16 first) by
    the rows of x (M, K), (M, N): tinyBLAS's 16 lanes when M >= 2, N % 4 == 0 and K % 16 == 0,
    else vec_dot per output (ggml_dot; f16: its double leftovers)."""
    x, w = np.asarray(x, _F32), np.asarray(w, _F32)
    if f16:
        x, w = _f16(x), _f16(w)
    (m, k), n = x.shape, w.shape[0]
    dot = _dot16 if m >= 2 and n % 4 == 0 and k % 16 == 0 else _dot_f16 if f16 else ggml_dot
    return np.array([[dot(x[i], w[j]) for j in range(n)] for i in range(m)], _F32).reshape(m, n)


def ggml_attention(q, k, v, scale, pos, window=0, scale_q=False, kv_f16=False, sinks=None):
    """llama.cpp's attention (no flash attention, F32 cache) of q (Tq, H, D) over cache rows
    k, v (Tk, Hkv, D), query i seeing rows j <= pos[i] (and pos[i] - j < window): S by ggml_dot,
    scaled (or q first); softmax by ggml_expf summed in double 16 slots at a time; P V by
    ggml_dot over the slots for one query, by tinyBLAS's 16 lanes and reduce16 for more. kv_f16
    (its F16 KV cache): q, k, v and P rounded to f16, and S of several queries by tinyBLAS too.
    sinks (H,): its soft_max's sink a head, max(max, sink) and libm's expf(sink - max) added to
    the double sum."""
    q, k, v = (np.asarray(a, _F32) for a in (q, k, v))
    if kv_f16:
        k, v = _f16(k), _f16(v)
    tq, h, d = q.shape
    tk, hkv = k.shape[:2]
    pad = -(-tk // 64) * 64
    out = np.zeros((tq, h, d), _F32)
    for i in range(tq):
        for hh in range(h):
            g = hh // (h // hkv)
            qs = (q[i, hh] * _F32(scale)).astype(_F32) if scale_q else q[i, hh]
            qs = _f16(qs) if kv_f16 else qs
            dot = ggml_dot if not kv_f16 else _dot16 if tq > 1 and d % 16 == 0 else _dot_f16
            w = np.full(pad, -np.inf, _F32)
            for j in range(tk):
                if j <= pos[i] and (window <= 0 or pos[i] - j < window):
                    w[j] = dot(k[j, g], qs) if scale_q else (dot(k[j, g], qs) * _F32(scale)).astype(_F32)
            mx = w.max() if sinks is None else max(w.max(), _F32(sinks[hh]))
            e = ggml_expf((w - mx).astype(_F32))
            total = sum(float(ggml_reduce16(e[c:c + 16])) for c in range(0, pad, 16))
            if sinks is not None:
                total += float(_libm().expf(float(_F32(sinks[hh]) - mx)))
            p = (e * _F32(1.0 / total)).astype(_F32)
            p = _f16(p) if kv_f16 else p
            vt = np.zeros((d, pad), _F32)
            vt[:, :tk] = v[:, g].T
            if tq == 1:
                out[i, hh] = ggml_dot(vt, p)
            else:
                acc = np.zeros((d, 16), _F32)
                for c in range(0, pad, 16):
                    acc = fma32(vt[:, c:c + 16], p[c:c + 16], acc)
                out[i, hh] = ggml_reduce16(acc)
    return out


def causal_conv1d(x, w, seg=None):
    """y[b, t, c] = sum_k w[c, k] x[b, t - L + 1 + k, c] over rows s >= 0 (of t's segment)."""
    x, w = _f64(x), _f64(w)
    b, t, c = x.shape
    taps = w.shape[1]
    y = np.zeros_like(x)
    for i in range(t):
        for k in range(taps):
            s = i - taps + 1 + k
            if s < 0:
                continue
            keep = np.ones(b) if seg is None else (seg[:, s] == seg[:, i]).astype(np.float64)
            y[:, i] += keep[:, None] * x[:, s] * w[:, k]
    return y


# ---- mixture of experts --------------------------------------------------------------------------


def moe_topk(z, k, gating="softmax", bias=None):
    """The ids of the k largest of each row of z (sigmoid gating: of sigmoid(z) plus bias),
    largest first (a stable sort: of equal values the lower index first)."""
    score = _f64(z) if gating == "softmax" else 1 / (1 + np.exp(-_f64(z))) + (0.0 if bias is None else _f64(bias))
    return np.argsort(-score, axis=-1, kind="stable")[..., :k].astype(np.int32)


def moe_weights(z, ids, norm, gating="softmax"):
    """softmax(z)[ids] (or sigmoid(z)[ids]; softmax_weight: softmax(z[ids])) over the last dim,
    divided by its sum over the k (clamped at 2^-14) when norm."""
    z = _f64(z)
    if gating == "softmax_weight":
        w = np.exp(np.take_along_axis(z, np.asarray(ids, np.int64), axis=-1))
        w = w / w.sum(-1, keepdims=True)
        return w / np.maximum(w.sum(-1, keepdims=True), 2.0 ** -14) if norm else w
    if gating == "sigmoid":
        p = 1 / (1 + np.exp(-z))
    else:
        p = np.exp(z - z.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
    w = np.take_along_axis(p, np.asarray(ids, np.int64), axis=-1)
    return w / np.maximum(w.sum(-1, keepdims=True), 2.0 ** -14) if norm else w


def moe_matmul(x, w, ids):
    """y[n, s] = w[ids[n, s]] @ x[n, 0 or s] (x (N, 1 or k, K), w (E, M, K), ids (N, k))."""
    x, w = _f64(x), _f64(w)
    n, k = ids.shape
    y = np.zeros((n, k, w.shape[1]))
    for i in range(n):
        for s in range(k):
            y[i, s] = w[ids[i, s]] @ x[i, 0 if x.shape[1] == 1 else s]
    return y
def delta_rule(q, k, v, g, beta, seg=None, s0=None):
    """The gated delta rule in float64: per V head h (K head h % Hk) a state S (Dk, Dv) from 0
    (or s0 (B, Hv, Dv, Dk), S = s0[b, h].T), back to 0 where seg changes; S = e^g S;
    S += k (beta (v - S^T k))^T; o = S^T q / sqrt(Dk). Returns o, or (o, last state) with s0."""
    q, k, v, g, beta = (_f64(a) for a in (q, k, v, g, beta))
    b, t, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    o = np.zeros_like(v)
    last = np.zeros((b, hv, dv, dk))
    for bi in range(b):
        for h in range(hv):
            s = np.zeros((dk, dv)) if s0 is None else _f64(s0)[bi, h].T.copy()
            for i in range(t):
                if (i == 0 and s0 is None) or (seg is not None and i > 0 and seg[bi, i] != seg[bi, i - 1]):
                    s = np.zeros((dk, dv))
                kk = k[bi, i, h % hk]
                s = np.exp(g[bi, i, h]) * s
                s = s + np.outer(kk, beta[bi, i, h] * (v[bi, i, h] - s.T @ kk))
                o[bi, i, h] = s.T @ q[bi, i, h % hk] / np.sqrt(dk)
            last[bi, h] = s.T
    return o if s0 is None else (o, last)


def swiglu_oai(g, u, alpha=1.702, limit=7.0):
    """ggml's swiglu_oai: x = min(g, limit), y = clip(u, -limit, limit); x sigmoid(alpha x) (y + 1)."""
    x, y = np.minimum(_f64(g), limit), np.clip(_f64(u), -limit, limit)
    return x / (1.0 + np.exp(-alpha * x)) * (y + 1.0)


def ggml_swiglu_oai(g, u, alpha=1.702, limit=7.0):
    """llama.cpp's CPU swiglu_oai in f32: x = min(g, limit), y = clamp(u, -limit, limit),
    x / (1 + expf(alpha * -x)) * (y + 1), libm's expf."""
    g, u, a, lim = np.asarray(g, _F32), np.asarray(u, _F32), _F32(alpha), _F32(limit)
    x, y = np.minimum(g, lim), np.clip(u, -lim, lim)
    m = _libm()
    with np.errstate(over="ignore"):    # (expf's inf past 88.7, as llama.cpp's)
        e = np.vectorize(lambda t: m.expf(float(t)), otypes=[_F32])((a * -x).astype(_F32))
    return (x / (_F32(1) + e) * (y + _F32(1))).astype(_F32)


def swiglu_oai_grads(g, u, dy, alpha=1.702, limit=7.0):
    """(dg, du) of sum(swiglu_oai(g, u) * dy): zero through a clamped side."""
    g, u, dy = _f64(g), _f64(u), _f64(dy)
    x, y = np.minimum(g, limit), np.clip(u, -limit, limit)
    s = 1.0 / (1.0 + np.exp(-alpha * x))
    dg = np.where(g < limit, dy * (y + 1.0) * (s + alpha * x * s * (1.0 - s)), 0.0)
    du = np.where(np.abs(u) <= limit, dy * x * s, 0.0)
    return dg, du


def attention_sinks(q, k, v, scale, sinks, causal=False, pos=None, seg=None, window=0):
    """O (B, Tq, H, D) of attention whose softmax has one more logit a head, sinks[h], with no
    value: the probabilities exp(z_j) / (sum_j' exp(z_j') + exp(sink)) over the keys seen."""
    q, k, v = _f64(q), _f64(k), _f64(v)
    b, tq, h, _ = q.shape
    g = h // k.shape[2]
    z = np.einsum("bihd,bjhd->bhij", q, np.repeat(k, g, axis=2)) * scale
    z = np.where(attention_mask(tq, k.shape[1], b, causal, pos, seg, window), z, -np.inf)
    s = _f64(sinks)[None, :, None, None]
    top = np.maximum(z.max(-1, keepdims=True), s)
    e = np.exp(z - top)
    p = e / (e.sum(-1, keepdims=True) + np.exp(s - top))
    return np.einsum("bhij,bjhd->bihd", p, np.repeat(v, g, axis=2))
