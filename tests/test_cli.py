"""The command line: help, version, error mapping."""
import subprocess
import sys

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


def test_python_dash_m_and_version():
    out = subprocess.run([sys.executable, "-m", "ggtrain", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("ggtrain ")


def test_unknown_option_is_a_usage_error():
    out = subprocess.run([sys.executable, "-m", "ggtrain", "--no-such-option"], capture_output=True, text=True)
    assert out.returncode == 2
