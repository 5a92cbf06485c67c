"""`ggtrain convert-checkpoint`: llama2.c import, output types against llama.cpp's own files,
checkpoint -> model / adapter, model -> checkpoint -> training, and bad input."""
import json

import gguf
import numpy as np
import pytest

from ggtrain.formats.checkpoint import load_checkpoint
from ggtrain.formats.gguf import read_gguf, write_gguf
from ggtrain.formats.quants import quantize
from ggtrain.formats.model_file import load_model
from ggtrain.formats.lora import merge_lora, read_lora, write_lora
from ggtrain.formats.mixture import OUT_TYPES
from ggtrain.native.dtypes import nbytes
from tests.interop import run_here

TEXT = "Tom had a red kite. The kite flew high over the park and Tom laughed. " * 40
FAST = ["--ctx", "64", "--batch", "2", "--lora-rank", "4", "--lr", "3e-3", "--quiet"]


def _cli(*args):
    """`ggtrain ARGS` by its entry point in this process (tests.interop.run_here)."""
    return run_here(*args)


def _tensors_equal(a, b) -> None:
    """Same tensor names, types and bytes (in any order)."""
    fa, fb = read_gguf(a), read_gguf(b)
    assert sorted(fa.tensors) == sorted(fb.tensors)
    for name, info in fb.tensors.items():
        assert fa.tensors[name].type == info.type, name
        assert np.array_equal(fa.read_tensor(name).view(np.uint8), fb.read_tensor(name).view(np.uint8)), name


def _kv(f) -> dict:
    return {k: (v.type, v.value.tolist() if hasattr(v.value, "tolist") else v.value) for k, v in f.kv.items()}


@pytest.fixture
def gguf_dir(shared_data):
    return shared_data / "gguf"


@pytest.fixture
def text(tmp_path):
    p = tmp_path / "t.txt"
    p.write_text(TEXT)
    return p


# ---- llama2.c ------------------------------------------------------------------------------

def test_llama2c_import_equals_ggml_orgs_stories260k(shared_data, tmp_path):
    out = tmp_path / "s.gguf"
    r = _cli("convert-checkpoint", shared_data / "llama2c" / "stories260K.bin", out, "--from", "llama2c",
             "--tokenizer", shared_data / "llama2c" / "tok512.bin")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"wrote {out}: llama model (f32) from llama2.c stories260K.bin, 48 tensors")
    config, weights, tok = load_model(out)
    ref_config, ref, ref_tok = load_model(shared_data / "gguf" / "stories260K.gguf")
    assert sorted(weights) == sorted(ref)
    for name in ref:
        np.testing.assert_allclose(weights[name], ref[name], rtol=0, atol=1e-6, err_msg=name)
    # the same architecture (llama2.c's seq_len 512 as context; ggml-org's file says 2048)
    assert {k: v for k, v in config.items() if k != "ctx"} == {k: v for k, v in ref_config.items() if k != "ctx"}
    assert config["ctx"] == 512
    assert tok.tokens == ref_tok.tokens
    assert np.array_equal(tok.token_type, ref_tok.token_type) and np.array_equal(tok.scores, ref_tok.scores)
    assert (tok.bos_id, tok.eos_id, tok.unk_id) == (ref_tok.bos_id, ref_tok.eos_id, ref_tok.unk_id)
    reader = gguf.GGUFReader(out)                     # gguf-py reads it
    assert len(reader.tensors) == 48


def test_llama2c_bad_files(shared_data, tmp_path):
    tok = shared_data / "llama2c" / "tok512.bin"
    raw = (shared_data / "llama2c" / "stories260K.bin").read_bytes()
    cases = {
        "truncated": (raw[:-100], "the file truncated"),
        "trailing": (raw + b"\0" * 8, "trailing bytes"),
        "header": (np.array([64, 172, 5, 7, 4, 512, 512], np.int32).tobytes() + raw[28:], "not a llama2.c checkpoint header"),
        "short": (raw[:10], "too short for a llama2.c header"),
        "v1": (b"24ka" + np.array([1], np.int32).tobytes() + raw[8:], "version 1 export"),
    }
    for name, (data, message) in cases.items():
        bad, out = tmp_path / f"{name}.bin", tmp_path / f"{name}.gguf"
        bad.write_bytes(data)
        r = _cli("convert-checkpoint", bad, out, "--from", "llama2c", "--tokenizer", tok)
        assert r.returncode == 1, name
        assert r.stderr.startswith(f"error: {bad}") and message in r.stderr and r.stderr.count("\n") == 1, r.stderr
        assert not out.exists()
    r = _cli("convert-checkpoint", shared_data / "llama2c" / "stories260K.bin", tmp_path / "x.gguf", "--from", "llama2c")
    assert r.returncode == 1 and "needs --tokenizer" in r.stderr
    short_tok = tmp_path / "tok.bin"
    short_tok.write_bytes(tok.read_bytes()[:3000])
    r = _cli("convert-checkpoint", shared_data / "llama2c" / "stories260K.bin", tmp_path / "x.gguf", "--from",
             "llama2c", "--tokenizer", short_tok)
    assert r.returncode == 1 and f"{short_tok}: ends after" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".gguf" or "tmp" in p.name) == []


