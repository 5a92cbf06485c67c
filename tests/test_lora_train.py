"""LoRA on a frozen llama: gradients of every target's factors against float64 finite
differences of an independent forward pass, training that moves only the adapters, and a
frozen base in a quantized type."""
import dataclasses

import numpy as np
import pytest

from ggtrain.core import ops
from ggtrain.core.autograd import backward
from ggtrain.core.backend import StoredTensor
from ggtrain.core.backend_cpu import CpuBackend
from ggtrain.core.graph import Graph, Runtime
from ggtrain.core.models import losses as model_losses
from ggtrain.core.models.config import ModelConfig, init_params
from ggtrain.core.models.decoder import Inputs, Net, forward
from ggtrain.core.models.inference import Runner
from ggtrain.core.models.lora import Adapter, LoraConfig, factor_names, init_lora
from ggtrain.core.train import TextConfig, TextRun
from ggtrain.errors import ConfigError
from ggtrain.formats.quants import dequantize, quantize
from tests import np_decoder as np_llama

CFG = ModelConfig(vocab=11, dim=16, layers=2, heads=4, kv_heads=2, ff=24, ctx=8)
LORA = LoraConfig(rank=2, alpha=3.0)


def _factors(weights, seed, cfg=CFG, lora=LORA):
    """Random non-zero factors (so that both A's and B's gradients are non-zero); stacked
    experts' (E, r, n_in) and (E, n_out, r)."""
    rng = np.random.default_rng(seed)
    out = {}
    for w in lora.weights(cfg):
        *lead, n_out, n_in = weights[w].shape
        a, b = factor_names(w)
        out[a] = rng.normal(0, 0.5, (*lead, lora.rank, n_in)).astype(np.float32)
        out[b] = rng.normal(0, 0.5, (*lead, n_out, lora.rank)).astype(np.float32)
    return out


def _merged(weights, factors, cfg=CFG, lora=LORA):
    """float64 weights with W + (alpha / r) B A (per expert for stacked experts): what the
    adapters compute, independently."""
    out = {k: v.astype(np.float64) for k, v in weights.items()}
    for w in lora.weights(cfg):
        a, b = factor_names(w)
        out[w] = out[w] + lora.scale * factors[b].astype(np.float64) @ factors[a].astype(np.float64)
    return out


def _expert_case(name):
    from tests.family_cases import TINY, TINY_CASES
    cfg = ModelConfig(**{**TINY, **TINY_CASES[name]})
    return cfg, LoraConfig(rank=2, alpha=3.0, targets=("attn_q",) + cfg.family.expert_targets)


@pytest.mark.parametrize("arch", ["llama", "phi3", "qwen3moe", "gemma4-moe", "qwen35moe", "lfm2moe"])
def test_every_target_gets_the_finite_difference_gradient(arch):
    """Every target's A and B gradients against float64 finite differences of the numpy twin
    with the merged weights; phi3: the fused qkv and gate|up weights; qwen3moe, gemma4's MoE,
    qwen35moe and lfm2moe: the stacked experts' per-expert factors (--lora-targets naming
    them), gemma4's ffn_gate_up_exps and its down scale, lfm2moe's sigmoid routing included."""
    cfg, lora = _expert_case(arch) if arch not in ("llama", "phi3") else (dataclasses.replace(CFG, arch=arch),
                                                                               LORA)
    weights = init_params(cfg, seed=1, std=0.3)
    factors = _factors(weights, 2, cfg, lora)
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, cfg.vocab, (1, 6))
    upstream = rng.normal(size=(1, 6, cfg.vocab))

    def loss64(fac):
        return float((np_llama.forward(cfg, _merged(weights, fac, cfg, lora), tokens, np.arange(6)) * upstream).sum())

    g = Graph()
    base = {k: g.param(v.shape, v, name=k, trainable=False) for k, v in weights.items()}
    fac = {k: g.param(v.shape, v, name=k) for k, v in factors.items()}
    adapters = {w: Adapter(fac[factor_names(w)[0]], fac[factor_names(w)[1]], lora.scale) for w in lora.weights(cfg)}
    tok = g.const(tokens.astype(np.int32), dtype="i32")
    pos = g.const(np.arange(6, dtype=np.int32), dtype="i32")
    logits = forward(Net(cfg, base, adapters), Inputs(tok, pos))
    loss = ops.sum(ops.mul(logits, g.const(upstream)))
    grads = backward(loss, list(fac.values()), checkpointing=False)
    rt = Runtime(g, CpuBackend(2))
    plan = rt.compile([grads[t] for t in fac.values()])
    rt.run(plan)
    analytic = {k: plan.read(grads[t]) for k, t in fac.items()}
    h = 1e-6
    pick = np.random.default_rng(4)
    seen = set()
    for k, v in factors.items():
        flat = v.reshape(-1)
        for i in pick.choice(flat.size, min(4, flat.size), replace=False):
            plus, minus = dict(factors), dict(factors)
            plus[k] = v.astype(np.float64).copy()
            minus[k] = v.astype(np.float64).copy()
            plus[k].reshape(-1)[i] += h
            minus[k].reshape(-1)[i] -= h
            numeric = (loss64(plus) - loss64(minus)) / (2 * h)
            got = analytic[k].reshape(-1)[i]
            assert got == pytest.approx(numeric, rel=2e-3, abs=2e-3), (k, i)
            seen.add(k.split(".")[2])
    assert seen == set(lora.targets or cfg.family.lora_targets)          # attn_k and attn_v included


