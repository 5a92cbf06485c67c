"""`ggtrain finetune` end to end on stories260K (F32, Q8_0, Q4_0): adapters and merged models,
chat data, bit-identical resume, Ctrl-C, --full, and bad input. Agreement with real llama.cpp
is in test_interop.py."""
import json
import signal
import subprocess
import sys
import time

import gguf
import numpy as np
import pytest

from ggtrain.core.backend_cpu import CpuBackend
from ggtrain.core.models.config import ModelConfig
from ggtrain.core.models.inference import Runner
from ggtrain.formats.gguf import read_gguf
from ggtrain.formats.quants import quantize
from ggtrain.formats.model_file import load_model
from ggtrain.formats.lora import lora_adapters, merge_lora, read_lora
from tests.interop import run_here

FAST = ["--ctx", "64", "--batch", "2", "--lora-rank", "4", "--lr", "3e-3", "--quiet"]
# a template for a vocabulary without chat tokens: each turn ends with the EOS text, which
# the tokenizer parses as the EOS token (an end-of-generation token). NOTE: the header ends in
# a newline, not a space: an SPM vocabulary merges a space with the next word ("▁B"), so a
# generation prompt ending in " " would be tokenized unlike any training sequence.
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}:\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:\n{% endif %}")


def _cli(*args):
    """`ggtrain ARGS` by its entry point in this process (tests.interop.run_here)."""
    return run_here(*args)


@pytest.fixture
def story(shared_data):
    return shared_data / "gguf" / "stories260K.gguf"


@pytest.fixture
def text(tmp_path, shared_data):
    p = tmp_path / "t.txt"
    p.write_text("Tom had a red kite. The kite flew high over the park and Tom laughed. " * 40)
    return p


@pytest.fixture
def chat(tmp_path):
    """ShareGPT records (JSON lines) and a template file."""
    rng = np.random.default_rng(0)
    names = ["Lily", "Ben", "Sam", "Mia"]
    lines = []
    for i in range(24):
        n = names[i % 4]
        lines.append(json.dumps({"conversations": [
            {"from": "human", "value": f"Who is {n}?"},
            {"from": "gpt", "value": f"{n} is a kid who likes to play with a ball {int(rng.integers(2, 9))} times."}]}))
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(lines) + "\n")
    tpl = tmp_path / "t.jinja"
    tpl.write_text(TEMPLATE)
    return data, tpl


def _logits(config, weights, ids, adapters=None):
    runner = Runner(ModelConfig(**config), weights, CpuBackend(2), length=len(ids), adapters=adapters)
    return runner.logits(np.asarray(ids, np.int32)[None])[0, :len(ids)]


@pytest.mark.parametrize("name", ["stories260K", "stories260K-Q8_0", "stories260K-Q4_0"])
def test_lora_on_text_lowers_loss_and_writes_an_adapter_and_a_merged_model(tmp_path, shared_data, text, name):
    base = shared_data / "gguf" / f"{name}.gguf"
    out, merged, log = tmp_path / "a.gguf", tmp_path / "m.gguf", tmp_path / "log.jsonl"
    r = _cli("finetune", "--model", base, "--data", text, "--out", out, "--merged-out", merged, "--steps", 30,
             "--log", log, *FAST)
    assert r.returncode == 0, r.stderr
    steps = [json.loads(x) for x in log.read_text().splitlines() if '"loss"' in x]
    assert steps[-1]["loss"] < 0.6 * steps[0]["loss"]
    alpha, arch, pairs = read_lora(out)
    assert (alpha, arch) == (32.0, "llama") and len(pairs) == 5 * 7
    assert all(a.shape[0] == 4 and b.shape[1] == 4 for a, b in pairs.values())
    reader = gguf.GGUFReader(out)            # gguf-py reads what we write
    assert reader.fields["general.type"].contents() == "adapter"
    # the merged model is the base plus the adapter: the same logits as the base with it
    config, weights, tok = load_model(base)
    ids = tok.encode("Tom had a red kite.", add_bos=True).tolist()
    with_adapter = _logits(config, weights, ids, lora_adapters(out, {k: v.shape for k, v in weights.items()}))
    mconfig, mweights, _ = load_model(merged)
    if name == "stories260K":
        np.testing.assert_allclose(_logits(mconfig, mweights, ids), with_adapter, atol=1e-3)
    # each merged matrix is W + s B A rounded once to the base's type where it has 8 bits or more,
    # else to F16 (Q4_0); the rest are the base's bytes
    expected = merge_lora(weights, out)
    fb, fm = read_gguf(base), read_gguf(merged)
    assert list(fm.tensors) == list(fb.tensors)
    for t, info in fm.tensors.items():
        stored = fb.tensors[t].type.name
        assert info.type.name == ("F16" if t in pairs and stored == "Q4_0" else stored), t
        want = quantize(expected[t], info.type) if t in pairs else fb.read_tensor(t)
        assert np.array_equal(fm.read_tensor(t).view(np.uint8), np.asarray(want).view(np.uint8)), t
    assert not np.allclose(_logits(config, weights, ids), with_adapter, atol=0.1)   # it learned something


