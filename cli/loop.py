"""What the training commands share (layer 6): their common options (declared once), the
optimizer's defaults, and around a TextRun (`train`, `finetune`) the progress bar, the JSONL
log, periodic and final checkpoints, Ctrl-C (one checkpoint, exit 130), the summary line.
In a data-parallel run only rank 0 shows progress and writes files."""
from __future__ import annotations

import pathlib
import sys
import time
from typing import Callable

import typer
from tqdm import tqdm

from ggtrain.cli.common import BACKENDS, JsonLog, stop_on_ctrl_c
from ggtrain.cli.tasks import task_words
from ggtrain.cli.config import load_config
from ggtrain.core.fit import Run
from ggtrain.core.optim import OPTIMIZERS
from ggtrain.core.preference import METRICS
from ggtrain.errors import ConfigError, WriteError
from ggtrain.formats.checkpoint import Checkpoint, load_checkpoint
from ggtrain.formats.files import remove_stale_temporaries

STEP_FIELDS = ("step", "epoch", "loss", "lr", "grad_norm", "tokens_per_s", "samples_per_s", "elapsed_s")
SEARCH_FIELDS = ("evals", "step_size")   # L-BFGS: forward+backward runs and accepted step of an update
# preference objectives (DPO, ORPO): TRL's rewards of an update's pairs
PREFERENCE_FIELDS = METRICS

# The options `train` and `finetune` share, declared once (the ones whose defaults differ,
# --lr, --warmup, ..., are declared by each command).
GRAD_CLIP = typer.Option(None, "--grad-clip", help="Global gradient-norm clip (0: off; default 1, "
                         "0 with lbfgs).")
CHECKPOINTING = typer.Option(True, "--checkpointing/--no-checkpointing",
                             help="Gradient checkpointing: keep each block's attention, q, k, v and "
                                  "mid residual, recompute its norms and FFN in backward (less memory "
                                  "for ~10-15% more time).")
CHECKPOINT_DIR = typer.Option(None, "--checkpoint-dir", help="Folder for resumable checkpoints.")
SAVE_EVERY = typer.Option(0, "--save-every", help="Save a checkpoint every N updates (needs --checkpoint-dir).")
ON_SAVE_ERROR = typer.Option("stop", "--on-save-error",
                             help="When a checkpoint cannot be written (a full disk, a folder not writable): "
                                  "stop (one line naming the last checkpoint to --resume from) or continue "
                                  "(a warning, and the run goes on). The previous checkpoint is intact either way.")
SAVE_ERRORS = ("stop", "continue")
EVAL_EVERY = typer.Option(0, "--eval-every", help="Validation loss every N updates (0: at the end only).")
THREADS = typer.Option(None, "--threads", help="CPU threads (default: all available).")
BACKEND = typer.Option("cpu", "--backend", help="; ".join(f"{k}: {v[1]}" for k, v in BACKENDS.items()) + ".")
LOG = typer.Option(None, "--log", help="JSON lines: steps, evaluations, and a final summary.")
QUIET = typer.Option(False, "--quiet", help="No progress bar.")
TOKEN_CACHE = typer.Option(None, "--token-cache",
                           help="Folder where a plain-text --data file's tokens are kept, so later runs and "
                                "--resume skip tokenizing it (default: GGTRAIN_TOKEN_CACHE, else "
                                "$GGTRAIN_CACHE/tokens, else ~/.cache/ggtrain/tokens); none: keep no copy.")
# also `mnist train`'s
OPTIMIZER = typer.Option("adamw", "--optimizer",
                         help=f"{'|'.join(OPTIMIZERS)}. lbfgs: each update is a line search of several "
                              "forward+backward runs on the same batch (suits full or large batches); "
                              "--lr is its first trial step (default 1), no schedule, decay or clipping.")
MOMENTUM = typer.Option(0.0, "--momentum", help="SGD momentum.")
EARLY_STOP_PATIENCE = typer.Option(0, "--early-stop-patience",
                                   help="Stop when the validation loss has not improved for N evaluations "
                                        "and keep the best model (0: off).")
MIN_DELTA = typer.Option(0.0, "--min-delta", help="What counts as an improvement for --early-stop-patience.")
CONFIG = typer.Option(None, "--config", is_eager=True, callback=load_config,
                      help="Options from a TOML file (keys: the long options, e.g. lr = 3e-4, kv-heads = 2) "
                           "or from a run's --log; options on the command line override it.")

LR_LBFGS = 1.0   # the quasi-Newton step: L-BFGS's first trial step


