"""L-BFGS: the line search on scalar functions, convergence against closed forms and gradient
descent, full-batch MNIST, exact reuse and resume, and thread-count independence."""
import math

import numpy as np
import pytest

from ggtrain.core import ops
from ggtrain.core.backend_cpu import CpuBackend
from ggtrain.core.graph import Graph
from ggtrain.core.optim import LBFGS, SGD, line_search
from ggtrain.core.step import TrainStep
from ggtrain.errors import ConfigError


def _phi(f, df):
    calls = []

    def phi(t):
        calls.append(t)
        return f(t), df(t)
    return phi, calls


def _strong_wolfe(f, df, t, c1=1e-4, c2=0.9):
    return f(t) <= f(0) + c1 * t * df(0) and abs(df(t)) <= c2 * abs(df(0))


@pytest.mark.parametrize("t0", [1e-3, 1.0, 50.0])
@pytest.mark.parametrize("c2", [0.9, 0.1])
def test_line_search_finds_a_strong_wolfe_step(t0, c2):
    # not a quadratic (so one interpolation is not exact); minimum near t = 2.3
    f = lambda t: (t - 3.0) ** 2 + 0.1 * t ** 4 - 2.0 * math.sin(t)   # noqa: E731
    df = lambda t: 2 * (t - 3.0) + 0.4 * t ** 3 - 2.0 * math.cos(t)   # noqa: E731
    phi, calls = _phi(f, df)
    r = line_search(phi, f(0), df(0), t0, c2=c2, max_evals=20)
    assert r.how == "wolfe" and r.evals == len(calls) <= 20
    assert _strong_wolfe(f, df, r.t, c2=c2)
    assert r.f == f(r.t) and r.gd == df(r.t)


def test_line_search_treats_an_overflowing_loss_as_too_far():
    f = lambda t: (t - 1.0) ** 2 if t < 1.5 else math.inf    # noqa: E731
    df = lambda t: 2 * (t - 1.0) if t < 1.5 else math.nan    # noqa: E731
    phi, _ = _phi(f, df)
    r = line_search(phi, f(0), df(0), 100.0, max_evals=20)
    assert r.how == "wolfe" and _strong_wolfe(f, df, r.t)


def test_line_search_falls_back_to_the_best_decrease_then_to_backtracking():
    f = lambda t: (t - 1.0) ** 2                 # noqa: E731
    df = lambda t: 2 * (t - 1.0)                 # noqa: E731
    # one evaluation allowed: t = 0.05 decreases the loss but fails the curvature condition
    r = line_search(_phi(f, df)[0], f(0), df(0), 0.05, max_evals=1)
    assert r.how == "armijo" and r.t == 0.05
    # t = 10 increases the loss; the fallback halves it until the loss decreases enough
    phi, calls = _phi(f, df)
    r = line_search(phi, f(0), df(0), 10.0, max_evals=1)
    assert r.how == "backtrack" and r.t == 1.25 and calls == [10.0, 5.0, 2.5, 1.25]
    # no decrease at all (an ascent direction in disguise): reported, not hidden
    r = line_search(_phi(lambda t: t * t + 1e-3 * t + 1.0, lambda t: -1e-3)[0], 1.0, -1e-3, 1.0,
                    max_evals=2, backtracks=3)
    assert r.how == "failed" and r.t is None
    with pytest.raises(ValueError, match="descent"):
        line_search(_phi(f, df)[0], 1.0, 0.5, 1.0)


def _least_squares(n=256, d=10, spread=1.0, seed=0):
    """A noisy linear regression with columns of different scales (condition ~110); its
    optimum in float64 from lstsq."""
    rng = np.random.default_rng(seed)
    X = (rng.normal(size=(n, d)) * np.logspace(0, spread, d)).astype(np.float32)
    Y = (X @ rng.normal(size=(d, 1)) + 0.5 + 0.1 * rng.normal(size=(n, 1))).astype(np.float32)
    A = np.hstack([X.astype(np.float64), np.ones((n, 1))])
    best = np.linalg.lstsq(A, Y.astype(np.float64), rcond=None)[0][:, 0]
    hessian = 2.0 / n * A.T @ A
    return X, Y, best, np.linalg.eigvalsh(hessian)