def test_chat_lora_trains_the_assistant_turns(tmp_path, story, chat):
    data, tpl = chat
    out, log = tmp_path / "a.gguf", tmp_path / "log.jsonl"
    r = _cli("finetune", "--model", story, "--data", data, "--chat-template", tpl, "--out", out, "--steps", 40,
             "--log", log, *FAST)
    assert r.returncode == 0, r.stderr
    assert "24 samples" in r.stderr
    steps = [json.loads(x) for x in log.read_text().splitlines() if '"loss"' in x]
    assert steps[-1]["loss"] < 0.5 * steps[0]["loss"]
    # the adapted model answers in the trained form (it cannot learn to stop: stories260K
    # never used its EOS, whose output row ties with other unused tokens', and LoRA does not
    # adapt the output projection; the SmolLM2 test in test_finetune_interop checks stopping)
    r = _cli("generate", "--model", story, "--lora", out, "--chat", "--chat-template", tpl, "--prompt", "Who is Ben?",
             "-n", "40", "--temp", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Ben is a kid who likes to play with a ball"), r.stdout


def test_resume_is_bit_identical(tmp_path, story, chat):
    data, tpl = chat
    common = ["--model", story, "--data", data, "--chat-template", tpl, "--steps", 12, *FAST]
    full = tmp_path / "full.gguf"
    assert _cli("finetune", "--out", full, *common).returncode == 0
    ck = tmp_path / "ck"
    part = tmp_path / "part.gguf"
    r = _cli("finetune", "--out", part, "--checkpoint-dir", ck, "--save-every", 5, *common)
    assert r.returncode == 0, r.stderr
    resumed = tmp_path / "resumed.gguf"
    r = _cli("finetune", "--out", resumed, "--resume", ck / "ckpt-000005.gguf", *common)
    assert r.returncode == 0, r.stderr
    assert full.read_bytes() == part.read_bytes() == resumed.read_bytes()


@pytest.mark.parametrize("optimizer, args, state", [("sgd", ["--lr", "0.05", "--momentum", "0.9"], "momentum."),
                                                     ("lbfgs", [], "lbfgs.")])
def test_other_optimizers_resume_bit_identically(tmp_path, story, text, optimizer, args, state):
    common = ["--model", story, "--data", text, "--steps", 6, "--optimizer", optimizer, *args,
              "--ctx", "64", "--batch", "2", "--lora-rank", "4", "--quiet"]
    full, ck = tmp_path / "full.gguf", tmp_path / "ck"
    r = _cli("finetune", "--out", full, "--checkpoint-dir", ck, "--save-every", 3, *common)
    assert r.returncode == 0, r.stderr
    names = [t.name for t in gguf.GGUFReader(ck / "ckpt-000003.gguf").tensors]
    assert any(n.startswith(state) for n in names) and not any(n.startswith("adam_") for n in names)
    resumed = tmp_path / "resumed.gguf"
    r = _cli("finetune", "--out", resumed, "--resume", ck / "ckpt-000003.gguf", *common)
    assert r.returncode == 0, r.stderr
    assert full.read_bytes() == resumed.read_bytes()


def test_ctrl_c_saves_a_checkpoint_that_resumes(tmp_path, story, text):
    common = ["--model", story, "--data", text, "--steps", 300, *FAST]
    full = tmp_path / "full.gguf"
    assert _cli("finetune", "--out", full, *common).returncode == 0
    out, log = tmp_path / "a.gguf", tmp_path / "log.jsonl"
    p = subprocess.Popen([sys.executable, "-m", "ggtrain", "finetune", "--out", str(out), "--log", str(log),
                          *map(str, common)], stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline:
        if log.exists() and log.read_text().count("\n") >= 4:
            break
        time.sleep(0.05)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    ckpt = tmp_path / "a.gguf.ckpt.gguf"
    assert ckpt.exists() and not out.exists()
    r = _cli("finetune", "--out", out, "--resume", ckpt, *common)
    assert r.returncode == 0, r.stderr
    assert out.read_bytes() == full.read_bytes()


def test_full_finetune_writes_a_model(tmp_path, story, text):
    out = tmp_path / "full.gguf"
    r = _cli("finetune", "--model", story, "--data", text, "--out", out, "--full", "--steps", 10, "--out-type",
             "f16", *FAST)
    assert r.returncode == 0, r.stderr
    assert "dequantizing" in r.stderr or "--full" in r.stderr
    config, weights, _ = load_model(out)
    base_config, base, _ = load_model(story)
    assert config == base_config
    changed = [k for k in base if not np.allclose(weights[k], base[k], atol=1e-2)]
    assert changed                                    # every weight is trainable
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
    assert types["blk.0.attn_q.weight"] == "F16" and types["blk.0.attn_norm.weight"] == "F32"
    assert types["blk.0.ffn_down.weight"] == "F16"


def test_full_finetune_takes_moe_aux_loss_and_lora_refuses_it(tmp_path):
    """finetune --full --moe-aux-loss 0.01 of a tiny qwen3moe trains with it (its checkpoint's
    training config holds 0.01); without --full (LoRA) the option is refused in one line before
    the base is read, and nothing is written; with a preference objective too (--method dpo), before the
    data is read."""
    text = tmp_path / "t.txt"
    text.write_text("Tom had a red kite. The kite flew high over the park and Tom laughed. " * 20)
    base, out, ck = tmp_path / "base.gguf", tmp_path / "full.gguf", tmp_path / "ck"
    r = _cli("train", "--arch", "qwen3moe", "--data", text, "--out", base, "--steps", 1, "--dim", 32, "--layers", 1,
             "--heads", 4, "--ff", 32, "--ctx", 16, "--batch", 2, "--quiet")
    assert r.returncode == 0, r.stderr
    tiny = ["--model", base, "--data", text, "--ctx", 16, "--batch", 2, "--steps", 2, "--quiet"]
    r = _cli("finetune", *tiny, "--out", out, "--full", "--moe-aux-loss", 0.01, "--checkpoint-dir", ck)
    assert r.returncode == 0, r.stderr
    from ggtrain.formats.checkpoint import load_checkpoint
    saved = sorted(ck.glob("*.gguf"))
    assert out.exists() and saved and load_checkpoint(saved[-1]).train_config["moe_aux_loss"] == 0.01
    lora = tmp_path / "lora.gguf"
    r = _cli("finetune", *tiny, "--out", lora, "--moe-aux-loss", 0.01)
    assert r.returncode == 1 and r.stderr == ("error: --moe-aux-loss is for --full: it balances routers trained "
                                              "whole, not LoRA adapters\n"), r.stderr
    assert not lora.exists()
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"prompt": "Q ", "chosen": "a", "rejected": "b"}\n' * 8)
    r = _cli("finetune", "--model", base, "--data", pairs, "--out", out.with_name("dpo.gguf"), "--full",
             "--method", "dpo", "--moe-aux-loss", 0.01)
    assert r.returncode == 1 and r.stderr == ("error: --moe-aux-loss is for --method sft: it balances routers trained "
                                              "on text, not under dpo's preference objective\n"), r.stderr
    assert not out.with_name("dpo.gguf").exists()


def test_bad_input(tmp_path, story, text, chat, shared_data):
    out = tmp_path / "a.gguf"
    data, tpl = chat

    def fails(*args, expect):
        r = _cli("finetune", "--out", out, *args)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert all(e in r.stderr for e in expect), r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert not out.exists()

    fails("--model", shared_data / "gguf" / "ggml-vocab-llama-spm.gguf", "--data", text, *FAST,
          expect=["ggml-vocab-llama-spm.gguf", "vocab-only"])
    fails("--model", story, "--data", text, "--lora-rank", "0", *FAST[:4], expect=["--lora-rank"])
    fails("--model", story, "--data", text, "--lora-targets", "attn_q,wq", *FAST, expect=["'wq'", "attn_q"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "c"}\n')
    fails("--model", story, "--data", bad, *FAST, expect=["bad.jsonl", "line 2", "completion"])
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ raise_exception('roles must alternate') }}{% endfor %}")
    fails("--model", story, "--data", data, "--chat-template", broken, *FAST, expect=["broken.jinja", "roles must alternate"])
    fails("--model", story, "--data", data, *FAST, expect=["stories260K.gguf", "chat_template"])
    fails("--model", story, "--data", text, "--full", "--merged-out", tmp_path / "m.gguf", *FAST,
          expect=["--merged-out"])
    # a checkpoint resumes only on its own base and data
    ck = tmp_path / "ck"
    r = _cli("finetune", "--model", story, "--data", text, "--out", tmp_path / "x.gguf", "--steps", 2,
             "--checkpoint-dir", ck, *FAST)
    assert r.returncode == 0, r.stderr
    fails("--model", shared_data / "gguf" / "stories260K-Q8_0.gguf", "--data", text, "--resume",
          ck / "ckpt-000002.gguf", *FAST, expect=["another base model"])
    other = tmp_path / "other.txt"
    other.write_text(text.read_text()[::-1])
    fails("--model", story, "--data", other, "--resume", ck / "ckpt-000002.gguf", *FAST, expect=["other.txt", "not the data"])


