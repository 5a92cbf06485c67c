"""`ggtrain generate` / `eval` on real llama files, against llama.cpp's recorded outputs."""
import json
import subprocess
import sys

import gguf
import numpy as np
import pytest

from ggtrain.core.backend_cpu import CpuBackend
from ggtrain.core.models.config import ModelConfig
from ggtrain.core.models.inference import Decoder, Runner, generate
from ggtrain.core.sampling import Sampler
from ggtrain.formats.model_file import load_model
from ggtrain.core.numerics import EXACT, LLAMA
from tests import np_decoder as np_llama
from tests.interop import run_here

# From ../shared/data/README.md: llama.cpp's greedy continuations of "Once upon a time".
LLAMA_CPP = {
    "stories260K": ", there was a little girl named Lily. She loved to play outside in the park. One day,",
    "stories260K-Q8_0": ", there was a little girl named Lily. She loved to play outside in the park. One day,",
    "stories260K-Q4_0": ", there was a little girl named Lily. She loved to play outside in the sun. One day, "
                        "she went to the park with her mom",
}
GOLDEN_FROM_BOS = [403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337]


def _cli(*args):
    """`ggtrain ARGS` by its entry point in this process (tests.interop.run_here)."""
    return run_here(*args)


@pytest.mark.parametrize("name", list(LLAMA_CPP))
def test_greedy_continuation_equals_llama_cpp(shared_data, name):
    r = _cli("generate", "--model", str(shared_data / "gguf" / f"{name}.gguf"), "--prompt", "Once upon a time",
             "-n", "40", "--temp", "0", "--numerics", "llama")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(LLAMA_CPP[name]), r.stdout


def test_greedy_from_bos_matches_golden_ids(shared_data):
    config, weights, tok = load_model(shared_data / "gguf" / "stories260K.gguf")
    decoder = Decoder(ModelConfig(**config), weights, CpuBackend(2), n_ctx=32)
    ids = list(generate(decoder, [tok.bos_id], 20, Sampler(temp=0)))
    assert ids == GOLDEN_FROM_BOS


