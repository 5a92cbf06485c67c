"""The kernels' llama.cpp modes (numerics llama: generate and eval --numerics llama):
rope, rms_norm, attention and swiglu computing llama.cpp's CPU numbers bit for bit, against
float32 emulations of its code (tests/refs.py ggml_*); with the 8-bit products (test_qdot8.py)
they make our logits llama.cpp's own (test_gemma3.py, test_interop.py check that against it)."""
import numpy as np
import pytest

from ggtrain.core import ops
from ggtrain.core.autograd import backward
from ggtrain.core.backend_cpu import CpuBackend
from ggtrain.core.backend_kernel import run_kernel
from ggtrain.core.graph import Graph
from ggtrain.errors import DTypeError, NativeError, ShapeError
from ggtrain.native import lib
from ggtrain.core.numerics import EXACT, LLAMA
from tests import refs

ROPE_MODES = {"norm": 0, "neox": 2}


def _rope(x, pos, n_dims, base, mode, freq_scale=1.0, factors=None, attn_factor=1.0, ggml=1, n_threads=1,
          yarn=(0.0, 0.0, 0.0)):
    dst = np.full_like(x, np.nan)
    srcs = [x, np.asarray(pos, np.int32)] + ([factors] if factors is not None else [])
    run_kernel("rope_fwd_f32", dst, srcs, ip=(n_dims, ROPE_MODES[mode], ggml),
               fp=(base, freq_scale, attn_factor) + tuple(yarn), n_threads=n_threads)
    return dst


@pytest.mark.parametrize("mode", ["norm", "neox"])
def test_rope_yarn_takes_llama_cpp_angles(mode):
    """YaRN (gpt-oss: factor 32 over 4096 original positions) in llama.cpp's f32 expressions
    (rope_yarn and its ramp), bit for bit; the exact-angle kernel within float rounding."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, 5, 2, 64)).astype(np.float32)
    pos = np.array([0, 1, 9, 333, 4095], np.int32)
    corr = ops.yarn_corr_dims(64, 4096, 150000.0)
    yarn = (1.0,) + corr
    got = _rope(x, pos, 64, 150000.0, mode, 1 / 32, None, 0.9, yarn=yarn)
    want = refs.ggml_rope(x[0], pos, 64, 150000.0, mode, 1 / 32, None, 0.9, 1.0, corr)
    np.testing.assert_array_equal(got[0], want)
    plain = _rope(x, pos, 64, 150000.0, mode, 1 / 32, None, 0.9)
    assert np.abs(plain - got).max() > 0.1     # YaRN changes the rotation
    exact = _rope(x, pos, 64, 150000.0, mode, 1 / 32, None, 0.9, ggml=0, yarn=yarn)
    np.testing.assert_allclose(exact, got, atol=2e-3)


@pytest.mark.parametrize("mode", ["norm", "neox"])
@pytest.mark.parametrize("n_dims,base,with_factors", [(64, 10000.0, False), (48, 1e6, True)])
def test_rope_takes_llama_cpp_angles(mode, n_dims, base, with_factors):
    """f32 angles theta *= powf(base, -2 / n_dims) from (float)pos, libm's cosf / sinf, an
    fma'd rotation; dims past n_dims copied. Not the exact-angle kernel's bits at far
    positions (its angles are rounded once)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 6, 3, 64)).astype(np.float32)
    pos = np.array([0, 1, 7, 100, 2047, 4095], np.int32)
    factors = rng.uniform(1.0, 8.0, n_dims // 2).astype(np.float32) if with_factors else None
    got = _rope(x, pos, n_dims, base, mode, 0.5, factors, 1.25)
    want = refs.ggml_rope(x[0], pos, n_dims, base, mode, 0.5, factors, 1.25)
    np.testing.assert_array_equal(got[0], want)
    np.testing.assert_array_equal(_rope(x, pos, n_dims, base, mode, 0.5, factors, 1.25, n_threads=3), got)
    exact = _rope(x, pos, n_dims, base, mode, 0.5, factors, 1.25, ggml=0)
    assert (exact[0, -1] != got[0, -1]).any()
    np.testing.assert_allclose(exact, got, atol=5e-3)


def test_rms_norm_sums_squares_in_double():
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((7, 640)) * np.exp(rng.standard_normal((7, 1)) * 3)).astype(np.float32)
    got = np.full_like(x, np.nan)
    run_kernel("rms_norm_fwd_f32", got, [x], ip=(1,), fp=(1e-6,), n_threads=2)
    np.testing.assert_array_equal(got, refs.ggml_rms_norm(x, 1e-6))


