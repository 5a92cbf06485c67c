"""Direct tests of the fused CPU kernels (norm, softmax, cross_entropy, rope,
dropout, get_rows, im2col, max_pool2d) against the float64 references in tests/refs.py,
plus finite-difference checks of the references' backward functions."""
from __future__ import annotations

import numpy as np
import pytest

from ggtrain.core.backend_kernel import run_kernel
from ggtrain.errors import DTypeError, GgtrainError, NativeError, ShapeError

from tests import refs

RTOL, ATOL = 1e-4, 1e-5


def f32(rng, *shape, lo=-1.0, hi=1.0):
    return rng.uniform(lo, hi, size=shape).astype(np.float32)


def run(kernel, out_shape, srcs, ip=(), fp=(), n_threads=1, scratch_bytes=None):
    """Run one kernel into a NaN-filled dst, so unwritten elements show (scratch: what
    the kernel asks for unless given)."""
    dst = np.full(out_shape, np.nan, dtype=np.float32)
    return run_kernel(kernel, dst, list(srcs), ip=ip, fp=fp, n_threads=n_threads,
                      scratch_bytes=scratch_bytes)


def close(got, want, rtol=RTOL, atol=ATOL):
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


# ---- rms_norm ------------------------------------------------------------------

RMS_SHAPES = [(1,), (3,), (1, 1), (3, 7), (2, 1, 33), (4, 257), (2, 3, 64)]


@pytest.mark.parametrize("shape", RMS_SHAPES)
def test_rms_norm(shape):
    rng = np.random.default_rng(1)
    x, g = f32(rng, *shape), f32(rng, *shape)
    eps = 1e-5
    close(run("rms_norm_fwd_f32", shape, [x], fp=(eps,)), refs.rms_norm(x, eps))
    close(run("rms_norm_bwd_f32", shape, [x, g], fp=(eps,)), refs.rms_norm_bwd(x, g, eps))


# ---- softmax ---------------------------------------------------------------------

SOFTMAX_CASES = [  # shape (..., T_q, T_k), scale, causal
    ((1, 1), 1.0, False),
    ((3, 7), 0.5, False),
    ((2, 5, 257), 1.0, False),
    ((4, 33), -0.7, False),
    ((1, 1), 1.0, True),
    ((7, 7), 0.125, True),
    ((2, 3, 5, 9), 1.0, True),    # T_q < T_k: row i sees j <= i + 4
    ((3, 17, 33), 0.3, True),
    ((6, 3), 1.0, True),          # T_q > T_k: the first 3 rows see nothing (all 0)
]


@pytest.mark.parametrize("shape,scale,causal", SOFTMAX_CASES)
def test_softmax(shape, scale, causal):
    rng = np.random.default_rng(2)
    x, g = f32(rng, *shape, lo=-4, hi=4), f32(rng, *shape)
    y = run("softmax_fwd_f32", shape, [x], ip=(int(causal),), fp=(scale,))
    want = refs.softmax(x, scale, causal)
    close(y, want)
    if causal:  # masked entries are exactly 0
        assert np.all(y[want == 0] == 0)
    dx = run("softmax_bwd_f32", shape, [y, g], fp=(scale,))
    close(dx, refs.softmax_bwd(want, g, scale))


SEG_CASES = [  # x shape (B, ..., T, T), seg rows (B, T)
    ((1, 1, 1), [[0]]),
    ((1, 2, 5, 5), [[0, 0, 1, 1, 1]]),
    # one row: 3 samples then padding (seg -1, which attends to earlier padding only)
    ((2, 3, 9, 9), [[0, 0, 0, 1, 1, 2, 2, 2, -1], [0, 0, 0, 0, 0, 0, 1, 1, 1]]),
    ((2, 33, 33), [[0] * 20 + [1] * 13, [0] * 5 + [1] * 17 + [2] * 9 + [-1] * 2]),   # runs over 16 lanes
    ((3, 1, 4, 4), [[0, 1, 2, 3], [-1, -1, -1, -1], [5, 5, 7, 7]]),      # 1-token samples, any ids
    ((1, 2, 7, 7), [[0, 1, 0, 1, 1, 0, 2]]),                              # a segment that comes back
]


@pytest.mark.parametrize("shape,seg", SEG_CASES)
def test_softmax_seg(shape, seg):
    rng = np.random.default_rng(15)
    seg = np.array(seg, dtype=np.int32)
    x, g = f32(rng, *shape, lo=-4, hi=4), f32(rng, *shape)
    y = run("softmax_fwd_f32", shape, [x, seg], ip=(3,), fp=(0.8,))
    want = refs.softmax(x, 0.8, seg=seg)
    close(y, want)
    assert np.all(y[want == 0] == 0)          # masked entries exactly 0
    close(y.sum(-1), 1.0)                     # every row sees at least its own token
    for n in (2, 3):
        assert np.array_equal(y, run("softmax_fwd_f32", shape, [x, seg], ip=(3,), fp=(0.8,), n_threads=n))
    dx = run("softmax_bwd_f32", shape, [y, g], fp=(0.8,))
    close(dx, refs.softmax_bwd(want, g, 0.8))


def test_softmax_seg_sample_as_if_alone():
    """A packed sample's rows equal the same sample alone at the start of a row: the kernel
    reads the run [start, i] as the causal kernel reads [0, i] (bit for bit)."""
    rng = np.random.default_rng(16)
    t, n0, n1 = 37, 11, 21
    x = f32(rng, 1, 2, t, t, lo=-4, hi=4)
    seg = np.array([[0] * n0 + [1] * n1 + [-1] * (t - n0 - n1)], np.int32)
    packed = run("softmax_fwd_f32", x.shape, [x, seg], ip=(3,), fp=(0.5,))
    alone_x = np.ascontiguousarray(x[:, :, n0:n0 + n1, n0:n0 + n1])
    alone = run("softmax_fwd_f32", alone_x.shape, [alone_x], ip=(1,), fp=(0.5,))
    assert np.array_equal(packed[:, :, n0:n0 + n1, n0:n0 + n1], alone)
    assert np.all(packed[:, :, n0:n0 + n1, :n0] == 0) and np.all(packed[:, :, n0:n0 + n1, n0 + n1:] == 0)


