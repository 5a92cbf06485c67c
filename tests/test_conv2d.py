"""The fused conv2d (direct convolution, bias, relu, max-pool in one kernel) against the
unfused composition it replaces (im2col, matmul, add, relu, max_pool2d): the same forward
bits, the same gradients to float rounding, the same bits for any thread count and at
every SIMD level; and its errors. tests/op_cases.py checks it against float64 numpy and
finite differences."""
from __future__ import annotations

import numpy as np
import pytest

from ggtrain.core import ops
from ggtrain.core.autograd import backward
from ggtrain.core.backend_cpu import CpuBackend
from ggtrain.core.backend_kernel import run_kernel
from ggtrain.core.graph import Graph, Runtime
from ggtrain.core.models import mnist
from ggtrain.errors import NativeError, ShapeError
from ggtrain.native import lib

# (x shape, kernel shape, stride, pad, relu, pool): both MNIST layers, then odd shapes
CONFIGS = [((3, 28, 28, 1), (8, 1, 3, 3), 1, 1, True, 2),
           ((5, 14, 14, 8), (16, 8, 3, 3), 1, 1, True, 2),
           ((2, 7, 9, 3), (5, 3, 3, 2), 2, 1, False, 1),
           ((2, 9, 7, 20), (37, 20, 2, 3), 1, 0, True, 3),
           ((1, 6, 6, 2), (70, 2, 3, 3), 1, 2, True, 1),
           ((2, 5, 5, 1), (3, 1, 5, 5), 3, 4, False, 2)]


def _unfused(x, k, b, stride, pad, relu, pool):
    cout, cin, kh, kw = k.shape
    cols = ops.im2col(x, kh, kw, stride, pad)
    n, oh, ow, ckk = cols.shape
    y = ops.matmul(ops.reshape(cols, (n * oh * ow, ckk)), ops.transpose(ops.reshape(k, (cout, ckk))))
    y = ops.add(ops.reshape(y, (n, oh, ow, cout)), b)
    y = ops.relu(y) if relu else y
    return ops.max_pool2d(y, pool) if pool > 1 else y


def _run(fused, cfg, thread_counts=(1,), seed=0):
    """Values and gradients (x, kernel, bias) of sum(y * R), once per thread count."""
    xs, ks, stride, pad, relu, pool = cfg
    results = []
    for nt in thread_counts:    # the same graph and values, on a backend of nt threads
        rng = np.random.default_rng(seed)
        g = Graph()
        x = g.param(xs, rng.standard_normal(xs).astype(np.float32))
        k = g.param(ks, rng.standard_normal(ks).astype(np.float32))
        b = g.param((ks[0],), rng.standard_normal(ks[0]).astype(np.float32))
        y = (ops.conv2d(x, k, b, stride, pad, relu, pool) if fused else _unfused(x, k, b, stride, pad, relu, pool))
        r = g.const(rng.standard_normal(y.shape).astype(np.float32))
        grads = backward(ops.sum(ops.mul(y, r)), [x, k, b], checkpointing=False)
        outs = [y] + [grads[t] for t in (x, k, b)]
        rt = Runtime(g, CpuBackend(nt))
        plan = rt.compile(outs)
        rt.run(plan)
        results.append([plan.read(o) for o in outs])
    return results


@pytest.fixture
def simd_level():
    """Set the dispatch level for a test; restores the widest afterwards."""
    yield lib.gt_set_simd_level
    lib.gt_set_simd_level(2)


@pytest.mark.parametrize("cfg", CONFIGS, ids=[f"{c[0]}x{c[1]}" for c in CONFIGS])
def test_matches_unfused_composition(cfg, simd_level):
    """Forward: the very bits of the unfused chain (its matmul runs the same FMA chains;
    the scalar level multiplies then adds, so there only close). Backward: the same
    gradients to float rounding (other summation orders)."""
    levels = [lvl for lvl in (2, 1, 0) if lvl == 0 or lib.gt_cpu_features() & lvl]
    for level in levels:
        simd_level(level)
        (fused,), (unfused,) = _run(True, cfg), _run(False, cfg)
        if level >= 1:
            np.testing.assert_array_equal(fused[0], unfused[0])
        np.testing.assert_allclose(fused[0], unfused[0], rtol=1e-5, atol=1e-5)
        for name, a, want in zip(("dx", "dkernel", "dbias"), fused[1:], unfused[1:]):
            scale = np.abs(want).max()
            np.testing.assert_allclose(a, want, rtol=1e-5, atol=1e-5 * scale, err_msg=f"{name} at level {level}")


