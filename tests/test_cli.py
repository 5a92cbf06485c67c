"""The command line: help, version, error mapping."""
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from ggtrain.cli.main import _register, app

runner = CliRunner()


def test_help_lists_usage():
    _register()
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    assert "Usage" in result.output and "ggtrain" in result.output


def test_every_command_has_help():
    _register()
    import typer.main
    group = typer.main.get_command(app)
    for name in getattr(group, "commands", {}):
        result = runner.invoke(app, [name, "--help"])
        assert result.exit_code == 0, f"`ggtrain {name} --help` failed: {result.output}"


def test_model_commands_name_every_family_they_run():
    """finetune, generate, eval and train --arch say which families they take, from the family
    registry (a family added is named without touching the help texts)."""
    from ggtrain.core.models.families import FAMILIES
    _register()
    for args in (["finetune", "--help"], ["generate", "--help"], ["eval", "--help"], ["train", "--help"]):
        out = " ".join(runner.invoke(app, args, terminal_width=400).output.split())
        assert all(arch in out for arch in FAMILIES), (args, out[:300])
    top = runner.invoke(app, ["--help"], terminal_width=400).output
    assert "a llama" not in top and "llama model" not in top


def test_python_dash_m_and_version():
    out = subprocess.run([sys.executable, "-m", "ggtrain", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("ggtrain ")


def test_unknown_option_is_a_usage_error():
    out = subprocess.run([sys.executable, "-m", "ggtrain", "--no-such-option"], capture_output=True, text=True)
    assert out.returncode == 2


def test_backend_cuda_says_why_it_cannot_run(tmp_path):
    """Every command with --backend refuses cuda with one line naming what is missing (the
    CUDA library where nvcc was absent at install, the driver or a device on a CPU-only
    machine)."""
    from ggtrain.core.backend_cuda import library_path, unavailable_reason

    reason = unavailable_reason()
    if reason is None:
        pytest.skip("this machine can run the CUDA backend")
    assert ("no CUDA library" in reason) == (library_path() is None)
    assert "no NVIDIA driver" in reason or "no CUDA device" in reason or "CUDA" in reason
    text = tmp_path / "t.txt"
    text.write_text("hello world " * 50)
    model = tmp_path / "m.gguf"
    for args in (["train", "--data", str(text), "--out", str(tmp_path / "o.gguf")],
                 ["finetune", "--model", str(model), "--data", str(text), "--out", str(tmp_path / "a.gguf")],
                 ["mnist", "train", "--out", str(tmp_path / "n.gguf")],
                 ["generate", "--model", str(model), "--prompt", "x"],
                 ["eval", "--model", str(model), "--data", str(text)]):
        r = subprocess.run([sys.executable, "-m", "ggtrain", *args, "--backend", "cuda"], capture_output=True,
                           text=True)
        assert r.returncode == 1, args
        assert r.stderr == f"error: --backend cuda: not available: {reason}\n", (args, r.stderr)
    r = subprocess.run([sys.executable, "-m", "ggtrain", "train", "--out", "x.gguf", "--backend", "tpu"],
                       capture_output=True, text=True)
    # a value that is not a choice is a usage error (exit 2) that lists the choices
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "'tpu' is not one of 'cpu', 'cuda', 'cuda-tf32', 'cuda-bf16'" in r.stderr
    for backend in ("cuda-tf32", "cuda-bf16"):
        r = subprocess.run([sys.executable, "-m", "ggtrain", "train", "--out", "x.gguf", "--backend", backend],
                           capture_output=True, text=True)
        assert r.returncode == 1 and r.stderr == f"error: --backend {backend}: not available: {reason}\n", r.stderr


@pytest.mark.parametrize("args, line", [
    (["train", "--lr", "abc"], "Invalid value for '--lr': 'abc' is not a number"),
    (["train", "--lr=abc"], "Invalid value for '--lr': 'abc' is not a number"),
    (["train", "--steps", "1.5"], "Invalid value for '--steps': '1.5' is not a whole number"),
    (["train", "--batch", "0"], "Invalid value for '--batch': '0' should be greater than or equal to 1"),
    (["finetune", "--method", "ppo"], "Invalid value for '--method': 'ppo' is not one of 'sft', 'dpo', 'orpo'."),
])
def test_a_bad_value_is_one_line_that_shows_it(capsys, args, line):
    """A value the option's type or bounds refuse is a usage error (status 2) whose one line
    echoes the value given, in plain words (Typer's said "Input should be a valid number" without
    the value, and "Value error, " before a choice's list)."""
    from ggtrain.cli import main
    main._register()
    with pytest.raises(SystemExit) as exit_:
        main._run(args)
    assert exit_.value.code == 2
    assert capsys.readouterr().err == f"error: {line}\n"
