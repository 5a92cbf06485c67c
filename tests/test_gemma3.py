"""Gemma 3 270M (Q4_K_M, a real model: tests/real_models.py) against real llama.cpp.

llama.cpp multiplies its quantized weights by activations it rounds to 8 bits (Q8_0 / Q8_K)
and reads gelu from an f16 table; ggtrain computes in f32 on the stored weights. Given the
weights as F32 (the same values, dequantized by convert-checkpoint), llama.cpp does f32
products too and the NLLs meet to ~3e-5 (the gelu table). On the Q4_K_M file each 8-bit
rounding that flips moves a position's logits by up to ~1 (measured), and every later position
of its window with it: on a 400-token text that alone moves llama.cpp's own mean NLL by 0.006
between its batched and its one-token paths (per-token std 0.11), and ours lies 0.013-0.019
from it. Over 3342 tokens (4.5 windows) the noise averages out: ours (f32) is 0.0014 from
llama.cpp's, --int8 0.0002, so that check's bound is issue #19's 0.01. Greedy text agrees up to
near-ties: where the two part, llama.cpp's own top-2 margin is small.
"""
import json

import numpy as np
import pytest

from ggtrain.formats.gguf import read_gguf
from ggtrain.formats.model import validate_model
from tests.conftest import SHARED_DATA
from tests.interop import open_llm, run_cli
from tests.real_models import gemma3_270m

NLL_TOL_F32 = 1e-3      # both in f32 on the same weights; llama.cpp's f16 gelu table is ~3e-5
NLL_TOL_Q = 0.01        # llama.cpp's 8-bit activations against the Q4_K_M weights, over LONG_TEXT
LONG_TEXT = 12000       # characters of tinyshakespeare: 3342 tokens
NEAR_TIE = 0.5          # a llama.cpp top-2 logit margin this small can flip under 8-bit activations


@pytest.fixture(scope="module")
def gemma():
    return gemma3_270m()


def test_gemma3_270m_layout(gemma):
    layout = validate_model(read_gguf(gemma))
    c = layout.config
    assert (c.arch, c.vocab, c.dim, c.layers, c.heads, c.kv_heads, c.head_dim, c.ff) == \
        ("gemma3", 262144, 640, 18, 4, 1, 256, 2048)
    assert (c.window, c.window_pattern, c.rope_base, c.rope_base_swa, c.tied) == (512, 6, 1e6, 1e4, True)
    assert [c.local(i) for i in range(12)] == [True] * 5 + [False] + [True] * 5 + [False]


def _their_nll(llama, model, text) -> float:
    """llama.cpp's mean NLL of text (with BOS) in windows of 512, F32 KV cache."""
    llm = open_llm(llama, model, n_ctx=512)
    ids = llm.tokenize(text.encode(), add_bos=True)
    total = 0.0
    for s in range(0, len(ids) - 1, 512):
        w = ids[s:s + 513]
        llm.reset()
        llm.eval(w[:-1])
        logits = np.array(llm.scores[:len(w) - 1], np.float64)
        z = logits - logits.max(-1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
        total -= logp[np.arange(len(w) - 1), w[1:]].sum()
    return total / (len(ids) - 1)


def _our_eval(model, data) -> dict:
    r = run_cli("eval", "--model", model, "--data", data, "--ctx", 512, "--json", "--threads", 2)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_gemma3_270m_nll_equals_llama_cpp(llama, gemma, tmp_path):
    full = (SHARED_DATA / "text" / "tinyshakespeare.txt").read_text() if SHARED_DATA.is_dir() else \
        " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog number {i * 7 % 13}." for i in range(600))
    data = tmp_path / "t.txt"
    data.write_text(full[:LONG_TEXT])
    assert _our_eval(gemma, data)["nll"] == pytest.approx(_their_nll(llama, gemma, full[:LONG_TEXT]), abs=NLL_TOL_Q)
    # the same weights as F32: llama.cpp computes in f32 too (a short text is enough)
    short = full[:1500]
    data.write_text(short)
    ours = _our_eval(gemma, data)
    f32 = tmp_path / "g32.gguf"
    r = run_cli("convert-checkpoint", gemma, f32, "--out-type", "f32")
    assert r.returncode == 0, r.stderr
    ours_f32 = _our_eval(f32, data)
    assert ours_f32["nll"] == pytest.approx(ours["nll"], abs=1e-5)      # dequantized in the GEMM or once
    assert ours["nll"] == pytest.approx(_their_nll(llama, f32, short), abs=NLL_TOL_F32)


