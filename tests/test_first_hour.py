"""What a new user meets in a first hour (issue 44's frictions), each checked end to end: a
resumed run's log goes on, generation says when it stops at the context, outputs are checked
before any work, sampling seeds are random unless given, the Ctrl-C checkpoint goes once its
run is complete, errors name the option and say what to do, progress without a terminal is
plain lines."""
import fcntl
import json
import os
import pty
import select
import shutil
import struct
import termios
import subprocess
import sys

import pytest

from tests.test_train_cli import TINY, _cli


@pytest.fixture
def text(tmp_path):
    from tests.conftest import write_shakespeare
    return write_shakespeare(tmp_path / "t.txt", 60000)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A tiny trained model (context 32) and one of its checkpoints."""
    from tests.conftest import write_shakespeare
    d = tmp_path_factory.mktemp("tiny")
    text = write_shakespeare(d / "t.txt", 60000)
    r = _cli("train", "--data", text, "--out", d / "m.gguf", "--steps", 4, "--checkpoint-dir", d / "ck",
             "--save-every", 2, "--log", d / "log.jsonl", *TINY)
    assert r.returncode == 0, r.stderr
    return d


def test_a_resumed_run_appends_to_its_log_and_its_time_goes_on(tiny_model, tmp_path, text):
    log = tmp_path / "log.jsonl"
    first = [json.loads(x) for x in (tiny_model / "log.jsonl").read_text().splitlines()]
    # the log of the run as it was at its step-2 checkpoint (what a Ctrl-C there leaves)
    kept = [x for x in first if x.get("step", 0) <= 2 and x.get("event") != "done"]
    log.write_text("".join(json.dumps(x) + "\n" for x in kept))
    r = _cli("train", "--data", text, "--out", tmp_path / "m.gguf", "--resume", tiny_model / "ck" / "ckpt-000002.gguf",
             "--steps", 4, "--log", log, *TINY)
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert lines[:len(kept)] == kept                                    # nothing lost
    resumed = next(i for i, x in enumerate(lines) if x.get("event") == "resumed")
    assert lines[resumed]["step"] == 2
    steps = [x for x in lines if "loss" in x and "event" not in x]
    assert [x["step"] for x in steps] == [1, 2, 3, 4]
    assert steps[2]["elapsed_s"] >= steps[1]["elapsed_s"]                # time continues, not from 0


def test_generation_says_when_it_stops_at_the_context(tiny_model):
    r = _cli("generate", "--model", tiny_model / "m.gguf", "--prompt", "ROMEO:", "-n", 500, "--temp", 0)
    assert r.returncode == 0, r.stderr
    assert r.stdout.endswith("\n")
    assert "note: stopped at the context of 32 positions" in r.stderr and "of -n 500" in r.stderr, r.stderr
    r = _cli("generate", "--model", tiny_model / "m.gguf", "--prompt", "ROMEO:", "-n", 4, "--temp", 0)
    assert r.returncode == 0 and "note:" not in r.stderr


def test_llama_cpps_option_names_are_accepted(tiny_model):
    want = _cli("generate", "--model", tiny_model / "m.gguf", "--prompt", "ROMEO:", "-n", 5, "--temp", 0)
    for args in (["--n-predict", 5], ["--n-tokens", 5], ["--n-predict=5"]):
        r = _cli("generate", "--model", tiny_model / "m.gguf", "--prompt", "ROMEO:", *args, "--temp", 0)
        assert r.returncode == 0 and r.stdout == want.stdout, (args, r.stderr)


def test_sampling_seed_is_random_unless_given(tiny_model):
    def run(*extra):
        r = _cli("generate", "--model", tiny_model / "m.gguf", "--prompt", "ROMEO:", "-n", 12, "--temp", 1.5,
                 "--top-k", 0, "--top-p", 1, "--min-p", 0, "--timings", *extra)
        assert r.returncode == 0, r.stderr
        return r.stdout, json.loads(r.stderr.strip().splitlines()[-1])["seed"]
    (a, sa), (_, sb) = run(), run()
    assert sa != sb                                   # 2^31 seeds: equal once in two billion
    again, seed = run("--seed", sa)
    assert seed == sa and again == a                  # the printed seed repeats the run


def test_outputs_are_checked_before_any_training(tmp_path, text, shared_data):
    folder = tmp_path / "adapters"
    folder.mkdir()
    r = _cli("finetune", "--model", shared_data / "gguf" / "stories260K.gguf", "--data", text, "--out", folder,
             "--steps", 1000, "--quiet")
    assert r.returncode == 1 and r.stderr.startswith(f"error: --out {folder}: is a folder"), r.stderr
    assert "planned memory" not in r.stderr          # refused before the model was read
    r = _cli("train", "--data", text, "--out", tmp_path / "m.gguf", "--log", folder, *TINY)
    assert r.returncode == 1 and r.stderr.startswith(f"error: --log {folder}: is a folder"), r.stderr
    assert "run.jsonl" in r.stderr
    r = _cli("train", "--data", text, "--out", tmp_path / "m.gguf", *TINY, "--lr", -1)
    assert r.returncode == 1 and "--lr must be > 0, got -1" in r.stderr, r.stderr


def test_the_interrupt_checkpoint_goes_once_its_run_is_complete(tiny_model, tmp_path, text):
    out = tmp_path / "m.gguf"
    stale = tmp_path / "m.gguf.ckpt.gguf"              # where Ctrl-C saves without --checkpoint-dir
    shutil.copy(tiny_model / "ck" / "ckpt-000002.gguf", stale)
    r = _cli("train", "--data", text, "--out", out, "--resume", stale, "--steps", 4, *TINY)
    assert r.returncode == 0, r.stderr
    assert out.exists() and not stale.exists()
    assert f"removed {stale}" in r.stderr.strip().splitlines()[-1]


def test_errors_name_the_option_and_the_next_step(tiny_model, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# ggtrain\n")
    r = _cli("generate", "--model", readme, "--prompt", "x")
    assert r.returncode == 1
    assert r.stderr == f'error: --model {readme}: not a GGUF file (it starts with "# gg", a GGUF file with "GGUF")\n'
    r = _cli("generate", "--model", tiny_model / "m.gguf", "--lora", tiny_model / "ck" / "ckpt-000002.gguf",
             "--prompt", "x")
    assert r.returncode == 1 and "a ggtrain checkpoint, not a LoRA adapter; `ggtrain convert-checkpoint" in r.stderr
    r = _cli("generate", "--model", tiny_model / "m.gguf", "--chat", "--prompt", "hi")
    assert r.returncode == 1 and r.stderr.startswith("error: --chat ") and "--chat-template" in r.stderr, r.stderr
    assert "chat records" not in r.stderr


def test_progress_without_a_terminal_is_plain_lines(text, tmp_path):
    r = subprocess.run([sys.executable, "-m", "ggtrain", "train", "--data", str(text), "--out", str(tmp_path / "m.gguf"),
                        "--steps", "30", *[str(a) for a in TINY if a != "--quiet"]], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "\r" not in r.stderr and len(r.stderr) < 2000, r.stderr[-500:]


def test_eval_shows_progress_and_info_names_a_checkpoints_targets(tiny_model, tmp_path, text, shared_data):
    """eval --data has a bar over its windows (and --quiet none); info names the targets a LoRA
    checkpoint trains when it was started without --lora-targets (the family's default)."""
    def bar(*extra) -> str:
        """What eval writes on a terminal (stderr a pseudo-terminal: tqdm's bar)."""
        main, side = pty.openpty()
        fcntl.ioctl(side, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))   # a terminal's size
        p = subprocess.Popen([sys.executable, "-m", "ggtrain", "eval", "--model", str(tiny_model / "m.gguf"),
                              "--data", str(text), *extra], stdout=subprocess.PIPE, stderr=side, text=True)
        os.close(side)
        seen = b""
        while True:                                  # read while it runs (a pty keeps little)
            if select.select([main], [], [], 0.2)[0]:
                try:
                    chunk = os.read(main, 65536)
                except OSError:                      # the child closed its side
                    chunk = b""
                seen += chunk
                if chunk:
                    continue
            if p.poll() is not None:
                break
        os.close(main)
        r = subprocess.CompletedProcess(p.args, p.returncode, p.stdout.read(), "")
        assert r.returncode == 0 and r.stdout.startswith("perplexity"), r.stdout
        return seen.decode(errors="replace")
    assert f"scoring {text.name}" in bar(), "no progress bar"
    assert "scoring" not in bar("--quiet")
    ck = tmp_path / "ck"
    r = _cli("finetune", "--model", shared_data / "gguf" / "stories260K.gguf", "--data", text, "--out",
             tmp_path / "a.gguf", "--steps", 2, "--ctx", 32, "--checkpoint-dir", ck, "--save-every", 1, "--quiet")
    assert r.returncode == 0, r.stderr
    from ggtrain.core.models.families import FAMILIES
    r = _cli("info", ck / "ckpt-000001.gguf")
    assert r.returncode == 0, r.stderr
    assert f"targets {','.join(FAMILIES['llama'].lora_targets)} (the family's default)" in r.stdout, r.stdout


def test_one_meaning_per_option_name(text, tmp_path):
    """--warmup is a fraction or a count in train as in finetune; mnist train takes --steps."""
    r = _cli("train", "--data", text, "--out", tmp_path / "m.gguf", "--steps", 2, "--warmup", 0.5, *TINY)
    assert r.returncode == 0, r.stderr
    r = _cli("mnist", "train", "--out", tmp_path / "mnist.gguf", "--steps", 2, "--batch", 100, "--physical-batch",
             100, "--limit", 1000, "--quiet")
    assert r.returncode == 0, r.stderr
    assert "2 updates" in r.stderr or "ran all 2 updates" in r.stderr, r.stderr
