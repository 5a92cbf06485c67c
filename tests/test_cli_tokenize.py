"""`ggtrain tokenize`: output formats, options, and one-line errors.

Oracles: llama.cpp's recorded test vectors (../shared/data/gguf/ggml-vocab-*.gguf.inp/.out)
and the recorded stories260K ids of ../shared/data/README.md. Agreement with a live
llama.cpp on every vocabulary is in tests/test_tokenize_interop.py.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGUFValueType as VT
from typer.testing import CliRunner

from ggtrain.cli.main import _register, app, main
from ggtrain.formats.gguf import read_gguf, write_gguf

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()
_register()


def _tokenize(*args):
    return runner.invoke(app, ["tokenize", *map(str, args)])


def _main(capsys, *args):
    """Run main() (the console entry point, with its error mapping) in this process."""
    with pytest.raises(SystemExit) as e:
        main(["tokenize", *map(str, args)])
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def _vectors(shared_data, name):
    raw = (shared_data / "gguf" / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8")
    inp = raw.split("\n__ggml_vocab_test__\n")
    lines = (shared_data / "gguf" / f"ggml-vocab-{name}.gguf.out").read_text().split("\n")
    return inp[:46], [[int(x) for x in line.split()] for line in lines[:46]]


@pytest.mark.parametrize("name", ["gpt-2", "llama-spm"])
def test_ids_are_llama_cpps_recorded_vectors(shared_data, tmp_path, name):
    # a sample (each run loads the vocabulary): the library is checked on all 46
    model = shared_data / "gguf" / f"ggml-vocab-{name}.gguf"
    inp, out = _vectors(shared_data, name)
    for k in range(1, 46, 6):
        text, want = inp[k], out[k]
        path = tmp_path / f"{k}.txt"
        path.write_bytes(text.encode("utf-8"))
        r = _tokenize("--model", model, "--file", path)
        assert r.exit_code == 0, r.output
        assert r.stdout == " ".join(map(str, want)) + "\n", repr(text)
    for k in (32, 43):                  # --text: "Hello, y'all! How are you 😁 ?我想在...", "Cửa Việt"
        want = " ".join(map(str, out[k])) + "\n"
        assert _tokenize("--model", model, "--text", inp[k]).stdout == want, repr(inp[k])


def test_json_is_one_object(shared_data):
    model = shared_data / "gguf" / "ggml-vocab-gpt-2.gguf"
    inp, out = _vectors(shared_data, "gpt-2")
    for text, want in zip(inp[10:13], out[10:13]):
        r = _tokenize("--model", model, "--text", text, "--json")
        assert r.exit_code == 0 and r.stdout.count("\n") == 1
        assert json.loads(r.stdout) == {"ids": want}


def test_bos_is_what_the_vocabulary_asks_for(shared_data):
    # README: llama.cpp (sentencepiece too) gives [403, 407, 261, 378], BOS is 1, add_bos true
    model = shared_data / "gguf" / "stories260K.gguf"
    assert _tokenize("--model", model, "--text", "Once upon a time").stdout == "403 407 261 378\n"
    r = _tokenize("--model", model, "--text", "Once upon a time", "--bos", "--json")
    assert json.loads(r.stdout) == {"ids": [1, 403, 407, 261, 378]}
    # gpt-2's vocabulary does not ask for BOS (no add_bos_token), so llama.cpp adds none
    gpt2 = shared_data / "gguf" / "ggml-vocab-gpt-2.gguf"
    assert _tokenize("--model", gpt2, "--text", "Hello", "--bos").stdout == \
        _tokenize("--model", gpt2, "--text", "Hello").stdout


def test_special_tokens_only_with_special(shared_data):
    # README: SmolLM2's BOS, id 1, is "<|im_start|>"; its EOS, id 2, "<|im_end|>"
    model = shared_data / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    text = "<|im_start|>user\nHi<|im_end|>"
    plain = json.loads(_tokenize("--model", model, "--text", text, "--json").stdout)["ids"]
    parsed = json.loads(_tokenize("--model", model, "--text", text, "--json", "--special").stdout)["ids"]
    assert 1 not in plain and 2 not in plain and len(plain) > len(parsed)
    assert parsed[0] == 1 and parsed[-1] == 2 and 1 not in parsed[1:-1]
    hi = json.loads(_tokenize("--model", model, "--text", "user\nHi", "--json").stdout)["ids"]
    assert parsed == [1] + hi + [2]


def test_empty_text(shared_data):
    r = _tokenize("--model", shared_data / "gguf" / "ggml-vocab-gpt-2.gguf", "--text", "", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout) == {"ids": []}


def _no_vocab(tmp_path):
    path = tmp_path / "novocab.gguf"
    write_gguf(path, [("general.architecture", "llama", VT.STRING)], [])
    return path


def _unsupported_pre(tmp_path, shared_data):
    f = read_gguf(shared_data / "gguf" / "ggml-vocab-gpt-2.gguf")
    kv = dict(f.kv)
    del kv["tokenizer.ggml.pre"]
    path = tmp_path / "kimi.gguf"
    write_gguf(path, list(kv.items()) + [("tokenizer.ggml.pre", "kimi-k2", VT.STRING)], [])
    return path


@pytest.mark.parametrize("case,message", [
    ("missing model", "--model {model}: no such file"),
    ("model is a directory", "--model {model}: is a directory"),
    ("not a GGUF", "{model}: not a GGUF file"),
    ("no vocabulary", "{model}: no tokenizer vocabulary"),
    ("WPM vocabulary", "{model}: tokenizer.ggml.model 'bert' is not supported"),
    ("unsupported pre", "{model}: tokenizer.ggml.pre 'kimi-k2' is not supported"),
    ("text and file", "give exactly one of --text and --file"),
    ("neither text nor file", "give exactly one of --text and --file"),
    ("missing file", "--file {file}: no such file"),
    ("file not UTF-8", "{file} line 1 column 4: not UTF-8 (byte 0xe9)"),
    ("file is Parquet", "{file}: a Parquet file (name it .parquet to read its records), not text"),
])
def test_errors_are_one_line_and_exit_1(capsys, tmp_path, shared_data, case, message):
    model = shared_data / "gguf" / "ggml-vocab-gpt-2.gguf"
    file = tmp_path / "text.txt"
    file.write_text("some text\n")
    args = ["--text", "hello"]
    if case == "missing model":
        model = tmp_path / "nope.gguf"
    elif case == "model is a directory":
        model = tmp_path
    elif case == "not a GGUF":
        model = tmp_path / "junk.gguf"
        model.write_bytes(b"this is not a model file at all, just some bytes")
    elif case == "no vocabulary":
        model = _no_vocab(tmp_path)
    elif case == "WPM vocabulary":
        model = shared_data / "gguf" / "ggml-vocab-bert-bge.gguf"
    elif case == "unsupported pre":
        model = _unsupported_pre(tmp_path, shared_data)
    elif case == "text and file":
        args = ["--text", "hello", "--file", file]
    elif case == "neither text nor file":
        args = []
    elif case == "missing file":
        file = tmp_path / "nope.txt"
        args = ["--file", file]
    elif case == "file not UTF-8":
        file.write_bytes(b"caf\xe9 latin-1\n")
        args = ["--file", file]
    elif case == "file is Parquet":
        file.write_bytes(b"PAR1\x15\x04\x15\xa0\x01")
        args = ["--file", file]
    code, out, err = _main(capsys, "--model", model, *args)
    lines = err.strip().splitlines()
    assert code == 1 and out == "", err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert message.format(model=model, file=file) in lines[0]


def test_usage_errors_exit_2(capsys, shared_data):
    code, _, err = _main(capsys, "--text", "hello")          # --model is required
    assert code == 2 and "--model" in err


def test_console_script(shared_data, tmp_path):
    """The real entry point: ids on stdout; an error is one line on stderr, exit 1."""
    model = shared_data / "gguf" / "ggml-vocab-llama-spm.gguf"
    inp, out = _vectors(shared_data, "llama-spm")
    r = subprocess.run([sys.executable, "-m", "ggtrain", "tokenize", "--model", str(model), "--text", inp[5]],
                       capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 0 and r.stdout == " ".join(map(str, out[5])) + "\n", r.stderr
    r = subprocess.run([sys.executable, "-m", "ggtrain", "tokenize", "--model", str(tmp_path / "x.gguf"),
                        "--text", "a"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