def test_swiglu_ggml_is_llama_cpp_swiglu_with_its_tail():
    """16 columns at a time through its vector exp, the last C % 16 through libm's expf."""
    rng = np.random.default_rng(5)
    g = (rng.standard_normal((3, 40)) * 6).astype(np.float32)
    g[0, :4] = [-100.0, 100.0, 0.0, -0.0]
    u = rng.standard_normal((3, 40)).astype(np.float32)
    got = np.full_like(g, np.nan)
    run_kernel("swiglu_ggml_fwd_f32", got, [g, u], n_threads=2)
    np.testing.assert_array_equal(got, refs.ggml_swiglu(g, u))


def test_swiglu_oai_ggml_is_llama_cpp_swiglu_oai():
    """gpt-oss's clamped gate in llama.cpp's order (libm's expf, a division, then y + 1), across
    both clamps and the exp's far ends; not the exact kernel's bits (its reciprocal and exp)."""
    rng = np.random.default_rng(6)
    g = (rng.standard_normal((3, 40)) * 6).astype(np.float32)
    g[0, :4] = [-100.0, 100.0, 0.0, -0.0]
    u = (rng.standard_normal((3, 40)) * 6).astype(np.float32)
    got, exact = np.full_like(g, np.nan), np.full_like(g, np.nan)
    run_kernel("swiglu_oai_ggml_fwd_f32", got, [g, u], fp=(1.702, 7.0), n_threads=2)
    np.testing.assert_array_equal(got, refs.ggml_swiglu_oai(g, u))
    run_kernel("swiglu_oai_fwd_f32", exact, [g, u], fp=(1.702, 7.0), n_threads=2)
    assert (got != exact).any()
    np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("k", [2, 17])
def test_moe_weights_softmax_weight_is_llama_cpp_soft_max_of_the_chosen(k):
    """gpt-oss's gating (llama.cpp's SOFTMAX_WEIGHT): ggml_soft_max of the k chosen logits in
    slot order (k < 16 all by libm's expf; 17: one vector block and one by libm), not the
    softmax over all E renormalised (qwen3moe's llama numbers), whose bits it is not; exactly it
    is that one, bit for bit as before."""
    rng = np.random.default_rng(7 + k)
    z = (rng.standard_normal((6, 20)) * 3).astype(np.float32)
    ids = np.argsort(-z, -1, kind="stable")[:, :k].astype(np.int32)

    def weights(norm, llama, gating):
        w = np.full(ids.shape, np.nan, np.float32)
        run_kernel("moe_weights_fwd_f32", w, [z, ids], ip=(norm, llama, gating), n_threads=2)
        return w
    got = weights(0, 1, 2)
    np.testing.assert_array_equal(got, refs.ggml_soft_max(np.take_along_axis(z, ids, -1)))
    assert (got != weights(1, 1, 0)).any()
    np.testing.assert_allclose(got, refs.moe_weights(z, ids, False, "softmax_weight"), rtol=1e-6)
    np.testing.assert_array_equal(weights(0, 0, 2), weights(1, 0, 0))
    with pytest.raises(NativeError, match="gating ip"):
        weights(0, 0, 3)


def _attention(q, k, v, scale, pos, window=0, scale_q=False, n_threads=2, kv_f16=False, sinks=None, lse=False):
    dst = np.full(q.size + q.shape[0] * q.shape[1], np.nan, np.float32)
    run_kernel("attention_fwd_f32", dst, [q[None], k[None], v[None], np.asarray(pos, np.int32)]
               + ([np.asarray(sinks, np.float32)] if sinks is not None else []),
               ip=(2, window, 1, int(scale_q), int(kv_f16), int(sinks is not None)), fp=(scale,), n_threads=n_threads)
    o = dst[:q.size].reshape(q.shape)
    return (o, dst[q.size:].reshape(q.shape[1], q.shape[0])) if lse else o


