"""Quantizing with an importance matrix as llama.cpp does: every --out-type mixture of the small
models is llama_model_quantize's with the same importance values (params.imatrix, llama-cpp-
python), and convert-checkpoint --imatrix FILE writes llama-quantize --imatrix FILE's file byte for
byte (its keys naming the file included) from llama-imatrix's own files, GGUF and legacy .dat,
on SmolLM2 (width 576: the fallback types) and on a model whose widths take K-quants."""
import pathlib
import subprocess

import numpy as np
import pytest

from ggtrain.errors import FormatError
from ggtrain.formats.imatrix import read_imatrix
from ggtrain.formats.mixture import MIXTURES
from ggtrain.formats.model_file import rewrite_model
from tests.conftest import write_shakespeare
from tests.interop import SMALL_MODELS, imatrix_with_llama_cpp, open_llm, quantize_with_llama_cpp, run_here, \
    same_model_files
from tests.test_imatrix import model_entries, write_imatrix_gguf

# the types the issue names, as llama-quantize calls them
TOOL_TYPES = {"q4_k_m": "Q4_K_M", "q5_k_m": "Q5_K_M", "q6_k": "Q6_K", "q3_k_m": "Q3_K_M", "q2_k": "Q2_K",
              "q4_0": "Q4_0"}
SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.parametrize("model", SMALL_MODELS)
@pytest.mark.parametrize("out_type", list(MIXTURES))
def test_mixtures_with_imatrix_are_llama_cpps_quantizer(llama, small_models, tmp_path, model, out_type):
    """Every mixture, quantized with an importance matrix (a file of random sums for every block
    matrix but one, as read_imatrix reads it), is llama_model_quantize's file given the same
    values: the imatrix-only rules (Q4_0/Q5_0's ffn_down), the weighted searches, the matrix
    without an entry quantized without; where that matrix needs one (Q2_K_S's Q2_K) both refuse,
    and with every entry write the same file."""
    src, ref, out = small_models[model], tmp_path / "ref.gguf", tmp_path / "ours.gguf"
    entries = model_entries(src, np.random.default_rng(7), counts=(48.0,))
    lacking = dict(entries)
    del lacking["blk.1.ffn_down.weight"]
    im = read_imatrix(write_imatrix_gguf(tmp_path / "im.gguf", lacking))
    if MIXTURES[out_type].needs_imatrix:
        quantize_with_llama_cpp(llama, src, ref, MIXTURES[out_type].file_type, imatrix=im.values, expect=1)
        with pytest.raises(FormatError, match="no entry for blk.1.ffn_down.weight"):
            rewrite_model(out, src, out_type=out_type, imatrix=im)
        assert not out.exists()
        im = read_imatrix(write_imatrix_gguf(tmp_path / "full.gguf", entries))
    quantize_with_llama_cpp(llama, src, ref, MIXTURES[out_type].file_type, imatrix=im.values)
    rewrite_model(out, src, out_type=out_type, imatrix=im)
    same_model_files(out, ref)


def _llama_imatrix(tools, model, text, out, fmt, ctx):
    cmd = [tools["llama-imatrix"], "-m", model, "-f", text, "-o", out, "--output-format", fmt, "-c", ctx,
           "--chunks", 4, "-t", 2, "--no-ppl"]
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    assert r.returncode == 0 and out.is_file(), r.stderr[-2000:]
    return out


@pytest.fixture(scope="module")
def imatrix_files(tmp_path_factory):
    """A folder with a text (20 kB of tiny shakespeare) and {model: {fmt: llama-imatrix's file}},
    filled by _imatrix as the tests ask."""
    d = tmp_path_factory.mktemp("imatrix-files")
    return d, write_shakespeare(d / "t.txt", 20000), {}


