"""convert-checkpoint's outputs in real llama.cpp (the interop extra): the llama2.c import runs
as ggml-org's stories260K.gguf, a checkpoint's model generates as `ggtrain generate` does,
merged models run as the base with the adapter, and the quantizers give llama.cpp's bytes."""
import itertools

import numpy as np
import pytest

from ggtrain.formats.gguf import read_gguf
from ggtrain.formats.model_file import load_model
from ggtrain.formats.lora import write_lora
from tests.interop import greedy, open_llm, random_lora_pairs, run_cli

PROMPT = "Once upon a time, there was a little"
# where a quantized merged model's greedy run parts from llama.cpp's base + adapter, llama.cpp's
# own top-2 logits there must be this close (its 8-bit activations move logits by up to ~0.25)
NEAR_TIE = 0.5


def _ids(model):
    _, _, tok = load_model(model)
    return tok, tok.encode(PROMPT, add_bos=True).tolist()


def test_llama2c_import_runs_in_llama_cpp_as_stories260k(llama, shared_data, tmp_path):
    out = tmp_path / "s.gguf"
    r = run_cli("convert-checkpoint", shared_data / "llama2c" / "stories260K.bin", out, "--from", "llama2c",
             "--tokenizer", shared_data / "llama2c" / "tok512.bin")
    assert r.returncode == 0, r.stderr
    ref = shared_data / "gguf" / "stories260K.gguf"
    tok, ids = _ids(ref)
    ours, theirs = open_llm(llama, out), open_llm(llama, ref)
    assert ours.tokenize(PROMPT.encode(), add_bos=True, special=False) == ids
    assert greedy(ours, ids, 40) == greedy(theirs, ids, 40)
    ours.reset()
    ours.eval(ids)
    theirs.reset()
    theirs.eval(ids)
    assert np.array_equal(np.asarray(ours.scores[:len(ids)]), np.asarray(theirs.scores[:len(ids)]))


def test_checkpoint_model_generates_in_llama_cpp_as_ggtrain_generate(llama, shared_data, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text((shared_data / "text" / "tinyshakespeare.txt").read_text()[:40000])
    ckdir, out = tmp_path / "ck", tmp_path / "m.gguf"
    r = run_cli("train", "--data", text, "--out", tmp_path / "final.gguf", "--dim", "64", "--layers", "2", "--heads", "4",
             "--kv-heads", "2", "--ff", "128", "--ctx", "64", "--batch", "4", "--steps", "30", "--warmup", "3",
             "--lr", "5e-3", "--checkpoint-dir", ckdir, "--save-every", "20", "--quiet")
    assert r.returncode == 0, r.stderr
    r = run_cli("convert-checkpoint", ckdir / "ckpt-000020.gguf", out)
    assert r.returncode == 0, r.stderr
    prompt = "KING RICHARD:\nWhat say you"
    _, _, tok = load_model(out)
    ids = tok.encode(prompt, add_bos=True).tolist()
    theirs = greedy(open_llm(llama, out), ids, 24)
    shown = list(itertools.takewhile(lambda t: t != tok.eos_id, theirs))
    r = run_cli("generate", "--model", out, "--prompt", prompt, "-n", 24, "--temp", 0, "--numerics", "llama")
    assert r.returncode == 0, r.stderr
    assert r.stdout == tok.decode(shown) + "\n"


@pytest.mark.parametrize("name", ["stories260K", "stories260K-Q8_0"])
def test_merged_model_runs_as_base_with_adapter(llama, shared_data, tmp_path, name):
    base = shared_data / "gguf" / f"{name}.gguf"
    config, weights, _ = load_model(base)
    pairs = random_lora_pairs(np.random.default_rng(3), weights, config["layers"], rank=4)
    adapter, merged = tmp_path / "a.gguf", tmp_path / "m.gguf"
    write_lora(adapter, "llama", 8.0, pairs)
    r = run_cli("convert-checkpoint", base, merged, "--adapter", adapter, "--scale", 0.5)
    assert r.returncode == 0, r.stderr
    assert {t.type for t in read_gguf(merged).tensors.values()} == {t.type for t in read_gguf(base).tensors.values()}
    _, ids = _ids(base)
    with_adapter = open_llm(llama, base, adapter, scale=0.5)
    theirs = greedy(with_adapter, ids, 32)
    assert theirs != greedy(open_llm(llama, base), ids, 32)        # the adapter changes the model
    ours = greedy(open_llm(llama, merged), ids, 32)
    if ours == theirs:
        return
    assert name != "stories260K", (ours, theirs)                # F32: exactly the same run
    i = next(k for k in range(len(ours)) if ours[k] != theirs[k])
    with_adapter.reset()
    with_adapter.eval(ids + theirs[:i])
    top2 = np.sort(np.asarray(with_adapter.scores[len(ids) + i - 1]))[-2:]
    assert top2[1] - top2[0] < NEAR_TIE, (i, top2)


@pytest.mark.parametrize("out_type,ftype", [("q4_1", "MOSTLY_Q4_1"), ("bf16", "MOSTLY_BF16"), ("f16", "MOSTLY_F16"),
                                            ("q4_0", "MOSTLY_Q4_0")])
def test_out_types_are_llama_cpps_quantizations(llama, shared_data, tmp_path, out_type, ftype):
    """llama.cpp's llama_model_quantize of stories260K and ours: the same type and bytes per tensor."""
    src = shared_data / "gguf" / "stories260K.gguf"
    ref, out = tmp_path / "ref.gguf", tmp_path / "ours.gguf"
    params = llama.llama_model_quantize_default_params()
    params.ftype = getattr(llama, f"LLAMA_FTYPE_{ftype}")
    params.nthread = 2
    assert llama.llama_model_quantize(str(src).encode(), str(ref).encode(), params) == 0
    r = run_cli("convert-checkpoint", src, out, "--out-type", out_type)
    assert r.returncode == 0, r.stderr
    a, b = read_gguf(out), read_gguf(ref)
    assert sorted(a.tensors) == sorted(b.tensors)
    for name, info in b.tensors.items():
        assert a.tensors[name].type == info.type, name
        assert np.array_equal(a.read_tensor(name).view(np.uint8), b.read_tensor(name).view(np.uint8)), name
    assert a.value("general.file_type") == b.value("general.file_type")
