"""convert-checkpoint's outputs in real llama.cpp (the interop extra): the llama2.c import runs
as ggml-org's stories260K.gguf, a checkpoint's model generates as `ggtrain generate` does,
merged models run as the base with the adapter, and the quantizers and every --out-type mixture
give llama.cpp's bytes."""
import itertools

import numpy as np
import pytest

from ggtrain.errors import FormatError
from ggtrain.formats.gguf import read_gguf
from ggtrain.formats.quants import quantize
from ggtrain.formats.lora import write_lora
from ggtrain.formats.mixture import MIXTURES
from ggtrain.formats.model_file import load_model, rewrite_model
from ggtrain.native.dtypes import DTYPES
from tests.interop import (SMALL_MODELS, ggml_quantize, greedy, open_llm, quantize_with_llama_cpp,
                           random_lora_pairs, run_here, same_model_files)

PROMPT = "Once upon a time, there was a little"
# where a quantized merged model's greedy run parts from llama.cpp's base + adapter, llama.cpp's
# own top-2 logits there must be this close (its 8-bit activations move logits by up to ~0.25)
NEAR_TIE = 0.5


def _ids(model):
    _, _, tok = load_model(model)
    return tok, tok.encode(PROMPT, add_bos=True).tolist()


def test_llama2c_import_runs_in_llama_cpp_as_stories260k(llama, shared_data, tmp_path):
    out = tmp_path / "s.gguf"
    r = run_here("convert-checkpoint", shared_data / "llama2c" / "stories260K.bin", out, "--from", "llama2c",
             "--tokenizer", shared_data / "llama2c" / "tok512.bin")
    assert r.returncode == 0, r.stderr
    ref = shared_data / "gguf" / "stories260K.gguf"
    tok, ids = _ids(ref)
    ours, theirs = open_llm(llama, out), open_llm(llama, ref)
    assert ours.tokenize(PROMPT.encode(), add_bos=True, special=False) == ids
    assert greedy(ours, ids, 40) == greedy(theirs, ids, 40)
    ours.reset()
    ours.eval(ids)
    theirs.reset()
    theirs.eval(ids)
    assert np.array_equal(np.asarray(ours.scores[:len(ids)]), np.asarray(theirs.scores[:len(ids)]))