def _imatrix(tools, imatrix_files, model, fmt, ctx) -> pathlib.Path:
    """llama-imatrix's file (fmt: gguf or dat) of model, over 4 chunks of ctx tokens of the text."""
    d, text, made = imatrix_files
    key = (str(model), fmt)
    if key not in made:
        out = d / f"{pathlib.Path(model).stem}.{fmt}"
        cmd = [tools["llama-imatrix"], "-m", model, "-f", text, "-o", out, "--output-format", fmt, "-c", ctx,
               "--chunks", 4, "-t", 2, "--no-ppl"]
        r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
        assert r.returncode == 0 and out.is_file(), r.stderr[-2000:]
        made[key] = out
    return made[key]


def _same_as_llama_quantize(tools, model, im, out_type, tmp_path):
    """convert-checkpoint MODEL --out-type T --imatrix FILE: llama-quantize's file, every byte."""
    ref, out = tmp_path / "ref.gguf", tmp_path / "ours.gguf"
    r = subprocess.run([str(c) for c in (tools["llama-quantize"], "--allow-requantize", "--imatrix", im, model, ref,
                                         TOOL_TYPES[out_type], 2)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    r = run_here("convert-checkpoint", model, out, "--out-type", out_type, "--imatrix", im)
    assert r.returncode == 0, r.stderr
    assert f"importance matrix {im}" in r.stdout, r.stdout
    same_model_files(out, ref)      # names the first tensor that differs
    assert out.read_bytes() == ref.read_bytes()
    return out


@pytest.mark.parametrize("out_type", list(TOOL_TYPES))
def test_k_widths_with_imatrix_are_llama_quantizes(llama_tools, imatrix_files, small_models, tmp_path, out_type):
    model = small_models["k256-f32"]
    im = _imatrix(llama_tools, imatrix_files, model, "gguf", 64)
    _same_as_llama_quantize(llama_tools, model, im, out_type, tmp_path)


def test_legacy_imatrix_is_llama_quantizes(llama_tools, imatrix_files, small_models, tmp_path):
    model = small_models["k256-f32"]
    im = _imatrix(llama_tools, imatrix_files, model, "dat", 64)
    _same_as_llama_quantize(llama_tools, model, im, "q4_k_m", tmp_path)


def _smollm2(llama, tools, imatrix_files, model, tmp_path, out_type):
    im = _imatrix(tools, imatrix_files, model, "gguf", 128)
    out = _same_as_llama_quantize(tools, model, im, out_type, tmp_path)
    m = open_llm(llama, out, n_ctx=32)
    m.eval(m.tokenize(b"The capital of France is", add_bos=False))
    assert np.isfinite(np.asarray(m.scores[:4])).all()


@pytest.mark.parametrize("out_type", ["q4_k_m", "q2_k"])
def test_smollm2_with_imatrix_is_llama_quantizes(llama, llama_tools, imatrix_files, shared_data, tmp_path, out_type):
    _smollm2(llama, llama_tools, imatrix_files, shared_data / "models" / SMOLLM2, tmp_path, out_type)


@pytest.mark.slow
@pytest.mark.parametrize("out_type", [t for t in TOOL_TYPES if t not in ("q4_k_m", "q2_k")])
def test_smollm2_every_type_with_imatrix_is_llama_quantizes(llama, llama_tools, imatrix_files, smollm2_blocks,
                                                            tmp_path, out_type):
    """Every other type on SmolLM2's first blocks (conftest.smollm2_blocks): its real tensors."""
    _smollm2(llama, llama_tools, imatrix_files, smollm2_blocks, tmp_path, out_type)


# ---- ggtrain imatrix against llama-imatrix ---------------------------------------------------
#
# llama-imatrix runs llama.cpp's CPU build: by default with flash attention and an F16 KV cache
# (which round q, k, v and the attention weights to f16), and the tools here are built for AVX2
# while llama-cpp-python's library (which --numerics llama reproduces bit for bit) is an AVX-512
# build: their f32 dot products (attention's, an F32 weight's) add in other orders. So the
# tool's sums are compared with llama-imatrix -fa off -ctk f32 -ctv f32, to a tolerance: on the
# random F32 model within 2.6e-6 (exact) and 1.2e-6 (llama numerics, whose layer-0 q/k/v sums
# are its own bit for bit), measured; 1e-5 asserted. Its collector run on llama-cpp-python's
# library (tests.interop.imatrix_with_llama_cpp) gives our --numerics llama sums bit for bit.
IMATRIX_RTOL = 1e-5


@pytest.mark.parametrize("model, cache", [("k256-f32", "f32"), ("k256-f32", "f16"), (SMOLLM2, "f16"),
                                          (SMOLLM2, "f32")])
def test_imatrix_in_llama_numbers_is_llama_cpps_bit_for_bit(llama, small_models, shared_data, imatrix_files, tmp_path,
                                                            model, cache):
    """llama-imatrix's collector on llama-cpp-python's own library (no flash attention, the KV
    cache F16 or F32): `ggtrain imatrix --numerics llama --cache-type` gives its sums and counts
    bit for bit, on the random F32 model and on SmolLM2's Q4_1 (8-bit activations: a single
    rounding apart would move whole columns) alike."""
    _, text, _ = imatrix_files
    path, ctx = (small_models[model], 64) if model in small_models else (shared_data / "models" / model, 128)
    theirs, counts = imatrix_with_llama_cpp(llama, path, text.read_text(), ctx, 4, kv_f32=cache == "f32")
    ours = read_imatrix(_ours(path, text, tmp_path / "ours.gguf", ctx, "--numerics", "llama", "--cache-type", cache))
    assert set(counts.values()) == {4 * ctx}
    sums, _, _ = _entries(ours.path)
    assert sorted(theirs) == sorted(ours.values)
    for name, s in theirs.items():
        np.testing.assert_array_equal(sums[name + ".in_sum2"].astype(np.float32), s, err_msg=name)


def _their_imatrix(tools, model, text, out, ctx, *extra):
    cmd = [tools["llama-imatrix"], "-m", model, "-f", text, "-o", out, "-c", ctx, "--chunks", 4, "-t", 2, "--no-ppl",
           *extra]
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    assert r.returncode == 0 and out.is_file(), r.stderr[-2000:]
    return out


def _entries(path) -> tuple:
    """({tensor name: f64 values}, {key: value}, [(name, type, shape)] in file order) as gguf-py reads them."""
    import gguf
    r = gguf.GGUFReader(str(path))
    keys = {f.name: f.contents() for f in r.fields.values() if not f.name.startswith("GGUF.")}
    layout = [(t.name, t.tensor_type.name, [int(n) for n in t.shape]) for t in r.tensors]
    return {t.name: np.array(t.data, np.float64).reshape(-1) for t in r.tensors}, keys, layout


def _ours(model, text, out, ctx, *extra):
    r = run_here("imatrix", "--model", model, "--data", text, "--out", out, "--ctx", ctx, "--chunks", 4, "--quiet",
                 *extra)
    assert r.returncode == 0, r.stderr
    return out


@pytest.mark.parametrize("numerics", ["exact", "llama"])
def test_imatrix_of_f32_model_is_llama_imatrixs(llama_tools, imatrix_files, small_models, tmp_path, numerics):
    """ggtrain imatrix on the random F32 model: llama-imatrix's file (without flash attention, F32
    KV cache): the same tensors in the same order, types and shapes, the same keys (the dataset as
    named), every count equal, every sum within IMATRIX_RTOL; read back by read_imatrix as
    llama-quantize reads it (sums / count)."""
    d, text, _ = imatrix_files
    model = small_models["k256-f32"]
    theirs = _their_imatrix(llama_tools, model, text, tmp_path / "theirs.gguf", 64, "-fa", "off", "-ctk", "f32",
                            "-ctv", "f32")
    ours = _ours(model, text, tmp_path / "ours.gguf", 64, "--numerics", numerics, "--cache-type", "f32")
    (a, a_keys, a_layout), (b, b_keys, b_layout) = _entries(ours), _entries(theirs)
    assert a_layout == b_layout and a_keys == b_keys
    assert len(a) == 2 * 56
    for name in b:
        if name.endswith(".counts"):
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)
            assert b[name][0] == 4 * 64
        else:
            np.testing.assert_allclose(a[name], b[name], rtol=IMATRIX_RTOL, atol=0, err_msg=name)
    im = read_imatrix(ours)
    assert im.chunk_count == 4 and im.datasets == (str(text),)
    name = "blk.3.ffn_down.weight"
    np.testing.assert_array_equal(im.values[name], (a[name + ".in_sum2"] / (4 * 64)).astype(np.float32))


def test_imatrix_of_smollm2_is_near_llama_imatrixs(llama_tools, imatrix_files, shared_data, tmp_path):
    """SmolLM2 (Q4_1): its products take activations rounded to 8 bits, and a difference of one
    rounding there moves whole columns. llama-imatrix's own runs with and without flash attention
    differ by a median 0.36% (p99 3.8%, 27% at most); ours in llama numerics (F16 cache, no flash
    attention) from its default run by a median 0.34% (p99 3.5%): asserted within 1% and 10%,
    every count equal (measured on 4 chunks of 128 tokens)."""
    d, _, _ = imatrix_files
    model = shared_data / "models" / SMOLLM2
    theirs = _imatrix(llama_tools, imatrix_files, model, "gguf", 128)
    text = d / "t.txt"
    a, _, a_layout = _entries(_ours(model, text, tmp_path / "ours.gguf", 128, "--numerics", "llama"))
    b, _, b_layout = _entries(theirs)
    assert a_layout == b_layout
    rel = []
    for name in b:
        if name.endswith(".counts"):
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)
        else:
            rel.append(np.abs(a[name] - b[name]) / b[name])
    rel = np.concatenate(rel)
    assert np.median(rel) < 0.01 and np.quantile(rel, 0.99) < 0.1, (np.median(rel), np.quantile(rel, 0.99))