@pytest.mark.parametrize("tq,tk,d,window,scale_q,big", [(1, 70, 64, 0, False, 1), (1, 40, 96, 0, True, 1),
                                                        (5, 70, 64, 0, False, 1), (6, 40, 96, 16, True, 1),
                                                        (3, 50, 64, 0, False, 12)])
def test_attention_takes_llama_cpp_order(tq, tk, d, window, scale_q, big):
    """S by ggml_vec_dot_f32's 64 lanes (96: 32 left over), softmax by its vector exp summed in
    double 16 slots at a time, P V by 64 lanes for one query and tinyBLAS's 16 for more; keys
    past 64 so every lane chains; GQA (4 heads on 2); a window; q scaled first or S; scores far
    enough apart (big) that exps fall below 2^-126 (the exp's exact far end)."""
    rng = np.random.default_rng(tq * 100 + d)
    q = (rng.standard_normal((tq, 4, d)) * 2 * big).astype(np.float32)
    k = (rng.standard_normal((tk, 2, d)) * 2).astype(np.float32)
    v = rng.standard_normal((tk, 2, d)).astype(np.float32)
    pos = np.arange(tk - tq, tk, dtype=np.int32) - (3 if tq > 1 else 0)
    scale = 1.0 / np.sqrt(d)
    got = _attention(q, k, v, scale, pos, window, scale_q)
    np.testing.assert_array_equal(got, refs.ggml_attention(q, k, v, scale, pos, window, scale_q))
    np.testing.assert_array_equal(_attention(q, k, v, scale, pos, window, scale_q, n_threads=3), got)
    want = np.einsum("ihj,jhd->ihd", refs.softmax(
        np.where(_seen(pos, tk, window)[:, None, :], np.einsum("ihd,jhd->ihj", q, np.repeat(k, 2, 1)) * scale,
                 -np.inf)), np.repeat(v, 2, 1))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    if big > 1:
        w = np.einsum("ihd,jhd->ihj", q, np.repeat(k, 2, 1)) * scale
        w = np.where(_seen(pos, tk, 0)[:, None, :], w, -np.inf)
        assert ((w - w.max(-1, keepdims=True)) < -87).any()


@pytest.mark.parametrize("tq,d", [(1, 64), (5, 64), (1, 72), (5, 8)])
def test_attention_as_llama_cpp_f16_kv_cache(tq, d):
    """llama.cpp's default F16 KV cache: q, k, v and the weights meet it rounded to f16, S of
    several queries by tinyBLAS's 16 lanes (D a multiple of 16), else by its f16 dot, whose
    leftovers past 64 it adds in double; not the F32 cache's bits."""
    rng = np.random.default_rng(11 + tq + d)
    q = (rng.standard_normal((tq, 4, d)) * 2).astype(np.float32)
    k = (rng.standard_normal((70, 2, d)) * 2).astype(np.float32)
    v = rng.standard_normal((70, 2, d)).astype(np.float32)
    pos = np.arange(70 - tq, 70, dtype=np.int32)
    got = _attention(q, k, v, 0.125, pos, kv_f16=True)
    np.testing.assert_array_equal(got, refs.ggml_attention(q, k, v, 0.125, pos, kv_f16=True))
    assert (got != _attention(q, k, v, 0.125, pos)).any()


