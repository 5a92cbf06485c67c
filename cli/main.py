"""The `ggtrain` command line (layer 6): the Typer app, error mapping and exit codes.

Each command lives in its own module and registers itself on `app` in `_register`.
Errors: a GgtrainError (or a missing/unreadable file) prints one line on stderr and exits 1 (`--debug` or
GGTRAIN_DEBUG=1 adds the traceback); usage errors exit 2 as Typer does; any other
exception is a bug and shows its traceback. In a data-parallel run (mpiexec) the line names
the rank, and a process that fails ends every other one (MPI_Abort) instead of leaving them
waiting in the next all-reduce.
"""
from __future__ import annotations

import os
import sys
import time
import traceback

import typer
from typer import rich_utils
from typer._click.exceptions import BadParameter, ClickException, NoArgsIsHelpError
from typer.exceptions import Abort

from ggtrain import __version__
from ggtrain.core import distributed
from ggtrain.errors import GgtrainError

app = typer.Typer(
    name="ggtrain",
    help="Train and fine-tune GGUF models from the command line (models of any family from scratch, "
         "LoRA or full fine-tuning, MNIST).",
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


def canonical(argv: list) -> list:
    """argv with the aliases of other tools' option names replaced (cli/options.py ALIASES)."""
    from ggtrain.cli.options import canonical as replace
    return replace(argv)


def _register() -> None:
    """Import the command modules; each adds its commands to `app`."""
    # (in the order --help shows them: Train, Run, Files)
    from ggtrain.cli import train  # noqa: F401  (ggtrain train)
    from ggtrain.cli import finetune  # noqa: F401  (ggtrain finetune)
    from ggtrain.cli import mnist  # noqa: F401  (ggtrain mnist train|eval)
    from ggtrain.cli import generate  # noqa: F401  (ggtrain generate, ggtrain eval)
    from ggtrain.cli import convert  # noqa: F401  (ggtrain convert-checkpoint)
    from ggtrain.cli import imatrix  # noqa: F401  (ggtrain imatrix)
    from ggtrain.cli import info  # noqa: F401  (ggtrain info)
    from ggtrain.cli import tokenize  # noqa: F401  (ggtrain tokenize)
    from ggtrain.cli import plot  # noqa: F401  (ggtrain plot)


def _command():
    """The app as one Click command, every flag shown without a value in the help (Typer
    would show `<bool>` beside the flags a command declares without options.flag, and --help)."""
    root = typer.main.get_command(app)

    def walk(cmd):
        for p in cmd.params:
            if getattr(p, "is_flag", False):
                p.metavar = ""
        made = cmd.get_help_option

        def help_option(ctx, made=made):
            option = made(ctx)
            if option is not None:
                option.metavar = ""
            return option
        cmd.get_help_option = help_option
        for sub in getattr(cmd, "commands", {}).values():
            walk(sub)
    walk(root)
    return root


def _say(line: str) -> None:
    """One line on stderr in one write: under mpiexec the ranks' streams are merged, and a
    line written in pieces (print writes the text, then the newline) could take another
    process's output in its middle."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


# how Typer's parsing words a value that is not of the option's type -> ours (the value goes first)
_TYPE_WORDS = {"Input should be a valid number, unable to parse string as a number": "not a number",
               "Input should be a valid integer, unable to parse string as an integer": "not a whole number",
               "Input should be a valid integer, got a number with a fractional part": "not a whole number"}


def _given(param, args: list):
    """The value the command line gave the option `param` (its last occurrence), or None."""
    value = None
    for i, arg in enumerate(args):
        for name in getattr(param, "opts", []) + getattr(param, "secondary_opts", []):
            if arg == name and i + 1 < len(args):
                value = args[i + 1]
            elif arg.startswith(name + "="):
                value = arg[len(name) + 1:]
    return value


def usage_line(exc: ClickException, args: list) -> str:
    """A usage error's one line: Click's, with the value a bad option was given in it (Typer's
    type errors leave it out: "--lr abc" said "Input should be a valid number") and without the
    "Value error, " Typer puts before a choice's list."""
    message = exc.format_message()
    if type(exc) is not BadParameter or exc.param is None or getattr(exc.param, "is_flag", False):
        return message
    words = exc.message.removeprefix("Value error, ")
    value = _given(exc.param, args)
    if value is not None and words in _TYPE_WORDS:
        words = f"{value!r} is {_TYPE_WORDS[words]}"
    elif value is not None and words.startswith("Input should be "):    # a bound: "... greater than ..."
        words = f"{value!r} should be {words.removeprefix('Input should be ')}"
    elif value is not None and repr(value) not in words:
        words = f"{value!r}: {words}"
    return message.replace(exc.message, words)


def _run(args: list) -> None:
    """The app on args; a usage error (a bad option or value) is one line too, with Click's
    status 2 (rather than its box drawn over a dozen lines)."""
    try:
        code = _command()(args=args, standalone_mode=False, prog_name="ggtrain")
    except ClickException as exc:
        if isinstance(exc, NoArgsIsHelpError):     # `ggtrain` alone: the help, as Typer shows it
            rich_utils.rich_format_error(exc)
        else:
            _say(f"error: {usage_line(exc, args)}")
        sys.exit(exc.exit_code)
    except Abort:
        sys.exit(1)
    if isinstance(code, int) and code:
        sys.exit(code)


def main(argv: list | None = None) -> None:
    """Entry point of the console script and `python -m ggtrain`."""
    distributed.supervise(sys.argv[1:] if argv is None else list(argv))
    _register()
    try:
        _run(canonical(sys.argv[1:] if argv is None else list(argv)))
    except SystemExit as exc:
        # every process stops together with 0 or 130 (Ctrl-C); any other status is this one
        # alone (e.g. Click's answer to a KeyboardInterrupt outside the training loop)
        world = distributed.started()
        if world is not None and exc.code not in (None, 0, 130):
            _say(f"error: rank {world.rank}: stopped with status {exc.code}")
            world.abort(exc.code if isinstance(exc.code, int) else 1)
        raise
    except (GgtrainError, FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as exc:
        if _state["debug"] or os.environ.get("GGTRAIN_DEBUG") == "1":
            traceback.print_exc()
        world = distributed.started()
        _say(f"error: {'' if world is None else f'rank {world.rank}: '}{exc}")
        if world is not None:
            world.abort(1)
        sys.exit(1)
    except BaseException as exc:   # a bug: its traceback, and no process left waiting
        world = distributed.started()
        if world is None:
            raise
        if type(exc).__module__.startswith("mpi4py"):
            # an MPI error here is most often a peer that died: its supervisor names it, given
            # a moment before this abort ends every process
            time.sleep(1.0)
        traceback.print_exc()
        _say(f"error: rank {world.rank}: {type(exc).__name__}: {exc}")
        world.abort(1)
