"""--config FILE: a training command's options from a TOML file or from a run's log (layer 6).

The keys are the command's long options without the dashes (`lr = 3e-4`, `kv-heads = 2`,
`checkpointing = false`); they become the options' defaults, so the command line overrides
them. A --log file (.jsonl) works too: its first line records the options a run was started
with (`config_record`), so `--config RUN.jsonl` repeats that run.
"""
from __future__ import annotations

import json
import pathlib

import typer

from ggtrain import __version__
from ggtrain.errors import ConfigError

try:
    import tomllib
except ModuleNotFoundError:      # Python 3.10: the same parser as a package (a declared dependency)
    import tomli as tomllib


def _is_option(p) -> bool:
    """An option other than --config (Typer vendors its own click: no isinstance on click's classes)."""
    return getattr(p, "param_type_name", None) == "option" and "--config" not in p.opts


def _long_names(command) -> dict:
    """{long option name without dashes: parameter name} of the command (--config aside)."""
    names = {}
    for p in command.params:
        if _is_option(p):
            for opt in p.opts:
                if opt.startswith("--"):
                    names[opt[2:]] = p.name
    return names


def _read(path: pathlib.Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except (IsADirectoryError, UnicodeDecodeError, OSError) as exc:
        raise ConfigError(f"--config {path}: cannot read it ({exc})") from None
    if path.suffix in (".jsonl", ".json"):
        first = text.split("\n", 1)[0]
        try:
            record = json.loads(first)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--config {path}: its first line is not JSON ({exc})") from None
        if not isinstance(record, dict) or record.get("event") != "config":
            raise ConfigError(f"--config {path}: its first line is not the options record of a --log file")
        return record.get("options") or {}
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config {path}: not valid TOML ({exc})") from None


def load_config(ctx: typer.Context, param: typer.CallbackParam, value):
    """Callback of the eager --config option: its keys become the other options' defaults."""
    if value is None:
        return None
    path = pathlib.Path(value)
    table = _read(path)
    names = _long_names(ctx.command)
    defaults = {}
    for key, v in table.items():
        if key not in names:
            raise ConfigError(f"--config {path}: unknown key {key!r}; the keys are the long options of "
                              f"`{ctx.command_path}` ({', '.join(sorted(names))})")
        if isinstance(v, (dict, list)):
            raise ConfigError(f"--config {path}: {key} must be a single value, got {v!r}")
        defaults[names[key]] = v
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return path


def config_record(ctx: typer.Context) -> dict:
    """The log's first line: {"event": "config", "command", "version", "options"} with every
    option the command ran with (long names; unset ones, None, left out), which --config
    reads back."""
    options = {}
    for p in ctx.command.params:
        if not _is_option(p) or p.name not in ctx.params:
            continue
        value = ctx.params[p.name]
        if value is None:
            continue
        long = next((o[2:] for o in p.opts if o.startswith("--")), p.name)
        options[long] = str(value) if isinstance(value, pathlib.PurePath) else value
    names, c = [], ctx
    while c.parent is not None:     # "train", "mnist train": the command without the program name
        names.append(c.info_name)
        c = c.parent
    return {"event": "config", "command": " ".join(reversed(names)), "version": __version__,
            "options": options}
