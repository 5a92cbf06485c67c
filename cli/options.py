"""The command line's options, declared once (layer 6): the help panels they are grouped in,
the choice types (shown as [a|b|c], a wrong value a usage error listing them), the options the
training commands share (one name, one meaning, one declaration), and the aliases users type
from other tools (llama.cpp's finetune and CLI).

An option whose default differs between commands is a function (opt_<name>) taking the command's
default and the reason for it (stated in its help); the others are constants. A choice option's value reaches
the command as the plain string (its callback unwraps the Enum).
"""
from __future__ import annotations

import enum
import pathlib

import typer

from ggtrain.cli.common import BACKENDS
from ggtrain.cli.config import load_config
from ggtrain.core.numerics import EXACT, LLAMA, NUMERICS
from ggtrain.core.optim import OPTIMIZERS
from ggtrain.errors import ConfigError

# help panels, in the order a command's help shows them
MODEL, DATA, LORA, OBJECTIVE = "Model and output", "Data", "LoRA", "Objective"
OPTIMIZATION, EVALUATION, CHECKPOINTS, RUNTIME = "Optimization", "Evaluation", "Checkpoints", "Runtime"
SAMPLING = "Sampling"

# what each training command's checkpoint may be continued by --resume
SAVE_ERRORS = ("stop", "continue")

# the options other tools call by another name: alias -> the name ggtrain declares (each said
# in that option's help)
ALIASES = {"--train-data": "--data", "--lora-out": "--out", "--output-adapter": "--out",
           "--lora-modules": "--lora-targets", "--n-tokens": "-n"}


def canonical(argv: list) -> list:
    """argv with every alias (also as --alias=value) replaced by the option it stands for."""
    out = []
    for arg in argv:
        name, eq, value = arg.partition("=")
        if name in ALIASES:
            arg = ALIASES[name] + eq + value
        out.append(arg)
    return out


def choices(name: str, values) -> type:
    """An Enum of string values for an option whose value is one of them."""
    return enum.Enum(name, {v: v for v in values}, type=str)


def _value(value):
    """A choice option's callback: the chosen string, not the Enum member."""
    return value.value if isinstance(value, enum.Enum) else value


def choice(default, *names, values, help: str, panel: str, name: str | None = None, **kw):
    """An option whose value is one of `values`: (its Enum type, the option). A command
    annotates its parameter with the type (for the help's [a|b]) and receives a string."""
    kind = choices(name or names[0].lstrip("-").title().replace("-", ""), values)
    return kind, typer.Option(default, *names, help=help, rich_help_panel=panel, callback=_value, **kw)


def flag(default: bool, *names, help: str, panel: str, **kw):
    """A flag (no value shown in the help's value column)."""
    return typer.Option(default, *names, help=help, rich_help_panel=panel, metavar="", **kw)


# ---- the training commands' options (train, finetune, mnist train) -----------------------------

Optimizer, OPTIMIZER = choice("adamw", "--optimizer", values=OPTIMIZERS, panel=OPTIMIZATION,
                              help="lbfgs: each update a line search of several forward and backward runs on "
                                   "one batch (for full or large batches); --lr is then its first trial step.")
OnSaveError, ON_SAVE_ERROR = choice("stop", "--on-save-error", values=SAVE_ERRORS, panel=RUNTIME,
                                    help="When a checkpoint cannot be written: stop (naming the last checkpoint to "
                                         "resume from) or continue with a warning.")
Backend, BACKEND = choice("cpu", "--backend", values=tuple(BACKENDS), panel=RUNTIME, metavar="NAME",
                          help="cpu (its threads); cuda (one GPU, exact f32), cuda-tf32 (TF32 products: about 2x "
                               "faster, ~1e-3 relative error) or cuda-bf16 (bf16 products, ~1e-2).")
STEPS = typer.Option(None, "--steps", rich_help_panel=OPTIMIZATION, show_default=False,
                     help="Optimizer updates (instead of --epochs).")