def test_convert_with_our_imatrix_is_llama_quantizes(llama_tools, imatrix_files, small_models, tmp_path):
    """convert-checkpoint --out-type q4_k_m --imatrix OURS is llama-quantize --imatrix OURS, every
    byte; and next to llama-quantize given llama-imatrix's file (sums ~1e-6 apart, so a few
    scale searches end on the other side of a tie) all but under 0.5% of the bytes are the same
    (0.09% measured)."""
    _, text, _ = imatrix_files
    model = small_models["k256-f32"]
    ours = _ours(model, text, tmp_path / "im-ours.gguf", 64, "--numerics", "llama", "--cache-type", "f32")
    mine = _same_as_llama_quantize(llama_tools, model, ours, "q4_k_m", tmp_path)
    theirs = _their_imatrix(llama_tools, model, text, tmp_path / "im-theirs.gguf", 64, "-fa", "off", "-ctk", "f32",
                            "-ctv", "f32")
    ref = tmp_path / "ref-theirs.gguf"
    r = subprocess.run([str(c) for c in (llama_tools["llama-quantize"], "--allow-requantize", "--imatrix", theirs,
                                         model, ref, "Q4_K_M", 2)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    from ggtrain.formats.gguf import read_gguf
    a, b = read_gguf(mine), read_gguf(ref)
    differ = total = 0
    for name in b.tensors:
        x, y = a.read_tensor(name).view(np.uint8), b.read_tensor(name).view(np.uint8)
        differ += int(np.count_nonzero(x != y))
        total += y.size
    assert 0 <= differ < 0.005 * total, (differ, total)


# ---- routed experts (MUL_MAT_ID): per expert sums and counts ------------------------------------

# a tiny qwen3moe whose matrices are K-quant wide (256 columns): 8 experts, 2 a token
MOE = dict(arch="qwen3moe", dim=256, layers=2, heads=4, kv_heads=2, head_dim=64, ff=256, ctx=64, experts=8,
           experts_used=2, expert_ff=256)
EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    from ggtrain.core.models.config import ModelConfig, init_params
    from ggtrain.formats.model_file import save_model
    from ggtrain.formats.tokenizer import load_tokenizer
    tok = load_tokenizer("byte", "First Citizen: Before we proceed any further, hear me speak.")
    config = dict(vocab=tok.n_vocab, **MOE)
    path = tmp_path_factory.mktemp("moe") / "qwen3moe.gguf"
    save_model(path, config, init_params(ModelConfig(**config), seed=1, std=0.05), tok, out_type="f32")
    return path


@pytest.fixture(scope="module")
def moe_imatrix(moe_model, imatrix_files):
    """`ggtrain imatrix --numerics llama --cache-type f32` of the qwen3moe model, 4 chunks of 64 tokens."""
    _, text, _ = imatrix_files
    return _ours(moe_model, text, moe_model.with_name("im-ours.gguf"), 64, "--numerics", "llama", "--cache-type", "f32")


def test_expert_imatrix_in_llama_numbers_is_llama_cpps_bit_for_bit(llama, moe_model, moe_imatrix, imatrix_files):
    """qwen3moe's stacked experts: llama-imatrix's collector of MUL_MAT_ID on llama-cpp-python's
    library (each routed row into its expert's sums, per expert counts) gives our --numerics
    llama sums and counts bit for bit, in_sum2 (n_expert, n_cols) and counts (n_expert, 1) per
    expert tensor, every expert reached; the dense matrices (the router among them) as before."""
    _, text, _ = imatrix_files
    theirs, counts = imatrix_with_llama_cpp(llama, moe_model, text.read_text(), 64, 4, kv_f32=True)
    sums, _, layout = _entries(moe_imatrix)
    shapes = {name: shape for name, _, shape in layout}
    experts = [f"blk.{i}.{t}.weight" for i in range(MOE["layers"]) for t in EXPERT_TENSORS]
    assert set(experts) <= set(theirs) and sorted(theirs) == sorted(n[:-len(".counts")] for n in shapes
                                                                        if n.endswith(".counts"))
    for name, s in theirs.items():
        np.testing.assert_array_equal(sums[name + ".in_sum2"].astype(np.float32), s.reshape(-1), err_msg=name)
        np.testing.assert_array_equal(sums[name + ".counts"], np.reshape(counts[name], -1), err_msg=name)
    for name in experts:
        assert shapes[name + ".in_sum2"] == [256, 8] and shapes[name + ".counts"] == [1, 8], name
        n = counts[name]
        assert n.sum() == 4 * 64 * 2 and (n > 0).all(), (name, n)
    assert counts["blk.0.ffn_gate_inp.weight"] == 4 * 64


def test_expert_imatrix_is_llama_imatrixs(llama_tools, imatrix_files, moe_model, moe_imatrix, tmp_path):
    """ggtrain imatrix of the qwen3moe model: llama-imatrix's own file (without flash attention,
    F32 KV cache): the same tensors, types and shapes ((n_expert, n_cols) sums and (n_expert, 1)
    counts of the experts), the same keys, every count (per expert) equal, every sum within
    IMATRIX_RTOL of the largest of its tensor (its AVX2 build's activations are f32 roundings
    apart, and an expert reached by a few rows has columns near zero: 1.4% apart there, 7e-7
    of the largest at most, measured); and convert-checkpoint --out-type q4_k_m --imatrix OURS writes llama-quantize
    --imatrix OURS's file, every byte (each expert's slice weighted by its own entry)."""
    _, text, _ = imatrix_files
    theirs = _their_imatrix(llama_tools, moe_model, text, tmp_path / "theirs.gguf", 64, "-fa", "off", "-ctk", "f32",
                            "-ctv", "f32")
    ours = moe_imatrix
    (a, a_keys, a_layout), (b, b_keys, b_layout) = _entries(ours), _entries(theirs)
    assert a_layout == b_layout and a_keys == b_keys
    assert ("blk.1.ffn_down_exps.weight.in_sum2", "F32", [256, 8]) in b_layout
    for name in b:
        if name.endswith(".counts"):
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)
        else:
            np.testing.assert_allclose(a[name], b[name], rtol=0, atol=IMATRIX_RTOL * b[name].max(), err_msg=name)
    im = read_imatrix(ours)
    assert im.values["blk.0.ffn_up_exps.weight"].shape == (8 * 256,)
    _same_as_llama_quantize(llama_tools, moe_model, ours, "q4_k_m", tmp_path)
