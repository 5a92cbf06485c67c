"""matmul and get_rows with a frozen weight in its stored type (gt_matmul_fwd_f32_<w>,
gt_get_rows_fwd_f32_<w>) against float64 numpy on the weight gguf-py dequantizes.

Two products per weight W (R, C): y = x @ W.T (src1 the transposed view, K = C) and
dx = g @ W (src1 W itself, K = R). The packed GEMM dequantizes W while packing and
must give exactly what gt_matmul_fwd_f32 gives on the dequantized matrix; x @ W.T with
at most GT_QDOT_MAX_M rows takes the row-dot path instead (a fixed summation order of
its own, checked against float64 and for bit-identity across thread counts and SIMD
levels).
"""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants

from ggtrain.core import ops
from ggtrain.core.autograd import backward
from ggtrain.core.backend_cpu import CpuBackend
from ggtrain.core.backend_kernel import run_kernel
from ggtrain.core.graph import Graph, Runtime
from ggtrain.errors import DTypeError, NativeError, ShapeError
from ggtrain.native import lib
from ggtrain.native.dtypes import WEIGHT_TYPES, dtype

TYPES = [w for w in WEIGHT_TYPES if w != "f32"]
FEATURES = lib.gt_cpu_features()
LEVELS = [0] + ([1] if FEATURES & 1 else []) + ([2] if FEATURES & 2 else [])
SMALL_M = 32   # GT_QDOT_MAX_M: x @ W.T with at most this many rows takes the row-dot path
BACKENDS = {n: CpuBackend(n) for n in (1, 2, 3)}

