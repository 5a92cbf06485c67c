"""Products of quantized weights with activations quantized to 8 bits (ops.matmul_q8, the
kernels matmul_q8_fwd_f32_<w> of native/cpu/qdot8.c): llama.cpp's numerics for generation
and evaluation, against a float64 reference of its quantize-then-dot semantics
(tests/refs.py act8_quantize / act8_matmul)."""
import numpy as np
import pytest

from ggtrain.core import ops
from ggtrain.core.backend_cpu import CpuBackend
from ggtrain.core.backend_kernel import run_kernel
from ggtrain.core.graph import Graph
from ggtrain.errors import DTypeError, NativeError, ShapeError
from ggtrain.formats.quants import quantize
from ggtrain.native import lib
from tests import refs

BACKENDS = {n: CpuBackend(n) for n in (1, 2, 3)}


def _raw(W: np.ndarray, w: str) -> np.ndarray:
    """W quantized: ours where we write the type, gguf-py's for Q5_0 / Q5_1."""
    if w in ("q5_0", "q5_1"):
        from gguf import GGMLQuantizationType, quants
        return np.frombuffer(quants.quantize(W, GGMLQuantizationType[w.upper()]).tobytes(), np.uint8)
    return np.frombuffer(bytes(quantize(W, w)), np.uint8)


def q8(x, raw, w, R, C, n_threads=1):
    """x @ W^T through matmul_q8_fwd_f32_<w>, W (R, C) stored as raw."""
    dst = np.full(x.shape[:-1] + (R,), np.nan, np.float32)
    return run_kernel(f"matmul_q8_fwd_f32_{w}", dst, [x, (raw, w, (C, R), (1, C))], n_threads=n_threads,
                      backend=BACKENDS[n_threads])


def test_the_library_has_the_types_the_op_names():
    assert ops.ACT8_TYPES == ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k", "mxfp4")


@pytest.mark.parametrize("w", ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "mxfp4"])
@pytest.mark.parametrize("M,K,N", [(1, 32, 1), (1, 96, 40), (3, 256, 17), (5, 64, 33), (33, 128, 9)])
def test_products_equal_the_float64_reference_of_quantize_then_dot(w, M, K, N):
    """Every row: within float rounding of the float64 sum of the integer block products
    scaled by the blocks' f16 scales (+ the Q4_1 minimum times the activations' f16 sum);
    clearly not the f32 product (the activations were rounded to 8 bits); the same bits for
    1, 2 and 3 threads. M = 33 crosses the kernel's groups of 32 rows."""
    rng = np.random.default_rng(M * 1000 + K + N)
    W = rng.standard_normal((N, K)).astype(np.float32)
    x = rng.standard_normal((M, K)).astype(np.float32)
    raw = _raw(W, w)
    got = q8(x, raw, w, N, K)
    want = refs.act8_matmul(x, raw.tobytes(), w, N, K)
    scale = np.abs(want).max() + 1.0
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * scale)
    exact = x.astype(np.float64) @ refs.weight_blocks_f64(raw.tobytes(), w, N, K).T
    assert np.abs(exact - want).max() > 1e-4 * scale          # the 8-bit rounding is visible
    for n in (2, 3):
        np.testing.assert_array_equal(q8(x, raw, w, N, K, n), got)


@pytest.mark.parametrize("w", ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "mxfp4"])
@pytest.mark.parametrize("N", [21, 44])
def test_plain_c_and_simd_give_the_same_bits(w, N):
    """The AVX2 path (maddubs, level 1), its VNNI form (level 2, where the CPU has it) and
    the plain C path agree bit for bit: per-lane FMAs; for Q4_0 with N a multiple of 8 rows
    (N = 44: five groups of 8 rows, then 4 rows alone) one chain a row, eight rows a vector."""
    rng = np.random.default_rng(7)
    W = rng.standard_normal((N, 160)).astype(np.float32)
    x = (rng.standard_normal((6, 160)) * np.exp(rng.standard_normal((6, 160)))).astype(np.float32)
    raw = _raw(W, w)
    got = {}
    try:
        for level in (0, 1, 2):
            lib.gt_set_simd_level(level)
            got[level] = q8(x, raw, w, N, 160)
    finally:
        lib.gt_set_simd_level(2)
    np.testing.assert_array_equal(got[0], got[1])
    np.testing.assert_array_equal(got[0], got[2])
    np.testing.assert_allclose(got[0], refs.act8_matmul(x, raw.tobytes(), w, N, 160), rtol=1e-5, atol=1e-5)


