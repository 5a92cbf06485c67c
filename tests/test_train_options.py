"""The training commands' shared options end to end: --optimizer (L-BFGS resume), early
stopping, --config, the rough edges a new user hits (--kv-heads, --epochs/--steps 0), and
`ggtrain plot`."""
import json
import os
import struct
import subprocess
import sys

import gguf
import pytest
from tests.interop import run_here

TINY = ["--dim", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ff", "64", "--ctx", "32",
        "--batch", "4", "--quiet"]


def _cli(*args):
    """`ggtrain ARGS` by its entry point in this process (tests.interop.run_here)."""
    return run_here(*args)


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---- rough edges --------------------------------------------------------------------------


def test_kv_heads_defaults_to_heads(tmp_path, text):
    out = tmp_path / "m.gguf"
    r = _cli("train", "--data", text, "--out", out, "--heads", "4", "--dim", "32", "--layers", "1", "--ff", "32",
             "--ctx", "16", "--steps", "1", "--quiet")
    assert r.returncode == 0, r.stderr
    reader = gguf.GGUFReader(out)
    field = reader.fields["llama.attention.head_count_kv"]
    assert int(field.parts[field.data[0]][0]) == 4


@pytest.mark.parametrize("args, words", [(["--epochs", "0"], "--epochs must be > 0"),
                                         (["--steps", "0"], "--steps must be >= 1")])
def test_train_refuses_zero_epochs_and_steps(tmp_path, text, args, words):
    out = tmp_path / "m.gguf"
    r = _cli("train", "--data", text, "--out", out, *args, *TINY)
    assert r.returncode == 1 and words in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()


def test_mnist_refuses_zero_epochs(tmp_path):
    out = tmp_path / "m.gguf"
    r = _cli("mnist", "train", "--out", out, "--epochs", "0", "--quiet")
    assert r.returncode == 1 and "--epochs must be > 0, got 0" in r.stderr
    assert not out.exists()


# ---- --config -----------------------------------------------------------------------------


def test_config_file_sets_options_the_command_line_overrides_and_the_log_repeats_the_run(tmp_path, text):
    cfg = tmp_path / "run.toml"
    cfg.write_text(f'data = "{text}"\nout = "{tmp_path / "ignored.gguf"}"\nsteps = 3\ndim = 32\nlayers = 1\n'
                   'heads = 4\nkv-heads = 2\nff = 32\nctx = 16\nbatch = 2\nlr = 3e-3\nwarmup = 1\n'
                   'checkpointing = false\nquiet = true\n')
    out, log, ck = tmp_path / "a.gguf", tmp_path / "a.jsonl", tmp_path / "ck"
    r = _cli("train", "--config", cfg, "--out", out, "--log", log, "--steps", 4, "--checkpoint-dir", ck)
    assert r.returncode == 0, r.stderr
    first = _lines(log)[0]
    assert first["event"] == "config" and first["command"] == "train"
    opts = first["options"]
    assert opts["steps"] == 4 and opts["out"] == str(out)          # the command line wins
    assert opts["kv-heads"] == 2 and opts["lr"] == 3e-3 and opts["checkpointing"] is False   # from the file
    assert "config" not in opts and "threads" not in opts           # unset options are not recorded
    assert max(l["step"] for l in _lines(log) if "loss" in l) == 4
    assert not (tmp_path / "ignored.gguf").exists()
    # the checkpoint holds the options too
    f = gguf.GGUFReader(ck / "ckpt-000004.gguf")
    field = f.fields["ggtrain.run_config"]
    assert json.loads(bytes(field.parts[field.data[0]]))["options"] == opts
    # the log repeats the run
    again = tmp_path / "b.gguf"
    r = _cli("train", "--config", log, "--out", again, "--log", tmp_path / "b.jsonl")
    assert r.returncode == 0, r.stderr
    assert again.read_bytes() == out.read_bytes()


@pytest.mark.parametrize("body, words", [("stepz = 3\n", "unknown key 'stepz'"),
                                         ("steps = \n", "not valid TOML"),
                                         ("steps = [1, 2]\n", "steps must be a single value")])
def test_bad_config_files_are_one_line_errors(tmp_path, text, body, words):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(body)
    r = _cli("train", "--data", text, "--out", tmp_path / "m.gguf", "--config", cfg, *TINY)
    assert r.returncode == 1 and words in r.stderr and str(cfg) in r.stderr and "Traceback" not in r.stderr


def test_missing_config_file(tmp_path):
    r = _cli("train", "--out", tmp_path / "m.gguf", "--config", tmp_path / "nope.toml")
    assert r.returncode == 1 and "nope.toml: no such file" in r.stderr