def test_gemma3_270m_greedy_equals_llama_cpp_up_to_near_ties(llama, gemma):
    prompt, n = "The capital of France is", 32
    r = run_cli("generate", "--model", gemma, "--prompt", prompt, "-n", n, "--temp", 0, "--threads", 2)
    assert r.returncode == 0, r.stderr
    llm = open_llm(llama, gemma, n_ctx=256)
    ids = llm.tokenize(prompt.encode(), add_bos=True)
    theirs = []
    for t in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
        theirs.append(int(t))
        if len(theirs) == n:
            break
    theirs_text = llm.detokenize(theirs).decode("utf-8", errors="replace")
    ours_text = r.stdout
    common = 0
    while common < min(len(ours_text), len(theirs_text)) and ours_text[common] == theirs_text[common]:
        common += 1
    if common < min(len(ours_text), len(theirs_text)):     # they part: a near-tie of llama.cpp's
        # the token of llama.cpp's where the texts part, and its top-2 margin there
        k = next(i for i in range(1, n + 1)
                 if len(llm.detokenize(theirs[:i]).decode("utf-8", errors="replace")) > common)
        llm.reset()
        llm.eval(ids + theirs[:k - 1])
        top2 = np.sort(np.array(llm.scores[len(ids) + k - 2], np.float64))[-2:]
        assert top2[1] - top2[0] < NEAR_TIE, (ours_text, theirs_text)
    assert common >= 20, (ours_text, theirs_text)


def test_gemma3_270m_logits_with_llama_cpp_numerics_equal_llama_cpp(llama, gemma):
    """The decoder in llama.cpp's CPU numerics (act8: 8-bit activations for the Q5_0, Q8_0,
    Q4_K and Q6_K products, and geglu's f16-table gelu) gives llama.cpp's logits bit for bit at
    the first positions, where the f32 path is ~0.5 away; later a rounding flip (an activation
    within an ulp of a boundary) moves them, and through attention every position after it.
    Fed a token at a time, both take the one-row products; fed the prompt at once, both take
    the batched ones, whose Q4_K float order differs (llama.cpp repacks Q4_K and multiplies
    rows four at a time): position 0 is bit-equal there too (it was 0.15 off in the one-row
    order)."""
    from ggtrain.core.backend_cpu import CpuBackend
    from ggtrain.core.models.decoder import Decoder, ModelConfig
    from ggtrain.formats.model_file import open_model
    be = CpuBackend(2)
    cfg, weights, _ = open_model(gemma, be)
    llm = open_llm(llama, gemma, n_ctx=256)
    ids = llm.tokenize(b"The capital of France is Paris, and the capital of Italy is", add_bos=True)
    llm.reset()
    for t in ids:
        llm.eval([t])
    theirs = np.array(llm.scores[:len(ids)], np.float32)      # a copy: the next eval rewrites scores
    llm.reset()
    llm.eval(ids)
    theirs_batched = np.array(llm.scores[:len(ids)], np.float32)
    assert np.abs(theirs_batched[0] - theirs[0]).max() > 0.01        # llama.cpp's two orders part
    diff = {}
    for act8 in (True, False):
        dec = Decoder(ModelConfig(**cfg), weights, be, n_ctx=64, act8=act8)
        diff[act8] = np.abs(np.concatenate([dec.feed([t], every=True) for t in ids]) - theirs).max(-1)
    assert (diff[True][:2] == 0).all() and (diff[False][:2] > 0.1).all(), (diff[True], diff[False])
    dec = Decoder(ModelConfig(**cfg), weights, be, n_ctx=64, act8=True)
    np.testing.assert_array_equal(dec.feed(ids, every=True)[0], theirs_batched[0])
