"""Faults a long run meets (issue 23): a disk that fills during a save, files a killed save
left behind, a damaged or foreign --resume, a chat template that tries to leave jinja2's
sandbox, and malformed data files. Each ends in one line naming what failed, never a
traceback, with nothing half-written under a final name."""
import json
import os
import resource
import signal
import subprocess
import sys

import numpy as np
import pytest

from ggtrain.errors import ConfigError, FormatError
from ggtrain.formats.chat import ChatTemplate
from ggtrain.formats.dataset import read_data
from ggtrain.formats.files import _host, open_temporary, remove_stale_temporaries
from ggtrain.formats.gguf import read_gguf
from ggtrain.formats.gguf_writer import GGUFWriter
from ggtrain.formats.tokenizer import ByteTokenizer

TINY = ["--dim", "32", "--layers", "1", "--heads", "2", "--ff", "64", "--ctx", "32", "--batch", "2", "--quiet"]


def _ggtrain(args, cwd, fsize=None):
    def limits():
        if fsize is not None:
            # writes past the limit fail with EFBIG (SIGXFSZ ignored), as on a full disk
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    return subprocess.run([sys.executable, "-m", "ggtrain", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, preexec_fn=limits, timeout=300)


def _one_line_error(r, *words, status=1):
    assert r.returncode == status, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), r.stderr
    for w in words:
        assert w in last, (w, last)
    return last


@pytest.fixture
def text(tmp_path, shared_data):
    path = tmp_path / "t.txt"
    path.write_text((shared_data / "text" / "tinyshakespeare.txt").read_text()[:20000])
    return path


# ---- a full disk during a save ----------------------------------------------------------------

def test_a_save_that_fails_stops_the_run_in_one_line_and_keeps_the_last_checkpoint(tmp_path, text):
    ck = tmp_path / "ck"
    r = _ggtrain(["train", "--data", text, "--out", tmp_path / "m.gguf", "--steps", 2, "--checkpoint-dir", ck,
                  "--save-every", 2, *TINY], tmp_path)
    assert r.returncode == 0, r.stderr
    first = ck / "ckpt-000002.gguf"
    before = first.read_bytes()
    # the resumed run's next checkpoint does not fit: every file write stops at 100 kB
    r = _ggtrain(["train", "--data", text, "--out", tmp_path / "m2.gguf", "--steps", 4, "--resume", first,
                  "--checkpoint-dir", ck, "--save-every", 2, *TINY], tmp_path, fsize=100_000)
    last = _one_line_error(r, "ckpt-000004.gguf", "cannot write", "File too large")
    assert str(first) in last and "--resume" in last          # what to resume from
    assert first.read_bytes() == before                       # the last checkpoint is intact
    assert sorted(p.name for p in ck.iterdir()) == ["ckpt-000002.gguf"]   # nothing half-written
    assert not (tmp_path / "m2.gguf").exists()


def test_on_save_error_continue_goes_on_and_says_so(tmp_path, text):
    log = tmp_path / "run.jsonl"
    ck = tmp_path / "ck"
    r = _ggtrain(["train", "--data", text, "--out", tmp_path / "m.gguf", "--steps", 4, "--checkpoint-dir", ck,
                  "--save-every", 2, "--on-save-error", "continue", "--log", log, *TINY], tmp_path, fsize=100_000)
    # the checkpoints fail and the run goes on; the model (about 110 kB) fails to be written at the end
    assert "warning: checkpoint" in r.stderr and "cannot write" in r.stderr
    _one_line_error(r, "m.gguf", "cannot write")
    events = [json.loads(line) for line in log.read_text().splitlines()]
    failed = [e for e in events if e.get("event") == "save_failed"]
    assert [e["step"] for e in failed][:2] == [2, 4]
    assert max(e["step"] for e in events if "loss" in e and "event" not in e) == 4
    assert list(ck.iterdir()) == [] and not (tmp_path / "m.gguf").exists()


def test_on_save_error_is_checked(tmp_path, text):
    r = _ggtrain(["train", "--data", text, "--out", tmp_path / "m.gguf", "--on-save-error", "retry", *TINY],
                 tmp_path)
    _one_line_error(r, "--on-save-error", "retry", "stop", "continue", status=2)   # a usage error


# ---- files a killed save left ---------------------------------------------------------------

def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_temporary_files_of_killed_saves_are_removed(tmp_path, text):
    ck = tmp_path / "ck"
    ck.mkdir()
    fd, live = open_temporary(ck / "ckpt-000002.gguf")      # a save under way in this process
    os.close(fd)
    dead = ck / f".ckpt-000004.gguf.{_host()}-{_dead_pid()}.0badf00d.tmp"
    dead.write_bytes(b"GGUF half")
    out_dead = tmp_path / f".m.gguf.{_host()}-{_dead_pid()}.12345678.tmp"
    out_dead.write_bytes(b"GGUF half")
    other = ck / "notes.tmp"                                # not named like ours: left alone
    other.write_text("mine")
    r = _ggtrain(["train", "--data", text, "--out", tmp_path / "m.gguf", "--steps", 2, "--checkpoint-dir", ck,
                  *TINY], tmp_path)
    assert r.returncode == 0, r.stderr
    assert not dead.exists() and not out_dead.exists()
    assert os.path.exists(live) and other.exists()