# ---- output types: llama.cpp's own quantizations of stories260K -----------------------------

@pytest.mark.parametrize("out_type,ref", [("q8_0", "stories260K-Q8_0.gguf"), ("q4_0", "stories260K-Q4_0.gguf")])
def test_out_type_reproduces_llama_cpps_quantized_files(gguf_dir, tmp_path, out_type, ref):
    """Every tensor: llama.cpp's type (F32 norms, F16 where rows are not whole blocks, Q8_0
    output under Q4_0) and llama.cpp's bytes; the keys are the base's with llama.cpp's
    general.file_type."""
    out = tmp_path / "q.gguf"
    r = _cli("convert-checkpoint", gguf_dir / "stories260K.gguf", out, "--out-type", out_type)
    assert r.returncode == 0, r.stderr
    _tensors_equal(out, gguf_dir / ref)
    ours, theirs = read_gguf(out), read_gguf(gguf_dir / ref)
    assert _kv(ours) == _kv(theirs)


def test_quantized_model_to_other_type_dequantizes_then_quantizes(gguf_dir, tmp_path):
    out = tmp_path / "f16.gguf"
    r = _cli("convert-checkpoint", gguf_dir / "stories260K-Q4_0.gguf", out, "--out-type", "f16")
    assert r.returncode == 0, r.stderr
    src, f = read_gguf(gguf_dir / "stories260K-Q4_0.gguf"), read_gguf(out)
    for name, info in f.tensors.items():
        want = "F32" if len(info.shape) == 1 else "F16"
        assert info.type.name == want
        assert np.array_equal(f.read_tensor(name).view(np.uint8),
                              quantize(src.tensor_f32(name), want).view(np.uint8)), name
    assert f.value("general.file_type") == 1


# ---- checkpoints ---------------------------------------------------------------------------

def test_train_checkpoint_becomes_the_model_train_writes(tmp_path, text):
    out, ckdir = tmp_path / "m.gguf", tmp_path / "ck"
    r = _cli("train", "--data", text, "--out", out, "--dim", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2",
             "--ff", "64", "--ctx", "32", "--batch", "2", "--steps", "6", "--warmup", "1", "--checkpoint-dir", ckdir,
             "--save-every", "6", "--eval-every", "0", "--quiet")
    assert r.returncode == 0, r.stderr
    ckpt = ckdir / "ckpt-000006.gguf"
    info = json.loads(_cli("info", ckpt, "--json").stdout)["checkpoint"]
    assert info["kind"] == "train" and info["updates"] == 6 and info["steps"] == 6 and info["optimizer"] == "adamw"
    assert info["tokens_seen"] == 6 * 2 * 32
    text_info = _cli("info", ckpt).stdout
    assert "ggtrain checkpoint (v2): a llama trained from scratch" in text_info and "progress: 6 of 6 updates" in text_info
    conv = tmp_path / "c.gguf"
    r = _cli("convert-checkpoint", ckpt, conv)
    assert r.returncode == 0, r.stderr
    assert "from train checkpoint ck" in r.stdout or "from train checkpoint" in r.stdout
    _tensors_equal(conv, out)                                 # what train --out wrote at the same update
    assert "adam" not in " ".join(read_gguf(conv).tensors)
    r = _cli("generate", "--model", ckpt, "--prompt", "Once", "-n", 2)     # a checkpoint is not a model
    assert r.returncode == 1 and f"{ckpt}: a ggtrain training checkpoint, not a model" in r.stderr
    q = tmp_path / "q.gguf"
    assert _cli("convert-checkpoint", ckpt, q, "--out-type", "q8_0").returncode == 0
    params = load_checkpoint(ckpt).state["params"]
    fq = read_gguf(q)
    for name, info in fq.tensors.items():
        assert np.array_equal(fq.read_tensor(name).view(np.uint8),
                              quantize(params[name], info.type).view(np.uint8)), name


