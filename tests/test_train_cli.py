"""`ggtrain train` end to end on tiny models: learning, bit-identical resume, Ctrl-C, bad input."""
import json
import signal
import subprocess
import sys
import time

import gguf
import numpy as np
import pytest

from ggtrain.formats.model_file import load_model
from tests.interop import run_here

TINY = ["--dim", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ff", "64", "--ctx", "32",
        "--batch", "4", "--warmup", "5", "--lr", "3e-3", "--quiet"]


def _cli(*args):
    """`ggtrain ARGS` by its entry point in this process (tests.interop.run_here); the Ctrl-C
    test runs its own process."""
    return run_here(*args)


@pytest.fixture
def text(tmp_path):
    from tests.conftest import write_shakespeare
    return write_shakespeare(tmp_path / "t.txt", 60000)


def test_a_run_without_validation_data_says_so_instead_of_nan(tmp_path, text):
    out, log = tmp_path / "m.gguf", tmp_path / "log.jsonl"
    r = _cli("train", "--data", text, "--out", out, "--steps", 3, "--val-split", 0, "--log", log, *TINY)
    assert r.returncode == 0, r.stderr
    assert "no validation data (--val-split 0)" in r.stderr and "nan" not in r.stderr
    done = json.loads(log.read_text().splitlines()[-1])
    assert done["event"] == "done" and done["val_loss"] is None


def test_training_lowers_loss_and_writes_a_clean_llama_model(tmp_path, text):
    out, log = tmp_path / "m.gguf", tmp_path / "log.jsonl"
    r = _cli("train", "--data", text, "--out", out, "--steps", 40, "--eval-every", 20, "--log", log, *TINY)
    assert r.returncode == 0, r.stderr
    lines = [json.loads(l) for l in log.read_text().splitlines()]
    steps = [l for l in lines if "loss" in l]
    assert {"step", "epoch", "loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s"} <= set(steps[0])
    assert steps[-1]["loss"] < steps[0]["loss"] - 1.0
    assert [l["step"] for l in lines if "val_loss" in l and "event" not in l] == [20, 40]
    assert lines[-1]["event"] == "done"
    names = [t.name for t in gguf.GGUFReader(out).tensors]
    assert not [n for n in names if n.startswith("adam_")]  # llama.cpp refuses extra tensors
    config, weights, tok = load_model(out)
    assert config["layers"] == 2 and tok.n_vocab == 260
    assert "planned memory" in r.stderr


@pytest.mark.parametrize("tokenizer", ["byte", "bpe:300"])
def test_resume_is_bit_identical(tmp_path, text, tokenizer):
    full, resumed, ck = tmp_path / "full.gguf", tmp_path / "resumed.gguf", tmp_path / "ck"
    r = _cli("train", "--data", text, "--out", full, "--steps", 24, "--checkpoint-dir", ck, "--save-every", 10,
             "--tokenizer", tokenizer, *TINY)
    assert r.returncode == 0, r.stderr
    r = _cli("train", "--data", text, "--out", resumed, "--resume", ck / "ckpt-000010.gguf", *TINY)
    assert r.returncode == 0, r.stderr
    assert full.read_bytes() == resumed.read_bytes()


def test_ctrl_c_saves_a_checkpoint_that_resumes_to_the_same_model(tmp_path, text):
    full = tmp_path / "full.gguf"
    args = ["--data", text, "--steps", 400, *TINY]
    assert _cli("train", "--out", full, *args).returncode == 0
    out = tmp_path / "m.gguf"
    p = subprocess.Popen([sys.executable, "-m", "ggtrain", "train", "--out", str(out), *map(str, args),
                          "--log", str(tmp_path / "log.jsonl")], stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline:  # wait until training is under way
        log = tmp_path / "log.jsonl"
        if log.exists() and log.read_text().count("\n") >= 3:
            break
        time.sleep(0.05)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err  # the signal came 3 updates into a 400-update run
    ckpt = tmp_path / "m.gguf.ckpt.gguf"
    assert ckpt.exists() and not out.exists()
    r = _cli("train", "--out", out, "--resume", ckpt, *args)
    assert r.returncode == 0, r.stderr
    assert out.read_bytes() == full.read_bytes()


def test_divergence_stops_and_keeps_the_last_good_checkpoint(tmp_path, text):
    ck = tmp_path / "ck"
    r = _cli("train", "--data", text, "--out", tmp_path / "m.gguf", "--steps", 50, "--checkpoint-dir", ck,
             "--save-every", 1, *TINY, "--lr", "1e6", "--grad-clip", "0", "--warmup", "0")
    assert r.returncode == 1 and "diverged" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "m.gguf").exists()
    saved = sorted(ck.iterdir())
    assert saved  # the good ones stay
    from ggtrain.formats.checkpoint import load_checkpoint
    state = load_checkpoint(saved[-1]).state
    assert all(np.isfinite(v).all() for v in state["params"].values())