def _regression_step(X, Y, optimizer, threads=1):
    g = Graph()
    x, y = g.input(X.shape), g.input(Y.shape)
    w, b = g.param((1, X.shape[1]), name="w"), g.param((1,), name="b")
    loss = ops.mean(ops.sqr(ops.sub(ops.linear(x, w, b), y)))
    st = TrainStep(loss, [w, b], optimizer, CpuBackend(threads))
    return st, {x: X, y: Y}, lambda: np.concatenate([st.get(w)[0], st.get(b)])


def _iterations_to(st, feed, params, best, tol, limit, lr):
    for k in range(1, limit + 1):
        st.step([feed], lr=lr, same_batch=k > 1)
        if np.abs(params() - best).max() <= tol:
            return k
    return None


def test_convex_problem_reaches_the_closed_form_optimum_far_faster_than_gradient_descent():
    X, Y, best, eig = _least_squares()
    st, feed, params = _regression_step(X, Y, LBFGS())
    k_lbfgs = _iterations_to(st, feed, params, best, 1e-6, 150, lr=1.0)
    assert k_lbfgs is not None, np.abs(params() - best).max()
    # gradient descent at its best fixed step, 2 / (L + mu), after ten times as many updates
    lr = 2.0 / (eig[0] + eig[-1])
    st, feed, params = _regression_step(X, Y, SGD(lr=lr))
    assert _iterations_to(st, feed, params, best, 1e-6, 10 * k_lbfgs, lr=lr) is None