def test_logits_and_perplexity_match_numpy_oracle(shared_data, tmp_path):
    path = shared_data / "gguf" / "stories260K.gguf"
    config, weights, tok = load_model(path)
    cfg = ModelConfig(**config)
    text = "Lily and Ben went to the park. They saw a big dog and a small cat. The dog was happy."
    ids = tok.encode(text, add_bos=True)
    runner = Runner(cfg, weights, CpuBackend(2), length=len(ids) - 1)
    got = runner.logits(ids[None, :-1])[0]
    want = np_llama.forward(cfg, weights, ids[None, :-1], np.arange(len(ids) - 1))[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    nll = np_llama.loss(want[None], ids[None, 1:]) * (len(ids) - 1)
    (tmp_path / "t.txt").write_text(text)
    r = _cli("eval", "--model", str(path), "--data", str(tmp_path / "t.txt"), "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["tokens"] == len(ids) - 1
    assert res["perplexity"] == pytest.approx(float(np.exp(nll / (len(ids) - 1))), rel=1e-4)


def test_bad_input(shared_data, tmp_path):
    vocab_only = shared_data / "gguf" / "ggml-vocab-llama-spm.gguf"
    r = _cli("generate", "--model", str(vocab_only), "--prompt", "hi")
    assert r.returncode == 1 and "Traceback" not in r.stderr and "ggml-vocab-llama-spm.gguf" in r.stderr
    r = _cli("generate", "--model", str(tmp_path / "none.gguf"), "--prompt", "hi")
    assert r.returncode == 1 and "none.gguf" in r.stderr
    r = _cli("generate", "--model", str(shared_data / "gguf" / "stories260K.gguf"), "--prompt", "x " * 3000)
    assert r.returncode == 1 and "context" in r.stderr
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00bad")
    r = _cli("eval", "--model", str(shared_data / "gguf" / "stories260K.gguf"), "--data", str(tmp_path / "bin.txt"))
    assert r.returncode == 1 and "UTF-8" in r.stderr


def test_lora_bad_input(shared_data, tmp_path):
    from ggtrain.formats.lora import write_lora
    model = shared_data / "gguf" / "stories260K.gguf"
    r = _cli("generate", "--model", str(model), "--lora", str(model), "--prompt", "hi", "-n", "2")
    assert r.returncode == 1 and "not a LoRA adapter" in r.stderr
    bad = tmp_path / "bad.gguf"
    write_lora(bad, "llama", 4.0, {"blk.0.attn_q.weight": (np.zeros((2, 32)), np.zeros((64, 2)))})
    r = _cli("generate", "--model", str(model), "--lora", str(bad), "--prompt", "hi", "-n", "2")
    assert r.returncode == 1 and "blk.0.attn_q.weight" in r.stderr
    missing = tmp_path / "m.gguf"
    write_lora(missing, "llama", 4.0, {"blk.9.attn_q.weight": (np.zeros((2, 64)), np.zeros((64, 2)))})
    r = _cli("generate", "--model", str(model), "--lora", str(missing), "--prompt", "hi", "-n", "2")
    assert r.returncode == 1 and "does not have" in r.stderr
    for args, option in ((["--model", str(tmp_path / "none.gguf")], "--model"),
                         (["--model", str(model), "--lora", str(tmp_path / "none.gguf")], "--lora")):
        r = _cli("generate", *args, "--prompt", "hi", "-n", "2")
        assert r.returncode == 1 and r.stderr.strip() == f"error: {option} {tmp_path / 'none.gguf'}: no such file"
    for data, words in ((tmp_path / "none.txt", "no such file"), (tmp_path, "is a directory, not a text file")):
        r = _cli("eval", "--model", str(model), "--data", str(data))
        assert r.returncode == 1 and r.stderr.strip() == f"error: --data {data}: {words}"


def test_open_llama_keeps_stored_types_without_copies(shared_data, backend):
    """Every matrix stays in the file's type, its bytes exactly the file's (no dequantization at
    load); the F32 norms are bound too."""
    from ggtrain.core.backend import StoredTensor
    from ggtrain.formats.gguf import read_gguf
    from ggtrain.formats.model_file import open_model

    path = shared_data / "gguf" / "stories260K-Q4_0.gguf"
    f = read_gguf(path)
    config, weights, tok = open_model(path, backend)
    types = set()
    for name, w in weights.items():
        assert isinstance(w, StoredTensor), name
        info = f.tensors[name]
        assert w.dtype == info.type.name.lower() and w.shape == info.shape
        raw = f.read_tensor(name).reshape(-1).view(np.uint8)
        assert np.array_equal(w.buffer.bytes[:raw.size], raw), name
        types.add(w.dtype)
    assert {"q4_0", "f16", "f32"} <= types


def test_load_peak_memory_is_the_stored_bytes(shared_data):
    """Loading SmolLM2 (Q4_1 blocks, a Q8_0 embedding: 98 MB) grows the process by about its
    tensor bytes, not by an f32 copy (~540 MB)."""
    model = shared_data / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    code = (
        "import resource, sys\n"
        "from ggtrain.core.backend_cpu import CpuBackend\n"
        "from ggtrain.formats.gguf import read_gguf\n"
        "from ggtrain.formats.model_file import open_model\n"
        "from ggtrain.formats.tokenizer import tokenizer_from_gguf\n"
        "tokenizer_from_gguf(sys.argv[1])\n"
        "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "cfg, w, tok = open_model(sys.argv[1], CpuBackend(1))\n"
        "peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "print((peak - base) * 1024, read_gguf(sys.argv[1]).tensor_bytes)\n")
    r = subprocess.run([sys.executable, "-c", code, str(model)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    grown, tensor_bytes = map(int, r.stdout.split())
    assert tensor_bytes > 90e6
    assert grown < 1.25 * tensor_bytes, (grown, tensor_bytes)


def _tiny_model(path, dtype_of=lambda name: "F32", dim=256):
    """A one-block llama (byte vocabulary) with tensors in the given ggml types (raw zeros
    for block types), written by our writer."""
    from ggtrain.formats.gguf import write_gguf
    from ggtrain.formats.model import config_to_kv, tensor_shapes
    from ggtrain.formats.tokenizer import ByteTokenizer
    from ggtrain.native.dtypes import nbytes

    tok = ByteTokenizer()
    hp = ModelConfig(vocab=tok.n_vocab, dim=dim, layers=1, heads=4, kv_heads=4, ff=dim, ctx=64)
    tensors = []
    for name, shape in tensor_shapes(hp).items():
        t = dtype_of(name)
        if t == "F32":
            tensors.append((name, np.ones(shape, np.float32), t))
        else:
            tensors.append((name, lambda shape=shape, t=t: np.zeros(nbytes(shape, t), np.uint8), t, shape))
    write_gguf(path, config_to_kv(hp) + list(tok.gguf_kv()), tensors)
    return path


def test_unsupported_weight_type_is_a_clear_error(tmp_path):
    model = _tiny_model(tmp_path / "iq.gguf", lambda n: "IQ2_XXS" if n == "blk.0.attn_q.weight" else "F32")
    r = _cli("generate", "--model", str(model), "--prompt", "hi", "-n", "2")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "iq.gguf" in r.stderr and "blk.0.attn_q.weight" in r.stderr and "IQ2_XXS" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_truncated_tensor_is_a_clear_error(tmp_path):
    model = _tiny_model(tmp_path / "t.gguf")
    raw = model.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(raw[:-1000])
    r = _cli("generate", "--model", str(cut), "--prompt", "hi", "-n", "2")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    last = list(gguf.GGUFReader(model).tensors)[-1].name       # the tensor the cut reaches
    assert "cut.gguf" in r.stderr and f"'{last}'" in r.stderr and "past the end" in r.stderr


def test_smollm2_logits_equal_float64_oracle(shared_data, backend):
    """The real instruct model in its own types (Q4_1 blocks, tied Q8_0 embedding, GQA 9/3,
    rope base 1e5): KV-cached logits equal a float64 numpy forward on the dequantized weights."""
    from ggtrain.formats.model_file import load_model, open_model

    path = shared_data / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    config, weights, tok = open_model(path, backend)
    cfg = ModelConfig(**config)
    ids = tok.encode("The capital of France is", add_bos=tok.add_bos).tolist()
    dec = Decoder(cfg, weights, backend, n_ctx=16)
    got = np.stack([dec.feed(ids[:3])] + [dec.feed([t]) for t in ids[3:]])
    _, f32_weights, _ = load_model(path)
    want = np_llama.forward(cfg, f32_weights, np.array([ids]), np.arange(len(ids)))[0, 2:]
    del f32_weights
    # f32 accumulation over 30 blocks of 576..1536-long dot products, logits of magnitude ~24:
    # measured within 3.2e-5 of float64 (llama.cpp, which rounds activations to 8 bits for
    # its integer dot products, is 0.9 away; see test_interop)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-3)
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_eval_numerics_llama_is_the_runner_in_llama_numbers(shared_data, tmp_path):
    """`eval --numerics llama` on stories260K-Q8_0 gives the perplexity of the Runner in llama
    numbers (its default F16 KV cache), not the default's (exact f32), which it is close to; the
    replaced `--int8` still gives it, with a warning naming --numerics."""
    from ggtrain.formats.model_file import open_model
    path = shared_data / "gguf" / "stories260K-Q8_0.gguf"
    be = CpuBackend(2)
    config, weights, tok = open_model(path, be)          # the stored Q8_0 matrices, as the CLI reads them
    text = "Lily and Ben went to the park. They saw a big dog and a small cat. The dog was happy."
    (tmp_path / "t.txt").write_text(text)
    ids = tok.encode(text, add_bos=True)
    got = {}
    for flag in ((), ("--numerics", "llama"), ("--int8",)):
        r = _cli("eval", "--model", str(path), "--data", str(tmp_path / "t.txt"), "--json", *flag)
        assert r.returncode == 0, r.stderr
        assert ("--numerics llama" in r.stderr) == (flag == ("--int8",)), r.stderr
        got[flag] = json.loads(r.stdout)["nll"]
    want = {}
    for numerics in (EXACT, LLAMA):
        runner = Runner(ModelConfig(**config), weights, be, length=len(ids) - 1, numerics=numerics, kv_f16=True)
        want[numerics] = runner.nll(ids[None, :-1], ids[None, 1:]) / (len(ids) - 1)
    assert got[()] == pytest.approx(want[EXACT], abs=1e-6)
    assert got[("--numerics", "llama")] == pytest.approx(want[LLAMA], abs=1e-6)
    assert got[("--int8",)] == got[("--numerics", "llama")]
    assert 1e-5 < abs(want[LLAMA] - want[EXACT]) < 0.05


@pytest.mark.parametrize("args, message", [(["--top-p", "2"], "--top-p is a probability (0..1), got 2.0"),
                                           (["--min-p", "-0.5"], "--min-p is a probability (0..1), got -0.5"),
                                           (["--temp", "-1"], "--temp must be >= 0"),
                                           (["--repeat-penalty", "0"], "--repeat-penalty > 0")])
def test_sampling_options_out_of_range_are_one_line(shared_data, args, message):
    """A sampling value outside its range (--top-p 2 was taken without a word) is one line naming it."""
    r = _cli("generate", "--model", str(shared_data / "gguf" / "stories260K.gguf"), "--prompt", "hi", "-n", "2", *args)
    assert r.returncode == 1 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
