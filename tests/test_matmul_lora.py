"""matmul_lora: a frozen product with its rank-r adapter's summed onto it in one pass (the
LoRA forward without a temporary of the output's size or an add). The kernel against float64
for the stored types and every path of the matmul (packed, skinny, row dots, batch dims not
folded), its bits across thread counts, bad input; the backward's fusion of a LoRA layer's input
gradient (g @ W + g_h @ A, autograd._accumulate) against float64; and a LoRA run with it
against the same run with the two products apart (tests/op_cases.py has its gradients)."""
import numpy as np
import pytest

from ggtrain.core import ops
from ggtrain.core.autograd import backward
from ggtrain.core.backend_cpu import CpuBackend
from ggtrain.core.graph import Graph, Runtime
from ggtrain.core.models.config import init_params
from ggtrain.core import train
from ggtrain.core.train import TextConfig, TextRun
from ggtrain.errors import ShapeError
from tests.test_linear_ce import _stored
from tests.test_lora_train import CFG, LORA, _factors


def _product(x, w, h, b, wtype, n_threads, fused=True):
    g = Graph()
    if wtype == "f32":
        ws, wd = g.param(w.shape, w, trainable=False, name="w"), w
    elif wtype == "f16":
        w16 = w.astype(np.float16)
        ws, wd = g.param(w.shape, w16, trainable=False, dtype="f16", name="w"), w16.astype(np.float32)
    else:
        raw, wd = _stored(w, wtype)
        ws = g.param(w.shape, raw, trainable=False, dtype=wtype, name="w")
    xs, hs, bs = g.param(x.shape, x, name="x"), g.param(h.shape, h, name="h"), g.param(b.shape, b, name="b")
    y = ops.matmul_lora(xs, ws, hs, bs) if fused else ops.add(ops.linear(xs, ws), ops.linear(hs, bs))
    rt = Runtime(g, CpuBackend(n_threads))
    plan = rt.compile([y])
    rt.run(plan)
    return plan.read(y), wd


# (batch dims, K, N, r, weight type): the packed path (rows past one MC block, N past one
# NC block), the skinny f32 kernels (narrow N), the row dots (a few rows times a transposed
# stored weight), K-quant blocks
SHAPES = [((4, 64), 576, 1536, 16, "q4_1"), ((300,), 256, 520, 16, "q4_k"), ((2, 20), 96, 2100, 16, "f32"),
          ((3, 50), 256, 40, 4, "f32"), ((1, 5), 64, 200, 8, "q8_0"), ((3,), 256, 300, 4, "q6_k"),
          ((2, 37), 64, 96, 16, "f16")]


@pytest.mark.parametrize("lead, k, n, r, wtype", SHAPES, ids=[f"{s[4]}-{s[1]}x{s[2]}" for s in SHAPES])
def test_equals_float64_of_the_two_products(lead, k, n, r, wtype):
    rng = np.random.default_rng(k + n)
    x = rng.standard_normal(lead + (k,)).astype(np.float32)
    w = (rng.standard_normal((n, k)) * 0.1).astype(np.float32)
    h = rng.standard_normal(lead + (r,)).astype(np.float32)
    b = (rng.standard_normal((n, r)) * 0.1).astype(np.float32)
    got, wd = _product(x, w, h, b, wtype, 2)
    want = x.astype(np.float64) @ wd.T.astype(np.float64) + h.astype(np.float64) @ b.T.astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())
    for nt in (1, 3):                         # each element's sums in one order whatever the threads
        assert np.array_equal(_product(x, w, h, b, wtype, nt)[0], got)


