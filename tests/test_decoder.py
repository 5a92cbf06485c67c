"""The llama graph against a self-contained float64 numpy llama (tests/np_llama.py)."""
import numpy as np
import pytest

from ggtrain.core.autograd import backward
from ggtrain.core.backend_cpu import CpuBackend
from ggtrain.core.graph import Graph, Runtime
from ggtrain.core.models import llama
from ggtrain.core.optim import AdamW
from ggtrain.core.train import TrainStep
from tests import np_llama

TINY = dict(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, ff=48, ctx=16)


def _graph(cfg, b, t, seed=0, checkpoint=False):
    g = Graph()
    init = llama.init_params(cfg, seed, std=0.1)   # larger than the default: visible attention
    params = {k: g.param(v.shape, v, name=k) for k, v in init.items()}
    tokens = g.input((b, t), "i32", name="tokens")
    targets = g.input((b, t), "i32", name="targets")
    pos = g.input((t,), "i32", name="pos")
    logits = llama.forward(cfg, params, tokens, pos, g, checkpoint=checkpoint)
    return g, init, params, tokens, targets, pos, logits, llama.loss(logits, targets)


@pytest.mark.parametrize("kw", [{}, {"tied": True, "kv_heads": 4}, {"kv_heads": 1, "rope_dims": 4}])
def test_forward_matches_numpy_llama(kw):
    cfg = llama.LlamaConfig(**{**TINY, **kw})
    b, t = 2, 7
    g, init, params, tokens, targets, pos, logits, loss = _graph(cfg, b, t)
    rng = np.random.default_rng(0)
    tok = rng.integers(0, cfg.vocab, (b, t)).astype(np.int32)
    tgt = rng.integers(0, cfg.vocab, (b, t)).astype(np.int32)
    p = np.arange(t, dtype=np.int32) + 3
    rt = Runtime(g, CpuBackend(2))
    for k, v in ((tokens, tok), (targets, tgt), (pos, p)):
        rt.set(k, v)
    plan = rt.compile([logits, loss])
    rt.run(plan)
    want = np_llama.forward(cfg, init, tok, p)
    np.testing.assert_allclose(plan.read(logits), want, rtol=1e-4, atol=1e-5)
    assert float(plan.read(loss)) == pytest.approx(np_llama.loss(want, tgt), rel=1e-5)


def test_gradients_match_finite_differences_of_numpy_llama():
    cfg = llama.LlamaConfig(**TINY)
    b, t = 2, 5
    g, init, params, tokens, targets, pos, logits, loss = _graph(cfg, b, t)
    rng = np.random.default_rng(1)
    tok = rng.integers(0, cfg.vocab, (b, t)).astype(np.int32)
    tgt = rng.integers(0, cfg.vocab, (b, t)).astype(np.int32)
    p = np.arange(t, dtype=np.int32)
    grads = backward(loss, list(params.values()), checkpointing=False)
    rt = Runtime(g, CpuBackend(2))
    for k, v in ((tokens, tok), (targets, tgt), (pos, p)):
        rt.set(k, v)
    plan = rt.compile([grads[params[k]] for k in params])
    rt.run(plan)
    ref = {k: v.astype(np.float64) for k, v in init.items()}
    for name in params:
        got = plan.read(grads[params[name]])
        flat = ref[name].reshape(-1)
        for i in rng.choice(flat.size, size=min(6, flat.size), replace=False):
            old = flat[i]
            flat[i] = old + 1e-6
            lp = np_llama.loss(np_llama.forward(cfg, ref, tok, p), tgt)
            flat[i] = old - 1e-6
            lm = np_llama.loss(np_llama.forward(cfg, ref, tok, p), tgt)
            flat[i] = old
            assert got.reshape(-1)[i] == pytest.approx((lp - lm) / 2e-6, rel=2e-3, abs=2e-5), f"{name}[{i}]"


def test_checkpointed_training_equals_plain_and_lowers_loss():
    cfg = llama.LlamaConfig(**TINY)
    b, t = 4, 16
    rng = np.random.default_rng(2)
    tok = rng.integers(0, cfg.vocab, (b, t + 1)).astype(np.int32)
    runs = []
    for checkpoint in (False, True):
        g, init, params, tokens, targets, pos, logits, loss = _graph(cfg, b, t, checkpoint=checkpoint)
        st = TrainStep(loss, list(params.values()), AdamW(lr=3e-3), CpuBackend(2), checkpointing=checkpoint)
        batch = {tokens: tok[:, :-1], targets: tok[:, 1:], pos: np.arange(t, dtype=np.int32)}
        losses = [st.step([batch], 3e-3) for _ in range(8)]
        runs.append((losses, {k: st.get(v) for k, v in params.items()}))
    (l0, p0), (l1, p1) = runs
    assert l0 == l1
    for k in p0:
        np.testing.assert_array_equal(p0[k], p1[k])
    assert l0[-1] < l0[0] - 0.3


def test_checkpointing_keeps_attention_and_the_mid_residual():
    # Checkpointed blocks keep the fused attention node (its output, and its inputs q, k,
    # v, which its backward reads) and the residual after it: backward never runs
    # attention's forward again, nor the q, k, v and output projections, but still
    # recomputes each block's gate and up products (every block ends a segment); and it
    # plans less memory than no checkpointing.
    cfg = llama.LlamaConfig(**dict(TINY, layers=3))
    b, t = 2, 16
    counts, arenas = {}, {}
    for checkpoint in (False, True):
        g, init, params, tokens, targets, pos, logits, loss = _graph(cfg, b, t, checkpoint=checkpoint)
        st = TrainStep(loss, list(params.values()), AdamW(lr=1e-3), CpuBackend(2), checkpointing=checkpoint)
        calls = st._update.plan.calls
        counts[checkpoint] = {k: sum(c.kernel == k for c in calls) for k in ("attention_fwd_f32", "matmul_fwd_f32")}
        arenas[checkpoint] = st.memory.arena
    assert counts[False]["attention_fwd_f32"] == counts[True]["attention_fwd_f32"] == cfg.layers
    assert counts[True]["matmul_fwd_f32"] - counts[False]["matmul_fwd_f32"] == 2 * cfg.layers
    assert arenas[True] < arenas[False]
