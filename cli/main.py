"""The `ggtrain` command line (layer 6): the Typer app, error mapping and exit codes.

Each command lives in its own module and registers itself on `app` in `_register`.
Errors: a GgtrainError (or a missing/unreadable file) prints one line on stderr and exits 1 (`--debug` or
GGTRAIN_DEBUG=1 adds the traceback); usage errors exit 2 as Typer does; any other
exception is a bug and shows its traceback.
"""
from __future__ import annotations

import os
import sys
import traceback

import typer

from ggtrain import __version__
from ggtrain.errors import GgtrainError

app = typer.Typer(
    name="ggtrain",
    help="Train and fine-tune GGUF models from the command line (llama from scratch, LoRA, MNIST).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

_state = {"debug": False}


def _version(value: bool):
    if value:
        typer.echo(f"ggtrain {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks of errors (also GGTRAIN_DEBUG=1)."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
):
    """ggtrain: train and fine-tune GGUF models on a C kernel core."""
    _state["debug"] = debug or os.environ.get("GGTRAIN_DEBUG") == "1"


def _register() -> None:
    """Import the command modules; each adds its commands to `app`."""
    from ggtrain.cli import finetune  # noqa: F401  (ggtrain finetune)
    from ggtrain.cli import generate  # noqa: F401  (ggtrain generate, ggtrain eval)
    from ggtrain.cli import info  # noqa: F401  (ggtrain info)
    from ggtrain.cli import mnist  # noqa: F401  (ggtrain mnist train|eval)
    from ggtrain.cli import plot  # noqa: F401  (ggtrain plot)
    from ggtrain.cli import tokenize  # noqa: F401  (ggtrain tokenize)
    from ggtrain.cli import train  # noqa: F401  (ggtrain train)


def main(argv: list | None = None) -> None:
    """Entry point of the console script and `python -m ggtrain`."""
    _register()
    try:
        app(args=argv, standalone_mode=True)
    except SystemExit:
        raise
    except (GgtrainError, FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as exc:
        if _state["debug"] or os.environ.get("GGTRAIN_DEBUG") == "1":
            traceback.print_exc()
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
