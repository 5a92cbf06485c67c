"""The decoder graph of every family against a self-contained float64 numpy twin
(tests/np_decoder.py): forward, and gradients by finite differences."""
import numpy as np
import pytest

from ggtrain.core.autograd import backward
from ggtrain.core.backend_cpu import CpuBackend
from ggtrain.core.graph import Graph, Runtime
from ggtrain.core.models import losses as model_losses
from ggtrain.core.models.config import ModelConfig, init_params, trainable
from ggtrain.core.models.decoder import Inputs, Net, Options, forward
from ggtrain.core.optim import AdamW
from ggtrain.core.step import TrainStep
from ggtrain.core.models.families import FAMILIES as FAMILIES_REGISTERED
from tests import np_decoder as np_llama
from tests.family_cases import INTEROP_CASES, ORACLE, TINY, TINY_CASES

# every family's tiny cases, by name
FAMILIES = [pytest.param(kw, id=name) for name, kw in TINY_CASES.items()]


def family_params(cfg, seed=0, std=0.1):
    """init_params with the 1-D tensors moved off their neutral values (norm weights near 1,
    biases near 0, rope factors 1..8 as llama 3's grow), so every family tensor matters."""
    rng = np.random.default_rng(seed + 100)
    init = init_params(cfg, seed, std=std)
    for name, v in init.items():
        if name in ("rope_freqs.weight", "rope_factors_long.weight"):
            init[name] = np.geomspace(1.0, 8.0, v.size).astype(np.float32)
        elif name == "rope_factors_short.weight":
            init[name] = np.geomspace(1.0, 1.5, v.size).astype(np.float32)
        elif name.endswith(("norm.weight", "layer_output_scale.weight", ".scale")):
            init[name] = (1 + rng.normal(0, 0.2, v.shape)).astype(np.float32)
        elif name.endswith(".bias"):
            init[name] = rng.normal(0, 0.3, v.shape).astype(np.float32)
        elif name.endswith(".ssm_a"):      # -exp(A_log): decays of several rates
            init[name] = -np.exp(rng.normal(0, 0.5, v.shape)).astype(np.float32)
    return init


def _graph(cfg, b, t, seed=0, checkpoint=False):
    g = Graph()
    init = family_params(cfg, seed, std=0.1)   # std larger than the default: visible attention
    params = {k: g.param(v.shape, v, name=k, trainable=trainable(k)) for k, v in init.items()}
    tokens = g.input((b, t), "i32", name="tokens")
    targets = g.input((b, t), "i32", name="targets")
    pos = g.input((t,), "i32", name="pos")
    logits = forward(Net(cfg, params), Inputs(tokens, pos), Options(checkpoint=g if checkpoint else None))
    return g, init, params, tokens, targets, pos, logits, model_losses.loss(logits, targets)


