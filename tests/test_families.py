"""Every model family against real llama.cpp (llama-cpp-python, the `interop` extra).

Tiny random-weight models of each family are written by gguf-py (not our writer) with the
keys and tensor names of llama.cpp's converters, and what sets each family apart: llama 3's
rope_freqs factors and a head size (attention.key_length) that is not n_embd / n_head,
linear rope scaling, qwen2's q/k/v biases with a tied output, qwen3's q/k norms with a wide
head. For each: `ggtrain eval`'s NLL equals llama.cpp's (F32 KV cache) to ~1e-5, and a LoRA
adapter `ggtrain finetune` trains, and its merged model, give in llama.cpp what they give in
ggtrain.
"""
import json
import re

import gguf
import numpy as np
import pytest

from ggtrain.core.backend_cpu import CpuBackend
from ggtrain.core.sampling import Sampler
from ggtrain.core.models.inference import Decoder, Runner, generate
from ggtrain.core.models.config import ModelConfig
from ggtrain.core.models.families import FAMILIES
from ggtrain.formats.gguf import read_gguf
from ggtrain.formats.lora import lora_adapters
from ggtrain.formats.model import validate_model
from ggtrain.formats.model_file import load_model
from ggtrain.formats.tokenizer import ByteTokenizer
from ggtrain.core.numerics import LLAMA
from tests import np_decoder
from tests.interop import open_llm, run_cli, run_here
from tests.family_cases import BASE, INTEROP_CASES, ORACLE, SCRATCH_KV_HEADS
from tests.test_decoder import family_params

CASES = INTEROP_CASES
TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
        "First Citizen:\nYou are all resolved rather to die than to famish?\n")
# random weights at std 0.3 give peaked logits; NLLs agree to float32 rounding
NLL_ATOL = 2e-5
LOGITS_ATOL = 1e-3
# GeGLU families: llama.cpp's CPU gelu reads a table of f16 values at x rounded to f16
# (GGML_GELU_FP16), ~1e-3 relative; ours is exact. The NLLs then differ by ~1e-4, and the
# float64 twin with that table (np_decoder.ggml_gelu_f16) meets llama.cpp to NLL_ATOL, which
# the test checks too: the wider tolerance covers the table and nothing else.
GELU_NLL_ATOL, GELU_LOGITS_ATOL = 3e-4, 1e-2
# logits of a family not in llama.cpp's bits (ORACLE llama_bits=False): f32 rounding apart
LOGITS_BITS_ATOL = 1e-4


def _gguf_py_names(arch: str, layers: int) -> set:
    """Every tensor name gguf-py (llama.cpp's own table) knows for arch, for `layers` blocks."""
    a = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = set()
    for t in gguf.MODEL_TENSORS[a]:
        for i in range(layers):
            base = gguf.TENSOR_NAMES[t].format(bid=i)
            names |= {base, base + ".weight", base + ".bias", base + ".scale"}     # ssm_a has no suffix
    return names