def test_softmax_large_inputs():
    """Row max subtracted: huge logits neither overflow nor lose the small ones."""
    rng = np.random.default_rng(3)
    x = (f32(rng, 4, 100) * 200 + 1000).astype(np.float32)
    close(run("softmax_fwd_f32", x.shape, [x], ip=(0,), fp=(1.0,)), refs.softmax(x))
    x = f32(rng, 2, 300, lo=-100, hi=100)   # exp arguments down to about -200: flush to 0
    close(run("softmax_fwd_f32", x.shape, [x], ip=(0,), fp=(1.0,)), refs.softmax(x))


def test_shared_exp_error_bound():
    """Softmax, silu, GELU's tanh and attention share one exp (elementmath.h gt_expf_, Cephes'
    reduction and polynomial in fused multiply-adds): its stated bound is 1.0 ulp. Softmax of a row (0, x) with
    x < -16.7 returns that exp exactly (1 + exp(x) rounds to 1), so its second column is
    gt_expf_(x); the arguments from -87.3 (the smallest normal result) to -16.7 take every
    reduced argument r in [-ln2/2, ln2/2] many times, and 2^n scales exactly."""
    xs = np.linspace(-87.3, -16.7, 200_003).astype(np.float32)
    rows = np.stack([np.zeros_like(xs), xs], axis=1)
    got = run("softmax_fwd_f32", rows.shape, [rows], ip=(0,), fp=(1.0,))
    assert np.all(got[:, 0] == 1.0)
    want = np.exp(xs.astype(np.float64))
    ulp = np.spacing(want.astype(np.float32)).astype(np.float64)
    err = np.abs(got[:, 1] - want) / ulp
    assert err.max() <= 1.0, f"gt_expf_ is {err.max():.2f} ulp off at x = {xs[err.argmax()]}"
    assert np.mean(got[:, 1] == want.astype(np.float32)) > 0.9    # most results correctly rounded


# ---- cross_entropy ------------------------------------------------------------------

def ce_run(logits, targets, count=0, n_threads=1, g=None):
    loss = run("cross_entropy_fwd_f32", (), [logits, targets], ip=(count,), n_threads=n_threads)
    if g is None:
        return loss
    return loss, run("cross_entropy_bwd_f32", logits.shape, [logits, targets, g], ip=(count,),
                     n_threads=n_threads)


@pytest.mark.parametrize("n,v", [(1, 1), (1, 7), (3, 33), (7, 257), (33, 3), (5, 1000)])
def test_cross_entropy(n, v):
    rng = np.random.default_rng(4)
    logits = f32(rng, n, v, lo=-5, hi=5)
    targets = rng.integers(0, v, size=n).astype(np.int32)
    g = np.array(rng.uniform(0.5, 2.0), dtype=np.float32)
    loss, dl = ce_run(logits, targets, g=g)
    close(loss, refs.cross_entropy(logits, targets))
    close(dl, refs.cross_entropy_bwd(logits, targets, g))


def test_cross_entropy_ignored_rows():
    rng = np.random.default_rng(5)
    logits = f32(rng, 9, 33, lo=-3, hi=3)
    targets = np.array([3, -1, 0, 32, -100, 5, -1, 7, 1], dtype=np.int32)
    g = np.array(1.7, dtype=np.float32)
    loss, dl = ce_run(logits, targets, g=g)
    close(loss, refs.cross_entropy(logits, targets))
    close(dl, refs.cross_entropy_bwd(logits, targets, g))
    assert np.all(dl[targets < 0] == 0)
    # an explicit count (ip[0] = 6, the number kept) gives the same; another count rescales
    loss6, dl6 = ce_run(logits, targets, count=6, g=g)
    assert loss6 == loss and np.array_equal(dl6, dl)
    loss12, dl12 = ce_run(logits, targets, count=12, g=g)
    close(loss12, refs.cross_entropy(logits, targets) / 2)
    close(dl12, refs.cross_entropy_bwd(logits, targets, g) / 2)
    # every row ignored: loss 0 and zero gradient, not NaN
    none = np.full(9, -1, dtype=np.int32)
    loss0, dl0 = ce_run(logits, none, g=g)
    assert loss0 == 0 and np.all(dl0 == 0)


# ---- rope ----------------------------------------------------------------------------

ROPE_CASES = [  # x shape (..., T, H, D), n_dims, max position
    ((1, 1, 2), 2, 10),
    ((3, 1, 8), 8, 10),
    ((2, 7, 3, 16), 16, 100),
    ((5, 2, 12), 8, 100),          # dims 8..11 pass through
    ((2, 33, 1, 6), 4, 2048),
    ((1, 2, 3, 7, 2, 64), 64, 2048),
    ((4, 2, 1040), 1040, 2048),    # more pairs than the on-stack cos/sin cache (256)
]


@pytest.mark.parametrize("shape,n_dims,max_pos", ROPE_CASES)
def test_rope(shape, n_dims, max_pos):
    rng = np.random.default_rng(6)
    x, g = f32(rng, *shape), f32(rng, *shape)
    t = shape[-3]
    pos = rng.integers(0, max_pos + 1, size=t).astype(np.int32)
    pos[-1] = max_pos
    base = 10000.0
    close(run("rope_fwd_f32", shape, [x, pos], ip=(n_dims,), fp=(base, 1.0, 1.0)), refs.rope(x, pos, n_dims, base))
    close(run("rope_bwd_f32", shape, [g, pos], ip=(n_dims,), fp=(base, 1.0, 1.0)), refs.rope_bwd(g, pos, n_dims, base))


