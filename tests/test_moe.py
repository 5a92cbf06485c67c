"""Routed experts beyond the op table and the family table (tests/family_cases.py runs qwen3moe
against llama.cpp and the float64 oracle): stored expert weights through the matmul's own
row-dot kernel, a quantized MoE file against llama.cpp, LoRA that keeps the experts frozen,
a full fine-tune that trains them, bad files refused in one line."""
import gguf
import numpy as np
import pytest

from ggtrain.core import ops
from ggtrain.core.autograd import backward
from ggtrain.core.backend_cpu import CpuBackend
from ggtrain.core.graph import Graph, Runtime
from ggtrain.core.models.config import ModelConfig
from ggtrain.errors import ConfigError, DTypeError
from ggtrain.formats.gguf import read_gguf
from ggtrain.formats.quants import dequantize, quantize
from ggtrain.formats.model_file import load_model, save_model
from ggtrain.formats.tokenizer import ByteTokenizer
from tests import refs
from tests.family_cases import BASE, INTEROP_CASES
from tests.interop import open_llm, run_cli
from tests.test_decoder import family_params
from tests.test_families import TEXT, _eval_cli, _their_nll, write_with_gguf_py

# 8 experts, 2 a token; experts 1 and 6 get no token
IDS = np.array([[3, 0], [3, 5], [0, 2], [7, 5], [4, 0], [2, 7]], np.int32)


def _stored(w, wtype):
    """(what Graph.param takes for w stored as wtype, the f32 values it then holds)."""
    if wtype == "f16":
        return w.astype(np.float16), w.astype(np.float16).astype(np.float32)
    raw = quantize(w.reshape(-1, w.shape[-1]), wtype)
    return raw, dequantize(raw, wtype, w.shape)


def _run(g, outs, threads=2):
    rt = Runtime(g, CpuBackend(threads))
    plan = rt.compile(outs)
    rt.run(plan)
    return [plan.read(o) for o in outs]


