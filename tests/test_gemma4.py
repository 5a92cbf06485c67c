"""Gemma 4 beyond the family table (tests/family_cases.py runs its dense and E-model layouts
against llama.cpp and the float64 oracle): its files as our writer writes them, read by
gguf-py; packed samples through layers that share keys and values; the KV-cached decoder
(shared KV layers keep no cache of their own) against whole windows; bad files refused in one
line."""
import gguf
import numpy as np
import pytest

from ggtrain.core.backend_cpu import CpuBackend
from ggtrain.core.models.config import ModelConfig, param_shapes
from ggtrain.core.models.inference import Decoder, Runner
from ggtrain.errors import ConfigError
from ggtrain.formats.model_file import save_model
from ggtrain.formats.tokenizer import ByteTokenizer
from tests.family_cases import BASE, INTEROP_CASES, TINY, TINY_CASES
from tests.test_decoder import family_params
from tests.test_families import check_finetune_refuses, check_packed_pair, write_with_gguf_py


def _field(r, key):
    f = r.fields[key]
    return [f.parts[i][0].item() for i in f.data] if len(f.data) > 1 or f.types[0] == gguf.GGUFValueType.ARRAY \
        else f.parts[-1][0].item()


@pytest.mark.parametrize("case", ["gemma4", "gemma4-e"])
def test_our_file_is_gemma4_as_gguf_py_reads_it(tmp_path, case):
    """save_model writes gemma4's keys as its converter does (the local flags a BOOL array, the
    local head size with its value length, the shared KV layers, the per-layer width, KV heads and
    FFN widths one a layer) and no K/V tensors where a layer has none."""
    tok = ByteTokenizer()
    cfg = ModelConfig(vocab=tok.n_vocab, **{**BASE, **INTEROP_CASES[case]})
    path = tmp_path / "m.gguf"
    save_model(path, vars(cfg), family_params(cfg), tok)
    r = gguf.GGUFReader(str(path))
    swa = r.fields["gemma4.attention.sliding_window_pattern"]
    assert swa.types == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.BOOL]
    assert _field(r, "gemma4.attention.sliding_window_pattern") == [bool(x) for x in INTEROP_CASES[case]["swa_layers"]]
    assert _field(r, "gemma4.attention.key_length_swa") == _field(r, "gemma4.attention.value_length_swa") \
        == cfg.head_dim_swa
    assert _field(r, "gemma4.attention.shared_kv_layers") == cfg.shared_kv == 2
    assert _field(r, "gemma4.embedding_length_per_layer_input") == cfg.per_layer_dim
    names = {t.name for t in r.tensors}
    assert names == set(param_shapes(cfg))
    assert not {n for n in names if n.startswith(("blk.3.attn_k", "blk.3.attn_v", "blk.4.attn_k"))}
    if case == "gemma4":      # layer 2 takes V from K
        assert "blk.2.attn_k.weight" in names and "blk.2.attn_v.weight" not in names
        assert _field(r, "gemma4.attention.head_count_kv") == [2, 2, 1, 2, 1]
    else:
        assert _field(r, "gemma4.feed_forward_length") == [96, 96, 192, 192]
        embd = next(t for t in r.tensors if t.name == "per_layer_token_embd.weight")
        assert list(embd.shape) == [cfg.layers * cfg.per_layer_dim, cfg.vocab]      # ggml's order
        assert {"per_layer_model_proj.weight", "per_layer_proj_norm.weight", "blk.0.inp_gate.weight",
                "blk.3.proj.weight", "blk.3.post_norm.weight"} <= names


@pytest.mark.parametrize("case", ["gemma4", "gemma4-e"])
def test_packed_samples_see_only_themselves_through_shared_kv(case):
    """Two samples packed in one row: each one's logits are those of the sample alone (the
    float64 oracle), through local, global and KV-sharing layers and per-layer embeddings."""
    cfg = ModelConfig(**{**TINY, **TINY_CASES[case]})
    weights = family_params(cfg, seed=2, std=0.1)
    check_packed_pair(cfg, weights)


@pytest.mark.parametrize("case", ["gemma4", "gemma4-e"])
def test_decoder_cache_equals_whole_windows(case):
    """The KV-cached decoder (no cache for the layers that share one; feeds of any size,
    rewound) gives the logits of the window runner, past the sliding window."""
    cfg = ModelConfig(**{**TINY, **TINY_CASES[case]})
    weights = family_params(cfg, seed=1, std=0.3)
    be = CpuBackend(2)
    ids = np.random.default_rng(0).integers(0, cfg.vocab, 12).astype(np.int32)
    whole = Runner(cfg, weights, be, length=12).logits(ids[None])[0]
    dec = Decoder(cfg, weights, be)
    assert [len(c) for c in dec.cache] == [2] * (cfg.layers - 2) + [0, 0]
    pieces = np.concatenate([dec.feed(ids[i:j], every=True) for i, j in ((0, 1), (1, 3), (3, 8), (8, 12))])
    np.testing.assert_allclose(pieces, whole, rtol=1e-5, atol=1e-5)
    dec.rewind(5)
    np.testing.assert_allclose(dec.feed(ids[5:], every=True), whole[5:], rtol=1e-5, atol=1e-5)


