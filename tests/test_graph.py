"""Graph machinery: memory planning, checkpointing, accumulation, optimizers, threads, errors."""
import sys

import numpy as np
import pytest

from ggtrain.core import ops
from ggtrain.core.autograd import backward
from ggtrain.core.backend_cpu import CpuBackend
from ggtrain.core.backend import Backend
from ggtrain.core.graph import Graph, Rows, Runtime, _pack
from ggtrain.core.optim import SGD, AdamW, ConstantLR, CosineLR
from ggtrain.core.step import TrainStep
from ggtrain.errors import ConfigError, DTypeError, GgtrainError, ShapeError


def _mlp(rng, batch=16, d_in=12, hidden=(24, 24), n_out=5, segments=True):
    """A small MLP classifier; each hidden layer is one checkpoint segment."""
    g = Graph()
    x = g.input((batch, d_in), name="x")
    y = g.input((batch,), "i32", name="y")
    params = []
    h = x
    d = d_in
    for i, n in enumerate(hidden):
        w = g.param((n, d), rng.normal(0, d ** -0.5, (n, d)), name=f"w{i}")
        b = g.param((n,), rng.normal(0, 0.1, n), name=f"b{i}")
        params += [w, b]
        h = ops.silu(ops.linear(h, w, b))
        if segments:
            g.checkpoint(h)
        d = n
    w = g.param((n_out, d), rng.normal(0, d ** -0.5, (n_out, d)), name="wout")
    params.append(w)
    loss = ops.cross_entropy(ops.linear(h, w), y)
    return g, x, y, params, loss


_TEACHER = np.random.default_rng(123).normal(size=(12, 5))


def _data(rng, n, d_in=12, n_out=5):
    """Inputs and the labels a fixed linear teacher gives them (learnable)."""
    X = rng.normal(size=(n, d_in)).astype(np.float32)
    Y = (X @ _TEACHER[:d_in, :n_out]).argmax(1).astype(np.int32)
    return X, Y


def test_pack_never_overlaps_live_tensors():
    rng = np.random.default_rng(0)
    start, end, size = {}, {}, {}
    for k in range(200):
        s = int(rng.integers(0, 100))
        start[k], end[k], size[k] = s, s + int(rng.integers(0, 10)), int(rng.integers(1, 5000))
    offsets, total = _pack(start, end, size)
    for a in range(200):
        for b in range(a + 1, 200):
            if start[a] <= end[b] and start[b] <= end[a]:
                assert offsets[a] + size[a] <= offsets[b] or offsets[b] + size[b] <= offsets[a]
    assert total < sum(size.values())  # reuse happened
    assert all(o % 64 == 0 for o in offsets.values())


def test_arena_reuses_memory_along_a_chain(backend):
    g = Graph()
    x = g.input((256, 256))
    h = x
    for _ in range(10):
        h = ops.relu(ops.scale(h, 1.1))
    plan = Runtime(g, backend).compile([h])
    assert plan.report.arena <= 3 * 256 * 256 * 4
    assert plan.report.arena_unpacked >= 20 * 256 * 256 * 4


def test_running_a_plan_with_an_input_never_set_is_an_error(backend):
    """A batch fed without one of the inputs a plan reads would compute on zeros (the loss
    chunks' weights left out: a zero loss, no gradient) without a word: refused, by name."""
    g = Graph()
    x, w = g.input((4,), name="x"), g.input((4,), name="weights")
    rt = Runtime(g, backend)
    plan = rt.compile([ops.sum(ops.mul(x, w))])
    rt.set(x, np.ones(4, np.float32))
    with pytest.raises(ValueError, match="'weights', never set"):
        rt.run(plan)
    rt.set(w, np.full(4, 2.0, np.float32))
    rt.run(plan)
    assert float(plan.read(g.nodes[-1])) == 8.0