# byte offsets of the f16 scale fields gguf-py cannot write (it has no K-quant quantizer)
_K_SCALES = {"q2_k": (80, 82), "q3_k": (108,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}


def make_weight(w: str, R: int, C: int, seed: int):
    """(raw bytes (R, row bytes) uint8, W (R, C) float32 = gguf-py's dequantization)."""
    rng = np.random.default_rng(seed)
    t = T[w.upper()]
    x = rng.standard_normal((R, C)).astype(np.float32)
    if w in _K_SCALES:  # random bytes with sane f16 scales (d, dmin around 0.01..0.1)
        block, nbytes = quants.GGML_QUANT_SIZES[t]
        raw = rng.integers(0, 256, (R, C // block, nbytes), dtype=np.uint8)
        for off in _K_SCALES[w]:
            raw[:, :, off:off + 2] = rng.uniform(0.01, 0.1, (R, C // block, 1)).astype(np.float16).view(np.uint8)
        raw = raw.reshape(R, -1)
    else:
        raw = quants.quantize(x, t)
    W = quants.dequantize(raw, t).astype(np.float32).reshape(R, C)
    return np.ascontiguousarray(raw).view(np.uint8).reshape(R, -1), W


def weight_ref(raw, w, R, C, transposed):
    """The kernel's view of the stored weight: W.T (C, R) or W (R, C)."""
    if transposed:
        return (raw, w, (C, R), (1, C))
    return (raw, w, (R, C), (C, 1))


def mm_weight(x, raw, w, R, C, transposed, n_threads=1):
    n = R if transposed else C
    dst = np.full(x.shape[:-1] + (n,), np.nan, np.float32)
    return run_kernel(f"matmul_fwd_f32_{w}", dst, [x, weight_ref(raw, w, R, C, transposed)],
                      n_threads=n_threads, backend=BACKENDS[n_threads])


def mm_f32(x, W, transposed, n_threads=1):
    b = W.T if transposed else W
    dst = np.full(x.shape[:-1] + (b.shape[1],), np.nan, np.float32)
    return run_kernel("matmul_fwd_f32", dst, [x, b], n_threads=n_threads, backend=BACKENDS[n_threads])


def check(got, x, b):
    """Against float64, tolerance as tests/test_matmul.py's `check`, scaled by the size
    of the terms (K-quant test weights are not O(1))."""
    ref = x.astype(np.float64) @ b.astype(np.float64)
    k = x.shape[-1]
    scale = max(1.0, float(np.abs(b).max()))
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=4e-5 * scale * max(1.0, np.sqrt(k)))


def block(w):
    return dtype(w).block


# (M, N, K in blocks or K = 512): together every M in 1, 3, 7, 33, 130, every N in 1, 3, 33,
# 257 and every K of 1, 2, 3 blocks and 512, on both paths
SHAPES = [(1, 257, 1), (3, 33, 2), (7, 1, 3), (33, 3, 512), (130, 257, 2), (1, 3, 512), (7, 33, 512),
          (33, 1, 1), (130, 33, 3), (3, 257, 3), (33, 257, 512)]


@pytest.mark.parametrize("transposed", [True, False], ids=["x@W.T", "g@W"])
@pytest.mark.parametrize("w", TYPES)
def test_products_against_float64_and_f32_kernel(w, transposed):
    for i, (M, N, kb) in enumerate(SHAPES):
        K = kb if kb == 512 else kb * max(block(w), 1)
        # the weight W (R, C): x @ W.T has K = C, N = R; g @ W has K = R, N = C
        R, C = (N, K) if transposed else (K, N)
        if C % block(w):
            C = (C + block(w) - 1) // block(w) * block(w)   # g @ W: N must be whole blocks
            N = C
        raw, W = make_weight(w, R, C, seed=i)
        rng = np.random.default_rng(100 + i)
        x = rng.standard_normal((M, K), dtype=np.float32)
        b = W.T if transposed else W
        one = mm_weight(x, raw, w, R, C, transposed)
        check(one, x, b)
        for nt in (2, 3):
            assert np.array_equal(one, mm_weight(x, raw, w, R, C, transposed, nt)), (M, N, K, nt)
        if not (transposed and M <= SMALL_M):   # packed path: exactly the f32 product
            assert np.array_equal(one, mm_f32(x, W, transposed)), (M, N, K)


@pytest.mark.parametrize("w", TYPES)
def test_simd_levels(w):
    """Packed path equals the f32 kernel at each level; the row-dot path gives the same
    bits at every level."""
    raw, W = make_weight(w, 40, 512, seed=7)
    rng = np.random.default_rng(8)
    x_big = rng.standard_normal((37, 512), dtype=np.float32)
    g_big = rng.standard_normal((37, 40), dtype=np.float32)
    x_small = rng.standard_normal((5, 512), dtype=np.float32)
    rows = {}
    for level in LEVELS:
        lib.gt_set_simd_level(level)
        try:
            assert np.array_equal(mm_weight(x_big, raw, w, 40, 512, True, 2), mm_f32(x_big, W, True)), level
            assert np.array_equal(mm_weight(g_big, raw, w, 40, 512, False, 3), mm_f32(g_big, W, False)), level
            rows[level] = mm_weight(x_small, raw, w, 40, 512, True, 2)
        finally:
            lib.gt_set_simd_level(2)
    check(rows[0], x_small, W.T)
    for level in LEVELS:
        assert np.array_equal(rows[0], rows[level]), level


@pytest.mark.parametrize("w", ["f16", "bf16"])
def test_element_types_any_k(w):
    """f16/bf16 weights have no block: K = 1..40 exercises the row-dot path's partial chunk."""
    for K in (1, 5, 16, 17, 40):
        raw, W = make_weight(w, 9, K, seed=K)
        x = np.random.default_rng(K).standard_normal((2, K), dtype=np.float32)
        res = {}
        for level in LEVELS:
            lib.gt_set_simd_level(level)
            try:
                res[level] = mm_weight(x, raw, w, 9, K, True)
            finally:
                lib.gt_set_simd_level(2)
        check(res[0], x, W.T)
        assert all(np.array_equal(res[0], r) for r in res.values()), K


def test_row_dot_bound_and_batch():
    """M = SMALL_M (row dots) and SMALL_M + 1 (packed) both match float64; a batch of
    x folds into M; a transposed x (column stride != 1) is read correctly."""
    raw, W = make_weight("q8_0", 70, 96, seed=3)
    rng = np.random.default_rng(4)
    for M in (SMALL_M, SMALL_M + 1):
        x = rng.standard_normal((M, 96), dtype=np.float32)
        check(mm_weight(x, raw, "q8_0", 70, 96, True, 2), x, W.T)
    xb = rng.standard_normal((2, 3, 96), dtype=np.float32)
    check(mm_weight(xb, raw, "q8_0", 70, 96, True, 2), xb, W.T)
    xt = rng.standard_normal((96, 5), dtype=np.float32).T
    check(mm_weight(xt, raw, "q8_0", 70, 96, True), xt, W.T)


def test_sizes_cover_the_work():
    # the per-thread work grows with K on the row-dot path (a copy of a strided x)
    be = BACKENDS[1]
    from ggtrain.core.backend import KernelCall, TensorRef
    for K in (32, 65536):
        call = KernelCall("matmul_fwd_f32_q8_0", TensorRef(None, 0, "f32", (1, 4), (4, 1)),
                          (TensorRef(None, 0, "f32", (1, K), (K, 1)),
                           TensorRef(None, 0, "q8_0", (K, 4), (1, K))))
        scratch, work = be.kernel_sizes(call)
        assert scratch == 0 and work >= SMALL_M * K * 4
    raw, W = make_weight("q4_0", 4, 64, seed=0)
    x = np.ones((1, 64), np.float32)
    # the CPU's per-thread work, on the CPU whichever backend the op tests take (CUDA passes
    # its shared work buffer, which an earlier test may have grown past what this needs)
    with pytest.raises(ValueError, match="matmul.*scratch"):
        run_kernel("matmul_fwd_f32_q4_0", np.empty((1, 4), np.float32),
                   [x, weight_ref(raw, "q4_0", 4, 64, True)], work_bytes=64, backend=be)


# ---- bad input --------------------------------------------------------------------------

def test_wrong_weight_dtype():
    raw, _ = make_weight("q4_0", 4, 64, seed=0)
    x = np.ones((2, 64), np.float32)
    with pytest.raises(DTypeError, match="matmul.*q8_0.*q4_0"):
        run_kernel("matmul_fwd_f32_q8_0", np.empty((2, 4), np.float32), [x, weight_ref(raw, "q4_0", 4, 64, True)])
    with pytest.raises(DTypeError, match="matmul"):
        run_kernel("matmul_fwd_f32_q4_0", np.empty((2, 4), np.float32),
                   [x.astype(np.float16), weight_ref(raw, "q4_0", 4, 64, True)])


def test_bad_weight_layouts():
    raw, _ = make_weight("q4_0", 8, 64, seed=0)
    x = np.ones((2, 64), np.float32)
    dst = np.empty((2, 4), np.float32)
    # every other row of W: not a whole stored matrix
    with pytest.raises(NativeError, match="matmul.*q4_0.*strides"):
        run_kernel("matmul_fwd_f32_q4_0", dst, [x, (raw, "q4_0", (64, 4), (1, 128))])
    # a 3-D weight
    with pytest.raises(NativeError, match="matmul.*2-D"):
        run_kernel("matmul_fwd_f32_q4_0", np.empty((1, 2, 8), np.float32),
                   [x.reshape(1, 2, 64), (raw, "q4_0", (1, 64, 8), (512, 1, 64))])
    # the stored rows' length is not whole blocks
    with pytest.raises(ShapeError, match="matmul.*multiple of its 32-element blocks"):
        run_kernel("matmul_fwd_f32_q4_0", np.empty((2, 16), np.float32),
                   [np.ones((2, 16), np.float32), (raw, "q4_0", (16, 16), (1, 16))])


def test_graph_rejects_bad_weights():
    g = Graph()
    raw, _ = make_weight("q4_0", 8, 64, seed=0)
    with pytest.raises(DTypeError, match="trainable"):
        g.param((8, 64), raw, trainable=True, dtype="q4_0")
    w = g.param((8, 64), raw, trainable=False, dtype="q4_0")
    x = g.param((3, 8), np.ones((3, 8), np.float32))
    with pytest.raises(ShapeError, match="matmul"):
        ops.matmul(x, ops.reshape(w, (2, 4, 64)))


# ---- get_rows -----------------------------------------------------------------------------

@pytest.mark.parametrize("w", TYPES)
def test_get_rows(w):
    C = 2 * max(block(w), 32)
    raw, W = make_weight(w, 11, C, seed=5)
    idx = np.array([[3, 0, 10], [10, 7, 3]], np.int32)
    for nt in (1, 2):
        dst = np.full((2, 3, C), np.nan, np.float32)
        run_kernel(f"get_rows_fwd_f32_{w}", dst, [(raw, w, (11, C), (C, 1)), idx], n_threads=nt,
                   backend=BACKENDS[nt])
        assert np.array_equal(dst, W[idx])


def test_get_rows_bad_input():
    raw, _ = make_weight("q8_0", 11, 64, seed=0)
    with pytest.raises(ValueError, match="get_rows.*idx.*11"):
        run_kernel("get_rows_fwd_f32_q8_0", np.empty((2, 64), np.float32),
                   [(raw, "q8_0", (11, 64), (64, 1)), np.array([1, 11], np.int32)])
    with pytest.raises(NativeError, match="get_rows.*q8_0.*whole stored matrix"):
        run_kernel("get_rows_fwd_f32_q8_0", np.empty((2, 64), np.float32),
                   [(raw, "q8_0", (5, 64), (128, 1)), np.array([1, 2], np.int32)])
    with pytest.raises(DTypeError, match="get_rows.*q8_0.*q4_0"):
        run_kernel("get_rows_fwd_f32_q8_0", np.empty((2, 64), np.float32),
                   [(raw, "q4_0", (11, 64), (64, 1)), np.array([1, 2], np.int32)])


# ---- through the graph ----------------------------------------------------------------------

@pytest.mark.parametrize("w", ["q4_0", "q6_k", "f16"])
@pytest.mark.parametrize("M", [3, 40], ids=["rows", "packed"])
def test_graph_linear_forward_and_input_gradient(w, M):
    """y = linear(x, W) with W frozen in its stored type; loss = sum(y * R). Forward
    against numpy, dL/dx (g @ W through the plain view) against float64 finite differences."""
    N, K = 33, 2 * max(block(w), 32)
    raw, W = make_weight(w, N, K, seed=11)
    rng = np.random.default_rng(12)
    x0 = rng.standard_normal((M, K), dtype=np.float32)
    R = rng.uniform(0.5, 1.5, (M, N)) * rng.choice([-1, 1], (M, N))
    g = Graph()
    wt = g.param((N, K), W if w == "f16" else raw, trainable=False, dtype=w, name="w")
    x = g.param((M, K), x0, name="x")
    y = ops.linear(x, wt)
    loss = ops.sum(ops.mul(y, g.const(R)))
    grads = backward(loss, [x], checkpointing=False)
    rt = Runtime(g, BACKENDS[2])
    plan = rt.compile([y, grads[x]])
    rt.run(plan)
    check(plan.read(y), x0, W.T)
    W64 = W.astype(np.float64)
    # central differences of the float64 loss, one element of x at a time; the loss is a
    # sum over rows of x, so only row i's term changes when x[i, j] does: the K
    # perturbations of a row are evaluated as one (K, K) @ W.T product
    h, eye = 1e-6, np.eye(K)
    numeric = np.zeros((M, K))
    for i in range(M):
        xi = x0[i].astype(np.float64)
        fp = ((xi + h * eye) @ W64.T) @ R[i]
        fm = ((xi - h * eye) @ W64.T) @ R[i]
        numeric[i] = (fp - fm) / (2 * h)
    np.testing.assert_allclose(plan.read(grads[x]), numeric, rtol=1e-4, atol=1e-4 * max(1.0, np.abs(W).max()))


def test_graph_get_rows_q8_0():
    raw, W = make_weight("q8_0", 50, 64, seed=13)
    g = Graph()
    table = g.param((50, 64), raw, trainable=False, dtype="q8_0")
    idx = g.const(np.array([[0, 49, 7], [7, 7, 1]], np.int32), dtype="i32")
    out = ops.get_rows(table, idx)
    rt = Runtime(g, BACKENDS[2])
    plan = rt.compile([out])
    rt.run(plan)
    assert np.array_equal(plan.read(out), W[[[0, 49, 7], [7, 7, 1]]])
