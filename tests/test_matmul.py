"""Tests of the CPU matmul kernel (gt_matmul_fwd_f32) against numpy in float64."""
import numpy as np
import pytest

from ggtrain.core.backend_cpu import CpuBackend
from ggtrain.core.backend_kernel import run_kernel
from ggtrain.errors import DTypeError, ShapeError
from ggtrain.native import lib

FEATURES = lib.gt_cpu_features()
LEVELS = [0] + ([1] if FEATURES & 1 else []) + ([2] if FEATURES & 2 else [])


def mm(a, b, n_threads=1, out_shape=None):
    """Run the kernel on numpy arrays (views are passed with their strides)."""
    shape = out_shape or np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
    dst = np.full(shape, np.nan, dtype=np.float32)
    return run_kernel("matmul_fwd_f32", dst, [a, b], n_threads=n_threads)


def check(got, a, b):
    """Compare with numpy's float64 product.

    Each output is a length-K f32 dot product accumulated in order. With O(1)
    random inputs its value is O(sqrt(K)), and the rounding errors (about
    2^-24 of the running sum per step) add up like a random walk to roughly
    2^-24 * K in absolute terms. So rtol 1e-4 on the value plus an atol that
    grows like sqrt(K) (1e-5 per unit of sqrt(K), x4 margin) is tight enough to
    catch a wrong index or a missing k (errors of order 1) without flaking on
    K = 784.
    """
    ref = a.astype(np.float64) @ b.astype(np.float64)
    k = a.shape[-1]
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=4e-5 * max(1.0, np.sqrt(k)))


def operand(rng, rows, cols, transposed):
    """A (rows, cols) f32 operand, as a transposed view of a (cols, rows) array if asked."""
    if transposed:
        return rng.standard_normal((cols, rows), dtype=np.float32).T
    return rng.standard_normal((rows, cols), dtype=np.float32)


SHAPES = [(1, 1, 1), (1, 7, 3), (3, 1, 7), (7, 3, 1), (1, 257, 33), (33, 257, 65),
          (257, 33, 3), (3, 257, 257), (13, 300, 1030), (500, 784, 37)]