def test_plans_of_a_runtime_share_one_arena(backend):
    """Two plans: one arena sized for the larger (the earlier plan moves into it), the report
    counts it once, both still compute right, and reading the first plan's output after the
    second ran is refused (the arena was reused), not a silently wrong value."""
    g = Graph()
    x = g.input((64, 64))
    small = ops.relu(ops.scale(x, 2.0))
    big = ops.relu(ops.scale(ops.repeat(ops.reshape(x, (1, 64, 64)), (8, 64, 64)), 3.0))
    rt = Runtime(g, backend)
    X = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    rt.set(x, X)
    p1 = rt.compile([small])
    first_arena = p1.report.arena
    p2 = rt.compile([ops.sum(big)])
    assert p2.report.arena >= 8 * 64 * 64 * 4 > first_arena
    assert rt.memory.arena == p2.report.arena           # one arena, not the sum
    rt.run(p1)
    np.testing.assert_array_equal(p1.read(small), np.maximum(2 * X, 0))   # p1 was moved
    rt.run(p2)
    with pytest.raises(RuntimeError, match="another plan"):
        p1.read(small)
    np.testing.assert_allclose(p2.read(g.nodes[-1]), 8 * np.maximum(3 * X, 0).sum(), rtol=1e-5)
    rt.set(x, X)  # persistent tensors are read any time
    np.testing.assert_array_equal(rt.get(x), X)


def test_plans_move_to_a_grown_arena_when_they_next_run(backend, monkeypatch):
    """Ten plans, each needing more arena than the last: each is lowered once when compiled, an
    earlier one again only when it runs after the arena grew (lowering every plan at each growth
    was 55 lowerings more), and it still computes right; read before that run, it refuses."""
    g = Graph()
    x = g.input((8, 64))
    rt = Runtime(g, backend)
    X = np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32)
    rt.set(x, X)
    lowered = []
    compile_native = backend.compile
    monkeypatch.setattr(backend, "compile", lambda calls: lowered.append(len(calls)) or compile_native(calls))
    outs = [ops.sum(ops.relu(ops.scale(ops.repeat(ops.reshape(x, (1, 8, 64)), (k, 8, 64)), 1.0)))
            for k in range(1, 11)]
    plans = [rt.compile([y]) for y in outs]
    assert len(lowered) == 10
    with pytest.raises(RuntimeError, match="grew the arena"):
        plans[0].read(outs[0])
    rt.run(plans[0])
    assert len(lowered) == 11
    np.testing.assert_allclose(plans[0].read(outs[0]), np.maximum(X, 0).sum(), rtol=1e-5)
    rt.run(plans[-1])
    rt.run(plans[0])
    assert len(lowered) == 11      # the arena did not grow again
    np.testing.assert_allclose(plans[0].read(outs[0]), np.maximum(X, 0).sum(), rtol=1e-5)


def test_bind_adopts_a_buffer_without_copying(backend):
    g = Graph()
    w = g.param((4, 8), name="w", trainable=False)
    x = g.input((2, 8))
    y = ops.linear(x, w)
    rt = Runtime(g, backend)
    buf = backend.alloc(4 * 8 * 4)
    W = np.arange(32, dtype=np.float32).reshape(4, 8)
    buf.view(0, "f32", (4, 8))[...] = W
    rt.bind(w, buf)
    assert rt.buffer(w) is buf
    X = np.ones((2, 8), np.float32)
    rt.set(x, X)
    plan = rt.compile([y])
    rt.run(plan)
    np.testing.assert_array_equal(plan.read(y), X @ W.T)
    with pytest.raises(ValueError, match="already has storage"):
        rt.bind(w, buf)
    with pytest.raises(ShapeError, match="cannot hold"):
        rt.bind(g.param((100,), name="big", trainable=False), buf)


def test_a_params_init_is_not_kept_after_upload(backend):
    g = Graph()
    w = g.param((3, 3), np.eye(3), name="w")
    Runtime(g, backend).buffer(w)
    assert not isinstance(w.init, np.ndarray)       # the runtime's buffer holds it now
    with pytest.raises(ValueError, match="another runtime"):
        Runtime(g, backend).buffer(w)