def write_with_gguf_py(path, cfg: ModelConfig, weights: dict, tok, *, f16: tuple = (),
                       types: dict | None = None) -> None:
    """A model file as llama.cpp's converters write it, through gguf-py's GGUFWriter: the
    tensors whose names end with one of f16 stored as F16; types: the tensors stored in another
    ggml type (name -> GGMLQuantizationType), by gguf-py's quantizer; the rest F32."""
    w = gguf.GGUFWriter(str(path), cfg.arch)
    w.add_name("tiny")     # llama.cpp gives names with "phi3" special tokens our byte vocabulary lacks
    w.add_context_length(cfg.ctx)
    w.add_embedding_length(cfg.dim)
    w.add_feed_forward_length(list(cfg.ff) if isinstance(cfg.ff, tuple) else cfg.ff)
    w.add_block_count(cfg.layers)
    w.add_head_count(cfg.heads)
    w.add_head_count_kv(list(cfg.kv_heads) if isinstance(cfg.kv_heads, tuple) else cfg.kv_heads)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_rope_freq_base(cfg.rope_base)
    w.add_rope_dimension_count(cfg.n_rot)
    if cfg.head_dim != cfg.dim // cfg.heads and cfg.arch != "gemma4":
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if cfg.rope_scale != 1.0 and cfg.rope_yarn:     # as gpt-oss's converter (the betas llama.cpp does not read)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(cfg.rope_scale)
        w.add_rope_scaling_orig_ctx_len(cfg.rope_orig_ctx)
        w.add_rope_scaling_yarn_beta_fast(32.0)
        w.add_rope_scaling_yarn_beta_slow(1.0)
    elif cfg.rope_scale != 1.0:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(cfg.rope_scale)
    if cfg.window:
        w.add_sliding_window(cfg.window)
        flags = cfg.swa_layers if isinstance(cfg.swa_layers, tuple) and cfg.swa_layers else None   # gemma4's as given
        w.add_sliding_window_pattern([bool(x) for x in flags] if flags else [cfg.local(i) for i in range(cfg.layers)])
        if not cfg.family.swa_rope_global:      # (gpt-oss's converter writes none: the global base)
            w.add_rope_freq_base_swa(cfg.rope_base_swa)
    if cfg.logit_softcap:
        w.add_final_logit_softcapping(cfg.logit_softcap)
    if cfg.arch == "granite":
        w.add_embedding_scale(cfg.embedding_scale)
        w.add_residual_scale(cfg.residual_scale)
        w.add_attention_scale(cfg.attn_scale)
        w.add_logit_scale(cfg.logit_scale)
    if cfg.arch == "phi3":      # the converter writes Phi's window; llama.cpp disables it (so do we)
        w.add_sliding_window(16)
    if cfg.arch in ("lfm2", "lfm2moe"):
        w.add_shortconv_l_cache(cfg.shortconv_l)
    if cfg.arch == "lfm2moe":     # as its converter: num_dense_layers, sigmoid gating
        w.add_leading_dense_block_count(cfg.dense_lead)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType(cfg.expert_gating))
    if cfg.experts:
        w.add_expert_count(cfg.experts)
        w.add_expert_used_count(cfg.experts_used)
    if cfg.expert_ff:     # Qwen3MoE's config has moe_intermediate_size; OLMoE's experts are n_ff wide
        w.add_expert_feed_forward_length(cfg.expert_ff)
    if cfg.shexp_ff:      # Qwen3.5-MoE's shared_expert_intermediate_size
        w.add_expert_shared_feed_forward_length(cfg.shexp_ff)
    if cfg.arch == "gemma4":    # as its converter: the local layers' heads, the layers sharing KV
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_key_length_swa(cfg.head_dim_swa)
        w.add_value_length_swa(cfg.head_dim_swa)
        w.add_rope_dimension_count_swa(cfg.rope_dims_swa or cfg.n_rot)
        w.add_shared_kv_layers(cfg.shared_kv)
        w.add_embedding_length_per_layer_input(cfg.per_layer_dim)
    if cfg.arch in ("qwen35", "qwen35moe"):
        w.add_ssm_conv_kernel(cfg.ssm_conv)
        w.add_ssm_inner_size(cfg.ssm_inner)
        w.add_ssm_state_size(cfg.ssm_state)
        w.add_ssm_time_step_rank(cfg.ssm_heads)
        w.add_ssm_group_count(cfg.ssm_groups)
        w.add_full_attention_interval(cfg.attn_interval)
        w.add_rope_dimension_sections(list(cfg.rope_sections))
    if cfg.rope_long:
        w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
        w.add_rope_scaling_orig_ctx_len(cfg.rope_orig_ctx)
        w.add_rope_scaling_attn_factors(cfg.rope_attn_factor)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for key, value, vt, *sub in tok.gguf_kv():
        value = value.tolist() if isinstance(value, np.ndarray) else value
        w.add_key_value(key, value, vt, sub_type=sub[0] if sub else None)
    for name, v in weights.items():
        v = np.ascontiguousarray(v, np.float32)
        if types and name in types:
            w.add_tensor(name, gguf.quants.quantize(v, types[name]), raw_dtype=types[name])
        else:
            w.add_tensor(name, v.astype(np.float16) if f16 and name.endswith(f16) else v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def check_packed_pair(cfg, weights) -> None:
    """Two samples packed in one row (positions restarting, segments by sample): each one's
    logits are those of the sample alone by the float64 oracle (the recurrent and attention
    layers' packed-sample tests of each family)."""
    from ggtrain.core.graph import Graph, Runtime
    from ggtrain.core.models.decoder import Inputs, Net, forward

    rng = np.random.default_rng(5)
    a, b = rng.integers(0, cfg.vocab, 4), rng.integers(0, cfg.vocab, 5)
    g = Graph()
    params = {k: g.param(v.shape, v, name=k, trainable=False) for k, v in weights.items()}
    tokens, pos, seg = (g.input((1, 9), "i32", name=n) for n in ("tokens", "pos", "seg"))
    logits = forward(Net(cfg, params), Inputs(tokens, pos, seg=seg))
    rt = Runtime(g, CpuBackend(2))
    rt.set(tokens, np.concatenate([a, b])[None].astype(np.int32))
    rt.set(pos, np.array([[0, 1, 2, 3, 0, 1, 2, 3, 4]], np.int32))
    rt.set(seg, np.array([[0] * 4 + [1] * 5], np.int32))
    plan = rt.compile([logits])
    rt.run(plan)
    got = plan.read(logits)[0]
    for ids, rows in ((a, slice(0, 4)), (b, slice(4, 9))):
        want = np_decoder.forward(cfg, weights, ids[None], np.arange(len(ids)))[0]
        np.testing.assert_allclose(got[rows], want, rtol=1e-4, atol=1e-5)


def check_finetune_refuses(tmp_path, path, message: str) -> str:
    """`finetune` on a bad model file: one line naming the file and `message`, exit 1, no output.
    Returns that line."""
    data = tmp_path / "t.txt"
    data.write_text(TEXT * 4)
    out = tmp_path / "a.gguf"
    r = run_cli("finetune", "--model", path, "--data", data, "--out", out, "--steps", 1, "--ctx", 16, "--quiet")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and message in r.stderr, r.stderr
    assert str(path) in r.stderr and not out.exists()
    return r.stderr


@pytest.fixture(scope="module", params=list(CASES))
def family_model(request, tmp_path_factory):
    """(path, ModelConfig, f32 weights, tokenizer) of a tiny model of one family, by gguf-py."""
    tok = ByteTokenizer()
    cfg = ModelConfig(vocab=tok.n_vocab, **{**BASE, **CASES[request.param]})
    weights = family_params(cfg, seed=3, std=0.3)
    path = tmp_path_factory.mktemp("families") / f"{request.param}.gguf"
    write_with_gguf_py(path, cfg, weights, tok)
    return path, cfg, weights, tok


def _their_nll(llm, ids) -> tuple:
    """llama.cpp's logits of ids[:-1] (n, V) and the mean NLL of ids[1:] under them (float64)."""
    llm.reset()
    llm.eval(list(ids[:-1]))
    logits = np.array(llm.scores[:len(ids) - 1], dtype=np.float64)
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return logits, float(-logp[np.arange(len(ids) - 1), ids[1:]].mean())


def _eval_cli(model, data, *extra) -> dict:
    res = run_here("eval", "--model", model, "--data", data, "--json", "--threads", 2, *extra)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_family_tensors_are_llama_cpps(family_model):
    path, cfg, weights, _ = family_model
    assert set(weights) <= _gguf_py_names(cfg.arch, cfg.layers)        # names llama.cpp knows for the arch
    layout = validate_model(read_gguf(path))
    assert layout.config == cfg


def _atol(cfg) -> tuple:
    """(NLL, logits) tolerances against llama.cpp for cfg's family."""
    return (GELU_NLL_ATOL, GELU_LOGITS_ATOL) if cfg.family.act == "gelu" else (NLL_ATOL, LOGITS_ATOL)


def _nll(logits, ids) -> float:
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return float(-logp[np.arange(len(ids) - 1), ids[1:]].mean())


def test_family_nll_equals_llama_cpp(llama, family_model, tmp_path):
    path, cfg, weights, tok = family_model
    data = tmp_path / "t.txt"
    data.write_text(TEXT)
    ids = tok.encode(TEXT, add_bos=tok.add_bos)
    theirs_logits, theirs = _their_nll(open_llm(llama, path), ids)
    ours = _eval_cli(path, data)
    nll_atol, logits_atol = _atol(cfg)
    assert ours["tokens"] == len(ids) - 1
    assert ours["nll"] == pytest.approx(theirs, abs=nll_atol)
    runner = Runner(cfg, weights, CpuBackend(2), length=len(ids) - 1)
    logits = runner.logits(np.asarray(ids[:-1], np.int32)[None])[0]
    np.testing.assert_allclose(logits, theirs_logits, rtol=0, atol=logits_atol)
    # ours is the exact float64 model; with llama.cpp's f16 gelu table the twin is llama.cpp
    twin = np_decoder.forward(cfg, weights, np.array([ids[:-1]]), np.arange(len(ids) - 1))[0]
    assert ours["nll"] == pytest.approx(_nll(twin, ids), abs=NLL_ATOL)
    if cfg.family.act == "gelu":
        table = np_decoder.forward(cfg, weights, np.array([ids[:-1]]), np.arange(len(ids) - 1),
                                   gelu=np_decoder.ggml_gelu_f16)[0]
        assert _nll(table, ids) == pytest.approx(theirs, abs=NLL_ATOL)


def test_family_lora_and_merged_model_equal_llama_cpp(llama, family_model, tmp_path):
    """finetune trains an adapter on the family (a few steps at a high rate, so it moves the
    logits); llama.cpp applies it, and loads the merged model, as ggtrain does."""
    path, cfg, weights, tok = family_model
    data = tmp_path / "t.txt"
    data.write_text(TEXT * 8)
    adapter, merged = tmp_path / "a.gguf", tmp_path / "m.gguf"
    res = run_here("finetune", "--model", path, "--data", data, "--out", adapter, "--merged-out", merged,
                   "--steps", 4, "--ctx", 32, "--batch", 2, "--lr", 3e-2, "--warmup", 0, "--val-split", 0,
                   "--threads", 2, "--quiet")
    assert res.returncode == 0, res.stderr
    ids = tok.encode(TEXT, add_bos=tok.add_bos)
    nll_atol, logits_atol = _atol(cfg)
    base_nll = _their_nll(open_llm(llama, path), ids)[1]
    lora_logits, lora_nll = _their_nll(open_llm(llama, path, lora=adapter), ids)
    assert abs(lora_nll - base_nll) > 0.01                  # the adapter changes the model
    probe = tmp_path / "probe.txt"
    probe.write_text(TEXT)
    assert _eval_cli(path, probe, "--lora", adapter)["nll"] == pytest.approx(lora_nll, abs=nll_atol)
    assert _their_nll(open_llm(llama, merged), ids)[1] == pytest.approx(lora_nll, abs=nll_atol)
    assert _eval_cli(merged, probe)["nll"] == pytest.approx(lora_nll, abs=nll_atol)
    adapters = lora_adapters(adapter, {n: w.shape for n, w in weights.items()}, 1.0, cfg.arch)
    assert {n.split(".", 2)[2][:-len(".weight")] for n in adapters} == set(cfg.family.lora_targets)
    runner = Runner(cfg, weights, CpuBackend(2), length=len(ids) - 1, adapters=adapters)
    np.testing.assert_allclose(runner.logits(np.asarray(ids[:-1], np.int32)[None])[0], lora_logits,
                               rtol=0, atol=logits_atol)
    mcfg, mweights, _ = load_model(merged)
    assert ModelConfig(**mcfg) == cfg and set(mweights) == set(weights)


def _rewrite_keys(src, dst, weights: dict, arch: str, drop: str = "", add=()):
    """src's keys and weights rewritten through gguf-py into dst: its architecture arch (the
    arch-prefixed keys renamed), without the key drop, with the (key, value) pairs of add
    (a str, a bool or a uint32); returns dst."""
    f = read_gguf(src)
    old = f.kv["general.architecture"].value
    w = gguf.GGUFWriter(str(dst), arch)
    for key, v in f.kv.items():
        if key.startswith(("general.architecture", "GGUF.")) or key == drop:
            continue
        value = v.value.tolist() if isinstance(v.value, np.ndarray) else v.value
        w.add_key_value(key.replace(old + ".", arch + ".", 1), value, v.type, sub_type=getattr(v, "item_type", None))
    for key, value in add:
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        else:
            w.add_uint32(key, value)
    for name, arr in weights.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.parametrize("damage,message", [
    (dict(kv=[("qwen2.rope.scaling.type", "yarn")]), "qwen2.rope.scaling.type = 'yarn': a rope scaling ggtrain "
                                                      "does not implement"),
    (dict(arch="qwen2moe"),
     f"architecture 'qwen2moe' is not supported (ggtrain computes {', '.join(sorted(FAMILIES))})"),
    (dict(kv=[("qwen2.expert_count", 4)]), "qwen2.expert_count = 4: a mixture-of-experts model"),
    (dict(drop="blk.1.attn_v.bias"), "missing tensor 'blk.1.attn_v.bias'"),
])
def test_bad_family_file_is_one_line_and_writes_nothing(tmp_path, damage, message):
    """finetune on a file that asks for what ggtrain does not compute: exit 1, one line naming
    it, no adapter written."""
    tok = ByteTokenizer()
    cfg = ModelConfig(vocab=tok.n_vocab, **{**BASE, **CASES["qwen2"]})
    weights = family_params(cfg)
    weights.pop(damage.get("drop", ""), None)
    path = tmp_path / "bad.gguf"
    write_with_gguf_py(path, cfg, weights, tok)
    if "kv" in damage or "arch" in damage:
        path = _rewrite_keys(path, tmp_path / "bad2.gguf", weights, damage.get("arch", "qwen2"),
                             add=damage.get("kv", []))
    data = tmp_path / "t.txt"
    data.write_text(TEXT * 4)
    out = tmp_path / "a.gguf"
    r = run_cli("finetune", "--model", path, "--data", data, "--out", out, "--steps", 1, "--ctx", 16, "--quiet")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and message in r.stderr, r.stderr
    assert str(path) in r.stderr and not out.exists()


@pytest.mark.parametrize("drop,add,message", [
    ("granite.logit_scale", None, "granite key 'granite.logit_scale' is missing"),      # llama.cpp needs all four
    (None, ("granite.rope.scaling.finetuned", False), "granite.rope.scaling.finetuned = false: granite without rope"),
])
def test_granite_scales_are_required_and_no_rope_is_refused(tmp_path, drop, add, message):
    tok = ByteTokenizer()
    cfg = ModelConfig(vocab=tok.n_vocab, **{**BASE, **CASES["granite"]})
    weights = family_params(cfg)
    write_with_gguf_py(tmp_path / "g.gguf", cfg, weights, tok)
    path = _rewrite_keys(tmp_path / "g.gguf", tmp_path / "bad.gguf", weights, "granite", drop=drop or "",
                         add=[add] if add else [])
    data = tmp_path / "t.txt"
    data.write_text(TEXT)
    r = run_cli("eval", "--model", path, "--data", data)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert message in r.stderr and str(path) in r.stderr, r.stderr


def test_family_logits_in_llama_cpp_numbers_are_its_own(llama, family_model):
    """In llama.cpp's numbers (--numerics llama) each family's F32 model
    gives llama.cpp's logits (F32 KV cache, its context of 256) bit for bit at every position,
    fed a token at a time (the decoder) and all at once (the window runner): its f32 products'
    order, norms, rope (llama 3's factors, phi3's long ones), attention (windows, q or S scaled
    by 1.0f / sqrtf(D), head sizes 24 and 96 among them), swiglu and gemma3's f16-table gelu."""
    path, cfg, weights, tok = family_model
    ids = tok.encode(TEXT[:60], add_bos=tok.add_bos).tolist()
    llm = open_llm(llama, path)
    llm.reset()
    for t in ids:
        llm.eval([t])
    one = np.array(llm.scores[:len(ids)], np.float32)
    batched = np.array(_their_nll(llm, ids + [0])[0], np.float32)
    be = CpuBackend(2)
    # a family whose oracle row says llama_bits=False has ops not in llama.cpp's float order
    # (qwen35: the delta rule's dot products, which its SIMD sums lane by lane): to LOGITS_BITS_ATOL
    same = (np.testing.assert_array_equal if ORACLE[cfg.arch].get("llama_bits", True)
            else lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=LOGITS_BITS_ATOL))
    dec = Decoder(cfg, weights, be, n_ctx=256, numerics=LLAMA)
    same(np.concatenate([dec.feed([t], every=True) for t in ids]), one)
    runner = Runner(cfg, weights, be, length=len(ids), numerics=LLAMA, n_ctx=256)
    same(runner.logits(np.asarray(ids, np.int32)[None])[0, :len(ids)], batched)