GRAD_ACC = typer.Option(1, "--grad-acc", min=1, rich_help_panel=OPTIMIZATION,
                        help="Micro-batches (of --batch windows) per update: their gradients add up.")
MOMENTUM = typer.Option(0.0, "--momentum", rich_help_panel=OPTIMIZATION, help="SGD's momentum.")
GRAD_CLIP = typer.Option(None, "--grad-clip", rich_help_panel=OPTIMIZATION, show_default=False,
                         help="Clip the global gradient norm (0: off) (default: 1; 0 with lbfgs).")
MOE_AUX_LOSS = typer.Option(0.0, "--moe-aux-loss", rich_help_panel=OPTIMIZATION, show_default=False,
                            help="Routed-expert families: plus this times the routers' load-balancing loss (Switch "
                                 "Transformer's E * sum f_e P_e, 1 when balanced; e.g. 0.01); routers trained whole "
                                 "only (finetune: with --full) (default: off).")
LR_MIN = typer.Option(None, "--lr-min", rich_help_panel=OPTIMIZATION, show_default=False,
                      help="Floor of the cosine schedule (default: --lr / 10).")
WARMUP_HELP = ("Linear warmup: a fraction of the run (< 1) or a number of updates, then cosine decay (a "
               "warmup as long as the run leaves none)")
CHECKPOINTING = flag(True, "--checkpointing/--no-checkpointing", panel=CHECKPOINTS,
                     help="Gradient checkpointing: recompute each block's norms and FFN in backward (less memory, "
                          "10-15% more time).")
CHECKPOINT_DIR = typer.Option(None, "--checkpoint-dir", rich_help_panel=CHECKPOINTS, show_default=False,
                              help="Folder for resumable checkpoints.")
SAVE_EVERY = typer.Option(0, "--save-every", rich_help_panel=CHECKPOINTS,
                          help="A checkpoint every N updates (needs --checkpoint-dir).")
EVAL_EVERY = typer.Option(0, "--eval-every", rich_help_panel=EVALUATION,
                          help="Validation loss every N updates (0: at the end only).")
EARLY_STOP_PATIENCE = typer.Option(0, "--early-stop-patience", rich_help_panel=EVALUATION,
                                   help="Stop after N evaluations without improvement; keep the best model.")
MIN_DELTA = typer.Option(0.0, "--min-delta", rich_help_panel=EVALUATION,
                         help="What counts as an improvement for --early-stop-patience.")
THREADS = typer.Option(None, "--threads", rich_help_panel=RUNTIME, show_default=False,
                       help="CPU threads (default: every CPU this process may use).")
LOG = typer.Option(None, "--log", rich_help_panel=RUNTIME, show_default=False,
                   help="JSON lines of the run: options, steps, evaluations, the end (appended to on --resume).")
QUIET = flag(False, "--quiet", panel=RUNTIME, help="No progress bar.")
TOKEN_CACHE = typer.Option(None, "--token-cache", rich_help_panel=DATA, show_default=False,
                           help="Folder keeping tokenized data for later runs; none: keep nothing "
                                "(default: $GGTRAIN_TOKEN_CACHE, else $GGTRAIN_CACHE/tokens, else "
                                "~/.cache/ggtrain/tokens).")
CONFIG = typer.Option(None, "--config", is_eager=True, callback=load_config, rich_help_panel=RUNTIME,
                      show_default=False,
                      help="Options from a TOML file (keys: the long options) or a run's --log; the command line "
                           "overrides them.")


# ---- the commands that run a model (generate, eval, imatrix) --------------------------------

def opt_numerics(default_words: str, llama_words: str):
    """--numerics (its Enum type, the option): default_words say whose default exact is,
    llama_words what llama.cpp's numbers give the command and cost."""
    return choice(EXACT, "--numerics", values=NUMERICS, panel=RUNTIME,
                  help=f"{EXACT}: f32 as training computes ({default_words}). {LLAMA}: llama.cpp's CPU build bit "
                       f"for bit ({llama_words}.")