NAMES = ["Lily", "Ben", "Sam", "Mia"]


def _as_it_comes(tmp_path, form):
    """A data file (or folder) of the form, as downloaded: Alpaca's JSON array, Alpaca or
    chat messages in Parquet, Dolly's CSV, a folder of Parquet and JSON lines shards."""
    import csv
    import pyarrow as pa
    import pyarrow.parquet as pq
    alpaca = [{"instruction": f"Who is {n}?", "input": "" if i % 2 else "Say it briefly.",
               "output": f"{n} is a kid who likes to play with a ball."} for i, n in enumerate(NAMES * 6)]
    chat = [{"messages": [{"role": "user", "content": r["instruction"]}, {"role": "assistant", "content": r["output"]}]}
            for r in alpaca]
    if form == "alpaca-json":
        path = tmp_path / "alpaca_data.json"
        path.write_text(json.dumps(alpaca, indent=4))
    elif form == "alpaca-parquet":
        path = tmp_path / "train-00000-of-00001.parquet"
        pq.write_table(pa.Table.from_pylist(alpaca), path, row_group_size=5)
    elif form == "chat-parquet":
        path = tmp_path / "chat.parquet"
        pq.write_table(pa.Table.from_pylist(chat), path, row_group_size=5)
    elif form == "dolly-csv":
        path = tmp_path / "dolly.csv"
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["instruction", "context", "response", "category"])
            w.writerows([r["instruction"], r["input"], r["output"], "open_qa"] for r in alpaca)
    else:
        path = tmp_path / "shards"
        (path / "data").mkdir(parents=True)
        pq.write_table(pa.Table.from_pylist(chat[:10]), path / "data" / "train-00000.parquet")
        (path / "data" / "train-00001.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat[10:]))
        (path / "README.md").write_text("# the dataset card\n")
    return path


# (form, with a chat template) -- without one, instruction records take Alpaca's own prompt
AS_IT_COMES = [("alpaca-json", False), ("alpaca-parquet", True), ("chat-parquet", True), ("dolly-csv", False),
               ("folder", True)]


@pytest.mark.parametrize("form, templated", AS_IT_COMES, ids=[f[0] for f in AS_IT_COMES])
def test_finetune_on_data_as_it_comes(tmp_path, story, chat, form, templated):
    """No conversion: each trains the tokens its layout says (the masks test_dataset.py
    checks), every record a sample."""
    from ggtrain.formats.chat import ChatTemplate
    from ggtrain.formats.dataset import read_data
    from ggtrain.formats.tokenizer import tokenizer_from_gguf
    _, tpl = chat
    data = _as_it_comes(tmp_path, form)
    out, log = tmp_path / "a.gguf", tmp_path / "log.jsonl"
    r = _cli("finetune", "--model", story, "--data", data, "--out", out, "--steps", 3, "--log", log,
             *(["--chat-template", tpl] if templated else []), *FAST[2:], "--ctx", 256)
    assert r.returncode == 0, r.stderr
    tok = tokenizer_from_gguf(story)
    template = ChatTemplate(tpl.read_text(), "<s>", "</s>") if templated else None
    want = read_data(data).samples(tok, template)
    trained = sum(int(s.train[1:].sum()) for s in want)
    assert f"24 samples, {trained:,} trained of {sum(len(s.ids) - 1 for s in want):,} tokens (0 cut" in r.stderr, r.stderr
    assert read_lora(out)[0] == 32.0


def test_finetune_refuses_what_is_not_data_in_one_line(tmp_path, story, text):
    import pyarrow as pa
    import pyarrow.parquet as pq
    out = tmp_path / "a.gguf"
    binary = tmp_path / "chat.txt"
    pq.write_table(pa.Table.from_pylist([{"text": "hello"}] * 20), binary)
    unknown = tmp_path / "qa.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "q", "answer": "a"}] * 20), unknown)
    header = tmp_path / "pc.csv"
    header.write_text("question,answer\nWho?,Me.\n")
    sheet = tmp_path / "data.xlsx"
    sheet.write_bytes(b"PK\x03\x04")
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.jsonl").write_text('{"text": "hello"}\n')
    (mixed / "b.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "README.md").write_text("# card\n")
    cases = [(binary, f"{binary}: a Parquet file (name it .parquet to read its records), not text"),
             (unknown, f'{unknown}: the columns ("question", "answer") are of no layout ggtrain reads (known: '),
             (header, f"{header}: the header's fields (\"question\", \"answer\") are of no layout"),
             (sheet, f"{sheet}: an Excel workbook, a format ggtrain does not read"),
             (mixed, f'{mixed}/b.jsonl line 1: a {{"prompt", "completion"}} record, but the first record '
                     f'({mixed}/a.jsonl line 1) is {{"text"}}'),
             (empty, f"{empty}: a folder without data files")]
    for data, message in cases:
        r = _cli("finetune", "--model", story, "--data", data, "--out", out, *FAST)
        assert r.returncode == 1 and r.stderr.startswith(f"error: {message}"), r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and not out.exists(), r.stderr
    # eval --data reads plain text only
    for data, message in [(unknown, f"{unknown}: a Parquet file of records, not plain text"),
                          (binary, f"{binary}: a Parquet file (name it .parquet")]:
        r = _cli("eval", "--model", story, "--data", data)
        assert r.returncode == 1 and r.stderr.startswith(f"error: {message}"), r.stderr
        assert len(r.stderr.strip().splitlines()) == 1


def test_help_lists_the_contract_options():
    r = _cli("finetune", "--help")
    assert r.returncode == 0
    for opt in ("--lora-rank", "--lora-alpha", "--lora-targets", "--lora-dropout", "--full", "--merged-out",
                "--out-type", "--chat-template", "--train-on-inputs", "--packing", "--drop-long", "--resume",
                "--checkpoint-dir", "--save-every", "--eval-every", "--val-split", "--grad-acc", "--epochs"):
        assert opt in r.stdout, opt


def test_a_missing_data_file_is_one_line_naming_the_option(tmp_path, story):
    for name in ("nope.jsonl", "nope.txt"):
        r = _cli("finetune", "--model", story, "--data", tmp_path / name, "--out", tmp_path / "a.gguf", "--quiet")
        assert r.returncode == 1 and r.stderr == f"error: --data {tmp_path / name}: no such file\n", r.stderr
        assert not (tmp_path / "a.gguf").exists()


def test_a_missing_model_is_one_line_naming_the_option(tmp_path):
    data = tmp_path / "t.txt"
    data.write_text("some text " * 50)
    r = _cli("finetune", "--model", tmp_path / "nope.gguf", "--data", data, "--out", tmp_path / "a.gguf", "--quiet")
    assert r.returncode == 1 and r.stderr == f"error: --model {tmp_path / 'nope.gguf'}: no such file\n", r.stderr
    assert not (tmp_path / "a.gguf").exists()


@pytest.mark.parametrize("case", ["out over model", "merged over out", "train out over data", "log over config",
                                  "imatrix out over model"])
def test_an_output_never_overwrites_an_input_or_another_output(tmp_path, story, text, case):
    """A command refuses, in one line naming both options and before any work, to write a file it
    reads (the base model, the data, the --config run log) or that another of its outputs names;
    the input is left as it was."""
    base = tmp_path / "base.gguf"
    base.write_bytes(story.read_bytes())
    if case == "log over config":
        run = tmp_path / "run.jsonl"
        r = _cli("train", "--data", text, "--out", tmp_path / "m.gguf", "--steps", "1", "--dim", "32", "--layers",
                 "1", "--heads", "2", "--ctx", "16", "--log", run, "--quiet")
        assert r.returncode == 0, r.stderr
    args, message, kept = {
        "out over model": (["finetune", "--model", base, "--data", text, "--out", base, "--steps", "1"],
                           f"--out {base} is also --model", base),
        "merged over out": (["finetune", "--model", base, "--data", text, "--out", tmp_path / "a.gguf",
                             "--merged-out", tmp_path / "a.gguf", "--steps", "1"],
                            f"--merged-out {tmp_path / 'a.gguf'} is also --out", base),
        "train out over data": (["train", "--data", text, "--out", text, "--steps", "1"],
                                f"--out {text} is also --data", text),
        "log over config": (["train", "--config", tmp_path / "run.jsonl"],
                            f"--log {tmp_path / 'run.jsonl'} is also --config", tmp_path / "run.jsonl"),
        "imatrix out over model": (["imatrix", "--model", base, "--data", text, "--out", base],
                                   f"--out {base} is also --model", base),
    }[case]
    before = kept.read_bytes()
    r = _cli(*args, "--quiet")
    assert r.returncode == 1 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert kept.read_bytes() == before
    assert not (tmp_path / "a.gguf").exists()


@pytest.mark.parametrize("content", ["", "\n  \n"])
def test_an_empty_data_file_says_so(tmp_path, story, content):
    """finetune takes text, so an empty (or blank) --data file is 'the file is empty', not
    'text, not records' (a new user's review)."""
    data = tmp_path / "empty.txt"
    data.write_text(content)
    r = _cli("finetune", "--model", story, "--data", data, "--out", tmp_path / "a.gguf", "--steps", "1")
    assert r.returncode == 1 and "empty.txt: the file is empty" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "a.gguf").exists()
