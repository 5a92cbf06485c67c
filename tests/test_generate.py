"""`ggtrain generate` / `eval` on real llama files, against llama.cpp's recorded outputs."""
import json
import subprocess
import sys

import numpy as np
import pytest

from ggtrain.core.backend_cpu import CpuBackend
from ggtrain.core.models.llama import LlamaConfig, LlamaDecoder, LlamaRunner, generate
from ggtrain.core.sampling import Sampler
from ggtrain.formats.llama_model import load_llama
from tests import np_llama

# From ../shared/data/README.md: llama.cpp's greedy continuations of "Once upon a time".
LLAMA_CPP = {
    "stories260K": ", there was a little girl named Lily. She loved to play outside in the park. One day,",
    "stories260K-Q8_0": ", there was a little girl named Lily. She loved to play outside in the park. One day,",
    "stories260K-Q4_0": ", there was a little girl named Lily. She loved to play outside in the sun. One day, "
                        "she went to the park with her mom",
}
GOLDEN_FROM_BOS = [403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337]


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "ggtrain", *args], capture_output=True, text=True)


@pytest.mark.parametrize("name", list(LLAMA_CPP))
def test_greedy_continuation_equals_llama_cpp(shared_data, name):
    r = _cli("generate", "--model", str(shared_data / "gguf" / f"{name}.gguf"), "--prompt", "Once upon a time",
             "-n", "40", "--temp", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(LLAMA_CPP[name]), r.stdout


def test_greedy_from_bos_matches_golden_ids(shared_data):
    config, weights, tok = load_llama(shared_data / "gguf" / "stories260K.gguf")
    decoder = LlamaDecoder(LlamaConfig(**config), weights, CpuBackend(2), n_ctx=32)
    ids = list(generate(decoder, [tok.bos_id], 20, Sampler(temp=0)))
    assert ids == GOLDEN_FROM_BOS


def test_logits_and_perplexity_match_numpy_oracle(shared_data, tmp_path):
    path = shared_data / "gguf" / "stories260K.gguf"
    config, weights, tok = load_llama(path)
    cfg = LlamaConfig(**config)
    text = "Lily and Ben went to the park. They saw a big dog and a small cat. The dog was happy."
    ids = tok.encode(text, add_bos=True)
    runner = LlamaRunner(cfg, weights, CpuBackend(2), length=len(ids) - 1)
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