LAYOUTS = ["A.B", "At.B", "A.Bt", "At.Bt"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mkn", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_shapes_and_layouts(mkn, layout):
    m, k, n = mkn
    rng = np.random.default_rng(m * 10007 + k * 101 + n)
    a = operand(rng, m, k, layout.startswith("At"))
    b = operand(rng, k, n, layout.endswith("Bt"))
    check(mm(a, b), a, b)


@pytest.mark.parametrize("which", ["A", "At", "B"])
def test_packed_and_in_place_operands_give_the_same_bits(which):
    """The packed path reads a plain A (AVX-512) in place unless its rows are a multiple of
    16 KiB apart (they would crowd a few cache sets), a plain B in place only when its
    rows are less than a page (1024 floats) apart, and always packs a transposed A. The
    same values 4096 floats (16 KiB) or 1100 floats apart give the products of a
    contiguous copy, bit for bit, on one thread and two (N = 150: not the skinny path)."""
    rng = np.random.default_rng(21)
    m, k, n = 37, 300, 150
    rows = {"A": m, "At": k, "B": k}[which]
    cols = {"A": k, "At": m, "B": n}[which]
    other = rng.standard_normal((m, k) if which == "B" else (k, n), dtype=np.float32)
    dense = rng.standard_normal((rows, cols), dtype=np.float32)
    variants = [dense]
    for stride in (4096, 1100):
        wide = np.zeros((rows, stride), np.float32)
        wide[:, :cols] = dense
        variants.append(wide[:, :cols])
    if which == "At":
        variants = [v.T for v in variants]
    for nt in (1, 2):
        if which == "B":
            got = [mm(other, v, n_threads=nt) for v in variants]
            check(got[0], other, variants[0])
        else:
            got = [mm(v, other, n_threads=nt) for v in variants]
            check(got[0], variants[0], other)
        for g in got[1:]:
            assert np.array_equal(g, got[0])


def test_large_square_two_threads():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((300, 520), dtype=np.float32)  # K crosses the 256-deep K blocks
    b = rng.standard_normal((520, 1100), dtype=np.float32)  # N crosses the 1024-wide panels
    check(mm(a, b, n_threads=2), a, b)


@pytest.mark.parametrize("mkn", [(0, 5, 4), (4, 5, 0), (0, 0, 0)])
def test_empty(mkn):
    m, k, n = mkn
    a = np.ones((m, k), np.float32)
    b = np.ones((k, n), np.float32)
    assert mm(a, b).shape == (m, n)


@pytest.mark.parametrize("n_threads", [1, 2])
def test_k_zero_gives_zeros(n_threads):
    a = np.ones((3, 0), np.float32)
    b = np.ones((0, 5), np.float32)
    got = mm(a, b, n_threads=n_threads)
    assert np.array_equal(got, np.zeros((3, 5), np.float32))


BATCHES = [
    ((2, 3, 7, 5), (1, 3, 5, 9)),     # size-1 batch dim of src1 reused
    ((5, 7, 33), (33, 9)),            # src1 without batch dims (folded into M)
    ((5, 1, 7, 33), (33, 9)),
    ((7, 33), (4, 33, 9)),            # src0 broadcast
    ((2, 1, 6, 4), (3, 4, 10)),       # both broadcast: (2, 3, 6, 10)
    ((1, 2, 1, 2, 3, 4), (2, 1, 2, 1, 4, 5)),   # 4 batch dims
    ((64, 16, 8), (64, 8, 16)),       # attention-like: many small matrices
]


@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("shapes", BATCHES, ids=str)
def test_batch_broadcast(shapes, n_threads):
    rng = np.random.default_rng(len(shapes[0]) * 7 + shapes[0][-1])
    a = rng.standard_normal(shapes[0], dtype=np.float32)
    b = rng.standard_normal(shapes[1], dtype=np.float32)
    check(mm(a, b, n_threads=n_threads), a, b)


def test_batch_transposed_views():
    rng = np.random.default_rng(3)
    a = rng.standard_normal((4, 33, 13), dtype=np.float32).transpose(0, 2, 1)  # (4, 13, 33)
    b = rng.standard_normal((1, 21, 33), dtype=np.float32).transpose(0, 2, 1)  # (1, 33, 21)
    check(mm(a, b, n_threads=2), a, b)


def test_size1_batch_with_odd_stride():
    rng = np.random.default_rng(4)
    a = rng.standard_normal((3, 9, 5), dtype=np.float32)
    base = rng.standard_normal((2, 5, 6), dtype=np.float32)
    b = np.lib.stride_tricks.as_strided(base, shape=(1, 5, 6), strides=(12345 * 4, 24, 4))
    check(mm(a, b), a, b)


def test_strided_slices():
    rng = np.random.default_rng(5)
    big_a = rng.standard_normal((80, 300), dtype=np.float32)
    big_b = rng.standard_normal((300, 90), dtype=np.float32)
    a = big_a[3:40, 7:264]          # (37, 257), row stride 300
    b = big_b[11:268, 5:76]         # (257, 71), row stride 90
    check(mm(a, b, n_threads=2), a, b)
    big_c = rng.standard_normal((300, 80), dtype=np.float32)
    at = big_c[7:264, 3:40].T       # (37, 257), transposed slice: column stride 80
    bt = big_a[3:40, 7:264].T       # (257, 37), row stride 1, column stride 300
    check(mm(at, bt, n_threads=2), at, bt)
    batched = rng.standard_normal((6, 20, 40), dtype=np.float32)[::2, 1:18, 3:36]  # batch stride 1600
    check(mm(batched, b[:33, :9]), batched, b[:33, :9])


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_simd_levels(level, layout):
    rng = np.random.default_rng(6)
    a = operand(rng, 37, 259, layout.startswith("At"))
    b = operand(rng, 259, 45, layout.endswith("Bt"))
    lib.gt_set_simd_level(level)
    try:
        got1 = mm(a, b)
        got2 = mm(a, b, n_threads=2)
    finally:
        lib.gt_set_simd_level(2)
    check(got1, a, b)
    assert np.array_equal(got1, got2)



@pytest.mark.skipif(not FEATURES & 2, reason="needs AVX-512F")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_path_in_place_operands(layout):
    # N > 80 takes the packed path, which reads a plain B's full panels and a transposed
    # A's full tiles where they lie and packs only the edges (N = 150: a 22- or 6-wide
    # tail panel; M = 31: an edge tile; K = 300: two K slices). Every SIMD level and
    # thread count gives the same bits (one FMA chain per element), all close to float64.
    # (N > M: threads split N.)
    rng = np.random.default_rng(8)
    a = operand(rng, 31, 300, layout.startswith("At"))
    b = operand(rng, 300, 150, layout.endswith("Bt"))
    got = {}
    for level in (1, 2):
        lib.gt_set_simd_level(level)
        try:
            for t in (1, 2, 3, 5):   # row or column splits at tile multiples, uneven shares
                got[level, t] = mm(a, b, n_threads=t)
        finally:
            lib.gt_set_simd_level(2)
    check(got[2, 1], a, b)
    for key, value in got.items():
        assert np.array_equal(value, got[2, 1]), key

@pytest.mark.skipif(not FEATURES & 2, reason="needs AVX-512F")
def test_avx2_and_avx512_agree_bitwise():
    # Both compute each element as the same in-order FMA chain over k.
    rng = np.random.default_rng(7)
    a = rng.standard_normal((29, 300), dtype=np.float32)
    b = rng.standard_normal((300, 70), dtype=np.float32).T.copy().T
    lib.gt_set_simd_level(1)
    try:
        avx2 = mm(a, b)
    finally:
        lib.gt_set_simd_level(2)
    assert np.array_equal(avx2, mm(a, b))


@pytest.mark.parametrize("shapes", [((500, 300), (300, 100)), ((100, 300), (300, 500)),
                                    ((3, 200, 70), (70, 150)), ((3, 40, 70), (3, 70, 150)),
                                    ((9, 12, 16), (9, 16, 12))], ids=str)
def test_threads_bit_identical(shapes):
    rng = np.random.default_rng(8)
    a = rng.standard_normal(shapes[0], dtype=np.float32)
    b = rng.standard_normal(shapes[1], dtype=np.float32)
    one = mm(a, b, n_threads=1)
    assert np.array_equal(one, mm(a, b, n_threads=2))
    assert np.array_equal(one, mm(a, b, n_threads=1))


def test_bad_k():
    with pytest.raises(ShapeError, match="matmul"):
        mm(np.ones((3, 4), np.float32), np.ones((5, 2), np.float32), out_shape=(3, 2))


def test_bad_batch():
    with pytest.raises(ShapeError, match="matmul"):
        mm(np.ones((2, 3, 4), np.float32), np.ones((3, 4, 2), np.float32), out_shape=(2, 3, 2))


def test_bad_dst_shape():
    with pytest.raises(ShapeError, match="matmul"):
        mm(np.ones((3, 4), np.float32), np.ones((4, 2), np.float32), out_shape=(3, 3))


def test_bad_dtype():
    with pytest.raises(DTypeError, match="matmul"):
        mm(np.ones((3, 4), np.float16), np.ones((4, 2), np.float32), out_shape=(3, 2))


def test_no_unit_stride():
    a = np.ones((6, 8), np.float32)[::2, ::2]  # strides (16, 2) elements
    with pytest.raises(ValueError, match="matmul.*stride"):
        mm(a, np.ones((4, 2), np.float32))


def test_missing_scratch():
    # the packing scratch is the CPU kernel's (the CUDA one calls cuBLAS and needs none)
    dst = np.empty((3, 2), np.float32)
    with pytest.raises(ValueError, match="matmul.*scratch"):
        run_kernel("matmul_fwd_f32", dst, [np.ones((3, 4), np.float32), np.ones((4, 2), np.float32)],
                   work_bytes=64, backend=CpuBackend(1))


# ---- skinny path (N <= 80 at AVX-512, <= 32 at AVX2, <= 8 ymm at either) ----------

def at_levels(fn):
    """fn() at every SIMD level this CPU has, as {level: result}."""
    out = {}
    for level in LEVELS:
        lib.gt_set_simd_level(level)
        try:
            out[level] = fn()
        finally:
            lib.gt_set_simd_level(2)
    return out


# The CNN's products (MNIST, 2 x 500 images) at reduced K or M: conv1 weight grad,
# conv2 weight grad, conv2 forward, conv2 input grad, conv1 forward.
CNN_SKINNY = [(9, 40000, 8, "At.B"), (72, 40000, 16, "At.B"), (5000, 72, 16, "A.Bt"),
              (5000, 16, 72, "A.B"), (20000, 9, 8, "A.Bt")]


@pytest.mark.parametrize("mknl", CNN_SKINNY, ids=lambda s: "x".join(map(str, s[:3])) + s[3])
def test_skinny_cnn_shapes(mknl):
    m, k, n, layout = mknl
    rng = np.random.default_rng(m + k + n)
    a = operand(rng, m, k, layout.startswith("At"))
    b = operand(rng, k, n, layout.endswith("Bt"))
    res = at_levels(lambda: [mm(a, b, n_threads=t) for t in (1, 2, 3)])
    for level, (one, two, three) in res.items():
        check(one, a, b)
        assert np.array_equal(one, two), level
        assert np.array_equal(one, three), level
    if 1 in res and 2 in res:  # same FMA chain per element on both
        assert np.array_equal(res[1][0], res[2][0])


# every vector count and tail width; row counts giving every kind of edge tile
# (MR = 12, 8, 6, 5, 3); K crossing the 256-deep slices
SKINNY_N = [1, 8, 9, 16, 17, 31, 33, 48, 63, 65, 79, 80, 81]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", SKINNY_N)
def test_skinny_widths(n, layout):
    rng = np.random.default_rng(n * 4 + len(layout))
    for m in (1, 5, 7, 11, 12, 13, 29):
        k = 300 if m in (7, 29) else 5
        a = operand(rng, m, k, layout.startswith("At"))
        b = operand(rng, k, n, layout.endswith("Bt"))
        res = at_levels(lambda: (mm(a, b), mm(a, b, n_threads=3) if m in (13, 29) else None))
        for level, (one, three) in res.items():
            check(one, a, b)
            assert three is None or np.array_equal(one, three), (m, level)
        if 1 in res and 2 in res:
            assert np.array_equal(res[1][0], res[2][0]), m


def test_skinny_strided_rows_and_k1():
    rng = np.random.default_rng(9)
    big = rng.standard_normal((700, 300), dtype=np.float32)
    a = big[5:605, 3:263]             # (600, 260), row stride 300
    b = big[11:271, 100:123]          # (260, 23), row stride 300: read in place
    check(mm(a, b, n_threads=2), a, b)
    bt = big[40:63, 7:267].T          # (260, 23), column stride 300: copied per slice
    check(mm(a, bt, n_threads=2), a, bt)
    a1 = rng.standard_normal((50, 1), dtype=np.float32)
    b1 = rng.standard_normal((1, 40), dtype=np.float32)
    check(mm(a1, b1), a1, b1)


def test_skinny_nonfinite_stays_in_its_row():
    # masked tail lanes compute inf * 0 = nan but are never stored
    rng = np.random.default_rng(10)
    a = rng.standard_normal((30, 20), dtype=np.float32)
    b = rng.standard_normal((20, 19), dtype=np.float32)
    a[4, 3] = np.inf
    for level, got in at_levels(lambda: mm(a, b)).items():
        assert not np.isfinite(got[4]).all(), level
        rows = np.arange(30) != 4
        check(got[rows], a[rows], b)


def test_skinny_batched():
    rng = np.random.default_rng(11)
    a = rng.standard_normal((6, 37, 50), dtype=np.float32)
    b = rng.standard_normal((6, 50, 24), dtype=np.float32)
    for threads in (1, 2, 4):
        check(mm(a, b, n_threads=threads), a, b)
    bt = rng.standard_normal((1, 24, 50), dtype=np.float32).transpose(0, 2, 1)
    assert np.array_equal(mm(a, bt, n_threads=1), mm(a, bt, n_threads=3))