CacheType, CACHE_TYPE = choice("f16", "--cache-type", values=("f16", "f32"), panel=RUNTIME,
                               help="The KV cache --numerics llama assumes: f16 (llama.cpp's default) or f32.")


def opt_epochs(words: str):
    return typer.Option(None, "--epochs", rich_help_panel=OPTIMIZATION, show_default=False,
                        help=f"Passes over the training data (instead of --steps) (default: {words}).")


def opt_batch(default: int, words: str):
    """--batch, its help the command's own sentence (what a batch holds differs: windows a
    micro-batch for train and finetune, images an update for mnist)."""
    return typer.Option(default, "--batch", min=1, rich_help_panel=OPTIMIZATION, help=words)


def opt_lr(words: str):
    return typer.Option(None, "--lr", rich_help_panel=OPTIMIZATION, show_default=False,
                        help=f"Peak learning rate (default: {words}; 1 with lbfgs).")


def opt_warmup(default: float):
    return typer.Option(default, "--warmup", rich_help_panel=OPTIMIZATION, help=WARMUP_HELP + ".")


def opt_weight_decay(words: str):
    return typer.Option(None, "--weight-decay", rich_help_panel=OPTIMIZATION, show_default=False,
                        help=f"Decay of the matrices (AdamW decoupled, SGD L2) (default: {words}; 0 with lbfgs).")


def opt_val_split(default: float, why: str):
    return typer.Option(default, "--val-split", rich_help_panel=EVALUATION,
                        help=f"Fraction of the data held out for validation ({why}).")


def opt_seed(what: str):
    return typer.Option(0, "--seed", rich_help_panel=RUNTIME, help=f"Seed of {what}.")


def opt_resume(what: str):
    return typer.Option(None, "--resume", rich_help_panel=CHECKPOINTS, show_default=False,
                        help=f"Continue from a checkpoint ({what}).")


def opt_out(help: str, panel: str = MODEL):
    return typer.Option(..., "--out", rich_help_panel=panel, show_default=False, help=help)


def opt_imatrix(panel: str):
    return typer.Option(None, "--imatrix", rich_help_panel=panel, show_default=False, metavar="FILE",
                        help="With --out-type: quantize as llama-quantize --imatrix FILE does, each matrix's "
                             "scales weighted by its columns' importance (llama-imatrix's file, GGUF or legacy "
                             ".dat; a matrix without an entry is quantized without, as llama.cpp does).")


def warmup_updates(value: float, steps: int) -> int:
    """--warmup in updates: a fraction of the run's steps (< 1) or a count."""
    return int(round(value * steps)) if 0 <= value < 1 else int(value)


def path_help(path: pathlib.Path | None) -> str:
    """A path as help texts show it (relative when under the working folder)."""
    if path is None:
        return "none"
    try:
        return str(path.relative_to(pathlib.Path.cwd()))
    except ValueError:
        return str(path)


# the task file's format, for eval --task and finetune --eval-task alike
HELLASWAG = typer.Option(False, "--hellaswag", rich_help_panel=EVALUATION, help="The task file (--task, --eval-task) is llama-perplexity's "
                         "HellaSwag file (6 lines an item).")
WINOGRANDE = typer.Option(False, "--winogrande", rich_help_panel=EVALUATION, help="The task file (--task, --eval-task) is llama-perplexity's "
                          "Winogrande CSV.")


def task_format(hellaswag: bool, winogrande: bool, task, option: str) -> str:
    """The format (formats.tasks.FORMATS) --hellaswag / --winogrande name for the task file of
    `option`; ConfigError when both are given, or one without a task file."""
    if (hellaswag or winogrande) and task is None or hellaswag and winogrande:
        raise ConfigError(f"--hellaswag and --winogrande say what {option} holds (one of them)")
    return "hellaswag" if hellaswag else "winogrande" if winogrande else "jsonl"