def test_bad_input_is_refused():
    g = Graph()
    x, w = g.input((4, 8)), g.input((6, 8))
    with pytest.raises(ShapeError, match=r"matmul_lora: expected h \(4, 'r'\) and b \(6, r\)"):
        ops.matmul_lora(x, w, g.input((4, 3)), g.input((6, 2)))
    with pytest.raises(ShapeError, match="k > 0"):
        ops.matmul_lora(x, w, g.input((4, 0)), g.input((6, 0)))


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_lora_run_trains_as_with_the_products_apart(checkpointing, monkeypatch):
    """The same LoRA run with the adapters' products summed onto the frozen ones' and apart:
    the same losses and factors over 3 AdamW updates to rounding, the frozen products still
    kept under selective checkpointing (never recomputed), no add of an adapter's product
    left, and the same FLOPs counted (fewer under checkpointing: nothing of it recomputed)."""
    weights = init_params(CFG, seed=1, std=0.3)
    factors = _factors(weights, 7)
    batches = [np.random.default_rng(s).integers(0, CFG.vocab, (2, CFG.ctx + 1)).astype(np.int32) for s in (1, 2, 3)]
    runs = {}
    for fused in (True, False):
        monkeypatch.setattr(train, "lora_fused", lambda backend, w, f=fused: f)
        tc = TextConfig(steps=3, batch=2, lr=1e-2, lr_min=1e-2, warmup=0, checkpointing=checkpointing)
        run = TextRun(CFG, factors, tc, CpuBackend(2), frozen=weights, lora=LORA)
        losses = [run.step.step([run.feed(b)], lr=1e-2) for b in batches]
        calls = run.step._update.plan.calls
        runs[fused] = (losses, run.param_values(), [c.kernel for c in calls], run.step.flops)
        # per token, the loss head's products (only counted rows take them) scale with the
        # fraction of positions whose target counts
        tokens = tc.batch * CFG.ctx
        assert run.step.row_flops > 0 and run.flop_per_token() == run.step.flops / tokens
        assert run.flop_per_token(0.25) == (run.step.flops - 0.75 * run.step.row_flops) / tokens
    (lf, pf, kf, ff), (lu, pu, ku, fu) = runs[True], runs[False]
    # the same products counted; under checkpointing the apart run also recomputes the adapters'
    # B products, which the kept matmul_lora outputs hold
    assert ff == fu if not checkpointing else ff < fu
    np.testing.assert_allclose(lf, lu, rtol=1e-5)
    for name in pf:
        np.testing.assert_allclose(pf[name], pu[name], rtol=1e-4, atol=1e-6)
    n_lora = len(LORA.weights(CFG))
    # each forward one once (kept, not recomputed), and the backward's input gradients of
    # every adapted layer but layer 0's q, k, v (their input, the frozen embedding's rows
    # normed, needs none); apart, none, and an add for each
    n_bwd = n_lora - 3
    assert sum(k.startswith("matmul_lora") for k in kf) == n_lora + n_bwd
    assert not any(k.startswith("matmul_lora") for k in ku)
    assert kf.count("add_fwd_f32") <= ku.count("add_fwd_f32") - n_lora - n_bwd


@pytest.mark.parametrize("wtype", ["f32", "q8_0"])
def test_a_lora_layers_input_gradient_is_one_matmul_lora(wtype):
    """Two adapted layers reading one x (as q and k do): x's gradient, g1 @ W1 + s (g1 B1) A1 +
    g2 @ W2 + s (g2 B2) A2, is made of two matmul_lora nodes (the frozen product and the
    adapter's in one pass each) and one add, not four products and three adds; against
    float64, the frozen weights as stored."""
    rng = np.random.default_rng(7)
    g = Graph()
    x0 = rng.standard_normal((2, 5, 64)).astype(np.float32)
    x = g.param(x0.shape, x0, name="x")
    s, terms, want = 0.5, [], np.zeros(x0.shape)
    for i, n in enumerate((96, 32)):
        w = (rng.standard_normal((n, 64)) * 0.1).astype(np.float32)
        if wtype == "f32":
            ws, wd = g.param(w.shape, w, trainable=False, name=f"w{i}"), w
        else:
            raw, wd = _stored(w, wtype)
            ws = g.param(w.shape, raw, trainable=False, dtype=wtype, name=f"w{i}")
        a0 = (rng.standard_normal((4, 64)) * 0.1).astype(np.float32)
        b0 = (rng.standard_normal((n, 4)) * 0.1).astype(np.float32)
        c0 = rng.standard_normal((2, 5, n)).astype(np.float32)
        a, b = g.param(a0.shape, a0, name=f"a{i}"), g.param(b0.shape, b0, name=f"b{i}")
        y = ops.matmul_lora(x, ws, ops.scale(ops.linear(x, a), s), b)
        terms.append(ops.sum(ops.mul(y, g.param(c0.shape, c0, trainable=False, name=f"c{i}"))))
        c = c0.astype(np.float64)
        want += c @ wd.astype(np.float64) + s * (c @ b0.astype(np.float64)) @ a0.astype(np.float64)
    grads = backward(ops.add(terms[0], terms[1]), [x], checkpointing=False)
    gx = grads[x]
    assert gx.op == "add" and [t.op for t in gx.srcs] == ["matmul_lora", "matmul_lora"]
    assert all(t.srcs[3].shape == (4, 64) for t in gx.srcs)     # the adapter's A as the second product
    rt = Runtime(g, CpuBackend(2))
    plan = rt.compile([gx])
    rt.run(plan)
    np.testing.assert_allclose(plan.read(gx), want, rtol=0, atol=2e-6 * np.abs(want).max())