def test_checkpoint_model_generates_in_llama_cpp_as_ggtrain_generate(llama, shared_data, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text((shared_data / "text" / "tinyshakespeare.txt").read_text()[:40000])
    ckdir, out = tmp_path / "ck", tmp_path / "m.gguf"
    r = run_here("train", "--data", text, "--out", tmp_path / "final.gguf", "--dim", "64", "--layers", "2", "--heads", "4",
             "--kv-heads", "2", "--ff", "128", "--ctx", "64", "--batch", "4", "--steps", "30", "--warmup", "3",
             "--lr", "5e-3", "--checkpoint-dir", ckdir, "--save-every", "20", "--quiet")
    assert r.returncode == 0, r.stderr
    r = run_here("convert-checkpoint", ckdir / "ckpt-000020.gguf", out)
    assert r.returncode == 0, r.stderr
    prompt = "KING RICHARD:\nWhat say you"
    _, _, tok = load_model(out)
    ids = tok.encode(prompt, add_bos=True).tolist()
    theirs = greedy(open_llm(llama, out), ids, 24)
    shown = list(itertools.takewhile(lambda t: t != tok.eos_id, theirs))
    r = run_here("generate", "--model", out, "--prompt", prompt, "-n", 24, "--temp", 0, "--numerics", "llama")
    assert r.returncode == 0, r.stderr
    assert r.stdout == tok.decode(shown) + "\n"


@pytest.mark.parametrize("name", ["stories260K", "stories260K-Q8_0"])
def test_merged_model_runs_as_base_with_adapter(llama, shared_data, tmp_path, name):
    base = shared_data / "gguf" / f"{name}.gguf"
    config, weights, _ = load_model(base)
    pairs = random_lora_pairs(np.random.default_rng(3), weights, config["layers"], rank=4)
    adapter, merged = tmp_path / "a.gguf", tmp_path / "m.gguf"
    write_lora(adapter, "llama", 8.0, pairs)
    r = run_here("convert-checkpoint", base, merged, "--adapter", adapter, "--scale", 0.5)
    assert r.returncode == 0, r.stderr
    assert {t.type for t in read_gguf(merged).tensors.values()} == {t.type for t in read_gguf(base).tensors.values()}
    _, ids = _ids(base)
    with_adapter = open_llm(llama, base, adapter, scale=0.5)
    theirs = greedy(with_adapter, ids, 32)
    assert theirs != greedy(open_llm(llama, base), ids, 32)        # the adapter changes the model
    ours = greedy(open_llm(llama, merged), ids, 32)
    if ours == theirs:
        return
    assert name != "stories260K", (ours, theirs)                # F32: exactly the same run
    i = next(k for k in range(len(ours)) if ours[k] != theirs[k])
    with_adapter.reset()
    with_adapter.eval(ids + theirs[:i])
    top2 = np.sort(np.asarray(with_adapter.scores[len(ids) + i - 1]))[-2:]
    assert top2[1] - top2[0] < NEAR_TIE, (i, top2)


@pytest.mark.parametrize("out_type", ["q4_1", "bf16", "f16", "q4_0"])
def test_out_types_are_llama_cpps_quantizations(llama, shared_data, tmp_path, out_type):
    """llama.cpp's llama_model_quantize of stories260K and ours: the same type and bytes per tensor."""
    src = shared_data / "gguf" / "stories260K.gguf"
    ref, out = tmp_path / "ref.gguf", tmp_path / "ours.gguf"
    quantize_with_llama_cpp(llama, src, ref, MIXTURES[out_type].file_type)
    r = run_here("convert-checkpoint", src, out, "--out-type", out_type)
    assert r.returncode == 0, r.stderr
    same_model_files(out, ref)


@pytest.mark.parametrize("name", [n for n, d in DTYPES.items() if d.can_quantize and d.is_block])
def test_block_quantizers_are_ggmls(llama, name):
    """Every block type ggtrain writes, row by row, gives the bytes of llama-cpp-python's own
    ggml_quantize_chunk: without an importance matrix (its reference quantizers) and with one
    (its weighted scale searches, as llama_model_quantize runs them given an imatrix: heavy-
    tailed importances, uniform ones, and a third of the columns of importance 0), on normal,
    heavy-tailed, one-signed, zero, tiny and mixed-zero rows."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((8, 1024)).astype(np.float32)
    rows = [x, x ** 3, np.abs(x) + 0.1, -np.abs(x), np.zeros_like(x), x * 1e-9]
    mixed = x.copy()
    mixed[:, :48] = 0
    mixed[3] = 0
    mixed[5, 7] = 100
    rows.append(mixed)
    importances = [None, (rng.random(1024) ** 4 * 10).astype(np.float32), np.ones(1024, np.float32),
                   np.where(rng.random(1024) < 0.3, 0, rng.random(1024)).astype(np.float32)]
    for i, r in enumerate(rows):
        for k, im in enumerate(importances):
            ours = quantize(r, name, imatrix=im).reshape(-1)
            theirs = ggml_quantize(llama, r, DTYPES[name].id, im)
            assert np.array_equal(ours, theirs), (name, i, k, np.flatnonzero(ours != theirs)[:8])


@pytest.mark.parametrize("model", SMALL_MODELS)
@pytest.mark.parametrize("out_type", list(MIXTURES))
def test_mixtures_are_llama_cpps_quantizer(llama, small_models, tmp_path, model, out_type):
    """Every --out-type (a row of formats.mixture.MIXTURES) of a model is llama_model_quantize's
    file of the same input: each tensor's type (the mixture's rules, the output's Q6_K/Q8_0, the
    fallbacks where rows are not whole blocks) and bytes, and general.file_type; llama.cpp runs it.
    A mixture llama.cpp writes only with an importance matrix (Q2_K_S) both refuse without one
    (tests/test_imatrix_interop.py compares it with one)."""
    src, ref, out = small_models[model], tmp_path / "ref.gguf", tmp_path / "ours.gguf"
    if MIXTURES[out_type].needs_imatrix:
        quantize_with_llama_cpp(llama, src, ref, MIXTURES[out_type].file_type, expect=1)
        with pytest.raises(FormatError, match="only with an importance matrix"):
            rewrite_model(out, src, out_type=out_type)
        assert not out.exists()
        return
    quantize_with_llama_cpp(llama, src, ref, MIXTURES[out_type].file_type)
    rewrite_model(out, src, out_type=out_type)
    same_model_files(out, ref)
    m = open_llm(llama, out, n_ctx=32)
    m.eval([1, 70, 80, 90])
    assert np.isfinite(np.asarray(m.scores[:4])).all()


def _smollm2_matches(llama, src, tmp_path, out_type):
    """convert-checkpoint SmolLM2 (Q4_1, Q8_0 embedding) --out-type: llama.cpp's requantization
    (--allow-requantize) byte for byte; the summary says it requantizes where a quantized tensor
    changes type; llama.cpp's greedy run on ours is the one on its own file."""
    ref, out = tmp_path / "ref.gguf", tmp_path / "ours.gguf"
    quantize_with_llama_cpp(llama, src, ref, MIXTURES[out_type].file_type, requantize=True)
    r = run_here("convert-checkpoint", src, out, "--out-type", out_type)
    assert r.returncode == 0, r.stderr
    same_model_files(out, ref)
    fs, fr = read_gguf(src), read_gguf(ref)
    changed = sorted({i.type.name for n, i in fs.tensors.items() if i.type.name.startswith("Q")
                      and fr.tensors[n].type != i.type})
    assert ("requantizes" in r.stdout) == bool(changed), r.stdout
    assert not changed or f"from {', '.join(changed)} (llama.cpp" in r.stdout, r.stdout
    theirs = open_llm(llama, ref)
    ids = theirs.tokenize(b"The capital of France is", add_bos=False)
    assert greedy(open_llm(llama, out), ids, 8) == greedy(theirs, ids, 8)


@pytest.mark.parametrize("out_type", ["q4_k_m", "q2_k"])
def test_smollm2_out_types_are_llama_cpps(llama, shared_data, tmp_path, out_type):
    _smollm2_matches(llama, shared_data / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf", tmp_path, out_type)


@pytest.mark.slow
@pytest.mark.parametrize("out_type", [t for t in MIXTURES if t not in ("q4_k_m", "q2_k")
                                      and not MIXTURES[t].needs_imatrix])     # q2_k_s: tests/test_imatrix_interop.py
def test_smollm2_every_out_type_is_llama_cpps(llama, smollm2_blocks, tmp_path, out_type):
    """Every other type on SmolLM2's first blocks (conftest.smollm2_blocks): its real tensors."""
    _smollm2_matches(llama, smollm2_blocks, tmp_path, out_type)
