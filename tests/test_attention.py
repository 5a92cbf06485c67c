"""Fused attention (issue 12): the kernels against float64 references and against the
unfused composition of existing ops (matmul, softmax, permutes), thread-count and SIMD-level
checks, strided inputs, bad inputs, a llama step and decoding against the unfused graph,
and the memory the fused graph plans at ctx 2048. (Finite differences: tests/op_cases.py.)"""
from __future__ import annotations

import re

import numpy as np
import pytest

from ggtrain.core import ops
from ggtrain.core.autograd import backward
from ggtrain.core.backend_cpu import CpuBackend
from ggtrain.core.backend_kernel import run_kernel
from ggtrain.core.graph import Graph, Runtime
from ggtrain.core.models import losses as model_losses
from ggtrain.core.models.config import ModelConfig, init_params
from ggtrain.core.models.decoder import Inputs, Net, Options, forward
from ggtrain.core.models.inference import Decoder
from ggtrain.errors import DTypeError, NativeError, ShapeError
from ggtrain.native import lib

from tests import refs

MODES = {"none": 0, "causal": 1, "pos": 2, "seg": 3, "tree": 4}


def _f32(rng, *shape):
    return rng.uniform(-1, 1, shape).astype(np.float32)


def _mask_input(mode, b, tq, tk, rng):
    """The mask's extra input (pos, seg, or (seg, parent)) and the reference's keywords, for a mode."""
    if mode == "pos":
        pos = rng.integers(-1, tk + 1, tq).astype(np.int32)   # -1 sees nothing, >= tk sees all
        return pos, {"pos": pos}
    if mode == "seg":
        seg = np.zeros((b, tq), np.int32)
        for i in range(b):   # packed samples of random lengths, then padding (-1)
            t, s = 0, 0
            while t < tq:
                n = int(rng.integers(1, max(2, tq // 2)))
                seg[i, t:t + n] = s if t + n < tq else -1
                t, s = t + n, s + 1
        if b > 1:
            seg[-1] = rng.integers(0, 3, tq)      # interleaved values: the key-by-key path
        return seg, {"seg": seg}
    if mode == "tree":
        seg, par = np.full((b, tq), -1, np.int32), np.full((b, tq), -1, np.int32)
        for i in range(b):   # packed items: a prefix, then continuations that see it; padding
            t, s = 0, 0
            while t < tq:
                n = int(rng.integers(1, max(2, tq // 3)))
                if t + n >= tq:
                    break
                seg[i, t:t + n] = par[i, t:t + n] = s
                prefix, s, t = s, s + 1, t + n
                for _ in range(int(rng.integers(1, 5))):
                    n = min(int(rng.integers(1, max(2, tq // 6))), tq - t)
                    seg[i, t:t + n], par[i, t:t + n] = s, prefix
                    s, t = s + 1, t + n
        if b > 1:     # interleaved values and parents: the key-by-key path
            seg[-1], par[-1] = rng.integers(0, 4, tq), rng.integers(0, 4, tq)
        return (seg, par), {"seg": seg, "parent": par}
    return None, {"causal": mode == "causal"}


def _extras(extra):
    return [] if extra is None else list(extra) if isinstance(extra, tuple) else [extra]


def fwd(q, k, v, mode, scale, extra=None, n_threads=1, window=0, **kw):
    """(O, LSE, the whole dst) of gt_attention_fwd_f32, into a NaN-filled dst."""
    b, tq, h, d = q.shape
    dst = np.full(q.size + b * h * tq, np.nan, np.float32)
    srcs = [q, k, v] + _extras(extra)
    run_kernel("attention_fwd_f32", dst, srcs, ip=(MODES[mode], window), fp=(scale,), n_threads=n_threads, **kw)
    return dst[:q.size].reshape(q.shape), dst[q.size:].reshape(b, h, tq), dst


def bwd(q, k, v, y, g, mode, scale, extra=None, n_threads=1, window=0, **kw):
    """(dq, dk, dv) of gt_attention_bwd_f32 for g = dO, or all of y's gradient (flat)."""
    dst = np.full(q.size + 2 * k.size, np.nan, np.float32)
    srcs = [q, k, v, y, g] + _extras(extra)
    run_kernel("attention_bwd_f32", dst, srcs, ip=(MODES[mode], window), fp=(scale,), n_threads=n_threads, **kw)
    return (dst[:q.size].reshape(q.shape), dst[q.size:q.size + k.size].reshape(k.shape),
            dst[q.size + k.size:].reshape(k.shape))


# (B, Tq, Tk, H, Hkv, D, mode): odd lengths (1, 7, 33, 257: partial blocks of 64), grouped
# heads, head sizes off the vector width (8, 40), every mask; rows 1 KiB apart (8 heads of 32:
# q, k, v and dO, or q and dO only, copied into contiguous blocks before their products; with
# 12 queries or fewer, as in decoding, read in place all the same)
SHAPES = [
    (1, 130, 130, 8, 8, 32, "causal"),
    (2, 70, 70, 8, 2, 32, "seg"),
    (1, 5, 140, 8, 8, 32, "pos"),
    (1, 40, 200, 8, 4, 32, "pos"),
    (1, 1, 1, 2, 2, 8, "causal"),
    (2, 7, 7, 4, 2, 8, "causal"),
    (1, 33, 33, 6, 2, 40, "causal"),
    (1, 257, 257, 4, 1, 32, "causal"),
    (2, 65, 65, 2, 2, 64, "seg"),
    (2, 257, 257, 2, 1, 16, "seg"),
    (2, 70, 70, 8, 2, 32, "tree"),
    (3, 257, 257, 2, 1, 16, "tree"),
    (1, 7, 33, 4, 4, 8, "pos"),
    (1, 33, 257, 3, 1, 32, "pos"),
    (2, 33, 7, 2, 1, 8, "none"),
    (1, 5, 130, 4, 2, 24, "causal"),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_kernels_match_float64(shape):
    b, tq, tk, h, hkv, d, mode = shape
    rng = np.random.default_rng(sum(shape[:6]))
    q, k, v = _f32(rng, b, tq, h, d), _f32(rng, b, tk, hkv, d), _f32(rng, b, tk, hkv, d)
    extra, kw = _mask_input(mode, b, tq, tk, rng)
    scale = 1.3 / np.sqrt(d)
    o, lse, y = fwd(q, k, v, mode, scale, extra)
    want_o, want_lse = refs.attention(q, k, v, scale, **kw)
    np.testing.assert_allclose(o, want_o, rtol=1e-4, atol=2e-6)
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(want_lse))   # -inf: rows seeing nothing
    seen = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[seen], want_lse[seen], rtol=1e-5, atol=1e-5)
    # backward with a random dO, then with gradients of O and LSE both
    g_o = _f32(rng, *q.shape)
    got = bwd(q, k, v, y, g_o, mode, scale, extra)
    for x, want in zip(got, refs.attention_bwd(q, k, v, g_o, scale, **kw)):
        np.testing.assert_allclose(x, want, rtol=1e-4, atol=1e-5)
    g_lse = _f32(rng, b, h, tq)
    flat = np.concatenate([g_o.reshape(-1), g_lse.reshape(-1)])
    got = bwd(q, k, v, y, flat, mode, scale, extra)
    for x, want in zip(got, refs.attention_bwd(q, k, v, g_o, scale, g_lse=g_lse, **kw)):
        np.testing.assert_allclose(x, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode,window", [("causal", 0), ("causal", 40), ("seg", 40), ("pos", 40)])
def test_quarters_no_row_sees_are_skipped(mode, window):
    """A partial block's quarters (32 query rows x 32 keys) that no row sees are left out of
    its products: a causal diagonal block's upper quarter, and with a 40-key window the lower
    quarter of the block below the diagonal (rows 96.. of keys 0..31 of the block at rows 64..,
    keys 0..): each product then starts or stops a half block later or sooner. The kernels
    still match float64, with dO and dLSE both, and O where no key is seen is exactly 0."""
    b, tq, h, hkv, d = 2, 200, 4, 2, 32
    rng = np.random.default_rng(11)
    q, k, v = _f32(rng, b, tq, h, d), _f32(rng, b, tq, hkv, d), _f32(rng, b, tq, hkv, d)
    extra, kw = _mask_input(mode, b, tq, tq, rng)
    o, lse, y = fwd(q, k, v, mode, 0.3, extra, window=window)
    want_o, want_lse = refs.attention(q, k, v, 0.3, window=window, **kw)
    np.testing.assert_allclose(o, want_o, rtol=1e-4, atol=2e-6)
    seen = np.isfinite(want_lse)
    np.testing.assert_array_equal(np.isfinite(lse), seen)
    np.testing.assert_allclose(lse[seen], want_lse[seen], rtol=1e-5, atol=1e-5)
    assert not np.any(o.transpose(0, 2, 1, 3)[~seen])
    g_o, g_lse = _f32(rng, *q.shape), _f32(rng, b, h, tq)
    flat = np.concatenate([g_o.reshape(-1), g_lse.reshape(-1)])
    got = bwd(q, k, v, y, flat, mode, 0.3, extra, window=window)
    for x, want in zip(got, refs.attention_bwd(q, k, v, g_o, 0.3, g_lse=g_lse, window=window, **kw)):
        np.testing.assert_allclose(x, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shape", [(2, 257, 257, 4, 2, 32, "causal"), (2, 130, 130, 3, 1, 40, "seg"),
                                   (1, 9, 200, 2, 2, 16, "pos"), (2, 200, 200, 4, 2, 32, "tree")],
                         ids=lambda s: s[-1])
def test_threads_bit_identical(shape):
    b, tq, tk, h, hkv, d, mode = shape
    rng = np.random.default_rng(5)
    q, k, v = _f32(rng, b, tq, h, d), _f32(rng, b, tk, hkv, d), _f32(rng, b, tk, hkv, d)
    extra, _ = _mask_input(mode, b, tq, tk, rng)
    g = _f32(rng, *q.shape)
    y1 = fwd(q, k, v, mode, 0.2, extra)[2]
    d1 = bwd(q, k, v, y1, g, mode, 0.2, extra)
    for n in (2, 3, 4):
        assert np.array_equal(y1, fwd(q, k, v, mode, 0.2, extra, n_threads=n)[2])
        for a, c in zip(d1, bwd(q, k, v, y1, g, mode, 0.2, extra, n_threads=n)):
            assert np.array_equal(a, c)


def test_backward_split_for_few_kv_heads():
    """One sequence of one KV head (Gemma 3 270M's attention) is one unit of backward work:
    its query heads are split into groups, one unit each, whose shares of dK and dV are
    summed. dQ keeps the bits of the unsplit kernel (which 8 copies of the sequence get,
    enough units); dK and dV are the same sums rounded another way; and the split depends
    on the shapes, not on the thread count. (The CPU kernel's split of the work: run on the
    CPU backend, whichever backend the other op tests run on.)"""
    cpu = {"backend": CpuBackend(1)}
    rng = np.random.default_rng(11)
    tq, h, d = 300, 4, 16
    q, k, v = _f32(rng, 1, tq, h, d), _f32(rng, 1, tq, 1, d), _f32(rng, 1, tq, 1, d)
    g = _f32(rng, *q.shape)
    y = fwd(q, k, v, "causal", 0.25, **cpu)[2]
    split = bwd(q, k, v, y, g, "causal", 0.25, **cpu)
    rep = lambda x: np.ascontiguousarray(np.repeat(x, 8, axis=0))   # noqa: E731
    y8 = fwd(rep(q), rep(k), rep(v), "causal", 0.25, **cpu)[2]
    whole = bwd(rep(q), rep(k), rep(v), y8, rep(g), "causal", 0.25, **cpu)
    assert np.array_equal(split[0], whole[0][:1])
    for x, w in zip(split[1:], whole[1:]):
        np.testing.assert_allclose(x, w[:1], rtol=1e-4, atol=1e-5)
    assert not np.array_equal(split[1], whole[1][:1])         # the shares were summed: it did split
    for x, want in zip(split, refs.attention_bwd(q, k, v, g, 0.25, causal=True)):
        np.testing.assert_allclose(x, want, rtol=1e-4, atol=1e-5)
    for n in (2, 3, 5):
        for a, c in zip(split, bwd(q, k, v, y, g, "causal", 0.25, n_threads=n, **cpu)):
            assert np.array_equal(a, c)


@pytest.mark.parametrize("level", [0, 1, 2])
def test_every_simd_level(level):
    """The block products run on matmul's tiles: each dispatch level (capped) is checked."""
    if level and not lib.gt_cpu_features() & (1 << (level - 1)):
        pytest.skip(f"this CPU lacks SIMD level {level}")
    rng = np.random.default_rng(9)
    q, k, v = _f32(rng, 1, 70, 4, 40), _f32(rng, 1, 70, 2, 40), _f32(rng, 1, 70, 2, 40)
    g = _f32(rng, *q.shape)
    lib.gt_set_simd_level(level)
    try:
        o, _, y = fwd(q, k, v, "causal", 0.3, n_threads=2)
        grads = bwd(q, k, v, y, g, "causal", 0.3, n_threads=2)
    finally:
        lib.gt_set_simd_level(2)
    np.testing.assert_allclose(o, refs.attention(q, k, v, 0.3, causal=True)[0], rtol=1e-4, atol=2e-6)
    for x, want in zip(grads, refs.attention_bwd(q, k, v, g, 0.3, causal=True)):
        np.testing.assert_allclose(x, want, rtol=1e-4, atol=1e-5)


def test_avx512_exp_keeps_the_bits():
    """Softmax's exps in the forward (and the backward's probabilities) take gt_expf16_ with
    AVX-512 (simd.h), gt_expf_ below it: the same bits, from logits spanning the exp's whole
    range (masked slots and rows that see no key included), and from huge ones (the clamps)."""
    if not lib.gt_cpu_features() & 2:
        pytest.skip("this CPU lacks AVX-512 (no second path to compare)")
    rng = np.random.default_rng(12)
    q, k, v = _f32(rng, 2, 70, 4, 32), _f32(rng, 2, 70, 2, 32), _f32(rng, 2, 70, 2, 32)
    q[0] *= 40.0                          # logits past -87 after the max: exps of 0 and tiny ones
    q[1, :5] *= 1e20                      # beyond both clamps
    g = _f32(rng, *q.shape)
    seg, kw = _mask_input("seg", 2, 70, 70, rng)
    got = {}
    for level in (1, 2):
        lib.gt_set_simd_level(level)
        try:
            for mode, extra in (("causal", None), ("seg", seg)):
                o, lse, y = fwd(q, k, v, mode, 0.3, extra, n_threads=2)
                grads = bwd(q, k, v, y, g, mode, 0.3, extra, n_threads=2)
                got[level, mode] = (y, *grads)
        finally:
            lib.gt_set_simd_level(2)
    for mode in ("causal", "seg"):
        for a, b in zip(got[1, mode], got[2, mode]):
            np.testing.assert_array_equal(a, b, err_msg=mode)


def test_strided_inputs_read_in_place():
    """q, k, v as views of one fused (B, T, (H + 2 Hkv) D) projection, and a strided dO: the
    same bits as from contiguous copies."""
    rng = np.random.default_rng(3)
    b, t, h, hkv, d = 2, 70, 4, 2, 16
    qkv = _f32(rng, b, t, (h + 2 * hkv) * d)
    q = qkv[:, :, :h * d].reshape(b, t, h, d)
    k = qkv[:, :, h * d:(h + hkv) * d].reshape(b, t, hkv, d)
    v = qkv[:, :, (h + hkv) * d:].reshape(b, t, hkv, d)
    g_wide = _f32(rng, b, t, h, 2 * d)
    g = g_wide[..., :d]
    assert not q.flags.c_contiguous and not g.flags.c_contiguous
    y = fwd(q, k, v, "causal", 0.25)[2]
    want_y = fwd(*(np.ascontiguousarray(x) for x in (q, k, v)), "causal", 0.25)[2]
    assert np.array_equal(y, want_y)
    got = bwd(q, k, v, y, g, "causal", 0.25)
    want = bwd(*(np.ascontiguousarray(x) for x in (q, k, v)), y, np.ascontiguousarray(g), "causal", 0.25)
    for a, c in zip(got, want):
        assert np.array_equal(a, c)


def test_bad_inputs_are_clear_errors():
    rng = np.random.default_rng(1)
    q, k = _f32(rng, 1, 4, 4, 8), _f32(rng, 1, 4, 2, 8)
    n = q.size + 4 * 4
    cases = [  # srcs, ip, dst size, exception, message part
        ([q, _f32(rng, 1, 4, 3, 8), _f32(rng, 1, 4, 3, 8)], 1, n, ShapeError, "H_kv dividing"),
        ([q, k, _f32(rng, 1, 5, 2, 8)], 1, n, ShapeError, "expected v of k's shape"),
        ([q, k, k], 1, n + 1, ShapeError, "O and LSE"),
        ([q, k, k], 5, n, NativeError, "mask ip[0]"),
        ([q, k, k, np.zeros((1, 4), np.int32)], 4, n, NativeError, "expected 5 inputs"),
        ([q, k, k, np.zeros((1, 4), np.int32), np.zeros((1, 5), np.int32)], 4, n, ShapeError,
         "expected parent (1, 4)"),
        ([q, k, k], 3, n, NativeError, "expected 4 inputs"),
        ([q, k, k, np.zeros((1, 5), np.int32)], 3, n, ShapeError, "expected seg (1, 4)"),
        ([q, k, k, np.zeros(3, np.int32)], 2, n, ShapeError, "expected pos (4,)"),
        ([q, k, k, np.zeros(4, np.float32)], 2, n, DTypeError, "pos"),
        ([q[..., 0], k, k], 1, n, ShapeError, "expected q (B, T, heads, D)"),
        ([q.astype(np.float16), k, k], 1, n, DTypeError, "q"),
    ]
    for srcs, ip, size, exc, msg in cases:
        with pytest.raises(exc, match=re.escape(msg)):
            run_kernel("attention_fwd_f32", np.zeros(size, np.float32), srcs, ip=(ip,), fp=(1.0,))
    with pytest.raises(NativeError, match="node scratch"):   # the CPU kernel's row tables (CUDA's needs none)
        run_kernel("attention_fwd_f32", np.zeros(n, np.float32), [q, k, k], ip=(1,), fp=(1.0,), scratch_bytes=8,
                   backend=CpuBackend(1))
    y = fwd(q, k, k, "causal", 1.0)[2]
    with pytest.raises(ShapeError, match="neither|expected g"):
        run_kernel("attention_bwd_f32", np.zeros(q.size + 2 * k.size, np.float32), [q, k, k, y, q[:, :3]],
                   ip=(1,), fp=(1.0,))
    g = Graph()
    tq, tk = g.input((1, 4, 4, 8)), g.input((1, 4, 2, 8))
    with pytest.raises(ValueError, match="one of causal"):
        ops.attention(tq, tk, tk, 1.0, causal=True, seg=g.input((1, 4), "i32"))
    with pytest.raises(ShapeError, match="segments"):
        ops.attention(tq, tk, tk, 1.0, seg=g.input((1, 5), "i32"))
    with pytest.raises(DTypeError, match="positions must be i32"):
        ops.attention(tq, tk, tk, 1.0, pos=g.input((4,)))
    with pytest.raises(ValueError, match="goes with seg"):
        ops.attention(tq, tk, tk, 1.0, causal=True, parent=g.input((1, 4), "i32"))
    with pytest.raises(ValueError, match=r"window \(3\) shorter than the rows \(4\)"):
        ops.attention(tq, tk, tk, 1.0, seg=g.input((1, 4), "i32"), parent=g.input((1, 4), "i32"), window=3)
    with pytest.raises(ShapeError, match="Hkv dividing H"):
        ops.attention(tq, g.input((1, 4, 3, 8)), g.input((1, 4, 3, 8)), 1.0)


# ---- against the unfused composition ---------------------------------------------------------


def unfused_attention(q, k, v, scale, causal=False, pos=None, seg=None, with_lse=False, window=0, parent=None):
    """ops.attention's O from matmul, softmax and permutes: the (B, H, Tq, Tk) scores and
    probabilities made whole, q, v and the output copied by permutes (grouped heads as one
    batched product per KV head). What llama.py ran before the fused op (no windows)."""
    assert not with_lse and not window and parent is None
    b, tq, h, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    g = h // hkv
    qh = ops.reshape(ops.cont(ops.permute(q, (0, 2, 1, 3))), (b, hkv, g * tq, d))   # (B, Hkv, G*Tq, D)
    kt = ops.permute(k, (0, 2, 3, 1))                                               # (B, Hkv, D, Tk) view
    vh = ops.cont(ops.permute(v, (0, 2, 1, 3)))                                     # (B, Hkv, Tk, D)
    scores = ops.reshape(ops.matmul(qh, kt), (b, h, tq, tk))
    probs = ops.softmax(scores, scale, causal=causal, pos=pos, seg=seg)
    out = ops.matmul(ops.reshape(probs, (b, hkv, g * tq, tk)), vh)                 # (B, Hkv, G*Tq, D)
    return ops.permute(ops.reshape(out, (b, h, tq, d)), (0, 2, 1, 3))               # (B, Tq, H, D) view


@pytest.mark.parametrize("mode", ["causal", "seg", "pos"])
def test_op_matches_unfused_composition(mode, backend):
    """Forward and the gradients of q, k, v (random upstream) of ops.attention and of the
    unfused graph agree to float rounding."""
    rng = np.random.default_rng(11)
    b, tq, h, hkv, d = 2, 70, 4, 2, 16
    tk = 90 if mode == "pos" else tq
    b = 1 if mode == "pos" else b
    arrays = [_f32(rng, b, tq, h, d), _f32(rng, b, tk, hkv, d), _f32(rng, b, tk, hkv, d)]
    extra, kw = _mask_input(mode, b, tq, tk, rng)
    upstream = _f32(rng, b, tq, h, d)
    results = []
    for fn in (ops.attention, unfused_attention):
        g = Graph()
        q, k, v = (g.param(a.shape, a) for a in arrays)
        if extra is not None:
            kw = {mode: g.const(extra, dtype="i32")}
        out = fn(q, k, v, 0.3, **kw)
        loss = ops.sum(ops.mul(out, g.const(upstream)))
        grads = backward(loss, [q, k, v], checkpointing=False)
        rt = Runtime(g, backend)
        plan = rt.compile([out] + [grads[t] for t in (q, k, v)])
        rt.run(plan)
        results.append([plan.read(out)] + [plan.read(grads[t]) for t in (q, k, v)])
    for got, want in zip(*results):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def _tiny_llama(**kw):
    return ModelConfig(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, ff=48, ctx=80, **kw)


def _llama_step(cfg, tokens, targets, pos, seg, checkpoint, backend):
    """Loss and every parameter's gradient of one llama step."""
    g = Graph()
    init = init_params(cfg, 0, std=0.2)
    params = {n: g.param(a.shape, a, name=n) for n, a in init.items()}
    tt, ty = g.const(tokens, dtype="i32"), g.const(targets, dtype="i32")
    tp = g.const(pos, dtype="i32")
    ts = g.const(seg, dtype="i32") if seg is not None else None
    loss = model_losses.loss(forward(Net(cfg, params), Inputs(tt, tp, seg=ts), Options(checkpoint=g if checkpoint else None)), ty)
    grads = backward(loss, list(params.values()), checkpointing=checkpoint)
    rt = Runtime(g, backend)
    plan = rt.compile([loss] + list(grads.values()))
    rt.run(plan)
    return float(plan.read(loss)), {t.name: plan.read(gr) for t, gr in grads.items()}


@pytest.mark.parametrize("packed,checkpoint", [(False, False), (True, False), (False, True)],
                         ids=["causal", "packed", "checkpointing"])
def test_llama_step_matches_unfused_graph(packed, checkpoint, backend, monkeypatch):
    """A training step's loss and gradients with the fused op equal the unfused graph's."""
    cfg = _tiny_llama()
    rng = np.random.default_rng(2)
    b, t = 2, 70
    tokens = rng.integers(0, cfg.vocab, (b, t)).astype(np.int32)
    targets = rng.integers(0, cfg.vocab, (b, t)).astype(np.int32)
    seg = None
    pos = np.arange(t, dtype=np.int32)
    if packed:   # samples of 30, 25, 15 tokens in row 0; 70 in row 1; positions restart
        seg = np.zeros((b, t), np.int32)
        seg[0, 30:55], seg[0, 55:] = 1, 2
        pos = np.stack([np.concatenate([np.arange(30), np.arange(25), np.arange(15)]),
                        np.arange(t)]).astype(np.int32)
    fused = _llama_step(cfg, tokens, targets, pos, seg, checkpoint, backend)
    monkeypatch.setattr(ops, "attention", unfused_attention)
    unfused = _llama_step(cfg, tokens, targets, pos, seg, checkpoint, backend)
    assert fused[0] == pytest.approx(unfused[0], rel=1e-5)
    assert fused[1].keys() == unfused[1].keys()
    for name, gr in fused[1].items():
        np.testing.assert_allclose(gr, unfused[1][name], rtol=1e-3, atol=1e-6, err_msg=name)


def test_decoder_matches_unfused_graph(backend, monkeypatch):
    """KV-cached decoding (mask by position) gives the unfused graph's logits."""
    cfg = _tiny_llama()
    weights = init_params(cfg, 1, std=0.2)
    ids = np.random.default_rng(4).integers(0, cfg.vocab, 40)

    def run():
        dec = Decoder(cfg, weights, backend, chunk=16)
        return np.stack([dec.feed(ids[:33])] + [dec.feed([i]) for i in ids[33:]])

    fused = run()
    monkeypatch.setattr(ops, "attention", unfused_attention)
    np.testing.assert_allclose(fused, run(), rtol=1e-4, atol=1e-5)


def test_ctx2048_training_plans_a_quarter_of_the_unfused_arena(monkeypatch):
    """dim 256, 4 layers, 8 heads, batch 1, ctx 2048, no checkpointing: the fused graph's
    arena is at most a quarter of the unfused one's (planning only, nothing runs), and its
    training step copies nothing around attention (no cont of q, v or the output, no
    zeros around dO) and holds no (T, T) tensor."""
    from ggtrain.core.train import TextConfig, TextRun

    cfg = ModelConfig(vocab=256, dim=256, layers=4, heads=8, kv_heads=8, ff=768, ctx=2048)
    init = init_params(cfg, 0)

    def plan():
        run = TextRun(cfg, init, TextConfig(steps=10, batch=1, checkpointing=False), CpuBackend(2))
        return run.step.memory.arena, run.step._update.plan.calls

    fused, calls = plan()
    kernels = {c.kernel for c in calls}
    assert "attention_fwd_f32" in kernels and "attention_bwd_f32" in kernels
    assert not kernels & {"copy_fwd_f32", "view_bwd_f32", "softmax_fwd_f32"}, sorted(kernels)
    assert not [c.label for c in calls if list(c.dst.shape).count(cfg.ctx) > 1]   # no (T, T) tensor
    monkeypatch.setattr(ops, "attention", unfused_attention)
    unfused = plan()[0]
    assert fused * 4 <= unfused, f"fused arena {fused / 2**20:.0f} MiB vs unfused {unfused / 2**20:.0f} MiB"
