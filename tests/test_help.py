"""Every command's --help reads at 80 columns: no option name cut (rich ellipsises a name that
does not fit its column), every option's names shown whole, the training commands' options in
their panels, one stated default per option."""
import os
import re
import subprocess
import sys

import pytest
import typer

from ggtrain.cli.main import _register, app

_register()


def _commands(group=app, prefix=()) -> list:
    """(command path, click command) of every command, nested groups included."""
    cmd = typer.main.get_command(group)
    out = []

    def walk(c, path):
        subs = getattr(c, "commands", None)
        if subs:
            for name, sub in subs.items():
                walk(sub, path + (name,))
        else:
            out.append((path, c))
    walk(cmd, prefix)
    return out


COMMANDS = _commands()


def _help(path) -> str:
    env = dict(os.environ, COLUMNS="80", TERM="dumb")
    r = subprocess.run([sys.executable, "-m", "ggtrain", *path, "--help"], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.parametrize("path, command", COMMANDS, ids=[" ".join(p) for p, _ in COMMANDS])
def test_help_at_80_columns_shows_every_option_whole(path, command):
    text = _help(path)
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "…" not in text, text
    assert "<bool>" not in text, text        # flags (and --help) show no value
    for p in command.params:
        if getattr(p, "hidden", False) or p.param_type_name != "option":
            continue
        for name in p.opts + p.secondary_opts:
            assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text), (name, text)
        # a default stated once: not both Typer's [default: x] and one in the text
        assert not (p.show_default and p.default is not None and "(default:" in (p.help or "")), p.opts


@pytest.mark.parametrize("path", [("train",), ("finetune",), ("mnist", "train")])
def test_training_options_are_grouped_in_panels(path):
    """Only --help is left in the generic "Options" panel of a training command."""
    text = _help(path)
    generic = text.split("╭─ Options")[1].split("╰")[0] if "╭─ Options" in text else ""
    names = re.findall(r"(--[\w-]+)", generic)
    assert names == ["--help"], names