def test_lora_checkpoint_becomes_its_adapter_and_merges_into_its_base(gguf_dir, tmp_path, text):
    base = gguf_dir / "stories260K.gguf"
    adapter, merged, ckdir = tmp_path / "a.gguf", tmp_path / "m.gguf", tmp_path / "ck"
    r = _cli("finetune", "--model", base, "--data", text, "--out", adapter, "--merged-out", merged, "--steps", 4,
             "--checkpoint-dir", ckdir, "--save-every", 4, *FAST)
    assert r.returncode == 0, r.stderr
    ckpt = ckdir / "ckpt-000004.gguf"
    info = json.loads(_cli("info", ckpt, "--json").stdout)["checkpoint"]
    assert info["kind"] == "finetune-lora" and info["lora"]["rank"] == 4 and info["base"]["path"] == str(base)
    conv = tmp_path / "c.gguf"
    r = _cli("convert-checkpoint", ckpt, conv)
    assert r.returncode == 0, r.stderr
    assert "LoRA adapter (rank 4)" in r.stdout
    _tensors_equal(conv, adapter)
    assert read_lora(conv)[:2] == read_lora(adapter)[:2]
    # the checkpoint merged into its base is finetune's --merged-out; so is base + adapter
    for args in ([ckpt, tmp_path / "m1.gguf", "--base", base], [base, tmp_path / "m2.gguf", "--adapter", adapter],
                 [tmp_path / "m3.gguf", "--base", base, "--adapter", adapter]):
        r = _cli("convert-checkpoint", *args)
        assert r.returncode == 0, r.stderr
    for m in ("m1", "m2", "m3"):
        _tensors_equal(tmp_path / f"{m}.gguf", merged)


def test_merge_scale_and_types(gguf_dir, tmp_path):
    """W + scale * alpha / r * B A in float64, rounded once into the base's type where it has 8
    bits or more (F16, Q8_0), else into F16 (Q4_0, as llama-export-lora does); the other
    tensors keep their bytes."""
    base = gguf_dir / "stories260K-Q4_0.gguf"
    config, weights, _ = load_model(base)
    rng = np.random.default_rng(0)
    pairs = {n: (rng.standard_normal((3, weights[n].shape[1])).astype(np.float32) * 0.1,
                 rng.standard_normal((weights[n].shape[0], 3)).astype(np.float32) * 0.1)
             for n in ("blk.0.attn_q.weight", "blk.1.ffn_down.weight", "output.weight")}
    adapter, out = tmp_path / "a.gguf", tmp_path / "m.gguf"
    write_lora(adapter, "llama", 6.0, pairs)
    r = _cli("convert-checkpoint", base, out, "--adapter", adapter, "--scale", "0.5")
    assert r.returncode == 0, r.stderr
    expected = merge_lora(weights, adapter, scale=0.5)
    fb, fm = read_gguf(base), read_gguf(out)
    merged_types = {"blk.0.attn_q.weight": "F16", "blk.1.ffn_down.weight": "F16", "output.weight": "Q8_0"}
    assert {n: fb.tensors[n].type.name for n in pairs} == {"blk.0.attn_q.weight": "Q4_0",
                                                           "blk.1.ffn_down.weight": "F16", "output.weight": "Q8_0"}
    for name, info in fm.tensors.items():
        assert info.type.name == merged_types.get(name, fb.tensors[name].type.name), name
        want = quantize(expected[name], info.type) if name in pairs else fb.read_tensor(name)
        assert np.array_equal(fm.read_tensor(name).view(np.uint8), np.asarray(want).view(np.uint8)), name
    s = 0.5 * 6.0 / 3
    a, b = pairs["blk.0.attn_q.weight"]
    w64 = weights["blk.0.attn_q.weight"].astype(np.float64) + s * (b.astype(np.float64) @ a.astype(np.float64))
    assert np.array_equal(expected["blk.0.attn_q.weight"], w64.astype(np.float32))