@pytest.mark.parametrize("cfg", CONFIGS[:3] + CONFIGS[4:5], ids=["mnist1", "mnist2", "stride2", "c70"])
def test_bit_identical_for_threads_and_simd_levels(cfg, simd_level):
    """1, 2 and 3 threads give the same bits; so do the AVX-512 tiles and the plain
    fmaf loops the other levels run (the same chains)."""
    runs = _run(True, cfg, (1, 2, 3))
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            np.testing.assert_array_equal(a, b)
    if lib.gt_cpu_features() & 2:
        simd_level(0)
        (plain,) = _run(True, cfg)
        for a, b in zip(runs[0], plain):
            np.testing.assert_array_equal(a, b)


def test_codes_name_the_first_maximum_and_relu_cuts():
    """The pooled node's second half: window index of the first maximum, -1 where relu cut."""
    x = np.array([[1, 3, -1, -2], [3, 2, -5, -1]], np.float32).reshape(1, 2, 4, 1)
    k = np.ones((1, 1, 1, 1), np.float32)
    g = Graph()
    y = ops.conv2d(g.param(x.shape, x), g.param(k.shape, k), None, 1, 0, True, 2)
    rt = Runtime(g, CpuBackend(1))
    plan = rt.compile([y.srcs[0]])
    rt.run(plan)
    raw = plan.read(y.srcs[0])
    np.testing.assert_array_equal(raw[0].reshape(-1), [3, 0])
    np.testing.assert_array_equal(raw[1].reshape(-1), [1, -1])   # the tie 3, 3 goes to (0, 1)


def test_mnist_cnn_plans_no_im2col():
    """The MNIST CNN's training graph has no im2col buffer (nor its relu/pool passes), and the
    gradient of the pooled values reaches conv2d's backward without view_bwd's zero-filled
    copy of the whole (values, codes) node."""
    g = Graph()
    params = {n: g.param(s, np.zeros(s, np.float32)) for n, s in mnist.PARAM_SHAPES["cnn"].items()}
    x = g.input((4, 28, 28))
    loss = ops.cross_entropy(mnist.forward("cnn", params, x), g.input((4,), "i32"))
    grads = backward(loss, list(params.values()), checkpointing=False)
    kinds = {t.op for t in g.ancestors(list(grads.values()))}
    assert "conv2d" in kinds and "conv2d_weight_bwd" in kinds and "conv2d_input_bwd" in kinds
    assert not kinds & {"im2col", "im2col_bwd", "max_pool2d", "max_pool2d_bwd", "relu", "relu_bwd", "view_bwd"}


def test_bad_input():
    g = Graph()
    x = g.param((1, 5, 5, 2))
    with pytest.raises(ShapeError, match=r"conv2d: x \(1, 5, 5, 2\) must be"):
        ops.conv2d(x, g.param((4, 3, 3, 3)))
    with pytest.raises(ShapeError, match=r"conv2d: bias \(3,\) must be \(4,\)"):
        ops.conv2d(x, g.param((4, 2, 3, 3)), g.param((3,)))
    with pytest.raises(ShapeError, match="pool window 4 does not fit"):
        ops.conv2d(x, g.param((4, 2, 3, 3)), None, 1, 0, pool=4)
    with pytest.raises(ShapeError, match="larger than padded input"):
        ops.conv2d(x, g.param((4, 2, 7, 7)))
    img, kern = np.zeros((1, 5, 5, 2), np.float32), np.zeros((4, 2, 3, 3), np.float32)
    with pytest.raises(NativeError, match="relu 0/1"):
        run_kernel("conv2d_fwd_f32", np.zeros((1, 3, 3, 4), np.float32), [img, kern], ip=(3, 3, 1, 0, 2, 1))
    with pytest.raises(ShapeError, match=r"conv2d: expected dst \(2, N, OH/pool"):
        run_kernel("conv2d_fwd_f32", np.zeros((1, 3, 3, 4), np.float32), [img, kern], ip=(3, 3, 1, 0, 1, 2))
    with pytest.raises(ShapeError, match=r"conv2d_weight_bwd: expected g"):
        run_kernel("conv2d_weight_bwd_f32", np.zeros((19, 4), np.float32),
                   [img, np.zeros((1, 3, 3, 4), np.float32), np.zeros((1, 2, 2, 4), np.float32)],
                   ip=(3, 3, 1, 0, 1, 1))


def test_plans_count_convolution_flops():
    """An update's FLOPs (bench figures, % of peak) include conv2d's three kernels: for the
    MNIST CNN, conv1 forward and weight gradient (x needs none), conv2 all three, the dense
    layer's three products."""
    from ggtrain.core.train_classifier import ClassifierConfig, ClassifierRun

    run = ClassifierRun(lambda p, t: mnist.forward("cnn", p, t), mnist.init_params("cnn", 0), (28, 28),
                        ClassifierConfig(batch=4, physical_batch=2, epochs=1), CpuBackend(1))
    conv1, conv2, dense = 2 * 28 * 28 * 8 * 9, 2 * 14 * 14 * 16 * 72, 2 * 784 * 10
    assert run.flop_per_sample == 2 * conv1 + 3 * conv2 + 3 * dense