@pytest.mark.parametrize("wtype", ["f16", "q8_0", "q4_0", "q4_k", "mxfp4"])
@pytest.mark.parametrize("threads", [1, 2])
def test_stored_experts_are_each_experts_own_matmul(wtype, threads):
    """moe_matmul over stored experts gives, for each expert, the bits of ops.matmul of the rows
    routed to it by that expert's slice stored alone (the same row-dot kernel); and the
    gradient to x equals the float64 one over the dequantized experts."""
    rng = np.random.default_rng(0)
    n, k, e, m, kk = IDS.shape[0], IDS.shape[1], 8, 40, 256
    x = rng.normal(size=(n, 1, kk)).astype(np.float32)
    w = rng.normal(size=(e, m, kk)).astype(np.float32)
    raw, deq = _stored(w, wtype)
    g = Graph()
    xt = g.param(x.shape, x)
    wt = g.param(w.shape, raw, trainable=False, dtype=wtype)
    ids = g.const(IDS, dtype="i32")
    y = ops.moe_matmul(xt, wt, ids)
    gy = rng.normal(size=(n, k, m)).astype(np.float32)
    loss = ops.sum(ops.mul(y, g.const(gy)))
    dx = backward(loss, [xt], checkpointing=False)[xt]
    got, got_dx = _run(g, [y, dx], threads)
    for ex in range(e):
        rows = [(i, s) for i in range(n) for s in range(k) if IDS[i, s] == ex]
        if not rows:
            continue
        g2 = Graph()
        xe = g2.const(np.stack([x[i, 0] for i, _ in rows]))
        we = g2.param((m, kk), _stored(w[ex], wtype)[0], trainable=False, dtype=wtype)
        want = _run(g2, [ops.matmul(xe, ops.transpose(we, 0, 1))], threads)[0]
        np.testing.assert_array_equal(np.stack([got[i, s] for i, s in rows]), want)
    np.testing.assert_allclose(got, refs.moe_matmul(x, deq, IDS), rtol=1e-4, atol=1e-3)
    want_dx = np.einsum("nsm,nsmk->nk", gy.astype(np.float64), deq[IDS].astype(np.float64))[:, None]
    np.testing.assert_allclose(got_dx, want_dx, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("wtype", ["f32", "q8_0"])
@pytest.mark.parametrize("X", [1, 2])
def test_grouped_expert_products_are_matmuls_at_every_thread_count(wtype, X):
    """Exact numerics gather each expert's routed rows into one GEMM (blocks of 256 rows: expert
    0 gets 300): y is, expert by expert, the bits of ops.matmul of its rows by its slice (the
    same GEMM chain); y, dx and dw (f32 experts) are the same bits at 1, 2 and 3 threads, and
    dx and dw the float64 gradients."""
    rng = np.random.default_rng(1)
    n, k, e, m, kk = 300, 2, 5, 72, 96
    ids = np.stack([np.zeros(n, np.int32), rng.integers(1, e - 1, n, dtype=np.int32)], 1)  # expert 4: none
    x = rng.normal(size=(n, X, kk)).astype(np.float32)
    w = rng.normal(size=(e, m, kk)).astype(np.float32)
    raw, deq = (w, w) if wtype == "f32" else _stored(w, wtype)
    gy = rng.normal(size=(n, k, m)).astype(np.float32)
    runs = []
    for threads in (1, 2, 3):
        g = Graph()
        xt = g.param(x.shape, x)
        wt = g.param(w.shape, raw, trainable=wtype == "f32", dtype=wtype)
        y = ops.moe_matmul(xt, wt, g.const(ids, dtype="i32"))
        grads = backward(ops.sum(ops.mul(y, g.const(gy))), [xt] + ([wt] if wtype == "f32" else []),
                         checkpointing=False)
        runs.append(_run(g, [y] + list(grads.values()), threads))
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            np.testing.assert_array_equal(a, b)
    got = runs[0][0]
    for ex in range(e - 1):
        rows = [(i, s) for i in range(n) for s in range(k) if ids[i, s] == ex]
        g2 = Graph()
        xe = g2.const(np.stack([x[i, 0 if X == 1 else s] for i, s in rows]))
        we = g2.param((m, kk), raw[ex] if wtype == "f32" else _stored(w[ex], wtype)[0], trainable=False, dtype=wtype)
        want = _run(g2, [ops.matmul(xe, ops.transpose(we, 0, 1))], 2)[0]
        np.testing.assert_array_equal(np.stack([got[i, s] for i, s in rows]), want)
    want_dx = np.zeros((n, X, kk))
    for s in range(k):
        want_dx[:, 0 if X == 1 else s] += np.einsum("nm,nmk->nk", gy[:, s].astype(np.float64), deq[ids[:, s]])
    np.testing.assert_allclose(runs[0][1], want_dx, rtol=1e-4, atol=1e-3)
    if wtype == "f32":
        want_dw = np.zeros((e, m, kk))
        for s in range(k):
            np.add.at(want_dw, ids[:, s], np.einsum("nm,nk->nmk", gy[:, s].astype(np.float64), x[:, 0 if X == 1 else s]))
        np.testing.assert_allclose(runs[0][2], want_dw, rtol=1e-4, atol=1e-3)
        assert not runs[0][2][e - 1].any()


def test_llama_numbers_of_quantized_experts_are_refused_by_name():
    g = Graph()
    w = g.param((8, 32, 256), quantize(np.ones((256, 256), np.float32), "q4_k"), trainable=False, dtype="q4_k")
    x, ids = g.input((3, 1, 256)), g.const(IDS[:3], dtype="i32")
    with pytest.raises(DTypeError, match="numerics llama.*q4_k experts are not implemented"):
        ops.moe_matmul(x, w, ids, numerics="llama")


def _model(tmp_path, name="m.gguf", case="qwen3moe", **over):
    tok = ByteTokenizer()
    cfg = ModelConfig(vocab=tok.n_vocab, **{**BASE, **INTEROP_CASES[case], **over})
    weights = family_params(cfg, seed=3, std=0.3)
    path = tmp_path / name
    write_with_gguf_py(path, cfg, weights, tok)
    return path, cfg, weights, tok


def test_quantized_moe_file_is_llama_cpps_model(llama, tmp_path):
    """Our writer's Q8_0 qwen3moe (experts Q8_0, the down experts' rows of 48 in F16, the router
    F32 as llama.cpp's quantizer keeps it): the stored experts stay stored, and ggtrain eval's
    NLL is llama.cpp's within what its 8-bit activations move it."""
    path, cfg, weights, tok = _model(tmp_path)
    q8 = tmp_path / "q8.gguf"
    save_model(q8, vars(cfg), weights, tok, out_type="q8_0")
    types = {n: t.type.name for n, t in read_gguf(q8).tensors.items()}
    assert types["blk.0.ffn_up_exps.weight"] == "Q8_0" and types["blk.1.ffn_down_exps.weight"] == "F16"
    assert types["blk.0.ffn_gate_inp.weight"] == "F32"
    data = tmp_path / "t.txt"
    data.write_text(TEXT)
    ids = tok.encode(TEXT, add_bos=tok.add_bos)
    theirs = _their_nll(open_llm(llama, q8), ids)[1]
    exact = _their_nll(open_llm(llama, path), ids)[1]
    ours = _eval_cli(q8, data)["nll"]
    assert abs(ours - theirs) < 0.02 and abs(theirs - exact) > 1e-4      # quantized, and ours is its model


def test_lora_on_quantized_experts_trains_attention_and_router_only(llama, tmp_path):
    """finetune (LoRA) on a model whose experts are Q8_0: the gradient flows back through the
    frozen stored experts; the adapter holds the attention's and the router's factors only, and
    llama.cpp applies it as ggtrain does."""
    path, cfg, weights, tok = _model(tmp_path)
    q8 = tmp_path / "q8.gguf"
    save_model(q8, vars(cfg), weights, tok, out_type="q8_0")
    data = tmp_path / "t.txt"
    data.write_text(TEXT * 8)
    adapter = tmp_path / "a.gguf"
    r = run_cli("finetune", "--model", q8, "--data", data, "--out", adapter, "--steps", 4, "--ctx", 32, "--batch", 2,
                "--lr", 3e-2, "--warmup", 0, "--val-split", 0, "--threads", 2, "--quiet")
    assert r.returncode == 0, r.stderr
    names = {t for t in read_gguf(adapter).tensors}
    assert {n.split(".")[2] for n in names} == {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_inp"}
    ids = tok.encode(TEXT, add_bos=tok.add_bos)
    base = _their_nll(open_llm(llama, q8), ids)[1]
    theirs = _their_nll(open_llm(llama, q8, lora=adapter), ids)[1]
    probe = tmp_path / "p.txt"
    probe.write_text(TEXT)
    assert abs(theirs - base) > 0.01
    assert abs(_eval_cli(q8, probe, "--lora", adapter)["nll"] - theirs) < 0.02


def test_full_finetune_trains_the_experts_and_router(llama, tmp_path):
    """finetune --full: every expert a token reached moves (and the router), experts no token
    reached do not; llama.cpp's NLL of the written model is ggtrain eval's."""
    path, cfg, weights, tok = _model(tmp_path)
    data = tmp_path / "t.txt"
    data.write_text(TEXT * 8)
    out = tmp_path / "full.gguf"
    r = run_cli("finetune", "--model", path, "--data", data, "--out", out, "--full", "--steps", 2, "--ctx", 32,
                "--batch", 2, "--lr", 1e-3, "--warmup", 0, "--val-split", 0, "--threads", 2, "--quiet")
    assert r.returncode == 0, r.stderr
    _, trained, _ = load_model(out)
    for name in ("blk.0.ffn_gate_inp.weight", "blk.1.ffn_down_exps.weight", "blk.0.ffn_up_exps.weight"):
        assert not np.array_equal(trained[name], weights[name]), name
    probe = tmp_path / "p.txt"
    probe.write_text(TEXT)
    ids = tok.encode(TEXT, add_bos=tok.add_bos)
    assert _eval_cli(out, probe)["nll"] == pytest.approx(_their_nll(open_llm(llama, out), ids)[1], abs=2e-5)


def test_expert_counts_are_checked_by_key():
    with pytest.raises(ConfigError, match=r"qwen3moe.expert_used_count = 9 exceeds qwen3moe.expert_count = 8"):
        ModelConfig(vocab=64, arch="qwen3moe", experts=8, experts_used=9)
    with pytest.raises(ConfigError, match="the family has no experts"):
        ModelConfig(vocab=64, arch="qwen3", experts=8)


def _rewrite(src, dst, key, value):
    """src with one key's value changed (or dropped: None), through gguf-py."""
    f = read_gguf(src)
    w = gguf.GGUFWriter(str(dst), f.kv["general.architecture"].value)
    for k, v in f.kv.items():
        if k.startswith(("general.architecture", "GGUF.")):
            continue
        if k == key:
            if value is not None:
                w.add_uint32(k, value)
            continue
        val = v.value.tolist() if isinstance(v.value, np.ndarray) else v.value
        w.add_key_value(k, val, v.type, sub_type=getattr(v, "item_type", None))
    for name in f.tensors:
        w.add_tensor(name, f.tensor_f32(name).reshape(tuple(f.tensors[name].shape)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.parametrize("key,value,message", [
    ("qwen3moe.expert_count", 6, "tensor 'blk.0.ffn_gate_inp.weight' has shape (8, 64), expected (6, 64)"),
    ("qwen3moe.expert_used_count", 9, "qwen3moe.expert_used_count = 9 exceeds qwen3moe.expert_count = 8"),
    ("qwen3moe.expert_feed_forward_length", 40, "tensor 'blk.0.ffn_gate_exps.weight' has shape (8, 48, 64), "
                                                 "expected (8, 40, 64)"),
    ("qwen3moe.expert_count", None, "expert_count"),
    ("qwen35moe.expert_count", 6, "tensor 'blk.0.ffn_gate_inp.weight' has shape (8, 64), expected (6, 64)"),
    ("qwen35moe.expert_shared_feed_forward_length", 40, "tensor 'blk.0.ffn_gate_shexp.weight' has shape (96, 64), "
                                                         "expected (40, 64)"),
    ("lfm2moe.expert_count", 6, "tensor 'blk.1.ffn_gate_inp.weight' has shape (8, 64), expected (6, 64)"),
    ("lfm2moe.leading_dense_block_count", 2, "missing tensor 'blk.1.ffn_gate.weight'"),
    ("lfm2moe.expert_gating_func", 3, "lfm2moe.expert_gating_func = 3: a gating ggtrain does not compute"),
    ("lfm2moe.expert_gating_func", None, "lfm2moe key 'lfm2moe.expert_gating_func' is missing"),
])
def test_bad_moe_file_is_one_line_and_writes_nothing(tmp_path, key, value, message):
    """A file whose expert keys do not match its tensors (or lack one): one line naming the key
    or the tensor, exit 1, nothing written."""
    path = _rewrite(_model(tmp_path, case=key.split(".")[0])[0], tmp_path / "bad.gguf", key, value)
    data = tmp_path / "t.txt"
    data.write_text(TEXT * 4)
    out = tmp_path / "a.gguf"
    r = run_cli("finetune", "--model", path, "--data", data, "--out", out, "--steps", 1, "--ctx", 16, "--quiet")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and message in r.stderr, r.stderr
    assert str(path) in r.stderr and not out.exists()


@pytest.mark.parametrize("arch", ["qwen3moe", "olmoe"])
def test_each_family_weights_its_experts_as_llama_cpp_fixes_it(arch, monkeypatch):
    """qwen3moe renormalises the k gate weights, olmoe does not (llama.cpp's norm_w, fixed per
    family): the decoder gives the float64 oracle's logits with its family's choice, and the
    other choice moves them."""
    from ggtrain.core.models.inference import Runner
    from tests import np_decoder
    from tests.family_cases import ORACLE, TINY, TINY_CASES
    cfg = ModelConfig(**{**TINY, **TINY_CASES[arch]})
    weights = family_params(cfg, seed=1, std=0.3)
    ids = np.random.default_rng(0).integers(0, cfg.vocab, (1, 7))
    ours = Runner(cfg, weights, CpuBackend(2), length=7).logits(ids.astype(np.int32))
    want = np_decoder.forward(cfg, weights, ids, np.arange(7))
    np.testing.assert_allclose(ours, want, rtol=1e-4, atol=1e-4)
    monkeypatch.setitem(ORACLE, arch, {**ORACLE[arch], "moe_norm": not ORACLE[arch].get("moe_norm")})
    other = np_decoder.forward(cfg, weights, ids, np.arange(7))
    assert np.abs(other - want).max() > 1e-2


def test_lfm2moe_selection_bias_and_sigmoid_gating_move_the_model():
    """The interop case's lfm2moe (tests/test_families.py checks it against llama.cpp): its
    selection bias changes which experts tokens take, and the decoder gives the float64
    oracle's logits, which move without the bias or with softmax gating (so llama.cpp's
    agreement tests both); the bias is never trained."""
    from ggtrain.core.models.config import trainable
    from ggtrain.core.models.inference import Runner
    from tests import np_decoder
    cfg = ModelConfig(vocab=ByteTokenizer().n_vocab, **{**BASE, **INTEROP_CASES["lfm2moe"]})
    weights = family_params(cfg, seed=3, std=0.3)
    ids = np.random.default_rng(0).integers(0, cfg.vocab, (1, 24))
    ours = Runner(cfg, weights, CpuBackend(2), length=24).logits(ids.astype(np.int32))
    want = np_decoder.forward(cfg, weights, ids, np.arange(24))
    np.testing.assert_allclose(ours, want, rtol=1e-4, atol=1e-4)
    unbiased = {k: np.zeros_like(v) if k.endswith("exp_probs_b.bias") else v for k, v in weights.items()}
    assert np.abs(np_decoder.forward(cfg, unbiased, ids, np.arange(24)) - want).max() > 1e-2
    softmax = ModelConfig(**{**vars(cfg), "expert_gating": 1})
    assert np.abs(np_decoder.forward(softmax, weights, ids, np.arange(24)) - want).max() > 1e-2
    assert not trainable("blk.1.exp_probs_b.bias") and trainable("blk.1.ffn_gate_inp.weight")


def test_olmoe_needs_as_many_kv_heads_as_heads(tmp_path):
    """llama.cpp's OLMoE norms q and k over n_embd: `train --arch olmoe` with grouped KV heads is
    one line naming why, nothing written."""
    data = tmp_path / "t.txt"
    data.write_text(TEXT * 4)
    out = tmp_path / "m.gguf"
    r = run_cli("train", "--arch", "olmoe", "--data", data, "--out", out, "--dim", 32, "--layers", 1, "--heads", 4,
                "--kv-heads", 2, "--steps", 1, "--quiet")
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "kv_heads (2) must equal heads (4)" in r.stderr and not out.exists()


@pytest.mark.parametrize("arch", ["qwen3moe", "olmoe"])
def test_f16_experts_in_llama_cpp_numbers_are_its_own(llama, tmp_path, arch):
    """An F16 MoE file (our writer's): in llama.cpp's numbers (--numerics llama) the logits are
    llama.cpp's (F32 KV cache) bit for bit at every position, fed a token at a time and all at
    once: the experts' products in its mul_mat_id order (x rounded to f16, its f16 vec_dot)."""
    from ggtrain.core.models.inference import Decoder, Runner
    from ggtrain.core.numerics import LLAMA
    from ggtrain.formats.model_file import open_model
    tok = ByteTokenizer()
    cfg = ModelConfig(vocab=tok.n_vocab, **{**BASE, **INTEROP_CASES[arch]})
    path = tmp_path / "f16.gguf"
    save_model(path, vars(cfg), family_params(cfg, seed=3, std=0.3), tok, out_type="f16")
    assert read_gguf(path).tensors["blk.0.ffn_down_exps.weight"].type.name == "F16"
    be = CpuBackend(2)
    mcfg, weights, _ = open_model(path, be)
    ids = tok.encode(TEXT[:40], add_bos=True).tolist()
    llm = open_llm(llama, path)
    llm.reset()
    for t in ids:
        llm.eval([t])
    one = np.array(llm.scores[:len(ids)], np.float32)
    llm.reset()
    llm.eval(ids)
    batched = np.array(llm.scores[:len(ids)], np.float32)
    dec = Decoder(ModelConfig(**mcfg), weights, be, n_ctx=256, numerics=LLAMA)
    np.testing.assert_array_equal(np.concatenate([dec.feed([t], every=True) for t in ids]), one)
    runner = Runner(ModelConfig(**mcfg), weights, be, length=len(ids), numerics=LLAMA, n_ctx=256)
    np.testing.assert_array_equal(runner.logits(np.asarray(ids, np.int32)[None])[0, :len(ids)], batched)


def test_olmoe_without_its_output_matrix_is_refused(tmp_path):
    """llama.cpp's OLMoE requires output.weight: a file without it (a tied output) is one line
    naming it, as llama.cpp could not load what ggtrain would write from it."""
    tok = ByteTokenizer()
    cfg = ModelConfig(vocab=tok.n_vocab, **{**BASE, **INTEROP_CASES["olmoe"]})
    weights = family_params(cfg, seed=3, std=0.3)
    del weights["output.weight"]
    object.__setattr__(cfg, "tied", True)
    path = tmp_path / "tied.gguf"
    write_with_gguf_py(path, cfg, weights, tok)
    data = tmp_path / "t.txt"
    data.write_text(TEXT)
    r = run_cli("eval", "--model", path, "--data", data)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "olmoe needs output.weight" in r.stderr and str(path) in r.stderr


@pytest.mark.parametrize("out_type", ["q4_k_m", "q2_k", "q3_k_s", "mxfp4_moe"])
def test_eight_expert_mixtures_are_llama_cpps_quantizer(llama, tmp_path, out_type):
    """A qwen3moe model of exactly 8 experts quantized as llama_model_quantize does, byte for
    byte: its rules for 8-expert models (attn_v, attn_k Q8_0; attn_output Q5_K), the experts'
    ffn_down ranked by the layer in their names, and MXFP4_MOE's experts MXFP4, the rest Q8_0."""
    from ggtrain.core.models.config import init_params
    from ggtrain.formats.mixture import MIXTURES
    from ggtrain.formats.model_file import rewrite_model
    from tests.interop import quantize_with_llama_cpp, same_model_files

    tok = ByteTokenizer()
    cfg = dict(arch="qwen3moe", vocab=tok.n_vocab, dim=256, layers=8, heads=4, kv_heads=2, head_dim=64, experts=8,
               experts_used=2, expert_ff=256, ff=512, ctx=64)
    src, ref, ours = tmp_path / "src.gguf", tmp_path / "ref.gguf", tmp_path / "ours.gguf"
    save_model(src, cfg, init_params(ModelConfig(**cfg), seed=1, std=0.02), tok, out_type="f32")
    quantize_with_llama_cpp(llama, src, ref, MIXTURES[out_type].file_type)
    rewrite_model(ours, src, out_type=out_type)
    same_model_files(ours, ref)


def _balance64(z, ids, k, gating="softmax"):
    """The load-balancing loss in float64: E * sum_e f_e P_e, f_e the share of the routed
    slots ids (N, k) that go to e, P_e the mean of softmax(z (N, E))[:, e] (with sigmoid
    gating: the sigmoids of z normalised over the experts)."""
    n, e = z.shape
    p = np.exp(z - z.max(-1, keepdims=True)) if gating == "softmax" else 1 / (1 + np.exp(-z))
    p /= p.sum(-1, keepdims=True)
    f = np.bincount(ids.reshape(-1), minlength=e) / (n * k)
    return e * float((f * p.mean(0)).sum())


@pytest.mark.parametrize("gating", ["softmax", "sigmoid"])
def test_load_balance_loss_and_its_gradient_are_the_float64_ones(gating):
    """ffns.load_balance_loss of router logits (12 tokens, 8 experts, 2 a token), the router's
    probabilities its softmax or its sigmoids normalised over the experts: the float64 loss, its
    gradient to the logits the float64 finite differences (the routing held, as it is piecewise
    constant); the routing is moe_topk's."""
    from ggtrain.core.models.ffns import load_balance_loss
    rng = np.random.default_rng(5)
    z = rng.normal(0, 1.5, (12, 8)).astype(np.float32)
    g = Graph()
    logits = g.param(z.shape, z, name="logits")
    ids = ops.moe_topk(logits, 2, gating)
    loss = load_balance_loss(logits, ids, gating)
    grad = backward(loss, [logits], checkpointing=False)[logits]
    got, got_ids, got_grad = _run(g, [loss, ids, grad])
    want_ids = np.argsort(-z, axis=-1, kind="stable")[:, :2]
    np.testing.assert_array_equal(got_ids, want_ids)
    assert float(got) == pytest.approx(_balance64(z.astype(np.float64), want_ids, 2, gating), rel=1e-6)
    assert float(got) > 1.0                 # this routing is not balanced
    h, fd = 1e-6, np.zeros_like(z, np.float64)
    for i in np.ndindex(z.shape):
        plus, minus = z.astype(np.float64), z.astype(np.float64)
        plus[i] += h
        minus[i] -= h
        fd[i] = (_balance64(plus, want_ids, 2, gating) - _balance64(minus, want_ids, 2, gating)) / (2 * h)
    np.testing.assert_allclose(got_grad, fd, rtol=1e-4, atol=1e-6)


def _router_balance64(cfg, weights, window):
    """(NLL, mean over the routed layers of their balance loss) of one window batch (B, T+1)
    in float64: the numpy twin's router inputs (taps) times ffn_gate_inp, top-k as moe_topk."""
    from tests import np_decoder
    taps = {}
    x, y = window[:, :-1], window[:, 1:]
    logits = np_decoder.forward(cfg, weights, x, np.arange(x.shape[1]), taps=taps)
    nll = float(np_decoder.loss(logits, y))
    terms = []
    for i in range(cfg.layers):
        name = f"blk.{i}.ffn_gate_inp.weight"
        z = taps[name][0].reshape(-1, cfg.dim) @ np.asarray(weights[name], np.float64).T
        terms.append(_balance64(z, np.argsort(-z, axis=-1, kind="stable")[:, :cfg.experts_used], cfg.experts_used))
    return nll, float(np.mean(terms))


def test_moe_aux_loss_trains_the_routers_on_the_float64_balance_loss():
    """TextRun with moe_aux_loss c on a tiny qwen3moe (gradient checkpointing on): the training
    loss is the float64 NLL plus c times the mean of the layers' balance losses, the validation
    loss the NLL alone; one SGD update moves the routers by c times the balance loss's float64
    finite-difference gradient more than the run without it (the first layer's router feeding
    the second layer's balance too)."""
    from ggtrain.core.train import TextConfig, TextRun
    from tests.family_cases import TINY, TINY_CASES
    cfg = ModelConfig(**{**TINY, **TINY_CASES["qwen3moe"]})
    weights = family_params(cfg, seed=2, std=0.3)
    window = np.random.default_rng(6).integers(0, cfg.vocab, (2, cfg.ctx + 1)).astype(np.int32)
    c = 0.5

    def step(aux):
        tc = TextConfig(steps=1, batch=2, lr=1.0, lr_min=1.0, warmup=0, weight_decay=0.0, grad_clip=0.0,
                        optimizer="sgd", moe_aux_loss=aux)
        run = TextRun(cfg, weights, tc, CpuBackend(2))
        val = run.evaluate([window])

        class Source:
            epoch = 0.0

            def next(self):
                return window

        seen = []
        run.fit(Source(), [], on_step=lambda info: seen.append(info["loss"]))
        return run, val, seen[0]

    nll, balance = _router_balance64(cfg, weights, window)
    run, val, loss = step(c)
    plain, plain_val, plain_loss = step(0.0)
    assert val == pytest.approx(nll, abs=1e-5) and plain_val == pytest.approx(nll, abs=1e-5)
    assert plain_loss == pytest.approx(nll, abs=1e-5)
    assert loss == pytest.approx(nll + c * balance, abs=1e-5) and balance > 1.0
    trained, untrained = run.param_values(), plain.param_values()
    pick = [(0, 1, 3), (0, 6, 17), (1, 2, 5), (1, 7, 30)]
    h = 1e-6
    for layer, e, j in pick:
        name = f"blk.{layer}.ffn_gate_inp.weight"
        plus, minus = dict(weights), dict(weights)
        for d, sign in ((plus, 1), (minus, -1)):
            w = np.asarray(weights[name], np.float64).copy()
            w[e, j] += sign * h
            d[name] = w
        fd = (_router_balance64(cfg, plus, window)[1] - _router_balance64(cfg, minus, window)[1]) / (2 * h)
        moved = (untrained[name][e, j] - trained[name][e, j]) / c          # lr 1: the extra step is c * gradient
        assert moved == pytest.approx(fd, rel=2e-3, abs=2e-5), (name, e, j)
