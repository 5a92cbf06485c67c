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
from tests.interop import SMALL_MODELS, open_llm, quantize_with_llama_cpp, run_cli, same_model_files
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
    r = run_cli("convert-checkpoint", model, out, "--out-type", out_type, "--imatrix", im)
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


def _smollm2(llama, tools, imatrix_files, shared_data, tmp_path, out_type):
    model = shared_data / "models" / SMOLLM2
    im = _imatrix(tools, imatrix_files, model, "gguf", 128)
    out = _same_as_llama_quantize(tools, model, im, out_type, tmp_path)
    m = open_llm(llama, out, n_ctx=32)
    m.eval(m.tokenize(b"The capital of France is", add_bos=False))
    assert np.isfinite(np.asarray(m.scores[:4])).all()


@pytest.mark.parametrize("out_type", ["q4_k_m", "q2_k"])
def test_smollm2_with_imatrix_is_llama_quantizes(llama, llama_tools, imatrix_files, shared_data, tmp_path, out_type):
    _smollm2(llama, llama_tools, imatrix_files, shared_data, tmp_path, out_type)


@pytest.mark.slow
@pytest.mark.parametrize("out_type", [t for t in TOOL_TYPES if t not in ("q4_k_m", "q2_k")])
def test_smollm2_every_type_with_imatrix_is_llama_quantizes(llama, llama_tools, imatrix_files, shared_data, tmp_path,
                                                            out_type):
    _smollm2(llama, llama_tools, imatrix_files, shared_data, tmp_path, out_type)