def test_history_pairs_hold_steps_and_gradient_changes():
    """After an update, the newest pair is (x1 - x0, g1 - g0) of the float64 problem."""
    X, Y, best, _ = _least_squares(n=64, d=3)
    st, feed, params = _regression_step(X, Y, LBFGS(history=3))
    A = np.hstack([X.astype(np.float64), np.ones((len(X), 1))])
    grad = lambda p: 2.0 / len(X) * A.T @ (A @ p - Y[:, 0])    # noqa: E731
    x0 = params()
    st.step([feed], lr=1.0)
    x1 = params()
    state = st.optimizer_state()
    count, newest = state["lbfgs.ring"].astype(int)
    assert count == 1
    np.testing.assert_allclose(state["lbfgs.s"][newest], x1 - x0, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(state["lbfgs.y"][newest], grad(x1) - grad(x0), rtol=1e-4, atol=1e-5)
    s, y = x1 - x0, grad(x1) - grad(x0)
    np.testing.assert_allclose(state["lbfgs.curv"][newest], [s @ y, y @ y], rtol=1e-4)


def _mnist_run(optimizer="lbfgs", epochs=6, n=1200, threads=2, reuse=True, lr=1.0):
    from ggtrain.cli.mnist import BUNDLED   # the bundled 5000-image subset: always there
    from ggtrain.core.models import mnist as model
    from ggtrain.core.train_classifier import ClassifierConfig, ClassifierRun, classifier_data
    from ggtrain.formats.idx import load_mnist
    x, y = load_mnist(BUNDLED, "train")
    cfg = ClassifierConfig(epochs=epochs, batch=n // 2, physical_batch=n // 4, lr=lr, val_split=0.5,
                           optimizer=optimizer)
    run = ClassifierRun(lambda p, t: model.forward("fc", p, t), model.init_params("fc", 0), (28, 28), cfg,
                        CpuBackend(threads))
    if not reuse:   # evaluate again at the start of every update
        step = run.step.step
        run.step.step = lambda batches, lr, stop=None, same_batch=False: step(batches, lr, stop=stop)
    losses = []
    history = run.fit(*classifier_data(x[:n], y[:n], cfg, run.world),
                      on_step=lambda info: losses.append((info["loss"], info["evals"])))
    return run, losses, history


def test_mnist_fc_full_batch_lowers_the_loss_monotonically():
    run, losses, history = _mnist_run()
    values = [l for l, _ in losses]
    assert len(values) == 6 and all(b < a for a, b in zip(values, values[1:])), values
    assert values[-1] < 0.5 * values[0]
    assert history[-1]["val_accuracy"] > 0.7
    # the first update evaluates at the start point; the later ones reuse the last evaluation
    assert losses[0][1] >= 2 and all(e >= 1 for _, e in losses[1:])


def test_reusing_the_last_evaluation_equals_evaluating_again_and_threads_do_not_matter():
    a, la, _ = _mnist_run(epochs=3, threads=2)
    b, lb, _ = _mnist_run(epochs=3, threads=1, reuse=False)
    assert [l for l, _ in la] == [l for l, _ in lb]
    assert [e + 1 for _, e in la[1:]] == [e for _, e in lb[1:]]   # one evaluation saved per update
    for name, value in a.param_values().items():
        np.testing.assert_array_equal(b.param_values()[name], value, err_msg=name)


def _mlp_steps(optimizer, steps, state=None, grad_acc=1):
    """A small MLP on a different random batch each update (mini-batch L-BFGS)."""
    rng = np.random.default_rng(0)
    g = Graph()
    x, y = g.input((32 // grad_acc, 6)), g.input((32 // grad_acc, 1))
    w1 = g.param((16, 6), rng.normal(size=(16, 6)) * 0.5, name="w1")
    w2 = g.param((1, 16), rng.normal(size=(1, 16)) * 0.5, name="w2")
    loss = ops.mean(ops.sqr(ops.sub(ops.linear(ops.silu(ops.linear(x, w1)), w2), y)))
    st = TrainStep(loss, [w1, w2], optimizer, CpuBackend(2), grad_acc=grad_acc)
    if state is not None:
        st.set(w1, state["w1"])
        st.set(w2, state["w2"])
        st.load_optimizer_state(state["optimizer"])
    data = np.random.default_rng(1)
    losses = []
    for k in range(steps[1]):
        X = data.normal(size=(32, 6)).astype(np.float32)
        Y = np.sin(X.sum(axis=1, keepdims=True)).astype(np.float32)
        if k < steps[0]:
            continue    # the batches a resumed run has already seen
        mb = 32 // grad_acc
        losses.append(st.step([{x: X[i * mb:(i + 1) * mb], y: Y[i * mb:(i + 1) * mb]}
                               for i in range(grad_acc)], lr=1.0))
    return st, {"w1": st.get(w1), "w2": st.get(w2), "optimizer": st.optimizer_state()}, losses


def test_resume_from_saved_history_is_bit_identical():
    _, whole, losses = _mlp_steps(LBFGS(history=3), (0, 8))
    _, half, _ = _mlp_steps(LBFGS(history=3), (0, 4))
    assert half["optimizer"]["lbfgs.ring"][0] == 3     # the ring is full and wrapped below
    _, resumed, rest = _mlp_steps(LBFGS(history=3), (4, 8), state=half)
    assert rest == losses[4:]
    for k in ("w1", "w2"):
        np.testing.assert_array_equal(resumed[k], whole[k])
    for k, v in whole["optimizer"].items():
        np.testing.assert_array_equal(resumed["optimizer"][k], v, err_msg=k)
    with pytest.raises(ConfigError, match="history"):
        _mlp_steps(LBFGS(history=4), (4, 5), state=half)


def test_accumulated_evaluations_equal_one_batch():
    _, one, l1 = _mlp_steps(LBFGS(), (0, 4))
    _, acc, l4 = _mlp_steps(LBFGS(), (0, 4), grad_acc=4)
    np.testing.assert_allclose(l4, l1, rtol=1e-5)
    for k in ("w1", "w2"):
        np.testing.assert_allclose(acc[k], one[k], rtol=1e-3, atol=1e-5)


def test_bad_settings_are_config_errors():
    with pytest.raises(ConfigError, match="history"):
        LBFGS(history=0)
    with pytest.raises(ConfigError, match="c1 < c2"):
        LBFGS(c1=0.5, c2=0.1)
    from ggtrain.core.optim import make_optimizer
    with pytest.raises(ConfigError, match="--weight-decay 0.1: L-BFGS"):
        make_optimizer("lbfgs", 1.0, weight_decay=0.1)
    with pytest.raises(ConfigError, match="--optimizer 'adam'"):
        make_optimizer("adam", 1.0)