@pytest.mark.parametrize("tq,window", [(1, 0), (5, 0), (4, 3)])
def test_attention_takes_sinks_as_llama_cpp_soft_max(tq, window):
    """gpt-oss's sinks inside the softmax, as llama.cpp's soft_max adds them: the max is
    max(max, sink) (sinks above and below the scores), the double sum gains libm's expf(sink -
    max); the exact weights' value (keys' share sigmoid(LSE - sink) of the sink-free softmax),
    LSE then over the keys and the sink. A row that sees no key (its window past the cache)
    has O = 0 and LSE the sink."""
    rng = np.random.default_rng(21 + tq + window)
    d, tk = 16, 40
    q = (rng.standard_normal((tq, 4, d)) * 2).astype(np.float32)
    k = (rng.standard_normal((tk, 2, d)) * 2).astype(np.float32)
    v = rng.standard_normal((tk, 2, d)).astype(np.float32)
    sinks = np.array([-3.0, 0.5, 2.5, 30.0], np.float32)     # the last above every score
    pos = np.arange(tk - tq, tk, dtype=np.int32)
    scale = 0.25
    got, lse = _attention(q, k, v, scale, pos, window, sinks=sinks, lse=True)
    np.testing.assert_array_equal(got, refs.ggml_attention(q, k, v, scale, pos, window, sinks=sinks))
    np.testing.assert_array_equal(_attention(q, k, v, scale, pos, window, n_threads=3, sinks=sinks), got)
    s = np.where(_seen(pos, tk, window)[:, None, :],
                 np.einsum("ihd,jhd->ihj", q.astype(np.float64), np.repeat(k, 2, 1)) * scale, -np.inf)
    s = np.concatenate([s, np.broadcast_to(sinks[None, :, None].astype(np.float64), (tq, 4, 1))], -1)
    p = refs.softmax(s)
    np.testing.assert_allclose(got, np.einsum("ihj,jhd->ihd", p[..., :tk], np.repeat(v, 2, 1)), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1)).T + s.max(-1).T,
                               rtol=1e-5)
    assert (got != _attention(q, k, v, scale, pos, window)).any()
    none, lse = _attention(q[:1], k, v, scale, [-1], sinks=sinks, lse=True)     # (a position before the cache)
    np.testing.assert_array_equal(none, 0.0)
    np.testing.assert_array_equal(lse[:, 0], sinks)


def _seen(pos, tk, window):
    j = np.arange(tk)[None, :]
    p = np.asarray(pos)[:, None]
    return (j <= p) & ((p - j < window) if window else True)


def test_llama_cpp_modes_refuse_what_they_do_not_do():
    """No gradient through them (inference only), no segment mask, and only the CPU forward
    kernels take the flags."""
    g = Graph()
    x = g.param((1, 2, 2, 8), name="x")
    pos = g.input((2,), "i32", name="pos")
    for y in (ops.rope(x, pos, numerics=LLAMA), ops.rms_norm(x, numerics=LLAMA)):
        with pytest.raises(ValueError, match="inference: no gradient"):
            backward(ops.sum(y), [x])
    y = ops.attention(x, x, x, 0.5, pos=pos, numerics=LLAMA)
    with pytest.raises(ValueError, match="inference: no gradient"):
        backward(ops.sum(y), [x])
    with pytest.raises(ValueError, match="no segment mask"):
        ops.attention(x, x, x, 0.5, seg=g.input((1, 2), "i32"), numerics=LLAMA)
    with pytest.raises(ValueError, match="scale_q and kv_f16 need llama numerics"):
        ops.attention(x, x, x, 0.5, causal=True, scale_q=True)
    q = np.zeros((1, 2, 2, 8), np.float32)
    with pytest.raises(NativeError, match="ip\\[2\\]"):
        run_kernel("rope_bwd_f32", q.copy(), [q, np.zeros(2, np.int32)], ip=(8, 0, 1), fp=(1e4, 1.0, 1.0))
    with pytest.raises(NativeError, match="ip\\[0\\]"):
        run_kernel("rms_norm_bwd_f32", q.copy(), [q, q], ip=(1,), fp=(1e-5,))
    with pytest.raises(NativeError, match="the CPU forward's"):
        run_kernel("attention_bwd_f32", np.zeros(3 * q.size, np.float32),
                   [q, q, q, np.zeros(q.size + 4, np.float32), q], ip=(1, 0, 1, 0), fp=(0.5,))


def test_decoder_in_llama_numerics_uses_the_llama_cpp_modes():
    """The llama-numerics graph's rope, rms_norm and attention nodes carry numerics llama, its
    FFN swiglu_ggml; the exact graph's none."""
    from ggtrain.core.models.inference import Decoder
    from ggtrain.core.models.config import ModelConfig, init_params
    cfg = ModelConfig(vocab=64, dim=32, layers=1, heads=2, kv_heads=1, ff=48, ctx=16)
    weights = init_params(cfg, seed=1)
    for numerics in (LLAMA, EXACT):
        dec = Decoder(cfg, weights, CpuBackend(1), n_ctx=16, numerics=numerics)
        plan, *_, logits = dec._plan(3, 16)
        nodes = _nodes(logits)
        flagged = {t.op for t in nodes if t.params.get("numerics") == LLAMA}
        assert flagged == ({"rope", "rms_norm", "attention"} if numerics == LLAMA else set())
        assert any(t.op == ("swiglu_ggml" if numerics == LLAMA else "swiglu") for t in nodes)