@pytest.mark.parametrize("kw", [{}, {"tied": True, "kv_heads": 4}, {"kv_heads": 1, "rope_dims": 4}]
                         + [p.values[0] for p in FAMILIES]
                         + [dict(arch="qwen3", rope_dims=6)],
                         ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_forward_matches_numpy_twin(kw):
    cfg = ModelConfig(**{**TINY, **kw})
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


@pytest.mark.parametrize("kw", [pytest.param({}, id="default")] + FAMILIES)
def test_gradients_match_finite_differences_of_numpy_twin(kw):
    cfg = ModelConfig(**{**TINY, **kw})
    b, t = 2, 5
    g, init, params, tokens, targets, pos, logits, loss = _graph(cfg, b, t)
    rng = np.random.default_rng(1)
    tok = rng.integers(0, cfg.vocab, (b, t)).astype(np.int32)
    tgt = rng.integers(0, cfg.vocab, (b, t)).astype(np.int32)
    p = np.arange(t, dtype=np.int32)
    params = {k: v for k, v in params.items() if v.requires_grad}     # not the rope factors
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


@pytest.mark.parametrize("kw", [{}, TINY_CASES["qwen3"], TINY_CASES["gemma4-e"]], ids=["llama", "qwen3", "gemma4-e"])
def test_checkpointed_training_equals_plain_and_lowers_loss(kw):
    cfg = ModelConfig(**{**TINY, **kw})
    b, t = 4, 16
    rng = np.random.default_rng(2)
    tok = rng.integers(0, cfg.vocab, (b, t + 1)).astype(np.int32)
    runs = []
    for checkpoint in (False, True):
        g, init, params, tokens, targets, pos, logits, loss = _graph(cfg, b, t, checkpoint=checkpoint)
        trained = [p for p in params.values() if p.requires_grad]
        st = TrainStep(loss, trained, AdamW(lr=3e-3), CpuBackend(2), checkpointing=checkpoint)
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
    cfg = ModelConfig(**dict(TINY, layers=3))
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


@pytest.mark.parametrize("kw", [{}, TINY_CASES["gemma3"]], ids=["llama", "gemma3"])
@pytest.mark.parametrize("frozen_head", [False, True], ids=["trained-head", "frozen-head"])
def test_chunked_loss_equals_one_chunk_and_holds_less(kw, frozen_head, monkeypatch):
    """The loss over the output projection in chunks of rows (large vocabularies): the same
    loss and gradients as one chunk; with a frozen output matrix (LoRA) each chunk's input
    gradient is taken in the forward (ops.with_grad), and the plan holds one chunk's logits,
    not all. (Budgets shrunk so a 2048-token vocabulary chunks.)"""
    cfg = ModelConfig(**{**TINY, **kw, "vocab": 2048, "ctx": 16})
    b, t = 4, 16
    rng = np.random.default_rng(3)
    tok = rng.integers(0, cfg.vocab, (b, t + 1)).astype(np.int32)
    tok[1, 5:] = -1                        # ignored targets, unevenly spread over the chunks
    monkeypatch.setattr(model_losses, "LOGITS_BUDGET", 1024)
    monkeypatch.setattr(model_losses, "CHUNK_BYTES", 9 * 2048 * 4)   # 9 rows a chunk: 8 chunks, the last short
    head = {"output.weight", "token_embd.weight"}
    runs = {}
    for chunked in (False, True):
        g = Graph()
        init = family_params(cfg, 0, std=0.1)
        params = {k: g.param(v.shape, v, name=k, trainable=trainable(k) and not (frozen_head and k in head))
                  for k, v in init.items()}
        tokens, targets = g.input((b, t), "i32"), g.input((b, t), "i32")
        pos = g.input((t,), "i32")
        n = model_losses.loss_chunks(cfg, b * t) if chunked else 1
        weights = g.input((n,), name="chunk_weights")
        hidden = forward(Net(cfg, params), Inputs(tokens, pos), Options(checkpoint=g, head=False))
        loss = model_losses.chunked_loss(Net(cfg, params), hidden, targets, weights, grad=frozen_head and chunked)
        trained = [p for p in params.values() if p.requires_grad]
        st = TrainStep(loss, trained, AdamW(lr=1e-3), CpuBackend(2), checkpointing=True)
        feed = {tokens: np.maximum(tok[:, :-1], 0), targets: tok[:, 1:], pos: np.arange(t, dtype=np.int32),
                weights: model_losses.chunk_weights(tok[:, 1:], n)}
        losses = [st.step([feed], 1e-3) for _ in range(3)]
        runs[chunked] = (n, losses, {k: st.get(v) for k, v in params.items()}, st.memory.arena)
    (n0, l0, p0, a0), (n1, l1, p1, a1) = runs[False], runs[True]
    assert (n0, n1) == (1, 8)
    assert model_losses.loss_chunks(cfg, b * t, head_trained=True) == 1      # what TextRun asks without LoRA
    want = np_llama.loss(np_llama.forward(cfg, family_params(cfg, 0, std=0.1), np.maximum(tok[:, :-1], 0),
                                          np.arange(t))[tok[:, 1:] >= 0], tok[:, 1:][tok[:, 1:] >= 0])
    assert l0[0] == pytest.approx(want, rel=1e-5) and l1[0] == pytest.approx(want, rel=1e-5)
    np.testing.assert_allclose(l1, l0, rtol=1e-5)
    for k in p0:
        np.testing.assert_allclose(p1[k], p0[k], rtol=1e-4, atol=1e-6)
    if frozen_head:
        assert a1 < a0 / 2      # the (64, 2048) logits and their gradient dominate the unchunked plan


def test_every_family_has_test_cases():
    """Each registered family has a case against the float64 oracle (TINY_CASES), one against
    llama.cpp (INTEROP_CASES, tests/test_families.py) and a row of the oracle's facts, as every
    op has a row in the op table: a new family without them fails here."""
    for arch in FAMILIES_REGISTERED:
        assert any(kw["arch"] == arch for kw in TINY_CASES.values()), f"{arch}: no case in TINY_CASES"
        assert any(kw["arch"] == arch for kw in INTEROP_CASES.values()), f"{arch}: no case in INTEROP_CASES"
        assert arch in ORACLE, f"{arch}: no row in tests/family_cases.py's ORACLE"
    assert set(ORACLE) == set(FAMILIES_REGISTERED)