def test_shared_kv_without_an_earlier_layer_of_its_kind_is_refused():
    with pytest.raises(ConfigError, match="layer 2 shares the keys and values of an earlier global layer, and "
                                          "there is none"):
        ModelConfig(**{**TINY, **TINY_CASES["gemma4"], "layers": 3, "swa_layers": (1, 1, 0), "kv_heads": 2,
                       "v_from_k": False, "shared_kv": 1})


def _bad_file(tmp_path, damage: str):
    tok = ByteTokenizer()
    cfg = ModelConfig(vocab=tok.n_vocab, **{**BASE, **INTEROP_CASES["gemma4-e"]})
    weights = family_params(cfg)
    if damage == "no-per-layer-embd":
        del weights["per_layer_token_embd.weight"]
    elif damage == "k-in-shared-layer":     # layer 3 shares layer 1's keys, yet carries its own
        weights["blk.3.attn_k.weight"] = weights["blk.1.attn_k.weight"]
    elif damage == "swa-count":
        object.__setattr__(cfg, "swa_layers", (1, 0, 1))
    elif damage == "swa-head":    # the local head size smaller than the rotated dims stated
        object.__setattr__(cfg, "head_dim_swa", 8)
        weights = family_params(ModelConfig(vocab=tok.n_vocab, **{**BASE, **INTEROP_CASES["gemma4-e"]}))
    path = tmp_path / "bad.gguf"
    write_with_gguf_py(path, cfg, weights, tok)
    return path


@pytest.mark.parametrize("damage,message", [
    ("no-per-layer-embd", "missing tensor 'per_layer_token_embd.weight'"),
    ("k-in-shared-layer", "tensor 'blk.3.attn_k.weight' is not part of a gemma4 model"),
    ("swa-count", "gemma4.attention.sliding_window_pattern) gives 3 values for 4 layers"),
    ("swa-head", "gemma4: rotary dims 16 of the local layers must be even and <= their head dim 8"),
])
def test_bad_gemma4_file_is_one_line_and_writes_nothing(tmp_path, damage, message):
    path = _bad_file(tmp_path, damage)
    check_finetune_refuses(tmp_path, path, message)


_E_MODEL = dict(arch="gemma4", dim=256, layers=8, heads=4, kv_heads=(2, 2, 1, 2, 2, 1, 2, 1), head_dim=64,
                swa_layers=(1, 1, 0, 1, 1, 0, 1, 0), window=16, rope_freqs=True, shared_kv=2, per_layer_dim=256,
                ff=(256,) * 6 + (512, 512), ctx=64, tied=True, v_from_k=(0, 0, 1, 0, 0, 1, 0, 0))
# 8 experts: llama.cpp's rules for 8-expert models (attn_v and attn_k Q8_0, attn_output Q5_K)
_MOE_MODEL = dict(arch="gemma4", dim=256, layers=4, heads=4, kv_heads=2, head_dim=64, swa_layers=(1, 0, 1, 0),
                  window=16, rope_freqs=True, experts=8, experts_used=2, expert_ff=256, ff=256, ctx=64, tied=True)


@pytest.mark.parametrize("model,out_type", [("e", "q4_k_m"), ("e", "q2_k"), ("e", "q8_0"), ("moe", "q4_k_m"),
                                            ("moe", "q3_k_m")])
def test_gemma4_mixtures_are_llama_cpps_quantizer(llama, tmp_path, model, out_type):
    """A quantized Gemma 4 file is llama_model_quantize's byte for byte: an E-model's
    per_layer_token_embd typed as the token embedding, per_layer_model_proj kept as it is, the
    V-from-K and KV-sharing layers counted as llama.cpp counts attn_v; a MoE model's two
    ffn_down kinds a layer ranked by the layer in their names, its 8 experts' rules."""
    from ggtrain.core.models.config import init_params
    from ggtrain.formats.mixture import MIXTURES
    from ggtrain.formats.model_file import rewrite_model
    from tests.interop import quantize_with_llama_cpp, same_model_files

    tok = ByteTokenizer()
    cfg = dict(vocab=tok.n_vocab, **(_E_MODEL if model == "e" else _MOE_MODEL))
    src, ref, ours = tmp_path / "src.gguf", tmp_path / "ref.gguf", tmp_path / "ours.gguf"
    save_model(src, cfg, init_params(ModelConfig(**cfg), seed=1, std=0.02), tok, out_type="f32")
    quantize_with_llama_cpp(llama, src, ref, MIXTURES[out_type].file_type)
    rewrite_model(ours, src, out_type=out_type)
    same_model_files(ours, ref)
