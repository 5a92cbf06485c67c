"""LFM2 beyond the family table (tests/family_cases.py runs it against llama.cpp and the float64
oracle): its files as our writer writes them, read by gguf-py; packed samples through the short
convolution; the decoder's convolution state against whole windows; bad files refused in one
line."""
import gguf
import numpy as np
import pytest

from ggtrain.core.backend_cpu import CpuBackend
from ggtrain.core.models.config import ModelConfig, param_shapes
from ggtrain.core.models.inference import Decoder, Runner
from ggtrain.formats.model_file import save_model
from ggtrain.formats.tokenizer import ByteTokenizer
from tests.family_cases import BASE, INTEROP_CASES, TINY, TINY_CASES
from tests.test_decoder import family_params
from tests.test_families import check_finetune_refuses, check_packed_pair, write_with_gguf_py


def _tiny():
    return ModelConfig(**{**TINY, **TINY_CASES["lfm2"]})


def test_our_file_is_lfm2_as_gguf_py_reads_it(tmp_path):
    """save_model writes lfm2's keys (head_count_kv one a layer, as the converter's INT32 array;
    shortconv.l_cache, stated although it is the default) and tensor names gguf-py knows."""
    tok = ByteTokenizer()
    cfg = ModelConfig(vocab=tok.n_vocab, **{**BASE, **INTEROP_CASES["lfm2"]})
    path = tmp_path / "m.gguf"
    save_model(path, vars(cfg), family_params(cfg), tok)
    r = gguf.GGUFReader(str(path))
    kv = r.fields["lfm2.attention.head_count_kv"]
    assert kv.types == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32]
    assert [int(kv.parts[i][0]) for i in kv.data] == list(cfg.kv_heads) == [0, 2, 0]
    assert int(r.fields["lfm2.shortconv.l_cache"].parts[-1][0]) == cfg.shortconv_l == 3
    names = {t.name for t in r.tensors}
    assert names == set(param_shapes(cfg))
    assert {"token_embd_norm.weight", "blk.0.shortconv.conv.weight", "blk.1.attn_q_norm.weight"} <= names
    assert "blk.0.attn_q.weight" not in names and "blk.1.shortconv.in_proj.weight" not in names
    conv = next(t for t in r.tensors if t.name == "blk.0.shortconv.conv.weight")
    assert list(conv.shape) == [cfg.shortconv_l, cfg.dim]          # ggml's {l_cache, n_embd}


def test_packed_samples_do_not_reach_across_the_short_convolution():
    """Two samples packed in one row (positions restarting, segments by sample): each one's
    logits are those of the sample alone (the float64 oracle), through conv and attention."""
    cfg = _tiny()
    weights = family_params(cfg, seed=2, std=0.1)
    check_packed_pair(cfg, weights)


def test_decoder_state_equals_whole_windows():
    """The decoder's convolution state (the last L - 1 rows of B * x, carried between feeds of
    any size, rewound by feeding again) gives the logits of the window runner."""
    cfg = _tiny()
    weights = family_params(cfg, seed=1, std=0.3)
    be = CpuBackend(2)
    ids = np.random.default_rng(0).integers(0, cfg.vocab, 12).astype(np.int32)
    whole = Runner(cfg, weights, be, length=12).logits(ids[None])[0]
    dec = Decoder(cfg, weights, be)
    pieces = np.concatenate([dec.feed(ids[i:j], every=True) for i, j in ((0, 1), (1, 3), (3, 8), (8, 12))])
    np.testing.assert_allclose(pieces, whole, rtol=1e-5, atol=1e-5)
    dec.rewind(5)
    np.testing.assert_allclose(dec.feed(ids[5:], every=True), whole[5:], rtol=1e-5, atol=1e-5)
    dec.reset()
    np.testing.assert_allclose(dec.feed(ids[:4], every=True), whole[:4], rtol=1e-5, atol=1e-5)


def _bad_file(tmp_path, damage: str):
    tok = ByteTokenizer()
    cfg = ModelConfig(vocab=tok.n_vocab, **{**BASE, **INTEROP_CASES["lfm2"]})
    weights = family_params(cfg)
    if damage == "no-conv":
        del weights["blk.2.shortconv.conv.weight"]
    elif damage == "l_cache":     # the file says 4 taps, the kernels hold 3
        cfg = ModelConfig(**{**vars(cfg), "shortconv_l": 4})
    elif damage == "kv-count":    # head_count_kv with values for 2 of the 3 layers
        object.__setattr__(cfg, "kv_heads", (0, 2))
    path = tmp_path / "bad.gguf"
    write_with_gguf_py(path, cfg, weights, tok)
    return path


@pytest.mark.parametrize("damage,message", [
    ("no-conv", "missing tensor 'blk.2.shortconv.conv.weight'"),
    ("l_cache", "tensor 'blk.0.shortconv.conv.weight' has shape (64, 3), expected (64, 4)"),
    ("kv-count", "lfm2.attention.head_count_kv) gives 2 values for 3 layers"),
])
def test_bad_lfm2_file_is_one_line_and_writes_nothing(tmp_path, damage, message):
    path = _bad_file(tmp_path, damage)
    stderr = check_finetune_refuses(tmp_path, path, message)
    if damage == "l_cache":       # the key is named with the value the file gives
        assert "lfm2.shortconv.l_cache=4" in stderr
