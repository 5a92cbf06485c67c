"""MXFP4 (ggml type 39: one E8M0 scale byte and 32 E2M1 codes a block) as a stored, frozen weight
type: its blocks against gguf-py's quantizer and dequantizer and a float64 decoding, its products
(exact and with llama.cpp's 8-bit activations: tests/test_qdot8.py) in the expert product, and a
qwen3moe file whose experts, embedding and output are MXFP4 against llama.cpp."""
import gguf
import numpy as np
import pytest

from ggtrain.core import ops
from ggtrain.core.backend_cpu import CpuBackend
from ggtrain.core.graph import Graph, Runtime
from ggtrain.core.models.config import ModelConfig
from ggtrain.formats.gguf import read_gguf
from ggtrain.formats.quants import dequantize, quantize
from ggtrain.formats.tokenizer import ByteTokenizer
from ggtrain.native.dtypes import dtype
from tests import refs
from tests.family_cases import BASE, INTEROP_CASES
from tests.interop import open_llm, run_cli
from tests.test_decoder import family_params
from tests.test_families import TEXT, _eval_cli, _their_nll, write_with_gguf_py

MXFP4 = gguf.GGMLQuantizationType.MXFP4


def test_the_table_row_is_ggmls_block():
    d = dtype("mxfp4")
    assert (d.id, d.block, d.block_bytes) == (int(MXFP4), *gguf.GGML_QUANT_SIZES[MXFP4])
    assert d.can_dequantize and d.can_quantize