def _grads(checkpointing, seed=0):
    rng = np.random.default_rng(seed)
    g, x, y, params, loss = _mlp(rng, hidden=(24, 24, 24))
    grads = backward(loss, params, checkpointing=checkpointing)
    rt = Runtime(g, CpuBackend(2))
    X, Y = _data(rng, 16)
    rt.set(x, X)
    rt.set(y, Y)
    plan = rt.compile([loss] + [grads[p] for p in params])
    rt.run(plan)
    return [plan.read(grads[p]) for p in params], plan


def test_checkpointed_gradients_equal_plain():
    plain, plan_plain = _grads(False)
    ckpt, plan_ckpt = _grads(True)
    for a, b in zip(plain, ckpt):
        np.testing.assert_array_equal(a, b)  # same ops in the same order: bit-identical
    assert plan_ckpt.n_nodes > plan_plain.n_nodes  # the recomputed forward is there


def test_checkpointing_lowers_planned_memory():
    def arena(checkpointing):
        rng = np.random.default_rng(0)
        g = Graph()
        x = g.input((512, 256))  # activations must dominate the (output) weight gradients
        params, h = [], x
        for i in range(8):
            w = g.param((256, 256), rng.normal(0, 0.06, (256, 256)), name=f"w{i}")
            params.append(w)
            h = g.checkpoint(ops.silu(ops.linear(ops.silu(ops.linear(h, w)), w)))
        loss = ops.mean(ops.sqr(h))
        grads = backward(loss, params, checkpointing=checkpointing)
        return Runtime(g, CpuBackend(1)).compile([loss] + [grads[p] for p in params]).report.arena
    assert arena(True) < 0.6 * arena(False)