def optimizer_settings(optimizer: str, lr: float | None, weight_decay: float | None,
                       grad_clip: float | None, lr_default: float, weight_decay_default: float) -> tuple:
    """(lr, weight decay, clip) for --optimizer: the command's defaults for adamw and sgd;
    for lbfgs lr 1 and neither decay nor clipping (given ones are refused by make_optimizer)."""
    if optimizer not in OPTIMIZERS:
        raise ConfigError(f"--optimizer {optimizer!r}: expected one of {', '.join(OPTIMIZERS)}")
    if optimizer == "lbfgs":
        return (LR_LBFGS if lr is None else lr, weight_decay or 0.0, grad_clip or 0.0)
    return (lr_default if lr is None else lr, weight_decay_default if weight_decay is None else weight_decay,
            1.0 if grad_clip is None else grad_clip)


def check_checkpoint_options(save_every: int, checkpoint_dir: pathlib.Path | None,
                             on_save_error: str = "stop") -> None:
    """--save-every needs --checkpoint-dir; the folder is created, and what killed saves left
    in it removed."""
    if on_save_error not in SAVE_ERRORS:
        raise ConfigError(f"--on-save-error {on_save_error}: expected {' or '.join(SAVE_ERRORS)}")
    if save_every < 0:
        raise ConfigError(f"--save-every must be >= 0, got {save_every}")
    if save_every and checkpoint_dir is None:
        raise ConfigError("--save-every needs --checkpoint-dir")
    if checkpoint_dir is not None:
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(checkpoint_dir)


# ---- the one resume path of train and finetune ------------------------------------------------

# the checkpoint kinds each command continues (a "model" checkpoint starts a new run in either)
RESUMES = {"train": ("train",), "finetune": ("finetune-lora", "finetune-full"), "mnist train": ("mnist",)}


def open_resume(resume: pathlib.Path | None, command: str) -> tuple:
    """(ckpt, start) of --resume: a checkpoint of this command's run to continue, or a model
    checkpoint (kind "model") to start a new run from with this command's options; (None,
    None) without --resume. A checkpoint another command continues is a ConfigError saying which."""
    if resume is None:
        return None, None
    ckpt = load_checkpoint(resume)
    if ckpt.kind == "model":
        if command == "mnist train":
            raise ConfigError(f"--resume {resume}: a language model's checkpoint; `mnist train --resume` "
                              f"continues an mnist checkpoint")
        return None, ckpt
    if ckpt.kind not in RESUMES[command]:
        other = next(c for c, kinds in RESUMES.items() if ckpt.kind in kinds)
        raise ConfigError(f"--resume {resume}: a {ckpt.kind} checkpoint; `ggtrain {other} --resume` continues it")
    return ckpt, None


def check_resume_data(ckpt: Checkpoint, fingerprint: str, resume: pathlib.Path, data) -> None:
    """The data is the run's: the same token ids (sha256) as when the checkpoint was written."""
    if ckpt.data_fingerprint != fingerprint:
        raise ConfigError(f"--resume {resume}: --data {data} is not the data this checkpoint was trained on")


def continue_run(run, batches, ckpt: Checkpoint) -> None:
    """Put the checkpoint's state into `run` and its batch source, so the run goes on exactly as
    the uninterrupted one would have."""
    run.load_state(ckpt.state)
    batches.set_state(ckpt.data_rng, drawn=run.drawn)


def _nothing(path: pathlib.Path) -> None:
    """The checkpoint writer of ranks other than 0."""


def check_out(out: pathlib.Path, option: str = "--out") -> None:
    """The folder of an output exists (what killed writes left in it is removed)."""
    if not out.parent.is_dir():
        raise ConfigError(f"{option} {out}: folder {out.parent} does not exist")
    remove_stale_temporaries(out.parent)


def eval_line(ev: dict) -> str:
    """A text run's line on an evaluation."""
    acc = (f", preference accuracy {ev['val_rewards_accuracy']:.3f}, reward margin "
           f"{ev['val_rewards_margin']:.3f}" if "val_rewards_accuracy" in ev else "")
    return f"step {ev['step']}: validation loss {ev['val_loss']:.4f}{acc}"