def _nodes(t, seen=None):
    seen = {} if seen is None else seen
    if id(t) not in seen:
        seen[id(t)] = t
        for s in t.srcs:
            _nodes(s, seen)
    return list(seen.values())


def _matmul_ggml(x, w, f16, n_threads=1):
    """x (..., K) @ w.T through matmul_ggml_fwd_f32[_f16], w (N, K) f32 or stored as f16."""
    n, k = w.shape
    dst = np.full(x.shape[:-1] + (n,), np.nan, np.float32)
    src1 = (w.astype(np.float16).view(np.uint16).reshape(-1).view(np.uint8), "f16", (k, n), (1, k)) if f16 else w.T
    run_kernel("matmul_ggml_fwd_f32" + ("_f16" if f16 else ""), dst, [x, src1], n_threads=n_threads)
    return dst


@pytest.mark.parametrize("f16", [False, True], ids=["f32", "f16"])
@pytest.mark.parametrize("m,n,k", [(1, 8, 96), (1, 5, 40), (3, 12, 80), (3, 10, 80), (4, 8, 70), (6, 36, 200),
                                   (5, 300, 64)])
def test_matmul_ggml_is_llama_cpp_mul_mat(f16, m, n, k):
    """f32 and f16 weights as llama.cpp's CPU multiplies them: tinyBLAS's 16 lanes for 2 or more
    rows when N % 4 == 0 and K % 16 == 0, else its vec_dot (64 lanes, the leftovers fma'd, or added
    in double for f16), x rounded to f16 against an f16 weight; same bits for any thread count and
    with the rows in batch dims."""
    rng = np.random.default_rng(m * 1000 + n + k)
    x = (rng.standard_normal((m, k)) * 3).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    got = _matmul_ggml(x, w, f16)
    np.testing.assert_array_equal(got, refs.ggml_matmul(x, w, f16))
    np.testing.assert_array_equal(_matmul_ggml(x, w, f16, n_threads=3), got)
    np.testing.assert_array_equal(_matmul_ggml(x.reshape(1, m, k), w, f16, n_threads=2)[0], got)
    lib.gt_set_simd_level(0)        # (the AVX-512 rows and the plain C give the same bits)
    try:
        np.testing.assert_array_equal(_matmul_ggml(x, w, f16, n_threads=2), got)
    finally:
        lib.gt_set_simd_level(2)
    wf = refs._f16(w) if f16 else w
    xf = refs._f16(x) if f16 else x
    np.testing.assert_allclose(got, xf.astype(np.float64) @ wf.T.astype(np.float64), rtol=1e-5, atol=1e-4)
    if m >= 2 and not f16:     # llama.cpp's order is not the exact kernel's fma chain
        exact = np.full_like(got, np.nan)
        run_kernel("matmul_fwd_f32", exact, [x, w.T])
        assert (exact != got).any()


def test_matmul_ggml_refuses_what_it_does_not_compute():
    g = Graph()
    x = g.input((2, 32))
    with pytest.raises(DTypeError, match="matmul_ggml: the weight must be f32 or stored in f16, got q8_0"):
        ops.matmul_ggml(x, ops.transpose(g.param((4, 32), trainable=False, dtype="q8_0"), 0, 1))
    with pytest.raises(ShapeError, match=r"matmul_ggml: the weight must be the 2-D view W.T"):
        ops.matmul_ggml(x, g.param((32, 4)))
    w = np.zeros((4, 32), np.float32)
    with pytest.raises(ShapeError, match=r"matmul_ggml: expected src1 the view W\^T \(K=32, N\) of a weight W \(N, K\) "
                       r"with contiguous rows, got shape \(4, 32\) strides \(32, 1\)"):
        run_kernel("matmul_ggml_fwd_f32", np.zeros((2, 32), np.float32), [np.zeros((2, 32), np.float32), w])
