"""gpt-oss beyond the family table (tests/family_cases.py runs it against llama.cpp and the float64
oracle): its files as our writer writes them (YaRN, the window, biases and sinks), read by
gguf-py and back; packed samples through sinks and windows; the KV-cached decoder against whole
windows; YaRN refused where a family does not compute it; bad files refused in one line; F16
experts against llama.cpp."""
import gguf
import numpy as np
import pytest

from ggtrain.core.backend_cpu import CpuBackend
from ggtrain.core.models.config import ModelConfig, param_shapes
from ggtrain.core.models.inference import Decoder, Runner
from ggtrain.errors import ConfigError
from ggtrain.formats.gguf import read_gguf
from ggtrain.formats.model import validate_model
from ggtrain.formats.model_file import save_model
from ggtrain.formats.tokenizer import ByteTokenizer
from tests.family_cases import BASE, INTEROP_CASES, TINY, TINY_CASES
from tests.test_decoder import family_params
from tests.interop import open_llm
from tests.test_families import (TEXT, _eval_cli, _their_nll, check_finetune_refuses, check_packed_pair,
                                 write_with_gguf_py)


def _tiny():
    return ModelConfig(**{**TINY, **TINY_CASES["gpt-oss"]})


def test_our_file_is_gpt_oss_as_gguf_py_reads_it(tmp_path):
    """save_model writes YaRN as the converter does (rope.scaling.type "yarn", its factor and
    original context), the required window, and every bias and sink tensor; the file reads back
    to the same config."""
    tok = ByteTokenizer()
    cfg = ModelConfig(vocab=tok.n_vocab, **{**BASE, **INTEROP_CASES["gpt-oss"]})
    path = tmp_path / "m.gguf"
    save_model(path, vars(cfg), family_params(cfg), tok)
    r = gguf.GGUFReader(str(path))
    assert bytes(r.fields["gpt-oss.rope.scaling.type"].parts[-1]).decode() == "yarn"
    assert float(r.fields["gpt-oss.rope.scaling.factor"].parts[-1][0]) == 32.0
    assert int(r.fields["gpt-oss.rope.scaling.original_context_length"].parts[-1][0]) == 64
    assert int(r.fields["gpt-oss.attention.sliding_window"].parts[-1][0]) == 8
    names = {t.name for t in r.tensors}
    assert names == set(param_shapes(cfg))
    assert {"blk.2.attn_sinks.weight", "blk.0.attn_output.bias", "blk.1.ffn_gate_inp.bias",
            "blk.0.ffn_down_exps.bias", "blk.0.post_attention_norm.weight"} <= names
    bias = next(t for t in r.tensors if t.name == "blk.0.ffn_gate_exps.bias")
    assert list(bias.shape) == [cfg.expert_ff, cfg.experts]             # ggml's {n_ff_exp, n_expert}
    assert validate_model(read_gguf(path)).config == cfg


def test_yarn_is_refused_where_the_family_has_none():
    with pytest.raises(ConfigError, match="no YaRN"):
        ModelConfig(**{**TINY, "rope_scale": 4.0, "rope_yarn": True})


def test_packed_samples_do_not_reach_across_sinks_and_windows():
    cfg = _tiny()
    check_packed_pair(cfg, family_params(cfg, seed=2, std=0.3))


def test_decoder_equals_whole_windows():
    """The KV-cached decoder (sinks at cache positions, the window by position) gives the
    whole-window logits, a token at a time and two at once."""
    cfg = _tiny()
    weights = family_params(cfg, seed=4, std=0.3)
    ids = np.random.default_rng(1).integers(0, cfg.vocab, 9).astype(np.int32)
    be = CpuBackend(2)
    whole = Runner(cfg, weights, be, length=len(ids)).logits(ids[None])[0]
    dec = Decoder(cfg, weights, be, n_ctx=16)
    steps = [dec.feed(ids[:1], every=True)] + [dec.feed(ids[i:i + 2], every=True) for i in range(1, 9, 2)]
    np.testing.assert_allclose(np.concatenate(steps), whole, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("drop,message", [
    ("blk.1.attn_sinks.weight", "missing tensor 'blk.1.attn_sinks.weight'"),
    ("blk.0.ffn_up_exps.bias", "missing tensor 'blk.0.ffn_up_exps.bias'"),
])
def test_bad_gpt_oss_file_is_one_line_and_writes_nothing(tmp_path, drop, message):
    tok = ByteTokenizer()
    cfg = ModelConfig(vocab=tok.n_vocab, **{**BASE, **INTEROP_CASES["gpt-oss"]})
    weights = family_params(cfg)
    weights.pop(drop)
    path = tmp_path / "bad.gguf"
    write_with_gguf_py(path, cfg, weights, tok)
    check_finetune_refuses(tmp_path, path, message)


@pytest.mark.parametrize("stored", ["F16", "MXFP4"])
def test_stored_experts_give_llama_cpps_nll(llama, tmp_path, stored):
    """The experts' stacked matrices stored as F16 (as a converter writes them unquantized) or
    MXFP4 (as the released gpt-oss models hold them): `ggtrain eval --numerics llama`
    (llama.cpp's CPU products: the experts' inputs rounded to F16 against F16 weights, or to
    8 bits against MXFP4 ones; an F32 KV cache as the oracle's) gives llama.cpp's NLL. (Exact
    numbers sit ~1e-4 away: that rounding of llama.cpp's.)"""
    tok = ByteTokenizer()
    cfg = ModelConfig(vocab=tok.n_vocab, **{**BASE, **INTEROP_CASES["gpt-oss"]})
    path = tmp_path / "experts.gguf"
    kind = getattr(gguf.GGMLQuantizationType, stored)
    weights = family_params(cfg, seed=3, std=0.3)
    experts = {n for n in weights if n.endswith("_exps.weight")}
    if stored == "F16":
        write_with_gguf_py(path, cfg, weights, tok, f16=("_exps.weight",))
    else:
        write_with_gguf_py(path, cfg, weights, tok, types={n: kind for n in experts})
    r = gguf.GGUFReader(str(path))
    assert {t.name for t in r.tensors if t.tensor_type == kind} == experts == \
        {f"blk.{i}.ffn_{m}_exps.weight" for i in range(cfg.layers) for m in ("gate", "up", "down")}
    data = tmp_path / "t.txt"
    data.write_text(TEXT)
    ids = tok.encode(TEXT, add_bos=tok.add_bos)
    theirs = _their_nll(open_llm(llama, path), ids)[1]
    ours = _eval_cli(path, data, "--numerics", "llama", "--cache-type", "f32")
    assert ours["nll"] == pytest.approx(theirs, abs=2e-5), (ours["nll"], theirs)    # MXFP4: 2.2e-7 measured