def test_mnist_train_takes_a_config_file(tmp_path):
    cfg = tmp_path / "m.toml"
    cfg.write_text('epochs = 1\nlimit = 600\nbatch = 100\nphysical-batch = 50\nquiet = true\noptimizer = "sgd"\n'
                   'lr = 0.05\nmomentum = 0.9\n')
    out, log = tmp_path / "m.gguf", tmp_path / "m.jsonl"
    r = _cli("mnist", "train", "--config", cfg, "--out", out, "--log", log)
    assert r.returncode == 0, r.stderr
    lines = _lines(log)
    assert lines[0]["command"] == "mnist train" and lines[0]["options"]["momentum"] == 0.9
    steps = [l for l in lines if "loss" in l]
    assert len(steps) == 5 and steps[-1]["loss"] < steps[0]["loss"]   # 570 images: 5 updates of 100


# ---- L-BFGS and early stopping through the commands ---------------------------------------


def test_lbfgs_training_resumes_bit_identically_from_its_history(tmp_path, text):
    args = ["--data", text, "--optimizer", "lbfgs", "--eval-every", 2, "--early-stop-patience", 5, *TINY]
    full, resumed, ck = tmp_path / "full.gguf", tmp_path / "resumed.gguf", tmp_path / "ck"
    r = _cli("train", "--out", full, "--steps", 8, "--checkpoint-dir", ck, "--save-every", 4,
             "--log", tmp_path / "log.jsonl", *args)
    assert r.returncode == 0, r.stderr
    steps = [l for l in _lines(tmp_path / "log.jsonl") if "loss" in l]
    assert all(l["evals"] >= 2 and l["lr"] == 1.0 for l in steps)   # start point + line search
    assert steps[-1]["loss"] < steps[0]["loss"]
    ckpt = gguf.GGUFReader(ck / "ckpt-000004.gguf")
    names = {t.name for t in ckpt.tensors}
    assert {"lbfgs.s", "lbfgs.y", "lbfgs.curv", "lbfgs.ring"} <= names
    assert any(n.startswith("best.") for n in names) and not any(n.startswith("adam_") for n in names)
    r = _cli("train", "--out", resumed, "--resume", ck / "ckpt-000004.gguf", *args)
    assert r.returncode == 0, r.stderr
    assert resumed.read_bytes() == full.read_bytes()


def test_lbfgs_refuses_weight_decay_and_clipping(tmp_path, text):
    r = _cli("train", "--data", text, "--out", tmp_path / "m.gguf", "--optimizer", "lbfgs", "--grad-clip", 1,
             "--steps", 1, *TINY)
    assert r.returncode == 1 and "--grad-clip 1: L-BFGS" in r.stderr
    r = _cli("train", "--data", text, "--out", tmp_path / "m.gguf", "--optimizer", "adam", "--steps", 1, *TINY)
    # not a choice: a usage error (exit 2) on one line that lists the optimizers
    assert r.returncode == 2 and "'adam' is not one of 'adamw', 'sgd', 'lbfgs'" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_early_stopping_keeps_the_best_model_and_says_why(tmp_path, text):
    # --min-delta 100: no evaluation after the first improves enough, so the run stops after
    # the third evaluation (update 6) and keeps the model of the first (update 2). L-BFGS has no
    # schedule, so that model is the one a 2-update run writes.
    args = ["--data", text, "--optimizer", "lbfgs", *TINY]
    out, log, short = tmp_path / "m.gguf", tmp_path / "log.jsonl", tmp_path / "short.gguf"
    r = _cli("train", "--out", out, "--steps", 50, "--eval-every", 2, "--early-stop-patience", 2,
             "--min-delta", 100, "--log", log, *args)
    assert r.returncode == 0, r.stderr
    assert "stopped early at update 6" in r.stderr and "kept the best model" in r.stderr
    done = _lines(log)[-1]
    assert done["stop_reason"] == "early_stop" and done["step"] == 6
    evals = [l for l in _lines(log) if "val_loss" in l and "event" not in l]
    assert [e["step"] for e in evals] == [2, 4, 6] and done["val_loss"] == pytest.approx(evals[0]["val_loss"])
    assert _cli("train", "--out", short, "--steps", 2, *args).returncode == 0
    assert out.read_bytes() == short.read_bytes()


def test_early_stopping_needs_evaluations(tmp_path, text):
    r = _cli("train", "--data", text, "--out", tmp_path / "m.gguf", "--early-stop-patience", 2, "--steps", 3, *TINY)
    assert r.returncode == 1 and "--eval-every" in r.stderr
    r = _cli("train", "--data", text, "--out", tmp_path / "m.gguf", "--min-delta", 0.1, "--steps", 3, *TINY)
    assert r.returncode == 1 and "--min-delta needs --early-stop-patience" in r.stderr


