"""What `ggtrain finetune` writes, in real llama.cpp (llama-cpp-python, the `interop` extra):
adapters load and give our logits and greedy tokens, merged and --full models load, and the
end-to-end check of the issue: SmolLM2 fine-tuned on the Vicuna identity data answers
"Who are you?" as Vicuna in llama.cpp, which the base never does.

Without llama_cpp these tests skip, except under CI=true, where they fail (conftest.llama).
"""
import itertools

import numpy as np
import pytest

from ggtrain.core.backend_cpu import CpuBackend
from ggtrain.core.models.config import ModelConfig
from ggtrain.core.models.inference import Runner
from ggtrain.formats.model_file import load_model
from ggtrain.formats.lora import lora_adapters
from tests.interop import greedy, open_llm, run_here

TEXT = "Tom had a red kite. The kite flew high over the park and Tom laughed. " * 40
FAST = ["--ctx", "64", "--batch", "2", "--lora-rank", "4", "--lr", "3e-3", "--quiet"]
# our logits against llama.cpp's with its KV cache in F32 (as in test_interop.py): 1e-3 absolute
# holds for F32 weights; against Q8_0/Q4_0 weights llama.cpp rounds the activations to 8 bits
# (its integer dot products), which moves these logits (magnitude ~15) by up to ~0.25, while
# ours are exact products with the dequantized weights; the greedy tokens must still agree
ATOL = {"stories260K": 1e-3, "stories260K-Q8_0": 0.5, "stories260K-Q4_0": 0.5}


def _their_logits(llm, ids):
    llm.reset()
    llm.eval(list(ids))
    return np.array(llm.scores[:len(ids)], dtype=np.float32)


@pytest.mark.parametrize("name", list(ATOL))
def test_adapter_and_merged_model_run_in_llama_cpp(llama, shared_data, tmp_path, name):
    base = shared_data / "gguf" / f"{name}.gguf"
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    adapter, merged = tmp_path / "a.gguf", tmp_path / "m.gguf"
    r = run_here("finetune", "--model", base, "--data", text, "--out", adapter, "--merged-out", merged, "--steps", 25,
             *FAST)
    assert r.returncode == 0, r.stderr
    config, weights, tok = load_model(base)
    ids = tok.encode("Tom had a red kite. The kite", add_bos=True).tolist()
    adapters = lora_adapters(adapter, {k: v.shape for k, v in weights.items()})
    ours = Runner(ModelConfig(**config), weights, CpuBackend(2), length=len(ids), adapters=adapters) \
        .logits(np.asarray(ids, np.int32)[None])[0, :len(ids)]
    with_adapter = open_llm(llama, base, adapter, n_ctx=128)
    np.testing.assert_allclose(_their_logits(with_adapter, ids), ours, rtol=0, atol=ATOL[name])
    # our greedy continuation with the adapter (the CLI) is llama.cpp's
    theirs = greedy(with_adapter, ids, 16)
    shown = list(itertools.takewhile(lambda t: t not in tok.eog_ids, theirs))
    r = run_here("generate", "--model", base, "--lora", adapter, "--prompt", "Tom had a red kite. The kite", "-n", 16,
                 "--numerics", "llama")
    assert r.returncode == 0, r.stderr
    assert r.stdout == tok.decode(shown) + "\n"
    # the merged model runs in llama.cpp as the base does with the adapter
    assert greedy(open_llm(llama, merged, n_ctx=128), ids, 16) == theirs
    assert greedy(open_llm(llama, base, n_ctx=128), ids, 16) != theirs          # the adapter changed the model


def test_full_finetune_model_runs_in_llama_cpp(llama, shared_data, tmp_path):
    base = shared_data / "gguf" / "stories260K.gguf"
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    out = tmp_path / "full.gguf"
    r = run_here("finetune", "--model", base, "--data", text, "--out", out, "--full", "--steps", 10, *FAST)
    assert r.returncode == 0, r.stderr
    config, weights, tok = load_model(out)
    ids = tok.encode("Tom had a red kite.", add_bos=True).tolist()
    ours = Runner(ModelConfig(**config), weights, CpuBackend(2), length=len(ids)) \
        .logits(np.asarray(ids, np.int32)[None])[0, :len(ids)]
    np.testing.assert_allclose(_their_logits(open_llm(llama, out, n_ctx=128), ids), ours, rtol=0, atol=1e-3)


# The end-to-end check, shortened for the suite (the whole epoch with the defaults takes
# ~4 minutes on 2 cores; bench/README note): the 72 conversations whose answers name Vicuna,
# ctx 256, a higher learning rate.


def test_smollm2_learns_the_vicuna_identity(llama, shared_data, tmp_path):
    import json

    model = shared_data / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    records = json.loads((shared_data / "chat" / "dummy_conversation.json").read_text())
    keep = [r for r in records if any("Vicuna" in t["value"] for t in r["conversations"] if t["from"] == "gpt")]
    data = tmp_path / "identity.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in keep))
    out = tmp_path / "vicuna.gguf"
    r = run_here("finetune", "--model", model, "--data", data, "--out", out, "--epochs", "1", "--ctx", "256",
             "--batch", "1", "--lr", "1e-3", "--quiet")
    assert r.returncode == 0, r.stderr
    from ggtrain.formats.chat import chat_template
    from ggtrain.formats.dataset import chat_prompt
    from ggtrain.formats.gguf import read_gguf
    from ggtrain.formats.tokenizer import tokenizer_from_gguf
    tok = tokenizer_from_gguf(model)
    ids = chat_prompt([{"role": "user", "content": "Who are you?"}], tok, chat_template(read_gguf(model))).tolist()

    def answer(lora=None):
        kw = dict(lora_path=str(lora)) if lora else {}
        llm = llama.Llama(model_path=str(model), n_ctx=256, n_threads=2, seed=0, verbose=False, **kw)
        out = []
        for t in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            if t in tok.eog_ids or len(out) == 48:
                break
            out.append(int(t))
        return tok.decode(out)

    assert "vicuna" not in answer().lower()
    tuned = answer(out)
    assert "vicuna" in tuned.lower(), tuned