def test_family_greedy_generation_equals_llama_cpp(llama, family_model):
    """KV-cached greedy decoding (sliding windows by position) in llama.cpp's numbers (--numerics
    llama) gives llama.cpp's greedy tokens, all of them; in exact f32 it may part only where
    llama.cpp's own top-2 margin is within the tolerance. `ggtrain generate` runs on the family
    too (its text is random bytes, so the ids are compared through the decoder it drives)."""
    path, cfg, weights, tok = family_model
    prompt, n = "First Citizen:\n", 40          # past gemma3's window of 8
    r = run_here("generate", "--model", path, "--prompt", prompt, "-n", 8, "--temp", 0, "--threads", 2)
    assert r.returncode == 0, r.stderr
    ids = tok.encode(prompt, add_bos=tok.add_bos).tolist()
    theirs = []     # (as generation runs: the prompt's last position alone through the last FFN and head)
    for t in open_llm(llama, path, logits_all=False).generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                                                                repeat_penalty=1.0):
        theirs.append(int(t))
        if len(theirs) == n:
            break
    assert list(generate(Decoder(cfg, weights, CpuBackend(2), n_ctx=256, numerics=LLAMA), ids, n, Sampler(temp=0))) == theirs
    llm = open_llm(llama, path)
    ours = list(generate(Decoder(cfg, weights, CpuBackend(2), n_ctx=256), ids, n, Sampler(temp=0)))
    common = 0
    while common < n and ours[common] == theirs[common]:
        common += 1
    if common < n:
        llm.reset()
        llm.eval(ids + theirs[:common])
        top2 = np.sort(np.array(llm.scores[len(ids) + common - 1], np.float64))[-2:]
        assert top2[1] - top2[0] < 2 * _atol(cfg)[1], (common, ours, theirs)


