"""Qwen3.5 beyond the family table (tests/family_cases.py runs it against llama.cpp and the
float64 oracle): its files as our writer writes them, read by gguf-py; packed samples through
the convolution and the delta rule; the decoder's recurrent state against whole windows; the
delta rule fed in pieces from a carried state; bad files refused in one line."""
import json

import gguf
import numpy as np
import pytest

from ggtrain.core import ops
from ggtrain.core.backend_cpu import CpuBackend
from ggtrain.core.graph import Graph, Runtime
from ggtrain.core.models.config import ModelConfig, param_shapes
from ggtrain.core.models.inference import Decoder, Runner
from ggtrain.errors import ConfigError
from ggtrain.formats.gguf import read_gguf
from ggtrain.formats.model import validate_model
from ggtrain.formats.model_file import save_model
from ggtrain.formats.tokenizer import ByteTokenizer
from tests import refs
from tests.family_cases import BASE, INTEROP_CASES, TINY, TINY_CASES
from tests.interop import open_llm, run_cli
from tests.test_decoder import family_params
from tests.test_families import NLL_ATOL, TEXT, _their_nll, check_finetune_refuses, check_packed_pair, write_with_gguf_py


def _tiny():
    return ModelConfig(**{**TINY, **TINY_CASES["qwen35"]})


def test_our_file_is_qwen35_as_gguf_py_reads_it(tmp_path):
    """save_model writes qwen35's keys (the ssm sizes, full_attention_interval, the rope
    sections as an INT32 array) and the tensor names gguf-py knows, DeltaNet tensors in the
    recurrent layers only, q | gate rows in attn_q."""
    tok = ByteTokenizer()
    cfg = ModelConfig(vocab=tok.n_vocab, **{**BASE, **INTEROP_CASES["qwen35"]})
    path = tmp_path / "m.gguf"
    save_model(path, vars(cfg), family_params(cfg), tok)
    r = gguf.GGUFReader(str(path))

    def value(key):
        return int(r.fields[f"qwen35.{key}"].parts[-1][0])
    assert (value("ssm.conv_kernel"), value("ssm.state_size"), value("ssm.group_count"), value("ssm.time_step_rank"),
            value("ssm.inner_size"), value("full_attention_interval")) == (4, 8, 2, 4, 32, 2)
    sec = r.fields["qwen35.rope.dimension_sections"]
    assert sec.types == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32]
    assert [int(sec.parts[i][0]) for i in sec.data] == [2, 1, 1, 0]
    names = {t.name for t in r.tensors}
    assert names == set(param_shapes(cfg))
    assert {"blk.0.attn_qkv.weight", "blk.0.ssm_a", "blk.0.ssm_dt.bias", "blk.1.attn_q_norm.weight"} <= names
    assert "blk.0.attn_q.weight" not in names and "blk.1.ssm_conv1d.weight" not in names
    q = next(t for t in r.tensors if t.name == "blk.1.attn_q.weight")
    assert list(q.shape) == [cfg.dim, 2 * cfg.heads * cfg.head_dim]          # ggml's {n_embd, q | gate}
    conv = next(t for t in r.tensors if t.name == "blk.0.ssm_conv1d.weight")
    assert list(conv.shape) == [cfg.ssm_conv, cfg.ssm_channels]              # ggml's {kernel, channels}


def test_packed_samples_do_not_reach_across_the_recurrence():
    """Two samples packed in one row (positions restarting, segments by sample): each one's
    logits are those of the sample alone (the float64 oracle), through the convolution, the
    delta rule's state and attention."""
    cfg = _tiny()
    weights = family_params(cfg, seed=2, std=0.1)
    check_packed_pair(cfg, weights)


def test_decoder_state_equals_whole_windows():
    """The decoder's recurrent state (the convolution's last L - 1 rows and S of each DeltaNet
    layer, carried between feeds of any size) gives the logits of the window runner; reset
    starts over."""
    cfg = _tiny()
    weights = family_params(cfg, seed=1, std=0.3)
    be = CpuBackend(2)
    ids = np.random.default_rng(0).integers(0, cfg.vocab, 12).astype(np.int32)
    whole = Runner(cfg, weights, be, length=12).logits(ids[None])[0]
    dec = Decoder(cfg, weights, be)
    pieces = np.concatenate([dec.feed(ids[i:j], every=True) for i, j in ((0, 1), (1, 3), (3, 8), (8, 12))])
    np.testing.assert_allclose(pieces, whole, rtol=1e-5, atol=1e-5)
    dec.reset()
    np.testing.assert_allclose(dec.feed(ids[:4], every=True), whole[:4], rtol=1e-5, atol=1e-5)