def _run(weights_frozen, steps=30, lora=LORA, cfg=CFG):
    tc = TextConfig(steps=steps, batch=2, lr=1e-2, lr_min=1e-2, warmup=0, weight_decay=0.0, grad_clip=1.0,
                    checkpointing=True)
    shapes = {w: weights_frozen[w].shape for w in lora.weights(cfg)}
    run = TextRun(cfg, init_lora(lora, shapes, 0), tc, CpuBackend(2), frozen=weights_frozen, lora=lora)
    rng = np.random.default_rng(5)
    data = np.tile(np.arange(cfg.vocab), 40)          # a pattern the base does not know

    class Windows:
        epoch = 0.0

        def next(self):
            s = rng.integers(0, len(data) - cfg.ctx - 1, 2)
            return np.stack([data[i:i + cfg.ctx + 1] for i in s]).astype(np.int32)

    losses, source = [], Windows()
    first = np.random.default_rng(5)
    s0 = first.integers(0, len(data) - cfg.ctx - 1, 2)
    first_batch = np.stack([data[i:i + cfg.ctx + 1] for i in s0]).astype(np.int32)
    run.fit(source, [], on_step=lambda info: losses.append(info["loss"]))
    return run, losses, first_batch


def test_training_moves_only_the_adapters():
    weights = init_params(CFG, seed=1, std=0.3)
    before = {k: v.copy() for k, v in weights.items()}
    run, losses, _ = _run(weights)
    assert losses[-1] < 0.5 * losses[0]
    for k, v in weights.items():
        np.testing.assert_array_equal(v, before[k])
    assert set(run.param_values()) == {n for w in LORA.weights(CFG) for n in factor_names(w)}


def test_initial_adapter_is_the_identity_and_quantized_base_stays_in_its_type():
    """B = 0 at the start (PEFT): the first loss is the base model's; a Q8_0 base is bound as
    stored bytes and its buffers are byte-identical after training."""
    cfg = ModelConfig(vocab=11, dim=32, layers=2, heads=4, kv_heads=2, ff=64, ctx=8)  # whole Q8_0 rows
    weights = init_params(cfg, seed=1, std=0.3)
    be = CpuBackend(2)
    stored = {}
    for k, v in weights.items():
        if v.ndim == 2:
            raw = quantize(v, "Q8_0").reshape(-1)
            buf = be.alloc(raw.size)
            buf.bytes[:] = raw
            stored[k] = StoredTensor(buf, "q8_0", v.shape)
        else:
            stored[k] = v
    copies = {k: w.buffer.bytes.copy() for k, w in stored.items() if isinstance(w, StoredTensor)}
    run, losses, first = _run(stored, steps=20, cfg=cfg)
    assert losses[-1] < 0.7 * losses[0]
    for k, raw in copies.items():
        assert np.array_equal(stored[k].buffer.bytes, raw), k
    # the first update's loss is the base model's loss on the same batch: B started at zero
    deq = {k: (dequantize(copies[k], "Q8_0", v.shape) if k in copies else v) for k, v in weights.items()}
    base = Runner(cfg, deq, CpuBackend(2), batch=2, length=cfg.ctx)
    want = base.nll(first[:, :-1], first[:, 1:]) / first[:, 1:].size
    assert losses[0] == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("kw, text", [(dict(rank=0), "--lora-rank"), (dict(targets=("attn_x",)), "attn_x"),
                                      (dict(alpha=0), "--lora-alpha"), (dict(dropout=1.0), "--lora-dropout"),
                                      (dict(targets=("attn_q", "attn_q")), "names a target twice")])