def test_bad_input(tmp_path, text):
    out = tmp_path / "m.gguf"
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    r = _cli("train", "--data", empty, "--out", out, *TINY)
    assert r.returncode == 1 and "empty" in r.stderr
    short = tmp_path / "short.txt"
    short.write_text("too short")
    r = _cli("train", "--data", short, "--out", out, *TINY)
    assert r.returncode == 1 and "--ctx" in r.stderr
    r = _cli("train", "--data", tmp_path / "nope.txt", "--out", out, *TINY)
    assert r.returncode == 1 and "nope.txt" in r.stderr
    r = _cli("train", "--data", text, "--out", out, "--save-every", 5, *TINY)
    assert r.returncode == 1 and "--checkpoint-dir" in r.stderr
    r = _cli("train", "--data", text, "--out", out, "--tokenizer", "bpe:abc", *TINY)
    assert r.returncode == 1 and "bpe:abc" in r.stderr
    r = _cli("train", "--data", text, "--out", out, "--heads", "3", *TINY[:4], *TINY[6:])
    assert r.returncode == 1
    ck = tmp_path / "ck"
    assert _cli("train", "--data", text, "--out", out, "--steps", 2, "--checkpoint-dir", ck, *TINY).returncode == 0
    other = tmp_path / "other.txt"
    other.write_text(text.read_text()[::-1])
    r = _cli("train", "--data", other, "--out", out, "--resume", ck / "ckpt-000002.gguf", *TINY)
    assert r.returncode == 1 and "is not the data this checkpoint was trained on" in r.stderr
    r = _cli("train", "--data", text, "--out", tmp_path / "m2.gguf", "--resume", out, *TINY)
    assert r.returncode == 1 and "not a ggtrain checkpoint" in r.stderr
    r = _cli("train", "--data", text, "--out", out, "--resume", out, *TINY)
    assert r.returncode == 1 and f"--out {out} is also --resume" in r.stderr


@pytest.mark.parametrize("tokenizer", ["byte", "bpe:300"])
def test_data_that_is_not_utf8_plain_text_is_one_line_and_trains_nothing(tmp_path, text, tokenizer):
    """Bytes that are not UTF-8 far into the file, a binary file named .txt, records, a folder."""
    raw = tmp_path / "raw.txt"
    good = text.read_bytes() * 2             # past the first block that data_format looks at
    raw.write_bytes(good + b"\xff\xfe broken\n")
    line = good.count(b"\n") + 1
    column = len(good) - good.rfind(b"\n")
    parquet = tmp_path / "chat.txt"
    parquet.write_bytes(b"PAR1\x15\x04\x15\xa0\x01" + bytes(range(256)))
    records = tmp_path / "r.jsonl"
    records.write_text('{"text": "hello"}\n' * 50)
    out = tmp_path / "m.gguf"
    for data, message in [(raw, f"{raw} line {line} column {column}: not UTF-8 (byte 0xff)"),
                          (parquet, f"{parquet}: a Parquet file (name it .parquet to read its records), not text"),
                          (records, f"{records}: JSON lines of records, not plain text"),
                          (tmp_path, f"{tmp_path}: a folder, not plain text")]:
        r = _cli("train", "--data", data, "--out", out, "--steps", 3, "--tokenizer", tokenizer, *TINY)
        assert r.returncode == 1 and r.stderr == f"error: {message}\n", r.stderr
        assert not out.exists()


def test_moe_aux_loss_trains_qwen3moe_and_is_refused_without_experts(tmp_path, text):
    """train --arch qwen3moe --moe-aux-loss 0.01 writes a model whose configuration says nothing
    of it (a training objective), resuming keeps it; on a model without experts, or negative,
    it is refused in one line and nothing is written."""
    out, ck, log = tmp_path / "m.gguf", tmp_path / "ck", tmp_path / "log.jsonl"
    r = _cli("train", "--arch", "qwen3moe", "--data", text, "--out", out, "--steps", 2, "--moe-aux-loss", 0.01,
             "--checkpoint-dir", ck, "--log", log, *TINY)
    assert r.returncode == 0, r.stderr
    config, _, _ = load_model(out)
    assert config["arch"] == "qwen3moe" and config["experts"] == 8
    from ggtrain.formats.checkpoint import load_checkpoint
    saved = sorted(ck.glob("*.gguf"))
    assert saved and load_checkpoint(saved[-1]).train_config["moe_aux_loss"] == 0.01
    for args, message in ((("--arch", "llama", "--moe-aux-loss", 0.01), "--moe-aux-loss: a llama model has no routed "
                                                                       "experts to balance"),
                          (("--arch", "qwen3moe", "--moe-aux-loss", -1), "--moe-aux-loss must be >= 0, got -1.0")):
        bad = tmp_path / "bad.gguf"
        r = _cli("train", "--data", text, "--out", bad, "--steps", 2, *args, *TINY)
        assert r.returncode == 1 and r.stderr == f"error: {message}\n", r.stderr
        assert not bad.exists()


@pytest.mark.parametrize("command, option", [("train", "--batch"), ("train", "--grad-acc"), ("mnist train", "--batch")])
def test_a_batch_of_zero_is_a_usage_error_not_a_traceback(tmp_path, command, option):
    """--batch 0 divided by zero in the windows an epoch takes (a traceback); now a usage
    error naming the option, exit 2, nothing written."""
    r = _cli(*command.split(), "--out", tmp_path / "m.gguf", "--steps", "1", option, "0")
    assert r.returncode == 2 and f"'{option}'" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "m.gguf").exists()