def _train(grad_acc, steps=3, optimizer=None, checkpointing=True, n_threads=2, batch=16):
    rng = np.random.default_rng(0)
    g, x, y, params, loss = _mlp(rng, batch=batch // grad_acc)
    st = TrainStep(loss, params, optimizer or AdamW(lr=1e-2, weight_decay=0.1, max_grad_norm=1.0),
                   CpuBackend(n_threads), grad_acc=grad_acc, checkpointing=checkpointing)
    data = np.random.default_rng(1)
    losses = []
    for _ in range(steps):
        X, Y = _data(data, batch)
        mb = batch // grad_acc
        batches = [{x: X[i * mb:(i + 1) * mb], y: Y[i * mb:(i + 1) * mb]} for i in range(grad_acc)]
        losses.append(st.step(batches, lr=1e-2))
    return [st.get(p) for p in params], losses, st


def test_accumulated_micro_batches_equal_one_big_batch():
    big, big_losses, _ = _train(1)
    acc, acc_losses, _ = _train(4)
    np.testing.assert_allclose(acc_losses, big_losses, rtol=1e-5)
    for a, b in zip(acc, big):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_one_and_two_threads_are_bit_identical():
    p1, l1, _ = _train(2, n_threads=1)
    p2, l2, _ = _train(2, n_threads=2)
    assert l1 == l2
    for a, b in zip(p1, p2):
        np.testing.assert_array_equal(a, b)


def test_adamw_step_matches_closed_form():
    rng = np.random.default_rng(0)
    g = Graph()
    w0 = rng.normal(size=(3, 4)).astype(np.float32)
    b0 = rng.normal(size=(4,)).astype(np.float32)
    t = rng.normal(size=(3, 4)).astype(np.float32)
    w = g.param((3, 4), w0, name="w")
    b = g.param((4,), b0, name="b")
    target = g.const(t)
    loss = ops.sum(ops.sqr(ops.sub(ops.add(w, b), target)))
    opt = AdamW(lr=0.05, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.3, max_grad_norm=2.0)
    st = TrainStep(loss, [w, b], opt, CpuBackend(1))
    W, B = w0.astype(np.float64), b0.astype(np.float64)
    mW = vW = np.zeros_like(W)
    mB = vB = np.zeros_like(B)
    for k in range(1, 4):
        st.step([{}], lr=0.05)
        r = 2 * (W + B - t)
        gW, gB = r, r.sum(0)
        norm = np.sqrt((gW ** 2).sum() + (gB ** 2).sum())
        c = min(1.0, 2.0 / (norm + 1e-6)) if norm > 2.0 else 1.0
        assert st.last_grad_norm == pytest.approx(norm, rel=1e-5)
        gW, gB = gW * c, gB * c
        mW, vW = 0.8 * mW + 0.2 * gW, 0.9 * vW + 0.1 * gW ** 2
        mB, vB = 0.8 * mB + 0.2 * gB, 0.9 * vB + 0.1 * gB ** 2
        bc1, bc2 = 1 - 0.8 ** k, 1 - 0.9 ** k
        W = W - 0.05 * 0.3 * W - 0.05 * (mW / bc1) / (np.sqrt(vW / bc2) + 1e-6)
        B = B - 0.05 * (mB / bc1) / (np.sqrt(vB / bc2) + 1e-6)  # 1-D: no weight decay
        np.testing.assert_allclose(st.get(w), W, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(st.get(b), B, rtol=1e-5, atol=1e-6)


def test_sgd_momentum_matches_closed_form():
    g = Graph()
    w0 = np.array([[1.0, -2.0], [0.5, 3.0]], dtype=np.float32)
    w = g.param((2, 2), w0, name="w")
    loss = ops.sum(ops.sqr(w))
    st = TrainStep(loss, [w], SGD(lr=0.1, momentum=0.9, weight_decay=0.01), CpuBackend(1))
    W, buf = w0.astype(np.float64), np.zeros((2, 2))
    for _ in range(3):
        st.step([{}], lr=0.1)
        gr = 2 * W + 0.01 * W
        buf = 0.9 * buf + gr
        W = W - 0.1 * buf
        np.testing.assert_allclose(st.get(w), W, rtol=1e-5)


def test_linear_regression_converges():
    rng = np.random.default_rng(0)
    true_w = rng.normal(size=(1, 8))
    X = rng.normal(size=(256, 8)).astype(np.float32)
    Y = (X @ true_w.T + 0.5).astype(np.float32)
    g = Graph()
    x, y = g.input((256, 8)), g.input((256, 1))
    w, b = g.param((1, 8), name="w"), g.param((1,), name="b")
    loss = ops.mean(ops.sqr(ops.sub(ops.linear(x, w, b), y)))
    st = TrainStep(loss, [w, b], SGD(lr=0.1), CpuBackend(2))
    for _ in range(200):
        last = st.step([{x: X, y: Y}], lr=0.1)
    assert last < 1e-8
    np.testing.assert_allclose(st.get(w), true_w, atol=1e-4)
    np.testing.assert_allclose(st.get(b), [0.5], atol=1e-4)


def test_mlp_training_lowers_loss():
    _, losses, st = _train(1, steps=40, batch=64)
    assert losses[-1] < 0.5 * losses[0]
    assert st.memory.peak > 0


def test_step_loop_runs_no_python_per_op():
    """The Python work of a step must not grow with the number of graph nodes."""
    def calls_per_step(hidden):
        rng = np.random.default_rng(0)
        g, x, y, params, loss = _mlp(rng, hidden=hidden)
        st = TrainStep(loss, params, AdamW(), CpuBackend(1))
        X, Y = _data(rng, 16)
        st.step([{x: X, y: Y}], lr=1e-3)
        count = [0]

        def prof(frame, event, arg):
            if event in ("call", "c_call"):
                count[0] += 1
        sys.setprofile(prof)
        try:
            st.step([{x: X, y: Y}], lr=1e-3)
        finally:
            sys.setprofile(None)
        return count[0], st._update.n_nodes
    small_calls, small_nodes = calls_per_step((24,))
    big_calls, big_nodes = calls_per_step((24,) * 8)
    assert big_nodes > 3 * small_nodes
    assert big_calls == small_calls


def test_schedules():
    s = CosineLR(lr_max=1.0, lr_min=0.1, warmup=10, total=110)
    assert s(0) == pytest.approx(0.1) and s(9) == pytest.approx(1.0)
    assert s(10) == pytest.approx(1.0) and s(110) == pytest.approx(0.1)
    assert s(60) == pytest.approx(0.55)
    r = CosineLR(lr_max=1.0, lr_min=0.0, warmup=0, total=100, restarts=2)
    assert r(49) < 0.01 and r(50) == pytest.approx(1.0)
    assert ConstantLR(0.3)(1000) == 0.3
    with pytest.raises(ConfigError):
        CosineLR(lr_max=0.1, lr_min=1.0, warmup=0, total=10)


@pytest.mark.parametrize("build, exc, words", [
    (lambda g: ops.add(g.input((2, 3)), g.input((4,))), ShapeError, "add: shapes (2, 3) and (4,)"),
    (lambda g: ops.matmul(g.input((2, 3)), g.input((4, 5))), ShapeError, "matmul: inner dims"),
    (lambda g: ops.relu(g.input((2,), "i32")), DTypeError, "relu: expected f32"),
    (lambda g: ops.cross_entropy(g.input((2, 3)), g.input((2,))), DTypeError, "targets must be i32"),
    (lambda g: ops.reshape(g.input((2, 3)), (4,)), ShapeError, "reshape"),
    (lambda g: ops.rms_norm(g.input((2, 3)), 1e-5) + g.input((3, 2)), ShapeError, "do not broadcast"),
])
def test_bad_shapes_and_dtypes_raise_clear_errors(build, exc, words):
    with pytest.raises(exc) as info:
        build(Graph())
    assert words in str(info.value)
    assert isinstance(info.value, GgtrainError)


def test_native_errors_become_exceptions(backend):
    from ggtrain.core.backend_kernel import run_kernel
    with pytest.raises(ShapeError, match="add"):
        run_kernel("add_fwd_f32", np.zeros((2, 3), np.float32),
                   [np.zeros((2, 4), np.float32), np.zeros((3,), np.float32)])
    with pytest.raises(DTypeError, match="relu"):
        run_kernel("relu_fwd_f32", np.zeros(3, np.float32), [np.zeros(3, np.int32)])
    with pytest.raises(GgtrainError, match="grad norm"):
        run_kernel("adamw_step_fwd_f32", np.zeros(3, np.float32), [np.zeros(3, np.float32)] * 2
                   + [np.zeros(9, np.float32), np.zeros(2, np.float32)] + [np.zeros(3, np.float32)] * 2)


def test_bad_config_raises():
    with pytest.raises(ConfigError):
        AdamW(beta1=1.0)
    rng = np.random.default_rng(0)
    g, x, y, params, loss = _mlp(rng)
    with pytest.raises(ConfigError):
        TrainStep(loss, params, AdamW(), CpuBackend(1), grad_acc=0)


def test_cross_entropy_gradient_takes_the_logits_memory(backend):
    """The logits die in cross_entropy_bwd, which writes their gradient over them (in place):
    the arena holds one (N, V) buffer, not two, and the gradient is still exact."""
    rng = np.random.default_rng(0)
    n, k, v = 64, 16, 1000
    g = Graph()
    x = g.input((n, k))
    y = g.input((n,), "i32")
    w = g.param((v, k), rng.normal(0, 0.3, (v, k)))
    logits = ops.linear(x, w)
    loss = ops.cross_entropy(logits, y)
    grads = backward(loss, [w], checkpointing=False)
    rt = Runtime(g, backend)
    X, Y = rng.normal(size=(n, k)).astype(np.float32), rng.integers(0, v, n).astype(np.int32)
    rt.set(x, X)
    rt.set(y, Y)
    plan = rt.compile([loss, grads[w]])
    ce = [c for c in plan.plan.calls if c.kernel == "cross_entropy_bwd_f32"][0]
    assert ce.dst.buffer is ce.srcs[0].buffer and ce.dst.offset == ce.srcs[0].offset
    assert plan.report.arena < 2 * n * v * 4
    rt.run(plan)
    z = X.astype(np.float64) @ rt.get(w).astype(np.float64).T
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(n), Y] -= 1
    np.testing.assert_allclose(plan.read(grads[w]), (p / n).T @ X, rtol=1e-4, atol=1e-6)


def test_gather_rows_gathers_a_batch_into_the_input():
    # Runtime.gather_rows (ClassifierRun's batches, as Rows values) writes source[index]
    # straight into the input's buffer: the same values as set(source[index]), through the
    # CPU backend's gather and through Backend's default (gather, then copy in).
    g = Graph()
    x = g.input((4, 3, 2), name="x")
    y = g.input((4,), "i32", name="y")
    rt = Runtime(g, CpuBackend(1))
    rng = np.random.default_rng(0)
    images = rng.standard_normal((10, 3, 2)).astype(np.float32)
    labels = rng.integers(0, 9, 10).astype(np.int32)
    idx = np.array([7, 0, 7, 3])
    rt.gather_rows(x, images, idx)
    rt.gather_rows(y, labels, idx)
    np.testing.assert_array_equal(rt.get(x), images[idx])
    np.testing.assert_array_equal(rt.get(y), labels[idx])
    Backend.gather_in(rt.backend, rt.buffer(x), 0, images, idx[::-1])
    np.testing.assert_array_equal(rt.get(x), images[idx[::-1]])
    with pytest.raises(DTypeError, match="f32 tensor cannot take rows of a float64"):
        rt.gather_rows(x, images.astype(np.float64), idx)
    with pytest.raises(ShapeError, match="3 rows"):
        rt.gather_rows(x, images, idx[:3])
    with pytest.raises(ShapeError, match="1-D integer"):
        rt.gather_rows(x, images, idx.astype(np.float32))
    with pytest.raises(IndexError):
        rt.gather_rows(x, images, np.array([0, 1, 2, 10]))


@pytest.mark.parametrize("threads", [1, 2])
def test_gather_rows_of_a_big_batch(threads):
    # 64 KiB and more of f32 rows: gathered by the thread pool (get_rows over the source in
    # place) with two threads; the same values as numpy's gather, negative indices too, and
    # the plan is reused for the next batch of the same source
    g = Graph()
    x = g.input((300, 8, 10), name="x")
    rt = Runtime(g, CpuBackend(threads))
    rng = np.random.default_rng(2)
    data = rng.standard_normal((1000, 8, 10)).astype(np.float32)
    for _ in range(2):
        idx = rng.integers(-1000, 1000, 300)
        rt.gather_rows(x, data, idx)
        np.testing.assert_array_equal(rt.get(x), data[idx])
    with pytest.raises(IndexError, match="out of range"):
        rt.gather_rows(x, data, np.full(300, 1000))
    with pytest.raises(IndexError, match="out of range"):
        rt.gather_rows(x, data, np.full(300, -1001))


def test_train_step_takes_rows_values():
    # a step fed Rows(source, index) trains exactly as one fed the gathered arrays
    rng = np.random.default_rng(1)
    data = rng.standard_normal((20, 5)).astype(np.float32)
    init = rng.standard_normal((5, 1)).astype(np.float32)
    idx = np.array([3, 1, 4, 1, 5, 9])
    results = []
    for value in (data[idx], Rows(data, idx)):
        g = Graph()
        w = g.param((5, 1), init)
        x = g.input((6, 5), name="x")
        st = TrainStep(ops.sum(ops.sqr(ops.matmul(x, w))), [w], SGD(lr=0.01), CpuBackend(1), checkpointing=False)
        results.append(([st.step([{x: value}], 0.01) for _ in range(3)], st.get(w)))
    assert results[0][0] == results[1][0] and results[0][0][2] < results[0][0][0]
    np.testing.assert_array_equal(results[0][1], results[1][1])
