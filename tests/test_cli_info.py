"""`ggtrain info`: text and JSON output, and one-line errors with exit status 1."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ggtrain.cli.main import _register, app
from ggtrain.formats.gguf_writer import GGUFWriter
from tests import gguf_craft as craft

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()
_register()


def _info(*args):
    return runner.invoke(app, ["info", *map(str, args)])


def _cli(*args):
    """Run the real console entry point (main's error mapping included)."""
    return subprocess.run([sys.executable, "-m", "ggtrain", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def test_text_output(shared_data):
    path = shared_data / "gguf" / "stories260K-Q8_0.gguf"
    r = _info(path)
    assert r.exit_code == 0, r.output
    out = r.output
    assert "GGUF v3" in out and "48 tensors" in out and "alignment 32" in out
    assert "llama.attention.head_count_kv" in out and "UINT32" in out
    assert "llama.attention.layer_norm_rms_epsilon  FLOAT32" in out and "1e-05" in out
    assert 'STRING[512]' in out and '"<unk>", "<s>", "</s>"' in out        # long array summarised
    assert "blk.0.ffn_down.weight" in out and "(64, 172)" in out            # numpy order
    assert "Q8_0" in out and "total: 48 tensors" in out


def test_json_output(shared_data):
    path = shared_data / "gguf" / "stories260K-Q4_0.gguf"
    r = _info(path, "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["n_tensors"] == 48 == len(data["tensors"])
    assert data["version"] == 3
    assert data["kv"]["llama.block_count"] == 5
    assert data["kv"]["general.architecture"] == "llama"
    assert data["kv"]["llama.attention.layer_norm_rms_epsilon"] == 1e-05
    tokens = data["kv"]["tokenizer.ggml.tokens"]
    assert tokens["length"] == 512 and tokens["item_type"] == "STRING" and tokens["head"][:2] == ["<unk>", "<s>"]
    by_name = {t["name"]: t for t in data["tensors"]}
    assert by_name["token_embd.weight"] == {"name": "token_embd.weight", "type": "Q4_0", "shape": [512, 64],
                                            "nbytes": 18432, "offset": by_name["token_embd.weight"]["offset"]}
    assert by_name["blk.0.ffn_down.weight"]["type"] == "F16"
    assert data["tensor_bytes"] == sum(t["nbytes"] for t in data["tensors"])
    full = json.loads(_info(path, "--json", "--max-items", "0").output)
    assert len(full["kv"]["tokenizer.ggml.tokens"]) == 512


def test_vocab_only_file(shared_data):
    path = shared_data / "gguf" / "ggml-vocab-gpt-2.gguf"
    r = _info(path)
    assert r.exit_code == 0 and "no tensors" in r.output and "STRING[50000]" in r.output
    data = json.loads(_info(path, "--json").output)
    assert data["n_tensors"] == 0 and data["tensors"] == []
    assert data["kv"]["tokenizer.ggml.merges"]["length"] == 50000


def test_written_file_with_every_value_kind(tmp_path):
    path = tmp_path / "w.gguf"
    with GGUFWriter(path) as w:
        w.add_kv("s.empty", "")
        w.add_kv("a.empty", [], item_type=4)
        w.add_kv("f.nan", float("nan"))
        w.add_kv("b", True)
        w.add_kv("s.multi", "line one\nline two")
        w.add_tensor_info("x", (2, 32), "Q8_0")
        w.write_tensor("x", np.ones((2, 32), np.float32))
    r = _info(path)
    assert r.exit_code == 0, r.output
    assert '""' in r.output and "UINT32[0]" in r.output and "\\n" in r.output
    data = json.loads(_info(path, "--json").output)
    assert data["kv"]["s.empty"] == "" and data["kv"]["a.empty"] == [] and data["kv"]["b"] is True
    assert data["kv"]["f.nan"] == "nan"


@pytest.mark.parametrize("content,message", [
    (None, "no such file"),
    (b"hello, world, this is not a model file at all", "not a GGUF file"),
    (craft.f32_tensor_file(16)[:-40], "run past the end"),
    (b"GGUF" + b"\x03\0\0\0" + b"\xff" * 16, "cannot fit"),
])
def test_errors_are_one_line_and_exit_1(tmp_path, content, message):
    path = tmp_path / "bad.gguf"
    if content is not None:
        path.write_bytes(content)
    r = _cli("info", path)
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(path) in lines[0], r.stderr
    assert message in lines[0]
    assert "Traceback" not in r.stderr


def test_directory_and_usage_errors(tmp_path):
    r = _cli("info", tmp_path)
    assert r.returncode == 1 and "directory" in r.stderr and "Traceback" not in r.stderr
    assert _cli("info").returncode == 2