def _kept(base, merged, adapter, scale) -> float:
    """The share of the adapter's change dW the merged file's tensors keep, from the three files:
    sum <merged - W, dW> / sum |dW|^2 over the adapted weights."""
    alpha, _, pairs = read_lora(adapter)
    fb, fm = read_gguf(base), read_gguf(merged)
    num = den = 0.0
    for name, (a, b) in pairs.items():
        delta = scale * alpha / a.shape[0] * (b.astype(np.float64) @ a.astype(np.float64))
        num += float(np.sum((fm.tensor_f32(name).astype(np.float64) - fb.tensor_f32(name)) * delta))
        den += float(np.sum(delta * delta))
    return num / den


def test_merge_says_how_much_of_the_adapter_it_keeps(gguf_dir, tmp_path):
    """The summary line gives the share of the adapter's change the written merged tensors keep
    (recomputed here from the files); into a 4-bit base it is near all by default (F16), and a
    forced --out-type q4_0 that rounds most of a small change away warns, naming the type and
    what to do instead."""
    base = gguf_dir / "stories260K-Q4_0.gguf"
    config, weights, _ = load_model(base)
    rng = np.random.default_rng(2)
    pairs = {f"blk.{i}.{t}.weight": (rng.standard_normal((4, weights[f"blk.{i}.{t}.weight"].shape[1])).astype(np.float32),
                                     rng.standard_normal((weights[f"blk.{i}.{t}.weight"].shape[0], 4)).astype(np.float32))
             for i in range(config["layers"]) for t in ("attn_q", "attn_v")}
    adapter = tmp_path / "a.gguf"
    write_lora(adapter, "llama", 4.0, pairs)
    scale = 0.002                      # a change of ~1% of the weights: under Q4_0's steps
    said = {}
    for label, extra in (("default", ()), ("q4_0", ("--out-type", "q4_0"))):
        out = tmp_path / f"{label}.gguf"
        r = _cli("convert-checkpoint", base, out, "--adapter", adapter, "--scale", scale, *extra)
        assert r.returncode == 0, r.stderr
        kept = _kept(base, out, adapter, scale)
        types = "F16" if label == "default" else "Q4_0"
        assert f"merged tensors as {types} keep {kept:.1%} of the adapter's change" in r.stdout, (r.stdout, kept)
        said[label] = (kept, [line for line in r.stderr.splitlines() if "warning" in line])   # (and a progress bar)
    assert said["default"][0] > 0.99 and said["default"][1] == []
    kept, warnings = said["q4_0"]
    assert kept < 0.9 and len(warnings) == 1
    assert warnings[0].startswith(f"warning: written as Q4_0, the merged tensors keep only {kept:.0%}")
    assert "F16 or Q8_0" in warnings[0] and "--lora" in warnings[0] and "ADAPTER" in warnings[0]


def test_requantizing_says_so(gguf_dir, tmp_path):
    out = tmp_path / "q.gguf"
    r = _cli("convert-checkpoint", gguf_dir / "stories260K-Q4_0.gguf", out, "--out-type", "q8_0")
    assert r.returncode == 0, r.stderr
    n = sum(i.type.name == "Q4_0" for i in read_gguf(gguf_dir / "stories260K-Q4_0.gguf").tensors.values())
    assert f"requantizes {n} tensors from Q4_0 (llama.cpp's quantizer asks --allow-requantize" in r.stdout, r.stdout
    r = _cli("convert-checkpoint", gguf_dir / "stories260K.gguf", tmp_path / "k.gguf", "--out-type", "q4_k_m")
    assert r.returncode == 0 and "requantizes" not in r.stdout, r.stdout