@pytest.mark.parametrize("arch", sorted(set(c["arch"] for c in CASES.values())))
def test_train_from_scratch_gives_a_model_llama_cpp_runs(llama, arch, tmp_path):
    """`ggtrain train --arch` for each family: a few updates, then llama.cpp's NLL of the
    written model equals `ggtrain eval`'s."""
    data = tmp_path / "t.txt"
    data.write_text(TEXT * 20)
    out = tmp_path / "m.gguf"
    r = run_here("train", "--arch", arch, "--data", data, "--out", out, "--dim", 32, "--layers", 2, "--heads", 4,
                 "--kv-heads", SCRATCH_KV_HEADS.get(arch, 2), "--ff", 64, "--ctx", 256, "--batch", 2, "--steps", 3,
                 "--threads", 2, "--quiet", "--val-split", 0.1)
    assert r.returncode == 0, r.stderr
    cfg = validate_model(read_gguf(out)).config
    assert cfg.arch == arch
    probe = tmp_path / "probe.txt"
    probe.write_text(TEXT)
    ids = ByteTokenizer().encode(TEXT, add_bos=True)
    theirs = _their_nll(open_llm(llama, out), ids)[1]
    ours = _eval_cli(out, probe)["nll"]
    assert ours == pytest.approx(theirs, abs=_atol(cfg)[0])