ROPE_ROW_CASES = [  # x shape (..., T, H, D) with positions of shape (..., T), n_dims
    ((1, 1, 1, 2), 2),
    ((3, 7, 2, 16), 16),
    ((2, 9, 3, 12), 8),
    ((2, 3, 5, 1, 6), 4),          # two leading dims
    ((2, 4, 2, 1040), 1040),       # more pairs than the on-stack cos/sin cache
]


@pytest.mark.parametrize("shape,n_dims", ROPE_ROW_CASES)
def test_rope_per_row(shape, n_dims):
    rng = np.random.default_rng(17)
    x, g = f32(rng, *shape), f32(rng, *shape)
    pos = rng.integers(0, 2049, size=shape[:-2]).astype(np.int32)
    pos.reshape(-1, shape[-3])[:, 0] = 0   # packed rows restart at 0 somewhere
    base = 10000.0
    y = run("rope_fwd_f32", shape, [x, pos], ip=(n_dims,), fp=(base, 1.0, 1.0))
    close(y, refs.rope(x, pos, n_dims, base))
    close(run("rope_bwd_f32", shape, [g, pos], ip=(n_dims,), fp=(base, 1.0, 1.0)), refs.rope_bwd(g, pos, n_dims, base))
    for n in (2, 3):
        assert np.array_equal(y, run("rope_fwd_f32", shape, [x, pos], ip=(n_dims,), fp=(base, 1.0, 1.0), n_threads=n))


def test_rope_per_row_equals_shared_rows():
    """Per-row positions give, row by row, what the shared (T,) positions give (bit for bit)."""
    rng = np.random.default_rng(18)
    x = f32(rng, 3, 6, 2, 8)
    pos = np.array([[0, 1, 2, 3, 4, 5], [0, 1, 0, 1, 2, 3], [7, 7, 7, 0, 100, 2]], np.int32)
    y = run("rope_fwd_f32", x.shape, [x, pos], ip=(8,), fp=(10000.0, 1.0, 1.0))
    for b in range(3):
        xb = np.ascontiguousarray(x[b:b + 1])
        assert np.array_equal(y[b:b + 1], run("rope_fwd_f32", xb.shape, [xb, pos[b]], ip=(8,), fp=(10000.0, 1.0, 1.0)))


# ---- dropout -------------------------------------------------------------------------------

def dropout_run(x, p, seed, salt, n_threads=1):
    return run("dropout_fwd_f32", x.shape, [x, np.array(seed, np.int32)], ip=(salt,), fp=(p,),
               n_threads=n_threads)


def test_murmur3_reference_vectors():
    """refs.murmur3_32 (the dropout hash, written from its definition) against published
    MurmurHash3_x86_32 values (SMHasher's verification set as commonly quoted; the 12-byte
    key checked with the mmh3 package)."""
    vectors = [(b"", 0, 0), (b"", 1, 0x514E28B7), (b"", 0xFFFFFFFF, 0x81F16F39),
               (b"\0\0\0\0", 0, 0x2362F9DE), (b"test", 0, 0xBA6BD213), (b"aaaa", 0x9747B28C, 0x5A97808A),
               (b"abcd", 0x9747B28C, 0xF0478627), (bytes(range(12)), 0x12345678, 0x756F0F7F)]
    for key, seed, want in vectors:
        words = np.frombuffer(key, dtype="<u4").reshape(1, -1)
        assert int(refs.murmur3_32(words, seed)[0]) == want, key