def test_blocks_are_gguf_pys_both_ways():
    """Our writer's bytes are gguf-py's quantizer's (normal, heavy-tailed, tiny, huge, zero and
    one-signed rows); every scale byte and code decodes to gguf-py's values and to the float64
    decoding of the format (doubled E2M1 value times 2^(e - 128))."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 512)).astype(np.float32)
    x *= np.exp(rng.uniform(-30, 30, (8, 1))).astype(np.float32)
    x[0, :32] = 0
    x[1] = x[1] ** 3
    x[2] = np.abs(x[2])
    x[3, 7] = 1e6
    ours = np.asarray(quantize(x, "mxfp4")).reshape(8, -1)
    np.testing.assert_array_equal(ours, gguf.quants.quantize(x, MXFP4))
    raw = rng.integers(0, 256, (16, 16 * 17), dtype=np.uint8)
    raw[:, ::17] = np.arange(256, dtype=np.uint8).reshape(16, 16)         # every scale byte
    got = dequantize(raw, "mxfp4", (16, 512))
    with np.errstate(over="ignore"):
        theirs = gguf.quants.dequantize(raw, MXFP4)
    np.testing.assert_array_equal(got.view(np.uint32), theirs.view(np.uint32))
    want = refs.weight_blocks_f64(raw.tobytes(), "mxfp4", 16, 512)
    fits = np.abs(want) <= np.finfo(np.float32).max
    assert np.array_equal(got[fits].astype(np.float64), want[fits])     # exact: one product, no rounding
    assert np.array_equal(got[~fits], np.copysign(np.inf, want[~fits]))  # (12 * 2^127 and such overflow)


def _run(g, outs, threads=2):
    rt = Runtime(g, CpuBackend(threads))
    plan = rt.compile(outs)
    rt.run(plan)
    return [plan.read(o) for o in outs]


@pytest.mark.parametrize("numerics", ["exact", "llama"])
def test_expert_products_are_each_experts_own_matmul(numerics):
    """moe_matmul over MXFP4 experts: each routed row the bits of that expert's own product (the
    exact row-dot kernel, or with the activations in 8 bits, llama.cpp's mul_mat_id, as
    ops.matmul_q8 gives them) for 40 rows (vec_dot's block pairs and odd last block, K = 96) and
    48 (the repacked chain); near the float64 product over the dequantized experts."""
    rng = np.random.default_rng(1)
    ids = np.array([[3, 0], [3, 5], [0, 2], [7, 5], [4, 0], [2, 7]], np.int32)
    for m in (40, 48):
        x = rng.normal(size=(6, 1, 96)).astype(np.float32)
        w = rng.normal(size=(8, m, 96)).astype(np.float32)
        raw = np.asarray(quantize(w.reshape(-1, 96), "mxfp4"))
        deq = dequantize(raw, "mxfp4", w.shape)
        g = Graph()
        y = ops.moe_matmul(g.const(x), g.param(w.shape, raw, trainable=False, dtype="mxfp4"),
                           g.const(ids, dtype="i32"), numerics=numerics)
        got = _run(g, [y])[0]
        for e in np.unique(ids):
            rows = [(i, s) for i in range(6) for s in range(2) if ids[i, s] == e]
            g2 = Graph()
            xe = g2.const(np.stack([x[i, 0] for i, _ in rows]))
            we = g2.param((m, 96), np.asarray(quantize(w[e], "mxfp4")), trainable=False, dtype="mxfp4")
            prod = ops.matmul(xe, ops.transpose(we, 0, 1)) if numerics == "exact" else ops.matmul_q8(xe, ops.transpose(we, 0, 1))
            np.testing.assert_array_equal(np.stack([got[i, s] for i, s in rows]), _run(g2, [prod])[0])
        np.testing.assert_allclose(got, refs.moe_matmul(x, deq, ids), rtol=0, atol=0.05 * np.abs(got).max())


def _mxfp4_model(tmp_path):
    """A qwen3moe file whose experts, token embedding and output matrix are MXFP4 (gguf-py's
    quantizer): experts 96 wide over a width of 96 (three blocks a row: the odd last block),
    the output's 260 rows not a multiple of 8 (llama.cpp's vec_dot, not its repacked GEMV)."""
    tok = ByteTokenizer()
    cfg = ModelConfig(vocab=tok.n_vocab, **{**BASE, **INTEROP_CASES["qwen3moe"], "dim": 96, "expert_ff": 96})
    weights = family_params(cfg, seed=3, std=0.3)
    types = {n: MXFP4 for n in weights if n.endswith("_exps.weight") or n in ("token_embd.weight", "output.weight")}
    path = tmp_path / "mxfp4.gguf"
    write_with_gguf_py(path, cfg, weights, tok, types=types)
    assert {n for n, t in read_gguf(path).tensors.items() if t.type == MXFP4} == set(types)
    return path, tok


def test_mxfp4_moe_file_is_llama_cpps_model(llama, tmp_path):
    """ggtrain eval's NLL is llama.cpp's, and `info` names the type; in llama.cpp's numbers the
    logits are llama.cpp's bit for bit at every position, fed a token at a time and all at once
    (the experts' and the output's products with 8-bit activations in its order)."""
    from ggtrain.core.models.inference import Decoder, Runner
    from ggtrain.core.numerics import LLAMA
    from ggtrain.formats.model_file import open_model
    path, tok = _mxfp4_model(tmp_path)
    r = run_cli("info", path)
    assert r.returncode == 0 and "MXFP4" in r.stdout.upper(), r.stderr
    data = tmp_path / "t.txt"
    data.write_text(TEXT)
    ids = tok.encode(TEXT, add_bos=tok.add_bos)
    llm = open_llm(llama, path)
    theirs = _their_nll(llm, ids)[1]
    assert _eval_cli(path, data)["nll"] == pytest.approx(theirs, abs=0.02)

    be = CpuBackend(2)
    mcfg, weights, _ = open_model(path, be)
    assert weights["blk.0.ffn_up_exps.weight"].dtype == "mxfp4"
    probe = tok.encode(TEXT[:40], add_bos=True).tolist()
    llm.reset()
    for t in probe:
        llm.eval([t])
    one = np.array(llm.scores[:len(probe)], np.float32)
    llm.reset()
    llm.eval(probe)
    batched = np.array(llm.scores[:len(probe)], np.float32)
    dec = Decoder(ModelConfig(**mcfg), weights, be, n_ctx=256, numerics=LLAMA)
    np.testing.assert_array_equal(np.concatenate([dec.feed([t], every=True) for t in probe]), one)
    runner = Runner(ModelConfig(**mcfg), weights, be, length=len(probe), numerics=LLAMA, n_ctx=256)
    np.testing.assert_array_equal(runner.logits(np.asarray(probe, np.int32)[None])[0, :len(probe)], batched)
    exact = Runner(ModelConfig(**mcfg), weights, be, length=len(probe), n_ctx=256)
    assert not np.array_equal(exact.logits(np.asarray(probe, np.int32)[None])[0, :len(probe)], batched)


def test_lora_on_mxfp4_experts_keeps_them_frozen(llama, tmp_path):
    """finetune (LoRA) on the MXFP4 model: the adapter holds the attention's and the router's
    factors only (the experts stay stored), and llama.cpp applies it as ggtrain does."""
    path, tok = _mxfp4_model(tmp_path)
    data = tmp_path / "t.txt"
    data.write_text(TEXT * 8)
    adapter = tmp_path / "a.gguf"
    r = run_cli("finetune", "--model", path, "--data", data, "--out", adapter, "--steps", 4, "--ctx", 32,
                "--batch", 2, "--lr", 3e-2, "--warmup", 0, "--val-split", 0, "--threads", 2, "--quiet")
    assert r.returncode == 0, r.stderr
    names = set(read_gguf(adapter).tensors)
    assert {n.split(".")[2] for n in names} == {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_inp"}
    ids = tok.encode(TEXT, add_bos=tok.add_bos)
    base = _their_nll(open_llm(llama, path), ids)[1]
    theirs = _their_nll(open_llm(llama, path, lora=adapter), ids)[1]
    probe = tmp_path / "p.txt"
    probe.write_text(TEXT)
    assert abs(theirs - base) > 0.01
    assert abs(_eval_cli(path, probe, "--lora", adapter)["nll"] - theirs) < 0.02