def test_delta_rule_from_a_carried_state_equals_one_pass():
    """delta_rule_state over rows 0..3 then 4..8 from the state it returned: the outputs and
    the last state of one pass over 0..8 (float64 reference), V heads sharing a K head."""
    rng = np.random.default_rng(0)
    b, t, hk, hv, d = 1, 9, 1, 2, 3
    q, k = rng.uniform(-1, 1, (2, b, t, hk, d))
    v = rng.uniform(-1, 1, (b, t, hv, d))
    gl, beta = rng.uniform(-1, -0.05, (b, t, hv)), rng.uniform(0.1, 0.9, (b, t, hv))
    want_o, want_s = refs.delta_rule(q, k, v, gl, beta, s0=np.zeros((b, hv, d, d)))
    outs, state = [], np.zeros((b, hv, d, d), np.float32)
    for lo, hi in ((0, 4), (4, 9)):
        g = Graph()
        ins = [g.const(np.ascontiguousarray(x[:, lo:hi], np.float32)) for x in (q, k, v, gl, beta)]
        o, s1 = ops.delta_rule_state(*ins, g.const(state))
        rt = Runtime(g, CpuBackend(1))
        plan = rt.compile([o, s1])
        rt.run(plan)
        outs.append(plan.read(o))
        state = plan.read(s1).copy()
    np.testing.assert_allclose(np.concatenate(outs, axis=1), want_o, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state, want_s, rtol=1e-5, atol=1e-6)


def test_rope_sections_that_leave_pairs_to_the_fourth_position_are_refused():
    """IMROPE turns pair j by section j % 3's position only while j < 3 x its size; a pair past
    that takes the fourth position (0 for text), which NEOX would not give: refused."""
    with pytest.raises(ConfigError, match="rope.dimension_sections"):
        ModelConfig(**{**TINY, **TINY_CASES["qwen35"], "rope_sections": (1, 0, 0, 1)})


def _bad_file(tmp_path, damage: str):
    tok = ByteTokenizer()
    cfg = ModelConfig(vocab=tok.n_vocab, **{**BASE, **INTEROP_CASES["qwen35"]})
    weights = family_params(cfg)
    if damage == "no-ssm-a":
        del weights["blk.2.ssm_a"]
    elif damage == "no-conv":
        del weights["blk.0.ssm_conv1d.weight"]
    elif damage == "inner":       # ssm.inner_size that is not time_step_rank x state_size
        object.__setattr__(cfg, "ssm_inner", 48)
    path = tmp_path / "bad.gguf"
    write_with_gguf_py(path, cfg, weights, tok)
    return path


@pytest.mark.parametrize("damage,message", [
    ("no-ssm-a", "missing tensor 'blk.2.ssm_a'"),
    ("no-conv", "missing tensor 'blk.0.ssm_conv1d.weight'"),
    ("inner", "ssm.inner_size 48 must be time_step_rank 4 x state_size 8"),
])
def test_bad_qwen35_file_is_one_line_and_writes_nothing(tmp_path, damage, message):
    path = _bad_file(tmp_path, damage)
    check_finetune_refuses(tmp_path, path, message)


def _with_recurrent_layers(tmp_path, pattern):
    """The interop case's file (gguf-py) with attention.recurrent_layers = pattern in place of
    full_attention_interval, as the converter writes models whose config lists layer types."""
    tok = ByteTokenizer()
    cfg = ModelConfig(vocab=tok.n_vocab, **{**BASE, **INTEROP_CASES["qwen35"]})
    weights = family_params(cfg, seed=3, std=0.3)
    write_with_gguf_py(tmp_path / "src.gguf", cfg, weights, tok)
    f = read_gguf(tmp_path / "src.gguf")
    path = tmp_path / "rec.gguf"
    w = gguf.GGUFWriter(str(path), "qwen35")
    for key, v in f.kv.items():
        if key.startswith(("general.architecture", "GGUF.")) or key == "qwen35.full_attention_interval":
            continue
        value = v.value.tolist() if isinstance(v.value, np.ndarray) else v.value
        w.add_key_value(key, value, v.type, sub_type=getattr(v, "item_type", None))
    w.add_array("qwen35.attention.recurrent_layers", list(pattern))
    for name, arr in weights.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, cfg, tok


def test_recurrent_layers_array_gives_the_layer_kinds(llama, tmp_path):
    """attention.recurrent_layers (one bool a layer, llama.cpp reads it before
    full_attention_interval) in place of the interval: the same model, and llama.cpp's NLL."""
    path, cfg, tok = _with_recurrent_layers(tmp_path, [True, False, True, False])
    assert validate_model(read_gguf(path)).config == cfg
    data = tmp_path / "t.txt"
    data.write_text(TEXT)
    r = run_cli("eval", "--model", path, "--data", data, "--json", "--threads", 2)
    assert r.returncode == 0, r.stderr
    ids = tok.encode(TEXT, add_bos=tok.add_bos)
    assert json.loads(r.stdout)["nll"] == pytest.approx(_their_nll(open_llm(llama, path), ids)[1], abs=NLL_ATOL)


def test_recurrent_layers_not_every_nth_attending_are_refused(tmp_path):
    path, _, _ = _with_recurrent_layers(tmp_path, [True, True, False, False])
    data = tmp_path / "t.txt"
    data.write_text(TEXT)
    r = run_cli("eval", "--model", path, "--data", data)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "qwen35.attention.recurrent_layers = [True, True, False, False]" in r.stderr, r.stderr