def test_full_finetune_trains_qwen2_biases_and_llama_cpp_runs_the_model(llama, tmp_path):
    """finetune --full on qwen2: the q/k/v biases are trained (they move), the written model
    loads in llama.cpp with ggtrain eval's NLL, and its checkpoint converts to the same model."""
    tok = ByteTokenizer()
    cfg = ModelConfig(vocab=tok.n_vocab, **{**BASE, **CASES["qwen2"]})
    base = tmp_path / "q.gguf"
    weights = family_params(cfg)
    write_with_gguf_py(base, cfg, weights, tok)
    data = tmp_path / "t.txt"
    data.write_text(TEXT * 8)
    out, ck = tmp_path / "full.gguf", tmp_path / "ck"
    r = run_here("finetune", "--model", base, "--data", data, "--out", out, "--full", "--steps", 3, "--ctx", 32,
                 "--batch", 2, "--lr", 1e-3, "--warmup", 0, "--val-split", 0, "--threads", 2, "--quiet",
                 "--checkpoint-dir", ck, "--save-every", 3)
    assert r.returncode == 0, r.stderr
    mcfg, trained, _ = load_model(out)
    assert ModelConfig(**mcfg) == cfg
    for name in ("blk.0.attn_q.bias", "blk.1.attn_v.bias"):
        assert np.abs(trained[name] - weights[name]).max() > 1e-5, name
    probe = tmp_path / "probe.txt"
    probe.write_text(TEXT)
    ids = tok.encode(TEXT, add_bos=tok.add_bos)
    assert _eval_cli(out, probe)["nll"] == pytest.approx(_their_nll(open_llm(llama, out), ids)[1], abs=NLL_ATOL)
    again = tmp_path / "again.gguf"
    r = run_here("convert-checkpoint", sorted(ck.glob("*.gguf"))[-1], again)
    assert r.returncode == 0, r.stderr
    _, converted, _ = load_model(again)
    for name in trained:
        np.testing.assert_array_equal(converted[name], trained[name])