def test_model_checkpoint_starts_training(shared_data, tmp_path, text):
    """model -> checkpoint: `finetune --full --resume` from it is `finetune --full --model` on the
    model (the same losses, bit for bit); `train --resume` trains it from its weights."""
    story = shared_data / "gguf" / "stories260K.gguf"
    ckpt = tmp_path / "c.gguf"
    r = _cli("convert-checkpoint", story, ckpt, "--to", "checkpoint")
    assert r.returncode == 0, r.stderr
    assert "model checkpoint (f32, update 0)" in r.stdout
    info = json.loads(_cli("info", ckpt, "--json").stdout)["checkpoint"]
    assert info["kind"] == "model" and info["updates"] == 0 and info["optimizer"] is None
    loaded = load_checkpoint(ckpt)
    _, weights, _ = load_model(story)
    assert all(np.array_equal(loaded.state["params"][k], v) for k, v in weights.items())

    logs = {}
    for how, args in (("model", ["--model", story]), ("resume", ["--resume", ckpt])):
        log = tmp_path / f"{how}.jsonl"
        r = _cli("finetune", *args, "--full", "--data", text, "--out", tmp_path / f"{how}.gguf", "--steps", 3,
                 "--log", log, *FAST)
        assert r.returncode == 0, r.stderr
        logs[how] = [json.loads(x)["loss"] for x in log.read_text().splitlines() if '"loss"' in x]
    assert logs["model"] == logs["resume"] and len(logs["model"]) == 3
    _tensors_equal(tmp_path / "resume.gguf", tmp_path / "model.gguf")
    r = _cli("finetune", "--resume", ckpt, "--data", text, "--out", tmp_path / "x.gguf", *FAST)
    assert r.returncode == 1 and "continues with --full" in r.stderr

    # train --resume: the checkpoint's architecture and tokenizer, this command's schedule
    small = tmp_path / "small.gguf"         # llama2.c's seq_len 512 as context: short windows
    assert _cli("convert-checkpoint", shared_data / "llama2c" / "stories260K.bin", small, "--from", "llama2c",
                "--tokenizer", shared_data / "llama2c" / "tok512.bin").returncode == 0
    ck2 = tmp_path / "c2.gguf"
    assert _cli("convert-checkpoint", small, ck2, "--to", "checkpoint").returncode == 0
    long_text = tmp_path / "long.txt"
    long_text.write_text(TEXT * 4)
    out, log = tmp_path / "t.gguf", tmp_path / "t.jsonl"
    r = _cli("train", "--resume", ck2, "--data", long_text, "--out", out, "--batch", 1, "--steps", 2, "--lr", "1e-4",
             "--warmup", 0, "--eval-every", 0, "--val-split", 0.2, "--log", log, "--quiet")
    assert r.returncode == 0, r.stderr
    first = next(e for e in map(json.loads, log.read_text().splitlines()) if "loss" in e)   # after the options
    assert first["loss"] < 3.0       # a trained model's loss on stories text; a fresh init gives ~6.2
    config, trained, _ = load_model(out)
    assert config["ctx"] == 512 and max(np.abs(trained[k] - weights[k]).max() for k in weights) < 0.01


# ---- bad input -----------------------------------------------------------------------------

def test_bad_input_is_one_line_and_writes_nothing(gguf_dir, tmp_path):
    story = gguf_dir / "stories260K.gguf"
    other = tmp_path / "other.gguf"            # an adapter made for another shape
    rng = np.random.default_rng(1)
    write_lora(other, "llama", 8.0, {"blk.0.attn_q.weight": (rng.standard_normal((2, 32)).astype(np.float32),
                                                             rng.standard_normal((32, 2)).astype(np.float32))})
    foreign = tmp_path / "foreign.gguf"
    write_lora(foreign, "gpt2", 8.0, {"blk.0.attn_q.weight": (np.zeros((2, 64), np.float32),
                                                              np.zeros((64, 2), np.float32))})
    iq4 = tmp_path / "iq4.gguf"                # a model with a tensor of a type ggtrain does not read
    f = read_gguf(story)
    tensors = [(n, f.read_tensor(n), i.type.name) for n, i in f.tensors.items() if n != "output.weight"]
    tensors.append(("output.weight", lambda: np.zeros(nbytes((512, 64), "iq4_nl"), np.uint8), "IQ4_NL", (512, 64)))
    write_gguf(iq4, [(k, v) for k, v in f.kv.items() if k != "general.alignment"], tensors)
    out = tmp_path / "out.gguf"
    cases = [
        ([tmp_path / "missing.gguf", out, "--out-type", "f16"], "missing.gguf: no such file"),
        ([story, out], "is already a model: give --out-type, --adapter or --to checkpoint"),
        ([story, out, "--out-type", "q5_k"], f"--out-type q5_k: not a type ggtrain writes (it writes "
                                             f"{', '.join(OUT_TYPES)})"),
        ([story, out, "--to", "weights"], "'weights' is not one of 'model', 'checkpoint'"),   # usage: 2
        ([story, out, "--adapter", other], "blk.0.attn_q.weight: adapter gives (32, 32), the weight is (64, 64)"),
        ([story, out, "--adapter", foreign], "an adapter for architecture 'gpt2'"),
        ([story, out, "--adapter", story], "a model, not a LoRA adapter"),
        ([other, out], "a LoRA adapter; merge it into its model"),
        ([gguf_dir / "ggml-vocab-llama-spm.gguf", out, "--to", "checkpoint"], "a vocab-only GGUF"),
        ([story, out, "--to", "checkpoint", "--out-type", "q8_0"], "a checkpoint holds f32 weights"),
        ([iq4, out, "--out-type", "q4_k_m"], "tensor 'output.weight' is IQ4_NL, which ggtrain cannot read to write "
                                             "it as Q8_0"),
        ([story, out, "--tokenizer", story], "--tokenizer is for --from llama2c"),
        ([story, story, "--out-type", "f16"], "is also IN"),
        ([story, tmp_path / "nodir" / "x.gguf", "--out-type", "f16"], "does not exist"),
    ]
    ckpt = tmp_path / "c.gguf"
    assert _cli("convert-checkpoint", story, ckpt, "--to", "checkpoint").returncode == 0
    cases += [([ckpt, out, "--to", "checkpoint"], "is already a checkpoint"),
              ([story, out, "--adapter", ckpt], "a checkpoint, not a LoRA adapter"),
              ([ckpt, out, "--base", story], "a model checkpoint has no adapter to merge")]
    before = sorted(p.name for p in tmp_path.iterdir())
    for args, message in cases:
        r = _cli("convert-checkpoint", *args)
        assert r.returncode == (2 if "weights" in args else 1), (args, r.stderr)
        assert message in r.stderr and r.stderr.count("\n") == 1, (args, r.stderr)
        assert sorted(p.name for p in tmp_path.iterdir()) == before, args