def test_remove_stale_temporaries_keeps_live_and_foreign_ones(tmp_path):
    dead = tmp_path / f".m.gguf.{_host()}-{_dead_pid()}.12345678.tmp"
    mine = tmp_path / f".m.gguf.{_host()}-{os.getpid()}.12345678.tmp"
    elsewhere = tmp_path / f".m.gguf.00000000-{_dead_pid()}.12345678.tmp"   # another machine's, recent
    old_elsewhere = tmp_path / ".n.gguf.00000000-1.12345678.tmp"
    for p in (dead, mine, elsewhere, old_elsewhere):
        p.write_bytes(b"x")
    old = os.path.getmtime(old_elsewhere) - 2 * 24 * 3600
    os.utime(old_elsewhere, (old, old))
    assert sorted(remove_stale_temporaries(tmp_path)) == sorted([str(dead), str(old_elsewhere)])
    assert mine.exists() and elsewhere.exists()


# ---- a damaged or foreign --resume ------------------------------------------------------------

@pytest.mark.parametrize("damage", ["header", "data", "foreign", "model", "empty"])
def test_a_damaged_or_foreign_resume_is_one_line(tmp_path, text, shared_data, damage):
    ck = tmp_path / "ck"
    r = _ggtrain(["train", "--data", text, "--out", tmp_path / "m.gguf", "--steps", 2, "--checkpoint-dir", ck,
                  *TINY], tmp_path)
    assert r.returncode == 0, r.stderr
    good = (ck / "ckpt-000002.gguf").read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes({"header": good[:5000], "data": good[:len(good) - 1000], "foreign": b"\x89PNG\r\n\x1a\n" * 40,
                     "model": (tmp_path / "m.gguf").read_bytes(), "empty": b""}[damage])
    for cmd in (["train", "--data", text, "--out", tmp_path / "x.gguf"],
                ["finetune", "--model", shared_data / "gguf" / "stories260K.gguf", "--data", text,
                 "--out", tmp_path / "x.gguf"]):
        _one_line_error(_ggtrain([*cmd, "--resume", bad], tmp_path), "bad.gguf")
        assert not (tmp_path / "x.gguf").exists()


# ---- a chat template that tries to leave the sandbox ------------------------------------------

# the payload of llama-cpp-python's CVE-2024-34359 (GHSA-56xg-wfcc-g829), aimed at a file here
ESCAPE = ("{% for x in ().__class__.__base__.__subclasses__() %}{% if \"warning\" in x.__name__ %}"
          "{{ x()._module.__builtins__['__import__']('os').system('touch PWNED') }}{% endif %}{% endfor %}"
          "{% for m in messages %}{{ m['content'] }}{% endfor %}")


def test_a_chat_template_escaping_the_sandbox_is_one_error_and_runs_nothing(tmp_path, shared_data):
    model = tmp_path / "evil.gguf"
    f = read_gguf(shared_data / "gguf" / "stories260K.gguf")
    w = GGUFWriter(model)
    for key, v in f.kv.items():
        if key != "general.alignment":
            w.kv[key] = v
    w.add_kv("tokenizer.chat_template", ESCAPE)
    for name, info in f.tensors.items():
        w.add_tensor_info(name, info.shape, info.type)
    for name in f.tensors:
        w.write_tensor(name, f.read_tensor(name))
    w.close()
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hello"}]}) + "\n")
    r = _ggtrain(["finetune", "--model", model, "--data", chat, "--out", tmp_path / "a.gguf", "--steps", 1],
                 tmp_path)
    _one_line_error(r, "chat template")
    r = _ggtrain(["generate", "--model", model, "--chat", "--prompt", "hi", "-n", 2], tmp_path)
    _one_line_error(r, "chat template")
    assert not (tmp_path / "PWNED").exists()
    with pytest.raises(FormatError, match="chat template"):
        ChatTemplate(ESCAPE).render([{"role": "user", "content": "hi"}])


# ---- malformed data files ---------------------------------------------------------------------