def test_mnist_early_stopping_writes_the_best_epoch(tmp_path):
    common = ["--limit", 600, "--batch", 100, "--physical-batch", 50, "--val-split", 0.2, "--quiet"]
    out, log, first = tmp_path / "m.gguf", tmp_path / "m.jsonl", tmp_path / "first.gguf"
    r = _cli("mnist", "train", "--out", out, "--log", log, "--epochs", 10, "--early-stop-patience", 1,
             "--min-delta", 100, *common)
    assert r.returncode == 0, r.stderr
    done = _lines(log)[-1]
    assert done["stop_reason"] == "early_stop" and done["epochs"] == 2 and done["epoch"] == 1
    assert "stopped early at epoch 2" in r.stderr
    assert _cli("mnist", "train", "--out", first, "--epochs", 1, *common).returncode == 0
    assert out.read_bytes() == first.read_bytes()


def test_mnist_lbfgs_full_batch(tmp_path):
    out, log = tmp_path / "m.gguf", tmp_path / "m.jsonl"
    r = _cli("mnist", "train", "--out", out, "--log", log, "--limit", 1000, "--val-split", 0.2, "--optimizer",
             "lbfgs", "--batch", 60000, "--physical-batch", 400, "--epochs", 4, "--quiet")
    assert r.returncode == 0, r.stderr
    assert "a full batch of 800" in r.stderr
    steps = [l for l in _lines(log) if "loss" in l]
    assert len(steps) == 4 and all(b["loss"] < a["loss"] for a, b in zip(steps, steps[1:]))


# ---- ggtrain plot -------------------------------------------------------------------------


def _png_size(path):
    raw = path.read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n" and raw[12:16] == b"IHDR"
    return struct.unpack(">II", raw[16:24]), len(raw)


def test_plot_draws_a_png_from_real_logs(tmp_path, text):
    try:
        import matplotlib  # noqa: F401  (the plot extra)
    except ImportError as e:
        msg = f"matplotlib cannot be imported ({e}); ggtrain plot needs the plot extra: pip install -e '.[plot]'"
        if os.environ.get("CI") == "true":
            pytest.fail("CI must run the plot test: " + msg, pytrace=False)
        pytest.skip(msg)
    logs = [tmp_path / "train.jsonl", tmp_path / "mnist.jsonl"]   # evaluations every 2 updates / per epoch
    r = _cli("train", "--data", text, "--out", tmp_path / "m.gguf", "--steps", 6, "--eval-every", 2,
             "--warmup", 2, "--log", logs[0], *TINY)
    assert r.returncode == 0, r.stderr
    r = _cli("mnist", "train", "--out", tmp_path / "mnist.gguf", "--limit", 600, "--batch", 100,
             "--physical-batch", 100, "--epochs", 2, "--log", logs[1], "--quiet")
    assert r.returncode == 0, r.stderr
    png = tmp_path / "loss.png"
    r = _cli("plot", *logs, "--out", png)
    assert r.returncode == 0, r.stderr
    (width, height), size = _png_size(png)
    assert width >= 600 and height >= 400 and size > 10_000
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".loss")] == []   # no temp file left


def test_plot_bad_input_and_missing_matplotlib(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"event": "config", "options": {}}\nnot json\n')
    r = _cli("plot", bad, "--out", tmp_path / "p.png")
    assert r.returncode == 1 and "bad.jsonl: line 2 is not JSON" in r.stderr
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"event": "config", "options": {}}\n')
    r = _cli("plot", empty, "--out", tmp_path / "p.png")
    assert r.returncode == 1 and "no training steps" in r.stderr
    # without matplotlib: one line naming the extra
    good = tmp_path / "good.jsonl"
    good.write_text('{"step": 1, "loss": 2.0, "lr": 0.1}\n{"step": 2, "loss": 1.5, "lr": 0.1}\n')
    hide = ("import sys; sys.modules['matplotlib'] = None; from ggtrain.cli.main import main; "
            f"main(['plot', {str(good)!r}, '--out', {str(tmp_path / 'p.png')!r}])")
    r = subprocess.run([sys.executable, "-c", hide], capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        "error: ggtrain plot needs matplotlib, the `plot` extra: pip install 'ggtrain[plot]'"]
    assert not (tmp_path / "p.png").exists()


@pytest.fixture
def text(shakespeare):
    return shakespeare


# ---- mnist train: the shared run loop's checkpoints and resume ----------------------------

MNIST_SMALL = ["--limit", 600, "--batch", 100, "--physical-batch", 50, "--val-split", 0.2, "--quiet"]