def test_bad_lora_settings(kw, text):
    with pytest.raises(ConfigError, match=text):
        LoraConfig(**kw)


def test_lora_dropout_trains_and_evaluates_without_masks():
    """With dropout the run still learns; evaluation uses no mask (it equals a dropout-free
    run's evaluation on the same factors), and resuming repeats the masks (same losses)."""
    weights = init_params(CFG, seed=1, std=0.3)
    drop = LoraConfig(rank=2, alpha=3.0, dropout=0.3)
    run, losses, first = _run(weights, steps=12, lora=drop)
    assert losses[-1] < losses[0]
    plain = TextRun(CFG, run.param_values(), TextConfig(steps=1, batch=2), CpuBackend(2), frozen=weights, lora=LORA)
    assert run.evaluate([first]) == plain.evaluate([first])
    again, losses2, _ = _run(weights, steps=12, lora=drop)
    assert losses2 == losses                      # the masks come from (seed, batch number)


def test_selective_checkpointing_gives_the_plain_gradients():
    """LoRA keeps the frozen products' outputs and recomputes the rest of each block: the
    gradients equal those of a run without checkpointing, bit for bit."""
    weights = init_params(CFG, seed=1, std=0.3)
    factors = _factors(weights, 7)
    batch = np.random.default_rng(8).integers(0, CFG.vocab, (2, CFG.ctx + 1)).astype(np.int32)
    grads, frozen_products, nodes = [], [], []
    for ck in (False, True):
        tc = TextConfig(steps=1, batch=2, lr=1e-2, lr_min=1e-2, warmup=0, checkpointing=ck)
        run = TextRun(CFG, factors, tc, CpuBackend(2), frozen=weights, lora=LORA)
        run.step.step([run.feed(batch)], lr=0.0)
        grads.append(run.step.get(run.step.grad_flat))
        rt = run.step.runtime
        frozen = {id(rt.buffer(t)) for t in run.graph.nodes if t.kind == "param" and not t.requires_grad}
        calls = run.step._update.plan.calls
        frozen_products.append(sum(c.kernel.startswith("matmul") and id(c.srcs[1].buffer) in frozen for c in calls))
        nodes.append(len(calls))
    assert np.array_equal(grads[0], grads[1])
    assert nodes[1] > nodes[0]                        # segments are recomputed ...
    assert frozen_products[1] == frozen_products[0]   # ... but not their frozen products


def test_packed_samples_have_the_losses_they_have_alone():
    """Three samples packed in one row (plus padding), positions restarting per sample and
    each attending only to itself: each sample's loss equals its loss run alone."""
    from ggtrain.core.data import pack

    weights = init_params(CFG, seed=1, std=0.3)
    rng = np.random.default_rng(9)
    samples = [(rng.integers(0, CFG.vocab, n).astype(np.int32), np.ones(n, bool)) for n in (4, 2, 3)]
    data, stats = pack(samples, CFG.ctx)
    assert data.rows == 1 and stats.padding == CFG.ctx - 6
    g = Graph()
    params = {k: g.param(v.shape, v, name=k, trainable=False) for k, v in weights.items()}
    tok, pos, seg = (g.const(getattr(data, k), dtype="i32") for k in ("tokens", "pos", "seg"))
    tgt = g.input((1, CFG.ctx), "i32")
    packed_loss = model_losses.loss(forward(Net(CFG, params), Inputs(tok, pos, seg=seg)), tgt)
    rt = Runtime(g, CpuBackend(2))
    plan = rt.compile([packed_loss])
    for i, (ids, _) in enumerate(samples):
        mine = np.where(data.seg == i, data.targets, -1)
        rt.set(tgt, mine)
        rt.run(plan)
        alone = Runner(CFG, weights, CpuBackend(2), length=len(ids) - 1)
        want = alone.nll(ids[None, :-1], ids[None, 1:]) / (len(ids) - 1)
        assert float(plan.read(packed_loss)) == pytest.approx(want, rel=1e-5), i