@pytest.mark.parametrize("case", ["qwen3moe", "gemma4-moe"])
def test_expert_lora_and_merged_model_equal_llama_cpp(llama, case, tmp_path):
    """finetune --lora-targets naming the routed experts (and the router, which picks them;
    gemma4's attn_q, its router not being a target):
    the adapter holds per-expert factors stacked (E, r, n_in) and (E, n_out, r) and moves them
    (B no longer zero); llama.cpp applies it through build_lora_mm_id with `ggtrain eval
    --lora`'s NLL, and the merged models (finetune --merged-out, convert-checkpoint --base
    --adapter) give it too, in llama.cpp and here; in llama.cpp's numbers (--numerics llama) the
    adapter gives its logits bit for bit. gemma4: the fused gate | up experts and the down
    scale beside the adapter (a merge divides the update by it)."""
    tok = ByteTokenizer()
    cfg = ModelConfig(vocab=tok.n_vocab, **{**BASE, **CASES[case]})
    weights = family_params(cfg, seed=3, std=0.3)
    path = tmp_path / "m.gguf"
    write_with_gguf_py(path, cfg, weights, tok)
    data = tmp_path / "t.txt"
    data.write_text(TEXT * 8)
    adapter, merged, converted = tmp_path / "a.gguf", tmp_path / "merged.gguf", tmp_path / "converted.gguf"
    targets = ("ffn_gate_inp" if "ffn_gate_inp" in cfg.family.lora_targets else "attn_q",) + cfg.family.expert_targets
    res = run_cli("finetune", "--model", path, "--data", data, "--out", adapter, "--merged-out", merged,
                  "--lora-targets", ",".join(targets), "--lora-rank", 4, "--steps", 4, "--ctx", 32, "--batch", 2,
                  "--lr", 3e-2, "--warmup", 0, "--val-split", 0, "--threads", 2, "--quiet")
    assert res.returncode == 0, res.stderr
    f = read_gguf(adapter)
    e, n_in = cfg.experts, cfg.dim
    for t in cfg.family.expert_targets:
        a, b = f.tensor_f32(f"blk.1.{t}.weight.lora_a"), f.tensor_f32(f"blk.1.{t}.weight.lora_b")
        n_out = weights[f"blk.1.{t}.weight"].shape[1]
        assert a.shape == (e, 4, weights[f"blk.1.{t}.weight"].shape[2]) and b.shape == (e, n_out, 4), t
        assert np.abs(b).max() > 0, t
    assert f.tensor_f32(f"blk.0.{targets[1]}.weight.lora_a").shape[-1] == n_in
    res = run_cli("convert-checkpoint", "--base", path, "--adapter", adapter, converted)
    assert res.returncode == 0, res.stderr
    ids = tok.encode(TEXT, add_bos=tok.add_bos)
    nll_atol, _ = _atol(cfg)
    base_nll = _their_nll(open_llm(llama, path), ids)[1]
    lora_logits, lora_nll = _their_nll(open_llm(llama, path, lora=adapter), ids)
    assert abs(lora_nll - base_nll) > 0.01                  # the adapter changes the model
    probe = tmp_path / "probe.txt"
    probe.write_text(TEXT)
    assert _eval_cli(path, probe, "--lora", adapter)["nll"] == pytest.approx(lora_nll, abs=nll_atol)
    # in llama.cpp's numbers: its logits with the adapter bit for bit (mul_mat_id of A, then of B)
    adapters = lora_adapters(adapter, {n: w.shape for n, w in weights.items()}, 1.0, cfg.arch)
    runner = Runner(cfg, weights, CpuBackend(2), length=len(ids) - 1, adapters=adapters, numerics=LLAMA, n_ctx=256)
    np.testing.assert_array_equal(runner.logits(np.asarray(ids[:-1], np.int32)[None])[0],
                                  lora_logits.astype(np.float32))
    for m in (merged, converted):
        assert _their_nll(open_llm(llama, m), ids)[1] == pytest.approx(lora_nll, abs=nll_atol)
        mcfg, mweights, _ = load_model(m)
        ours = Runner(ModelConfig(**mcfg), mweights, CpuBackend(2), length=len(ids) - 1)
        assert _nll(ours.logits(np.asarray(ids[:-1], np.int32)[None])[0].astype(np.float64), ids) == \
            pytest.approx(lora_nll, abs=nll_atol)