@pytest.mark.parametrize("shape,p", [((1,), 0.5), ((3, 7), 0.1), ((2, 33, 17), 0.5), ((1000, 257), 0.9)])
def test_dropout_mask_and_scale(shape, p):
    rng = np.random.default_rng(19)
    x = f32(rng, *shape, lo=0.5, hi=2.0)      # no zeros: y == 0 means dropped
    y = dropout_run(x, p, 77, 3)
    keep = refs.dropout_keep(shape, p, 77, 3)
    assert np.array_equal(y != 0, keep)       # the kernel's hash is the reference's
    s = refs.dropout_scale(p)
    assert np.array_equal(y[keep], x[keep] * s)   # exact: one float multiply
    assert np.all(y[~keep] == 0)
    close(y, refs.dropout(x, p, 77, 3))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_kept_fraction(p):
    """Over 2^20 elements the kept count lies within 5 binomial standard deviations of
    n (1 - p), also in each quarter (low and high indices) and in every other element."""
    n = 1 << 20
    y = dropout_run(np.ones(n, np.float32), p, 2024, 1)
    for part in (y, y[: n // 4], y[-n // 4:], y[::2], y[1::2]):
        k, m = np.count_nonzero(part), part.size
        assert abs(k - m * (1 - p)) <= 5 * np.sqrt(m * p * (1 - p)), (p, k, m)


def test_dropout_same_and_different_masks():
    x = np.ones((64, 65), np.float32)
    base = dropout_run(x, 0.5, 5, 1) != 0
    assert np.array_equal(base, dropout_run(x, 0.5, 5, 1) != 0)
    n = x.size
    for other in (dropout_run(x, 0.5, 5, 2), dropout_run(x, 0.5, 6, 1), dropout_run(x, 0.5, -5, 1)):
        agree = np.count_nonzero(base == (other != 0))
        # independent masks agree on about half the elements
        assert abs(agree - n / 2) <= 5 * np.sqrt(n / 4)
    # a smaller p keeps a superset (the same hash, a lower threshold)
    assert np.all(dropout_run(x, 0.2, 5, 1)[base] != 0)


def test_dropout_p0_is_identity_and_threads_bit_identical():
    rng = np.random.default_rng(20)
    x = f32(rng, 37, 129)
    assert np.array_equal(dropout_run(x, 0.0, 1, 1), x)
    one = dropout_run(x, 0.3, 11, 4)
    for n in (2, 3, 4):
        assert np.array_equal(one, dropout_run(x, 0.3, 11, 4, n_threads=n))


# ---- get_rows --------------------------------------------------------------------------

@pytest.mark.parametrize("v,c,idx_shape", [(1, 1, (1,)), (5, 3, (7,)), (33, 17, (2, 3)),
                                            (7, 257, (3, 1, 4)), (257, 33, (33,))])
def test_get_rows(v, c, idx_shape):
    rng = np.random.default_rng(7)
    table = f32(rng, v, c)
    idx = rng.integers(0, v, size=idx_shape).astype(np.int32)
    idx.reshape(-1)[0] = idx.reshape(-1)[-1]   # at least one repeated index
    close(run("get_rows_fwd_f32", idx_shape + (c,), [table, idx]), refs.get_rows(table, idx))
    g = f32(rng, *idx_shape, c)
    close(run("get_rows_bwd_f32", (v, c), [g, idx]), refs.get_rows_bwd(g, idx, v))


def test_get_rows_strided_table():
    rng = np.random.default_rng(8)
    big = f32(rng, 6, 10)
    table = big[:, 2:7]            # rows of stride 10, columns contiguous
    idx = np.array([5, 0, 5, 2], dtype=np.int32)
    close(run("get_rows_fwd_f32", (4, 5), [table, idx]), refs.get_rows(table, idx))


# ---- im2col --------------------------------------------------------------------------

IM2COL_CASES = [  # x shape (N, H, W, C), (KH, KW, stride, pad)
    ((1, 1, 1, 1), (1, 1, 1, 0)),
    ((1, 3, 3, 1), (3, 3, 1, 1)),
    ((2, 7, 5, 3), (3, 3, 1, 0)),
    ((2, 7, 7, 3), (3, 2, 2, 1)),
    ((1, 8, 9, 4), (5, 5, 1, 2)),
    ((3, 9, 7, 2), (2, 3, 3, 2)),   # stride > kernel width: some pixels in no window
    ((1, 5, 6, 33), (3, 3, 2, 0)),
]


@pytest.mark.parametrize("shape,p", IM2COL_CASES)
def test_im2col(shape, p):
    rng = np.random.default_rng(9)
    x = f32(rng, *shape)
    want = refs.im2col(x, *p)
    close(run("im2col_fwd_f32", want.shape, [x], ip=p), want)
    g = f32(rng, *want.shape)
    close(run("im2col_bwd_f32", shape, [g], ip=p), refs.im2col_bwd(g, shape, *p))


IM2COL_FAST_CASES = [  # interior windows unrolled (3x3) or generic, border windows zeroed then filled
    ((2, 6, 7, c), (kh, kw, s, pad))
    for c in (1, 3, 8, 16)
    for (kh, kw, s, pad) in ((3, 3, 1, 1), (3, 3, 2, 1), (3, 3, 1, 0), (3, 3, 1, 2), (3, 3, 2, 2), (2, 3, 1, 1),
                             (1, 1, 1, 0), (5, 5, 2, 3))
]


def _im2col_bwd_ordered(g, shape, kh, kw, s, pad):
    """dx in float32, summed from 0 in order of increasing (oh, ow) as the kernel documents."""
    n, h, w, c = shape
    _, oh, ow, _ = g.shape
    dxp = np.zeros((n, h + 2 * pad + kh, w + 2 * pad + kw, c), np.float32)
    gp = g.reshape(n, oh, ow, c, kh, kw).transpose(0, 1, 2, 4, 5, 3)   # (n, oh, ow, kh, kw, c)
    for i in range(oh):
        for j in range(ow):
            dxp[:, i * s:i * s + kh, j * s:j * s + kw, :] += gp[:, i, j]
    return dxp[:, pad:pad + h, pad:pad + w, :]


@pytest.mark.parametrize("shape,p", IM2COL_FAST_CASES)
def test_im2col_exact(shape, p):
    rng = np.random.default_rng(13)
    x = f32(rng, *shape)
    want = refs.im2col(x, *p).astype(np.float32)
    got = run("im2col_fwd_f32", want.shape, [x], ip=p)
    np.testing.assert_array_equal(got, want)   # a pure copy
    g = f32(rng, *want.shape)
    dx = run("im2col_bwd_f32", shape, [g], ip=p)
    np.testing.assert_array_equal(dx, _im2col_bwd_ordered(g, shape, *p))
    close(dx, refs.im2col_bwd(g, shape, *p))
    for nt in (2, 3):
        assert np.array_equal(got, run("im2col_fwd_f32", want.shape, [x], ip=p, n_threads=nt))
        assert np.array_equal(dx, run("im2col_bwd_f32", shape, [g], ip=p, n_threads=nt))


# ---- max_pool2d ------------------------------------------------------------------------

@pytest.mark.parametrize("shape,k", [((1, 1, 1, 1), 1), ((2, 4, 4, 3), 2), ((1, 7, 5, 33), 2),
                                     ((3, 9, 10, 2), 3), ((1, 2, 5, 1), 3), ((2, 5, 6, 70), 2)])
def test_max_pool2d(shape, k):
    rng = np.random.default_rng(10)
    x = f32(rng, *shape)
    want = refs.max_pool2d(x, k)
    close(run("max_pool2d_fwd_f32", want.shape, [x], ip=(k,)), want)
    g = f32(rng, *want.shape)
    close(run("max_pool2d_bwd_f32", shape, [x, g], ip=(k,)), refs.max_pool2d_bwd(x, g, k))


@pytest.mark.parametrize("c", [5, 37, 70])   # per-channel path (< 16), vector path, both
def test_max_pool2d_ties_go_to_first(c):
    rng = np.random.default_rng(11)
    x = rng.integers(0, 3, size=(2, 6, 7, c)).astype(np.float32)   # many ties
    g = f32(rng, 2, 2, 2, c)
    dx = run("max_pool2d_bwd_f32", x.shape, [x, g], ip=(3,))
    np.testing.assert_array_equal(dx, refs.max_pool2d_bwd(x, g, 3).astype(np.float32))


@pytest.mark.parametrize("shape,k", [((2, 6, 6, 8), 2), ((2, 7, 9, 16), 2), ((1, 9, 8, 24), 3), ((3, 5, 5, 8), 1),
                                     ((1, 2, 5, 8), 3)])
def test_max_pool2d_blocks_of_8(shape, k):
    """C a multiple of 8 (vector path, tail rows/columns) against the reference and,
    bit for bit with ties and NaNs, against the same data with one channel fewer
    (the per-channel or max_into paths)."""
    rng = np.random.default_rng(14)
    x = rng.integers(0, 3, size=shape).astype(np.float32)
    x[..., 1::3] = f32(rng, *x[..., 1::3].shape)
    want = refs.max_pool2d(x, k)
    got = run("max_pool2d_fwd_f32", want.shape, [x], ip=(k,))
    np.testing.assert_array_equal(got, want.astype(np.float32))
    g = f32(rng, *want.shape)
    dx = run("max_pool2d_bwd_f32", shape, [x, g], ip=(k,))
    np.testing.assert_array_equal(dx, refs.max_pool2d_bwd(x, g, k).astype(np.float32))
    x.reshape(-1)[rng.integers(0, x.size, size=x.size // 7)] = np.nan   # NaN first in a window, or later
    x[:, ::k, ::k, 0] = np.nan
    got = run("max_pool2d_fwd_f32", want.shape, [x], ip=(k,))
    dx = run("max_pool2d_bwd_f32", shape, [x, g], ip=(k,))
    xs, gs = np.ascontiguousarray(x[..., :-1]), np.ascontiguousarray(g[..., :-1])
    assert np.array_equal(got[..., :-1], run("max_pool2d_fwd_f32", gs.shape, [xs], ip=(k,)), equal_nan=True)
    assert np.array_equal(dx[..., :-1], run("max_pool2d_bwd_f32", xs.shape, [xs, gs], ip=(k,)), equal_nan=True)
    for nt in (2, 3):
        assert np.array_equal(got, run("max_pool2d_fwd_f32", want.shape, [x], ip=(k,), n_threads=nt), equal_nan=True)
        assert np.array_equal(dx, run("max_pool2d_bwd_f32", shape, [x, g], ip=(k,), n_threads=nt))


# ---- thread counts: bit-identical ----------------------------------------------------------

def _thread_cases():
    rng = np.random.default_rng(12)
    x = f32(rng, 5, 7, 33)
    g = f32(rng, 5, 7, 33)
    logits, tg = f32(rng, 37, 257, lo=-4, hi=4), rng.integers(-1, 257, size=37).astype(np.int32)
    gs = np.array(0.7, dtype=np.float32)
    rx = f32(rng, 2, 9, 3, 20)
    pos = rng.integers(0, 500, size=9).astype(np.int32)
    table, idx = f32(rng, 11, 40), rng.integers(0, 11, size=(5, 7)).astype(np.int32)
    gr = f32(rng, 5, 7, 40)
    img = f32(rng, 3, 9, 8, 5)
    cols = f32(rng, 3, 5, 4, 45)
    pooled = f32(rng, 3, 4, 4, 5)
    img8, cols8, pooled8 = f32(rng, 3, 9, 7, 8), f32(rng, 3, 9, 7, 72), f32(rng, 3, 4, 3, 8)
    seg = np.array([[0, 0, 0, 1, 1, 2, 2, 2, -1], [0, 0, 0, 0, 0, 0, 1, 1, 1]], np.int32)
    row_pos = rng.integers(0, 500, size=(2, 9)).astype(np.int32)
    return [
        ("rms_norm_fwd_f32", x.shape, [x], (), (1e-5,), None),
        ("rms_norm_bwd_f32", x.shape, [x, g], (), (1e-5,), None),
        ("softmax_fwd_f32", x.shape, [x], (1,), (0.5,), None),
        ("softmax_bwd_f32", x.shape, [x, g], (), (0.5,), None),
        ("cross_entropy_fwd_f32", (), [logits, tg], (0,), (), None),
        ("cross_entropy_bwd_f32", logits.shape, [logits, tg, gs], (0,), (), None),
        ("rope_fwd_f32", rx.shape, [rx, pos], (16,), (10000.0, 1.0, 1.0), None),
        ("rope_bwd_f32", rx.shape, [rx, pos], (16,), (10000.0, 1.0, 1.0), None),
        ("get_rows_fwd_f32", (5, 7, 40), [table, idx], (), (), None),
        ("get_rows_bwd_f32", (11, 40), [gr, idx], (), (), None),
        ("im2col_fwd_f32", cols.shape, [img], (3, 3, 2, 1), (), None),
        ("im2col_bwd_f32", img.shape, [cols], (3, 3, 2, 1), (), None),
        ("max_pool2d_fwd_f32", pooled.shape, [img], (2,), (), None),
        ("max_pool2d_bwd_f32", img.shape, [img, pooled], (2,), (), None),
        ("softmax_fwd_f32", (2, 3, 9, 9), [f32(rng, 2, 3, 9, 9), seg], (3,), (0.5,), None),
        ("rope_fwd_f32", rx.shape, [rx, row_pos], (12,), (10000.0, 1.0, 1.0), None),
        ("rope_bwd_f32", rx.shape, [rx, row_pos], (12,), (500.0, 1.0, 1.0), None),
        # NEOX pairs with llama 3's frequency factors and a linear scale
        ("rope_fwd_f32", rx.shape, [rx, pos, np.geomspace(1, 8, 6).astype(np.float32)], (12, 2), (1e4, 0.5, 1.3), None),
        ("rope_bwd_f32", rx.shape, [rx, row_pos, np.geomspace(1, 8, 8).astype(np.float32)], (16, 2), (1e4, 1.0, 1.0),
         None),
        ("dropout_fwd_f32", x.shape, [x, np.array(3, np.int32)], (9,), (0.4,), None),
        ("im2col_fwd_f32", cols8.shape, [img8], (3, 3, 1, 1), (), None),
        ("im2col_bwd_f32", img8.shape, [cols8], (3, 3, 1, 1), (), None),
        ("max_pool2d_fwd_f32", pooled8.shape, [img8], (2,), (), None),
        ("max_pool2d_bwd_f32", img8.shape, [img8, pooled8], (2,), (), None),
    ]


@pytest.mark.parametrize("case", _thread_cases(), ids=lambda c: c[0])
def test_threads_bit_identical(case):
    kernel, shape, srcs, ip, fp, scratch = case
    one = run(kernel, shape, srcs, ip, fp, n_threads=1, scratch_bytes=scratch)
    assert not np.isnan(one).any()
    for n in (2, 3):
        assert np.array_equal(one, run(kernel, shape, srcs, ip, fp, n_threads=n, scratch_bytes=scratch))


# ---- bad inputs -------------------------------------------------------------------------

def _bad_cases():
    rng = np.random.default_rng(13)
    x = f32(rng, 3, 8)
    i32 = np.zeros(3, dtype=np.int32)
    h = x.astype(np.float16)
    img = f32(rng, 1, 4, 4, 2)
    x3, x4 = f32(rng, 2, 3, 3), f32(rng, 2, 3, 1, 4)
    seg2 = np.zeros((2, 3), np.int32)
    seg23 = np.zeros((2, 6), np.int32)
    return [  # kernel, dst shape, srcs, ip, fp, scratch, exception, op name
        ("rms_norm_fwd_f32", (3, 7), [x], (), (1e-5,), 0, ShapeError, "rms_norm"),
        ("rms_norm_fwd_f32", (3, 8), [h], (), (1e-5,), 0, DTypeError, "rms_norm"),
        ("rms_norm_bwd_f32", (3, 8), [x, x[:, :4]], (), (1e-5,), 0, ShapeError, "rms_norm_bwd"),
        ("rms_norm_fwd_f32", (3, 4), [x[:, ::2]], (), (1e-5,), 0, NativeError, "rms_norm"),
        ("softmax_fwd_f32", (8,), [x[0]], (1,), (1.0,), 0, ShapeError, "softmax"),
        ("softmax_fwd_f32", (3, 8), [x], (2,), (1.0,), 0, NativeError, "softmax"),
        ("softmax_bwd_f32", (3, 8), [x, h], (), (1.0,), 0, DTypeError, "softmax_bwd"),
        # segment mask: x (B, ..., T, T), seg (B, T) i32 contiguous
        ("softmax_fwd_f32", (2, 3, 3), [x3], (3,), (1.0,), 0, NativeError, "expected 2 inputs"),
        ("softmax_fwd_f32", (2, 3, 3), [x3, seg2], (4,), (1.0,), 0, NativeError, "mask ip[0]"),
        ("softmax_fwd_f32", (3, 3), [x3[0], seg2], (3,), (1.0,), 0, ShapeError, "3+ dims"),
        ("softmax_fwd_f32", (2, 3, 3), [x3, seg2.astype(np.float32)], (3,), (1.0,), 0, DTypeError, "seg i32"),
        ("softmax_fwd_f32", (2, 3, 3), [x3, seg2[:1]], (3,), (1.0,), 0, ShapeError, "expected seg (2, 3)"),
        ("softmax_fwd_f32", (2, 3, 3), [x3, seg2[:, :2]], (3,), (1.0,), 0, ShapeError, "expected seg (2, 3)"),
        ("softmax_fwd_f32", (2, 3, 3), [x3, seg2.reshape(-1)], (3,), (1.0,), 0, ShapeError, "expected seg"),
        ("softmax_fwd_f32", (2, 3, 3), [x3, seg23[:, ::2]], (3,), (1.0,), 0, NativeError, "seg contiguous"),
        ("softmax_fwd_f32", (2, 2, 3), [np.ascontiguousarray(x3[:, :2]), seg2], (3,), (1.0,), 0, ShapeError,
         "T_q == T_k"),
        ("cross_entropy_fwd_f32", (), [x, np.array([1, 8, 0], dtype=np.int32)], (0,), (), 12,
         NativeError, "row 1 is 8"),
        ("cross_entropy_fwd_f32", (), [x, np.zeros(4, dtype=np.int32)], (0,), (), 16, ShapeError,
         "cross_entropy"),
        ("cross_entropy_fwd_f32", (), [x, i32.astype(np.float32)], (0,), (), 12, DTypeError,
         "cross_entropy"),
        ("cross_entropy_fwd_f32", (), [x, i32], (0,), (), 8, NativeError, "scratch"),
        ("cross_entropy_bwd_f32", (3, 8), [x, i32, x], (0,), (), 0, ShapeError, "cross_entropy_bwd"),
        ("rope_fwd_f32", (3, 8), [x, i32], (8,), (1e4, 1.0, 1.0), 0, ShapeError, "rope"),
        ("rope_fwd_f32", (3, 1, 8), [x.reshape(3, 1, 8), i32], (7,), (1e4, 1.0, 1.0), 0, NativeError, "n_dims"),
        ("rope_fwd_f32", (3, 1, 8), [x.reshape(3, 1, 8), i32], (10,), (1e4, 1.0, 1.0), 0, NativeError, "n_dims"),
        ("rope_fwd_f32", (3, 1, 8), [x.reshape(3, 1, 8), i32], (8, 1), (1e4, 1.0, 1.0), 0, NativeError, "mode"),
        ("rope_fwd_f32", (3, 1, 8), [x.reshape(3, 1, 8), i32], (8,), (1e4, 0.0, 1.0), 0, NativeError, "freq_scale"),
        ("rope_fwd_f32", (3, 1, 8), [x.reshape(3, 1, 8), i32], (8,), (1e4, 1.0, 0.0), 0, NativeError, "attn_factor"),
        ("rope_fwd_f32", (3, 1, 8), [x.reshape(3, 1, 8), i32, np.ones(3, np.float32)], (8,), (1e4, 1.0, 1.0), 0,
         ShapeError, "factors (4,)"),
        ("rope_bwd_f32", (3, 1, 8), [x.reshape(3, 1, 8), i32[:2]], (8,), (1e4, 1.0, 1.0), 0, ShapeError,
         "rope_bwd"),
        # per-row positions: x's leading dims (B, T), contiguous
        ("rope_fwd_f32", (2, 3, 1, 4), [x4, np.zeros((3, 3), np.int32)], (4,), (1e4, 1.0, 1.0), 0, ShapeError,
         "or (2, 3)"),
        ("rope_fwd_f32", (2, 3, 1, 4), [x4, np.zeros((2, 4), np.int32)], (4,), (1e4, 1.0, 1.0), 0, ShapeError,
         "expected positions (3,) or (2, 3)"),
        ("rope_bwd_f32", (2, 3, 1, 4), [x4, np.zeros((1, 2, 3), np.int32)], (4,), (1e4, 1.0, 1.0), 0, ShapeError,
         "rope_bwd"),
        ("rope_fwd_f32", (2, 3, 1, 4), [x4, np.zeros((2, 6), np.int32)[:, ::2]], (4,), (1e4, 1.0, 1.0), 0,
         NativeError, "positions contiguous"),
        ("rope_fwd_f32", (2, 3, 1, 4), [x4, np.zeros((2, 3), np.float32)], (4,), (1e4, 1.0, 1.0), 0, DTypeError,
         "positions i32"),
        # dropout: seed i32 of one element, p in [0, 1), salt in [0, 2^32), x contiguous
        ("dropout_fwd_f32", (3, 8), [x, np.array(1, np.int32)], (0,), (1.0,), 0, NativeError, "p (fp[0])"),
        ("dropout_fwd_f32", (3, 8), [x, np.array(1, np.int32)], (0,), (-0.1,), 0, NativeError, "p (fp[0])"),
        ("dropout_fwd_f32", (3, 8), [x, np.array(1, np.int32)], (0,), (float("nan"),), 0, NativeError,
         "in [0, 1)"),
        ("dropout_fwd_f32", (3, 8), [x, np.array(1, np.int32)], (-1,), (0.5,), 0, NativeError, "salt"),
        ("dropout_fwd_f32", (3, 8), [x, np.array(1, np.int32)], (2**32,), (0.5,), 0, NativeError, "salt"),
        ("dropout_fwd_f32", (3, 8), [x, np.array(1.0, np.float32)], (0,), (0.5,), 0, DTypeError, "seed i32"),
        ("dropout_fwd_f32", (3, 8), [x, np.array([1, 2], np.int32)], (0,), (0.5,), 0, ShapeError,
         "seed of one element"),
        ("dropout_fwd_f32", (3, 4), [x[:, ::2], np.array(1, np.int32)], (0,), (0.5,), 0, NativeError,
         "x contiguous"),
        ("dropout_fwd_f32", (3, 7), [x, np.array(1, np.int32)], (0,), (0.5,), 0, ShapeError, "dropout"),
        ("dropout_fwd_f32", (3, 8), [x], (0,), (0.5,), 0, NativeError, "expected 2 inputs"),
        ("get_rows_fwd_f32", (2, 8), [x, np.array([0, 3], dtype=np.int32)], (), (), 0, NativeError,
         "is 3"),
        ("get_rows_fwd_f32", (2, 8), [x, np.array([-1, 0], dtype=np.int32)], (), (), 0, NativeError,
         "is -1"),
        ("get_rows_fwd_f32", (2, 7), [x, np.array([0, 1], dtype=np.int32)], (), (), 0, ShapeError,
         "get_rows"),
        ("get_rows_bwd_f32", (3, 8), [x[:2], np.array([0, 5], dtype=np.int32)], (), (), 0, NativeError,
         "is 5"),
        ("get_rows_bwd_f32", (3, 8), [x[:2], np.array([0.0, 1.0], dtype=np.float32)], (), (), 0,
         DTypeError, "get_rows_bwd"),
        ("im2col_fwd_f32", (1, 2, 2, 9), [img], (3, 3, 1, 0), (), 0, ShapeError, "im2col"),
        ("im2col_fwd_f32", (1, 2, 2, 18), [img], (3, 3, 0, 0), (), 0, NativeError, "im2col"),
        ("im2col_fwd_f32", (1, 1, 1, 50), [img], (5, 5, 1, 0), (), 0, ShapeError, "larger than"),
        ("im2col_bwd_f32", (1, 4, 4, 2), [f32(rng, 1, 2, 2, 9)], (3, 3, 1, 0), (), 0, ShapeError,
         "im2col_bwd"),
        ("max_pool2d_fwd_f32", (1, 2, 2, 2), [img], (0,), (), 0, NativeError, "max_pool2d"),
        ("max_pool2d_fwd_f32", (1, 2, 2, 2), [img], (3,), (), 0, ShapeError, "max_pool2d"),
        ("max_pool2d_bwd_f32", (1, 4, 4, 2), [img, f32(rng, 1, 2, 2, 3)], (2,), (), 0, ShapeError,
         "max_pool2d_bwd"),
    ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: f"{c[0]}-{c[6].__name__}-{c[7]}")
def test_bad_inputs(case):
    kernel, shape, srcs, ip, fp, scratch, exc, text = case
    with pytest.raises(exc) as info:
        run(kernel, shape, srcs, ip, fp, scratch_bytes=scratch)
    assert isinstance(info.value, GgtrainError)
    assert text in str(info.value)
    if exc is NativeError:   # GT_ERR_INVALID also reads as a ValueError
        assert isinstance(info.value, ValueError)


# ---- the references' backward vs finite differences of their forward -------------------

def fd_grad(f, x, r, h=1e-6):
    """d sum(f(x) * r) / dx by central differences (float64)."""
    x = np.array(x, dtype=np.float64)
    grad = np.zeros_like(x)
    flat, gflat = x.reshape(-1), grad.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + h
        up = np.sum(f(x) * r)
        flat[i] = old - h
        down = np.sum(f(x) * r)
        flat[i] = old
        gflat[i] = (up - down) / (2 * h)
    return grad


def fd_close(got, want):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_fd_rms_norm():
    rng = np.random.default_rng(20)
    x, r = rng.standard_normal((3, 5)), rng.standard_normal((3, 5))
    fd_close(refs.rms_norm_bwd(x, r, 1e-3), fd_grad(lambda a: refs.rms_norm(a, 1e-3), x, r))


@pytest.mark.parametrize("shape,causal", [((3, 6), False), ((2, 3, 5), True), ((4, 3), True)])
def test_fd_softmax(shape, causal):
    rng = np.random.default_rng(21)
    x, r = rng.standard_normal(shape), rng.standard_normal(shape)
    scale = 0.7
    y = refs.softmax(x, scale, causal)
    fd_close(refs.softmax_bwd(y, r, scale), fd_grad(lambda a: refs.softmax(a, scale, causal), x, r))


def test_fd_cross_entropy():
    rng = np.random.default_rng(22)
    x = rng.standard_normal((5, 7))
    t = np.array([3, -1, 0, 6, 2], dtype=np.int32)
    g = 1.3
    fd_close(refs.cross_entropy_bwd(x, t, g), fd_grad(lambda a: refs.cross_entropy(a, t), x, g))


def test_fd_softmax_seg():
    rng = np.random.default_rng(27)
    x, r = rng.standard_normal((2, 2, 6, 6)), rng.standard_normal((2, 2, 6, 6))
    seg = np.array([[0, 0, 1, 1, 1, -1], [0, 1, 2, 2, 0, 2]], np.int32)
    y = refs.softmax(x, 0.9, seg=seg)
    fd_close(refs.softmax_bwd(y, r, 0.9), fd_grad(lambda a: refs.softmax(a, 0.9, seg=seg), x, r))


def test_fd_rope_per_row():
    rng = np.random.default_rng(28)
    x, r = rng.standard_normal((2, 3, 2, 6)), rng.standard_normal((2, 3, 2, 6))
    pos = np.array([[0, 5, 17], [0, 1, 0]], dtype=np.int32)
    fd_close(refs.rope_bwd(r, pos, 4, 100.0), fd_grad(lambda a: refs.rope(a, pos, 4, 100.0), x, r))


def test_fd_rope():
    rng = np.random.default_rng(23)
    x, r = rng.standard_normal((2, 3, 2, 6)), rng.standard_normal((2, 3, 2, 6))
    pos = np.array([0, 5, 17], dtype=np.int32)
    fd_close(refs.rope_bwd(r, pos, 4, 100.0), fd_grad(lambda a: refs.rope(a, pos, 4, 100.0), x, r))


def test_fd_get_rows():
    rng = np.random.default_rng(24)
    table = rng.standard_normal((4, 3))
    idx = np.array([[1, 3], [1, 0]], dtype=np.int32)
    r = rng.standard_normal((2, 2, 3))
    fd_close(refs.get_rows_bwd(r, idx, 4), fd_grad(lambda a: refs.get_rows(a, idx), table, r))


@pytest.mark.parametrize("shape,p", [((1, 4, 5, 2), (3, 2, 1, 1)), ((2, 5, 5, 1), (2, 2, 3, 1))])
def test_fd_im2col(shape, p):
    rng = np.random.default_rng(25)
    x = rng.standard_normal(shape)
    r = rng.standard_normal(refs.im2col(x, *p).shape)
    fd_close(refs.im2col_bwd(r, shape, *p), fd_grad(lambda a: refs.im2col(a, *p), x, r))


def test_fd_max_pool2d():
    rng = np.random.default_rng(26)
    x = rng.permutation(2 * 5 * 4 * 3).reshape(2, 5, 4, 3) * 0.1   # distinct values: no ties
    r = rng.standard_normal(refs.max_pool2d(x, 2).shape)
    fd_close(refs.max_pool2d_bwd(x, r, 2), fd_grad(lambda a: refs.max_pool2d(a, 2), x, r))


# ---- set_rows (in place) ------------------------------------------------------------------

def test_set_rows_in_place_and_bad_indices():
    rng = np.random.default_rng(5)
    target = f32(rng, 4, 40)
    before = target.copy()
    values = f32(rng, 2, 40)
    idx = np.array([3, 0], np.int32)
    for n in (1, 3):
        t = before.copy()
        run_kernel("set_rows_fwd_f32", t, [t, values, idx], n_threads=n)
        want = before.copy()
        want[3], want[0] = values[0], values[1]
        assert np.array_equal(t, want)
    with pytest.raises(NativeError, match="idx\\[1\\] is 4"):
        t = before.copy()
        run_kernel("set_rows_fwd_f32", t, [t, values, np.array([0, 4], np.int32)])
    assert np.array_equal(t, before)          # checked before any row is written
    with pytest.raises(NativeError, match="alias"):
        run_kernel("set_rows_fwd_f32", before.copy(), [before, values, idx])