def test_out_type_is_for_models(gguf_dir, tmp_path, text):
    """An adapter is not quantized (llama.cpp reads adapters in F32/F16): --out-type on a LoRA
    run without --merged-out, or on a LoRA checkpoint becoming its adapter, is refused before
    anything runs or is written."""
    out = tmp_path / "a.gguf"
    r = _cli("finetune", "--model", gguf_dir / "stories260K.gguf", "--data", text, "--out", out, "--steps", 1,
             "--out-type", "q4_k_m", *FAST)
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "--out-type q4_k_m is for a model (--full or --merged-out)" in r.stderr
    assert not out.exists()


def test_finetune_merged_out_keeps_the_fine_tune(gguf_dir, tmp_path, text):
    """finetune --merged-out follows convert-checkpoint's rules: into a Q4_0 base the adapted
    Q4_0 matrices are written F16, the rest keep their bytes, and the summary gives the share kept
    (the file's, recomputed here)."""
    base = gguf_dir / "stories260K-Q4_0.gguf"
    adapter, merged = tmp_path / "a.gguf", tmp_path / "m.gguf"
    r = _cli("finetune", "--model", base, "--data", text, "--out", adapter, "--merged-out", merged, "--steps", 3,
             "--lora-targets", "attn_q,ffn_down", *FAST)
    assert r.returncode == 0, r.stderr
    _, _, pairs = read_lora(adapter)
    fb, fm = read_gguf(base), read_gguf(merged)
    for name, info in fm.tensors.items():
        want = "F16" if name in pairs else fb.tensors[name].type.name     # (ffn_down: F16 in the base)
        assert info.type.name == want, name
        if name not in pairs:
            assert np.array_equal(fm.read_tensor(name).view(np.uint8), fb.read_tensor(name).view(np.uint8)), name
    assert f"merged tensors as F16 keep {_kept(base, merged, adapter, 1.0):.1%} of the adapter's change" in r.stderr


def test_full_checkpoint_of_a_4_bit_base_becomes_an_f16_model(gguf_dir, tmp_path, text):
    """A --full checkpoint's model is written in its base's type only where that has 8 bits or
    more: from a Q4_0 base, F16 (rounded back to Q4_0 the update would mostly be lost)."""
    ckdir, out = tmp_path / "ck", tmp_path / "m.gguf"
    r = _cli("finetune", "--model", gguf_dir / "stories260K-Q4_0.gguf", "--data", text, "--out", tmp_path / "f.gguf",
             "--full", "--steps", 2, "--checkpoint-dir", ckdir, "--save-every", 2, *FAST)
    assert r.returncode == 0, r.stderr
    r = _cli("convert-checkpoint", ckdir / "ckpt-000002.gguf", out)
    assert r.returncode == 0, r.stderr
    assert "model (f16) from finetune-full checkpoint" in r.stdout, r.stdout
    f = read_gguf(out)
    assert {i.type.name for i in f.tensors.values()} == {"F16", "F32"}
    assert f.value("general.file_type") == 1