def test_expert_adapter_of_another_shape_is_refused(tmp_path):
    """An expert adapter whose stacked factors do not fit: another expert count than the
    model's, or A and B of other experts or ranks, is a FormatError naming the tensor."""
    from ggtrain.errors import FormatError
    from ggtrain.formats.lora import write_lora
    name, shape = "blk.0.ffn_up_exps.weight", (8, 32, 64)
    z = np.zeros
    cases = [((z((7, 2, 64)), z((7, 32, 2))), f"{name}: adapter gives (7, 32, 64), the weight is (8, 32, 64)"),
             ((z((8, 2, 64)), z((7, 32, 2))), f"{name}: lora_a (8, 2, 64) and lora_b (7, 32, 2) do not share a rank "
                                              f"and experts"),
             ((z((8, 2, 64)), z((8, 32, 3))), "do not share a rank"),
             ((z((2, 64)), z((32, 2))), f"{name}: adapter gives (32, 64), the weight is (8, 32, 64)")]
    for i, (pair, message) in enumerate(cases):
        path = tmp_path / f"a{i}.gguf"
        write_lora(path, "qwen3moe", 8.0, {name: pair})
        with pytest.raises(FormatError, match=message.replace("(", r"\(").replace(")", r"\)")):
            lora_adapters(path, {name: shape}, 1.0, "qwen3moe")


@pytest.mark.parametrize("change, words", [({"act": "relu"}, "act 'relu'"), ({"rope_mode": "yarn"}, "rope_mode 'yarn'"),
                                           ({"gating": "sparsemax"}, "gating 'sparsemax' (one of softmax, sigmoid"),
                                           ({"block": ("attn_foo.weight",)}, "no shape for block tensor 'attn_foo.weight'")])
def test_a_family_with_a_value_the_decoder_lacks_is_refused_where_declared(change, words):
    """A family is data: one naming an activation, rope mode, gating or block tensor the decoder
    has no code for fails when it is declared, naming the field, not when a model runs."""
    import dataclasses
    from ggtrain.core.models.families import FAMILIES
    with pytest.raises(ValueError, match=re.escape(f"family llama: {words}")):
        dataclasses.replace(FAMILIES["llama"], **change)