def _fuzzed(rng, seed_files: list) -> tuple:
    """(name, bytes) of one malformed data file: a real one cut, flipped or twisted."""
    name, raw = seed_files[int(rng.integers(len(seed_files)))]
    how = int(rng.integers(8))
    if how == 0:                                   # truncated
        raw = raw[:int(rng.integers(1, max(2, len(raw))))]
    elif how == 1:                                 # bytes flipped
        b = bytearray(raw)
        for i in rng.integers(0, len(b), int(rng.integers(1, 20))):
            b[i] = int(rng.integers(256))
        raw = bytes(b)
    elif how == 2:                                 # invalid UTF-8 inserted
        at = int(rng.integers(len(raw)))
        raw = raw[:at] + bytes(rng.choice([b"\xff", b"\xc3(", b"\xed\xa0\x80", b"\xf0\x9f"])) + raw[at:]
    elif how == 3:                                 # deep nesting
        depth = int(rng.integers(1000, 200_000))
        raw = b'{"text": ' + b"[" * depth + b"]" * depth + b"}\n" + raw
    elif how == 4:                                 # wrong types
        value = [5, None, True, [1], {"a": 1}, 1.5][int(rng.integers(6))]
        raw = raw.replace(b'"hello"', json.dumps(value).encode(), 1).replace(
            b'"assistant"', json.dumps(value).encode(), 1)
    elif how == 5:                                 # empty records
        raw = raw + [b"{}\n", b"[]\n", b"null\n", b'{"text": ""}\n', b'{"messages": []}\n'][int(rng.integers(5))]
    elif how == 6:                                 # a record cut over two lines
        raw = raw.replace(b", ", b",\n", 1)
    else:                                          # lines shuffled with a different kind
        raw = raw + b'{"prompt": "a", "completion": "b"}\n'
    return name, raw


def test_300_fuzzed_data_files_give_one_line_errors_naming_file_and_line(tmp_path):
    text = json.dumps({"text": "hello there"})
    pc = json.dumps({"prompt": "hello", "completion": " there"})
    chat = json.dumps({"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]})
    share = json.dumps({"conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "hi"}]})
    pref = json.dumps({"prompt": "hello", "chosen": "yes", "rejected": "no"})
    seeds = [("text.jsonl", "\n".join([text] * 3).encode()), ("pc.jsonl", "\n".join([pc] * 3).encode()),
             ("chat.jsonl", "\n".join([chat] * 3).encode()), ("share.json", f"[{share}, {share}]".encode()),
             ("pref.jsonl", "\n".join([pref] * 3).encode())]
    tok = ByteTokenizer()
    template = ChatTemplate("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
                            "{% if add_generation_prompt %}<assistant>{% endif %}")
    rng = np.random.default_rng(23)
    errors = 0
    for k in range(300):
        name, raw = _fuzzed(rng, seeds)
        path = tmp_path / f"{k:03d}-{name}"
        path.write_bytes(raw)
        try:
            data = read_data(path)
            if data.kind != "plain":
                data.samples(tok, template)
        except (FormatError, ConfigError) as e:
            message = str(e)
            assert "\n" not in message and str(path) in message, message
            if not message.endswith(("the file is empty", "holds no records")) and "array" not in message:
                assert " line " in message or " record " in message, message
            errors += 1
    assert errors > 150          # most of them are malformed, and each one said so


def test_a_100_mb_line_is_one_error(tmp_path):
    path = tmp_path / "long.jsonl"
    with open(path, "wb") as f:
        f.write(b'{"text": "ok"}\n{"text": "')
        f.write(b"a" * (100 << 20))               # never closed
        f.write(b"\n")
    with pytest.raises(FormatError, match=r"long.jsonl line 2 column \d+: invalid JSON"):
        read_data(path)


def test_each_command_names_the_one_that_continues_another_commands_checkpoint(tmp_path, text, shared_data):
    ck = tmp_path / "ck"
    r = _ggtrain(["train", "--data", text, "--out", tmp_path / "m.gguf", "--steps", 2, "--checkpoint-dir", ck,
                  *TINY], tmp_path)
    assert r.returncode == 0, r.stderr
    story = shared_data / "gguf" / "stories260K.gguf"
    r = _ggtrain(["finetune", "--model", story, "--data", text, "--out", tmp_path / "a.gguf",
                  "--resume", ck / "ckpt-000002.gguf"], tmp_path)
    _one_line_error(r, "a train checkpoint", "`ggtrain train --resume` continues it")
    r = _ggtrain(["finetune", "--model", story, "--data", text, "--out", tmp_path / "a.gguf", "--steps", 2,
                  "--ctx", 32, "--batch", 2, "--checkpoint-dir", tmp_path / "fk", "--quiet"], tmp_path)
    assert r.returncode == 0, r.stderr
    r = _ggtrain(["train", "--data", text, "--out", tmp_path / "x.gguf", "--resume", tmp_path / "fk" / "ckpt-000002.gguf"],
                 tmp_path)
    _one_line_error(r, "a finetune-lora checkpoint", "`ggtrain finetune --resume` continues it")
    # another text: the run's data is checked before anything trains
    other = tmp_path / "other.txt"
    other.write_text(text.read_text()[::-1])
    r = _ggtrain(["train", "--data", other, "--out", tmp_path / "x.gguf", "--resume", ck / "ckpt-000002.gguf"],
                 tmp_path)
    _one_line_error(r, "is not the data this checkpoint was trained on")