def test_q4_0_sums_each_block_then_chains_the_blocks_when_rows_are_a_multiple_of_8():
    """llama.cpp's repacked Q4_0 GEMV (rows a multiple of 8): y = fma((float)block sum, d_w * d_x,
    y) over the blocks in order, float32 throughout; with 44 rows (not a multiple of 8) the
    eight-lane dot instead. The two orders differ in the last bits, and each kernel gives its
    own exactly (float32 emulated with float64 rounded at every step: the products and sums
    here are exact in float64, so one rounding to float32 is the FMA's)."""
    rng = np.random.default_rng(11)
    K = 96
    x = (rng.standard_normal((1, K)) * 3).astype(np.float32)
    qx, dx, _ = refs.act8_quantize(x)
    for N in (40, 44):
        raw = _raw(rng.standard_normal((N, K)).astype(np.float32), "q4_0")
        qw, dw, _ = refs.weight_blocks(raw.tobytes(), "q4_0", N, K)
        isum = np.einsum("bk,nbk->nb", qx[0].astype(np.int64), qw.astype(np.int64))
        lanes = np.einsum("blk,nblk->nbl", qx[0].reshape(-1, 8, 4).astype(np.int64),
                          qw.reshape(N, -1, 8, 4).astype(np.int64))
        dd = (dw * dx[0]).astype(np.float32)                        # (N, blocks), f32 products
        want = np.zeros(N, np.float32)
        if N % 8 == 0:
            for b in range(K // 32):
                want = (want.astype(np.float64) + isum[:, b] * dd[:, b].astype(np.float64)).astype(np.float32)
        else:
            acc = np.zeros((N, 8), np.float32)
            for b in range(K // 32):
                acc = (acc.astype(np.float64) + lanes[:, b] * dd[:, b:b + 1].astype(np.float64)).astype(np.float32)
            r = acc[:, 0:4] + acc[:, 4:8]
            want = (r[:, 0] + r[:, 2]) + (r[:, 1] + r[:, 3])
        np.testing.assert_array_equal(q8(x, raw, "q4_0", N, K)[0], want, err_msg=f"N = {N}")


def test_activations_round_half_to_even_and_keep_f16_scales():
    """A Q8_0 weight of ones (scale 1) sums the activations' integers times their scale: a
    block whose largest magnitude is 127 keeps 127 / amax = 1, so x = 2.5, 3.5, -2.5, 0.5
    round to nearest even (2, 4, -2, 0), as llama.cpp's AVX2 quantizer does; a block of zeros
    gives 0 (no NaN), and a scale is the f16 rounding of amax / 127."""
    block = np.zeros((1, 34), np.uint8)
    block[0, :2] = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    block[0, 2:] = 1
    raw = np.tile(block, (1, 3)).reshape(-1)         # one row, 3 blocks of K = 96
    x = np.zeros((1, 96), np.float32)
    x[0, :6] = [127.0, 2.5, 3.5, -2.5, 0.5, 1.5]      # block 0: 127 + 2 + 4 - 2 + 0 + 2
    x[0, 64:66] = [0.1, -0.05]                        # block 2: amax 0.1
    got = q8(x, raw, "q8_0", 1, 96)[0, 0]
    d2 = np.float32(np.float16(np.float32(0.1) / np.float32(127)))
    q2 = np.rint(np.float32(-0.05) * (np.float32(127) / np.float32(0.1)))        # -63.5 -> -64
    assert q2 == -64
    assert got == np.float32(133.0 + np.float64(d2) * (127 + q2))


def test_bad_operands_are_refused():
    g = Graph()
    x = g.input((2, 64))
    w16 = g.param((8, 64), name="w16", trainable=False, dtype="f16")
    with pytest.raises(DTypeError, match="matmul_q8: the weight must be stored in one of q4_0, q4_1, q5_0, q5_1, q8_0, q4_k, q5_k, q6_k"):
        ops.matmul_q8(x, ops.transpose(w16, 0, 1))
    wq = g.param((8, 64), name="wq", trainable=False, dtype="q8_0")
    with pytest.raises(ShapeError, match=r"matmul_q8: the weight must be the view W.T"):
        ops.matmul_q8(g.input((2, 8)), wq)
    raw = _raw(np.ones((8, 64), np.float32), "q8_0")
    with pytest.raises(NativeError, match=r"matmul_q8: expected x @ W\^T with W stored in one of q4_0 q4_1 q5_0 q5_1 q8_0 q4_k q5_k q6_k"):
        run_kernel("matmul_q8_fwd_f32_q8_0", np.zeros((2, 64), np.float32),
                   [np.ones((2, 8), np.float32), (raw, "q8_0", (8, 64), (64, 1))])


def _kquant_raw(rng, w: str, N: int, K: int) -> np.ndarray:
    """Random q4_k / q5_k / q6_k super-blocks, their f16 scales small and finite."""
    bb, at = {"q4_k": (144, (0, 2)), "q5_k": (176, (0, 2)), "q6_k": (210, (208,))}[w]
    raw = rng.integers(0, 256, (N, K // 256, bb), dtype=np.uint8)
    for a in at:
        raw[..., a:a + 2] = np.frombuffer(rng.uniform(-0.01, 0.01, (N, K // 256)).astype(np.float16).tobytes(),
                                          np.uint8).reshape(N, K // 256, 2)
    return raw.reshape(-1)


@pytest.mark.parametrize("w", ["q4_k", "q5_k", "q6_k"])
@pytest.mark.parametrize("M,K,N", [(1, 256, 1), (1, 512, 24), (3, 768, 17), (33, 256, 9)])
def test_k_quant_products_equal_the_float64_reference(w, M, K, N):
    """Q4_K, Q5_K and Q6_K times activations in llama.cpp's Q8_K super-blocks (one scale a 256, -127 /
    the element of largest magnitude, sums of 16): the float64 sum of the integer products with
    the sub-blocks' scales (and Q4_K's and Q5_K's mins times the activations' sums), to float rounding; not
    the f32 product; the same bits for 1, 2, 3 threads and the plain C and AVX2 paths."""
    rng = np.random.default_rng(M * 7 + K + N)
    raw = _kquant_raw(rng, w, N, K)
    x = (rng.standard_normal((M, K)) * np.exp(rng.standard_normal((M, K)))).astype(np.float32)
    got = q8(x, raw, w, N, K)
    want = refs.act8k_matmul(x, raw.tobytes(), w, N, K)
    scale = np.abs(want).max() + 1.0
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * scale)
    exact = x.astype(np.float64) @ refs.kquant_f64(raw.tobytes(), w, N, K).T
    assert np.abs(exact - want).max() > 1e-5 * scale
    for n in (2, 3):
        np.testing.assert_array_equal(q8(x, raw, w, N, K, n), got)
    try:
        lib.gt_set_simd_level(0)
        np.testing.assert_array_equal(q8(x, raw, w, N, K), got)
    finally:
        lib.gt_set_simd_level(2)


def _q4k_chain(x, raw, N, K, per):
    """Q4_K x @ W^T in f32 with llama.cpp's fma chains, the integers summed over `per` elements
    (64: its 4-row GEMM; 256: its one-row GEMV) before each fma (f32 fma emulated in float64:
    the product of two f32 is exact there)."""
    qx, dx, _ = refs.act8k_quantize(x)
    q, sc, d, mn, dmin = refs.kquant_blocks(raw.tobytes(), "q4_k", N, K)
    M, nb = x.shape[0], K // 256
    qx = qx.astype(np.int64).reshape(M, nb, 256 // per, per)
    isum = np.einsum("mbpk,nbpk->mnbp", qx, (sc * q).reshape(N, nb, 256 // per, per))
    msum = np.einsum("mbpk,nbpk->mnbp", qx, mn.reshape(N, nb, 256 // per, per))
    f32 = np.float32
    out = np.empty((M, N), np.float32)
    for m in range(M):
        for n in range(N):
            a = am = f32(0)
            for b in range(nb):
                dd, md = f32(d[n, b] * dx[m, b]), f32(dmin[n, b] * dx[m, b])
                for p in range(256 // per):
                    a = f32(float(f32(isum[m, n, b, p])) * float(dd) + float(a))
                    am = f32(float(f32(msum[m, n, b, p])) * float(md) + float(am))
            out[m, n] = a - am
    return out


@pytest.mark.parametrize("simd", [2, 0])
@pytest.mark.parametrize("w", ["q6_k", "q4_k", "q5_k"])
def test_products_of_8_rows_or_more_take_llama_cpp_tiled_order(simd, w):
    """Weights llama.cpp does not repack (Q6_K, Q5_K; Q4_K with rows not a multiple of 8) times 8
    or more rows go through its tiled K-quant GEMM: per super-block the exact integers, r =
    (float)I * d (Q4_K, Q5_K: fma(-dmin, (float)Im, r)), acc = fma(r, x.d, acc); 7 rows keep its
    one-row (vec_dot) order, whose bits differ."""
    rng = np.random.default_rng(6)
    K, N = 768, 12
    raw = _kquant_raw(rng, w, N, K)
    x = (rng.standard_normal((9, K)) * np.exp(rng.standard_normal((9, K)))).astype(np.float32)
    qx, dx, _ = refs.act8k_quantize(x)
    q, sc, d, mn, dmin = refs.kquant_blocks(raw.tobytes(), w, N, K)
    isum = np.einsum("mbk,nbk->mnb", qx.astype(np.int64), sc * q)
    msum = np.einsum("mbk,nbk->mnb", qx.astype(np.int64), mn) if mn is not None else 0 * isum
    f32 = np.float32
    want = np.zeros((9, N), f32)
    for b in range(K // 256):
        r = isum[:, :, b].astype(f32) * d[None, :, b]
        if mn is not None:
            r = refs.fma32(-dmin[None, :, b], msum[:, :, b].astype(f32), r)
        want = refs.fma32(r, dx[:, b:b + 1], want)
    try:
        lib.gt_set_simd_level(simd)
        got = q8(x, raw, w, N, K)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(q8(x[:8], raw, w, N, K), want[:8])
        seven = q8(x[:7], raw, w, N, K)
        assert (seven != want[:7]).any()
        np.testing.assert_allclose(seven, want[:7], rtol=1e-5, atol=1e-5 * np.abs(want).max())
    finally:
        lib.gt_set_simd_level(2)


@pytest.mark.parametrize("simd", [2, 0])
def test_q4_k_rows_take_llama_cpp_batched_then_single_row_order(simd):
    """llama.cpp repacks a Q4_K matrix whose rows are a multiple of 8 and multiplies the first
    M - M % 4 rows of x four at a time (an fma each 64 elements), the rest one at a time (an
    fma each super-block): rows 0-3 of a 6-row product have the first order's bits, rows 4-5
    the second's, and the two orders differ somewhere; with rows not a multiple of 8 every row
    takes llama.cpp's vec_dot (its lanes, _vec_dot), which is neither."""
    rng = np.random.default_rng(5)
    K = 512
    x = (rng.standard_normal((6, K)) * np.exp(rng.standard_normal((6, K)))).astype(np.float32)
    try:
        lib.gt_set_simd_level(simd)
        for N in (16, 12):
            raw = _kquant_raw(rng, "q4_k", N, K)
            got = q8(x, raw, "q4_k", N, K)
            batched, single = _q4k_chain(x, raw, N, K, 64), _q4k_chain(x, raw, N, K, 256)
            if N % 8 == 0:
                np.testing.assert_array_equal(got[:4], batched[:4])
                assert (batched[:4] != single[:4]).any()
                np.testing.assert_array_equal(got[4:], single[4:])
            else:
                np.testing.assert_array_equal(got, _vec_dot(x, raw, "q4_k", N, K))
                assert (got != single).any()
    finally:
        lib.gt_set_simd_level(2)


def _vec_dot(x, raw, w, N, K):
    """llama.cpp's ggml_vec_dot_q4_K_q8_K / _q5_K_q8_K (AVX2) emulated in f32: eight int32 lanes
    a super-block (lane l: the elements 32 s + 4 l .. + 3 of every sub-block s, times its scale),
    acc[l] = fma(x.d * d, lane l, acc[l]), the mins with dmin' = -(x.d * dmin): Q5_K one chain
    summs = fma(Im, dmin', summs), Q4_K four lanes accm[t] = fma(dmin', mins of sub-blocks 2t,
    2t+1, accm[t]); y = hsum8(acc) + summs, or + ((accm0 + accm2) + (accm1 + accm3))."""
    qx, dx, _ = refs.act8k_quantize(x)
    q, sc, d, mn, dmin = refs.kquant_blocks(raw.tobytes(), w, N, K)
    M, nb = x.shape[0], K // 256
    prod = (sc * q).reshape(N, nb, 8, 8, 4)                 # (n, b, sub-block, lane, k)
    lanes = np.einsum("mbslk,nbslk->mnbl", qx.astype(np.int64).reshape(M, nb, 8, 8, 4), prod)
    mins = np.einsum("mbsk,nbsk->mnbs", qx.astype(np.int64).reshape(M, nb, 8, 32), mn.reshape(N, nb, 8, 32))
    f32 = np.float32
    out = np.empty((M, N), f32)
    for m in range(M):
        for n in range(N):
            acc, accm, summs = np.zeros(8, f32), np.zeros(4, f32), f32(0)
            for b in range(nb):
                dd, dm = f32(dx[m, b] * d[n, b]), -f32(dx[m, b] * dmin[n, b])
                acc = refs.fma32(dd, lanes[m, n, b].astype(f32), acc)
                sub = mins[m, n, b]
                if w == "q5_k":
                    summs = refs.fma32(f32(sub.sum()), dm, summs)
                else:
                    accm = refs.fma32(dm, (sub[0::2] + sub[1::2]).astype(f32), accm)
            r = [acc[0] + acc[4], acc[1] + acc[5], acc[2] + acc[6], acc[3] + acc[7]]
            h = f32(f32(r[0] + r[2]) + f32(r[1] + r[3]))
            out[m, n] = h + (summs if w == "q5_k" else f32(f32(accm[0] + accm[2]) + f32(accm[1] + accm[3])))
    return out


@pytest.mark.parametrize("simd", [2, 0])
@pytest.mark.parametrize("w,N", [("q5_k", 16), ("q5_k", 12), ("q4_k", 12)])
def test_fewer_than_8_rows_take_llama_cpp_vec_dot_order(simd, w, N):
    """Q5_K (never repacked on x86), and Q4_K whose rows are not a multiple of 8 (not repacked),
    times fewer than 8 rows of x: llama.cpp's vec_dot, whose lanes and mins chains (see
    _vec_dot) give bits of their own."""
    rng = np.random.default_rng(7)
    K = 768
    raw = _kquant_raw(rng, w, N, K)
    x = (rng.standard_normal((5, K)) * np.exp(rng.standard_normal((5, K)))).astype(np.float32)
    try:
        lib.gt_set_simd_level(simd)
        got = q8(x, raw, w, N, K)
        np.testing.assert_array_equal(got, _vec_dot(x, raw, w, N, K))
        np.testing.assert_array_equal(q8(x, raw, w, N, K, 3), got)
    finally:
        lib.gt_set_simd_level(2)