def drive(run: Run, batches, val_batches, *, log: JsonLog, quiet: bool, save_every: int,
          checkpoint_dir: pathlib.Path | None, out: pathlib.Path,
          checkpoint: Callable[[pathlib.Path], None], evaluate_task: Callable[[], dict] | None = None,
          on_save_error: str = "stop", resumed_from: pathlib.Path | None = None,
          describe_eval: Callable[[dict], str] = eval_line, evals_when_quiet: bool = False) -> dict:
    """Run `run.fit` to its last update with a progress bar, logging and checkpoints: the one
    loop of `train`, `finetune` (a TextRun) and `mnist train` (a ClassifierRun), both a
    core.fit.Run.

    checkpoint(path) writes a resumable checkpoint of the run; only rank 0 calls it (and
    only its log has a file). On Ctrl-C one is written (into --checkpoint-dir, else beside
    --out) and the command exits with status 130 (every process, after the same update).
    Returns {"step", "val_loss" (None without validation data), the run's seen(), "elapsed_s",
    "stop_reason", "stopped"} after the final evaluation (of the best model with early
    stopping); "stopped" says why in words. Each evaluation is logged and described in a line
    (describe_eval) above the bar, or, with evals_when_quiet, on stderr without one.
    evaluate_task() (rank 0 only): {"task_acc", ...} of the model now, logged every
    config.eval_every updates and at the end (in the result).
    A checkpoint that cannot be written (WriteError) stops the run with one line naming the
    last one written (or resumed from), or with on_save_error "continue" is logged
    ("save_failed") and warned about while the run goes on.
    """
    write = log.write
    total = run.total_updates(batches)
    lead = run.world.lead
    if not lead:
        checkpoint, evaluate_task = _nothing, None
    bar = None if quiet or not lead else tqdm(total=total, initial=run.updates, unit="step", file=sys.stderr)
    last = [resumed_from]

    def save(path: pathlib.Path, step: int, then_continue: bool = True) -> None:
        try:
            checkpoint(path)
            last[0] = path
        except WriteError as e:
            if on_save_error == "continue" and then_continue:
                write({"event": "save_failed", "step": step, "checkpoint": str(path), "error": str(e)})
                (bar.write if bar is not None else lambda m: typer.echo(m, err=True))(
                    f"warning: checkpoint {e}; the run goes on (--on-save-error continue)")
                return
            resume = (f"the last checkpoint is {last[0]} (resume with --resume {last[0]})" if last[0]
                      else "no checkpoint of this run was written")
            raise WriteError(f"checkpoint {e}; {resume}") from None

    def on_step(info):
        write({k: info[k] for k in STEP_FIELDS + SEARCH_FIELDS + PREFERENCE_FIELDS if k in info})
        if bar is not None:
            extra = ({"margin": f"{info['rewards_margin']:.3f}", "acc": f"{info['rewards_accuracy']:.2f}"}
                     if "rewards_margin" in info else {})
            speed = ({"tok_s": f"{info['tokens_per_s']:.0f}"} if "tokens_per_s" in info
                     else {"samples_s": f"{info['samples_per_s']:.0f}"})
            bar.set_postfix(loss=f"{info['loss']:.4f}", **extra, lr=f"{info['lr']:.2e}", **speed)
            bar.update(1)
        if save_every and info["step"] % save_every == 0:
            save(checkpoint_dir / f"ckpt-{info['step']:06d}.gguf", info["step"])
        every = run.config.eval_every if evaluate_task is not None else 0
        if every and info["step"] % every == 0 and info["step"] < total:
            ev = {"step": info["step"], **evaluate_task()}
            write(ev)
            if bar is not None:
                bar.write(f"step {ev['step']}: task {task_words(ev, 'task_')}")

    def on_eval(ev):
        write(ev)
        if bar is not None:
            bar.write(describe_eval(ev))
        elif lead and evals_when_quiet:
            typer.echo(describe_eval(ev), err=True)

    t0 = time.perf_counter()
    try:
        with stop_on_ctrl_c(run):
            run.fit(batches, val_batches, on_step, on_eval)
    finally:
        if bar is not None:
            bar.close()
    if run.interrupted:
        path = (checkpoint_dir / f"ckpt-{run.updates:06d}.gguf" if checkpoint_dir
                else out.parent / (out.name + ".ckpt.gguf"))
        save(path, run.updates, then_continue=False)
        write({"event": "interrupted", "step": run.updates, "checkpoint": str(path)})
        log.close()
        if lead:
            typer.echo(f"interrupted at update {run.updates}: checkpoint {path} (resume with --resume {path})",
                       err=True)
        raise typer.Exit(130)
    validation = run.validate(val_batches) if val_batches else {"val_loss": None}
    if checkpoint_dir is not None:
        save(checkpoint_dir / f"ckpt-{run.updates:06d}.gguf", run.updates)
    task = evaluate_task() if evaluate_task is not None else {}
    return {"step": run.updates, **validation, **task, **run.seen(), "elapsed_s": time.perf_counter() - t0,
            "stop_reason": run.stop_reason, "stopped": run.why_stopped()}


def validation_words(result: dict) -> str:
    """The summary's words on validation: its loss (and preference accuracy), or that there
    was no validation data (not a nan)."""
    if result.get("val_loss") is None:
        return "no validation data (--val-split 0)"
    acc = (f", preference accuracy {result['val_rewards_accuracy']:.3f}"
           if "val_rewards_accuracy" in result else "")
    return f"validation loss {result['val_loss']:.4f}{acc}"