@pytest.mark.parametrize("extra", [[], ["--early-stop-patience", 3, "--optimizer", "sgd", "--momentum", 0.9]])
def test_mnist_resumes_mid_epoch_to_the_same_model(tmp_path, extra):
    """4 updates an epoch (480 training images): the checkpoint after update 6 is in the middle
    of epoch 2; resumed from it, the run ends with the uninterrupted run's model and log."""
    common = ["--epochs", 3, *MNIST_SMALL, *extra]
    whole, log = tmp_path / "whole.gguf", tmp_path / "whole.jsonl"
    r = _cli("mnist", "train", "--out", whole, "--log", log, "--checkpoint-dir", tmp_path / "ck",
             "--save-every", 3, *common)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [
        "ckpt-000003.gguf", "ckpt-000006.gguf", "ckpt-000009.gguf", "ckpt-000012.gguf"]
    info = _cli("info", tmp_path / "ck" / "ckpt-000006.gguf")
    assert info.returncode == 0 and "mnist train --resume" in info.stdout and "6 updates of 3 epochs" in info.stdout
    again, log2 = tmp_path / "again.gguf", tmp_path / "again.jsonl"
    r = _cli("mnist", "train", "--out", again, "--log", log2, "--resume", tmp_path / "ck" / "ckpt-000006.gguf",
             "--quiet")
    assert r.returncode == 0, r.stderr
    assert again.read_bytes() == whole.read_bytes()
    first, second = _lines(log), _lines(log2)
    steps = {l["step"]: l["loss"] for l in first if "loss" in l}
    assert [l["loss"] for l in second if "loss" in l] == [steps[s] for s in range(7, 13)]
    epochs = lambda lines: [(l["epoch"], l["train_loss"], l["val_loss"]) for l in lines if "train_loss" in l
                            and "event" not in l]
    assert epochs(second) == epochs(first)[1:]   # epoch 2's training totals include its first two updates
    assert {k: v for k, v in second[-1].items() if k not in ("elapsed_s", "out", "samples_seen")} == \
        {k: v for k, v in first[-1].items() if k not in ("elapsed_s", "out", "samples_seen")}
    # --epochs with --resume: the run's new total
    r = _cli("mnist", "train", "--out", tmp_path / "more.gguf", "--log", tmp_path / "more.jsonl", "--resume",
             tmp_path / "ck" / "ckpt-000012.gguf", "--epochs", 4, "--quiet")
    assert r.returncode == 0, r.stderr
    more = [l["step"] for l in _lines(tmp_path / "more.jsonl") if "loss" in l]
    assert more == ([13, 14, 15, 16] if second[-1]["stop_reason"] == "finished" else [])
    # the checkpoint becomes the model it holds
    model = tmp_path / "at6.gguf"
    r = _cli("convert-checkpoint", tmp_path / "ck" / "ckpt-000006.gguf", model)
    assert r.returncode == 0 and "mnist-fc model" in r.stdout, r.stderr
    assert _cli("mnist", "eval", "--model", model, "--json").returncode == 0


def test_mnist_resume_refuses_other_data_and_other_checkpoints(tmp_path, text):
    ck = tmp_path / "ck"
    r = _cli("mnist", "train", "--out", tmp_path / "m.gguf", "--epochs", 1, "--checkpoint-dir", ck, *MNIST_SMALL)
    assert r.returncode == 0, r.stderr
    last = ck / "ckpt-000004.gguf"
    r = _cli("train", "--data", text, "--out", tmp_path / "t.gguf", "--resume", last, *TINY)
    assert r.returncode == 1 and "`ggtrain mnist train --resume` continues it" in r.stderr, r.stderr
    r = _cli("train", "--data", text, "--out", tmp_path / "t.gguf", "--steps", 1, "--checkpoint-dir", tmp_path / "t",
             *TINY)
    assert r.returncode == 0, r.stderr
    r = _cli("mnist", "train", "--out", tmp_path / "m2.gguf", "--resume", next((tmp_path / "t").iterdir()))
    assert r.returncode == 1 and "`ggtrain train --resume` continues it" in r.stderr, r.stderr
    # the bundled images, but not the first 600 of them: not the data the checkpoint was trained on
    from ggtrain.cli.mnist import BUNDLED
    data = tmp_path / "mnist"
    data.mkdir()
    for p in BUNDLED.iterdir():
        (data / p.name).write_bytes(p.read_bytes())
    import gzip
    images = data / "train-images-idx3-ubyte.gz"
    raw = bytearray(gzip.decompress(images.read_bytes()))
    raw[16 + 100] ^= 0xFF    # one pixel of the first image
    images.write_bytes(gzip.compress(bytes(raw)))
    r = _cli("mnist", "train", "--out", tmp_path / "m2.gguf", "--resume", last, "--data", data)
    assert r.returncode == 1 and "is not the data this checkpoint was trained on" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
