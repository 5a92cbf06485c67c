"""The scaffold of the training commands (layer 6): `train`, `finetune` and `mnist train` are
each a TrainingCommand (processes, options record, backend, output checks, resume, summary
line, log, the drive of the run, the final line), the optimizer's defaults, and around a run
the progress bar, the JSONL log, periodic and final checkpoints, Ctrl-C (one checkpoint, exit
130). In a data-parallel run only rank 0 shows progress and writes files."""
from __future__ import annotations

import json
import os
import pathlib
import time
from typing import Callable

import typer

from ggtrain.cli.common import JsonLog, make_backend, progress_bar, start_world, stop_on_ctrl_c
from ggtrain.cli.config import config_record
from ggtrain.cli.options import SAVE_ERRORS
from ggtrain.cli.tasks import task_words
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

LR_LBFGS = 1.0   # the quasi-Newton step: L-BFGS's first trial step


def optimizer_settings(optimizer: str, lr: float | None, weight_decay: float | None,
                       grad_clip: float | None, lr_default: float, weight_decay_default: float) -> tuple:
    """(lr, weight decay, clip) for --optimizer: the command's defaults for adamw and sgd;
    for lbfgs lr 1 and neither decay nor clipping (given ones are refused by make_optimizer)."""
    if optimizer not in OPTIMIZERS:
        raise ConfigError(f"--optimizer {optimizer!r}: expected one of {', '.join(OPTIMIZERS)}")
    for name, value in (("--lr", lr), ("--weight-decay", weight_decay), ("--grad-clip", grad_clip)):
        if value is not None and (value < 0 or (name == "--lr" and value == 0)):
            raise ConfigError(f"{name} must be {'> 0' if name == '--lr' else '>= 0'}, got {value:g}")
    if optimizer == "lbfgs":
        return (LR_LBFGS if lr is None else lr, weight_decay or 0.0, grad_clip or 0.0)
    return (lr_default if lr is None else lr, weight_decay_default if weight_decay is None else weight_decay,
            1.0 if grad_clip is None else grad_clip)


def check_length(steps: int | None, epochs: float | None) -> None:
    """--steps or --epochs (one of them), each positive."""
    if steps is not None and steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {steps}")
    if epochs is not None and not epochs > 0:
        raise ConfigError(f"--epochs must be > 0, got {epochs:g}")
    if steps is not None and epochs is not None:
        raise ConfigError("give --steps or --epochs, not both")


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
    """An output can be written where it is named: its folder exists and is writable, and the
    name is not a folder (so a run is not lost when it ends); what killed writes left in the
    folder is removed."""
    if out.is_dir():
        example = out / ("run.jsonl" if option == "--log" else "out.gguf")
        raise ConfigError(f"{option} {out}: is a folder; name the file to write (e.g. {example})")
    if not out.parent.is_dir():
        raise ConfigError(f"{option} {out}: folder {out.parent} does not exist")
    if not os.access(out.parent, os.W_OK):
        raise ConfigError(f"{option} {out}: folder {out.parent} cannot be written")
    remove_stale_temporaries(out.parent)


def check_apart(outs: dict, ins: dict) -> None:
    """No output is written over an input or over another output: ConfigError naming both
    options. outs, ins: {option: path or None}; an input counts where its file exists."""
    taken = {}
    for option, path in ins.items():
        if path is not None and pathlib.Path(path).exists():
            taken.setdefault(pathlib.Path(path).resolve(), option)
    for option, path in outs.items():
        if path is None:
            continue
        where = pathlib.Path(path).resolve()
        if where in taken:
            raise ConfigError(f"{option} {path} is also {taken[where]}: write to another file")
        taken[where] = option


def command_paths(context: typer.Context, outs: dict) -> dict:
    """{option: path} of every path option the command was given that is not one of outs (its
    inputs: --model, --data, --config, --resume, ...)."""
    paths = {}
    for p in context.command.params:
        value = context.params.get(p.name)
        long = next((o for o in getattr(p, "opts", ()) if o.startswith("--")), p.name)
        if isinstance(value, pathlib.PurePath) and long not in outs:
            paths[long] = value
    return paths


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
    bar = progress_bar(quiet or not lead, total=total, initial=run.updates, unit="step")
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
                else interrupt_checkpoint(out))
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
    return {"step": run.updates, **validation, **task, **run.seen(), "elapsed_s": run.elapsed_offset + time.perf_counter() - t0,
            "stop_reason": run.stop_reason, "stopped": run.why_stopped()}


def validation_words(result: dict) -> str:
    """The summary's words on validation: its loss (and preference accuracy), or that there
    was no validation data (not a nan)."""
    if result.get("val_loss") is None:
        return "no validation data (--val-split 0)"
    acc = (f", preference accuracy {result['val_rewards_accuracy']:.3f}"
           if "val_rewards_accuracy" in result else "")
    return f"validation loss {result['val_loss']:.4f}{acc}"


def interrupt_checkpoint(out: pathlib.Path) -> pathlib.Path:
    """Where Ctrl-C saves a run without --checkpoint-dir: beside --out."""
    return out.parent / (out.name + ".ckpt.gguf")


def _last_elapsed(log: pathlib.Path, step: int) -> float:
    """The elapsed_s of a log's last step record at or before `step` (0 without one)."""
    last = 0.0
    try:
        lines = log.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return 0.0
    for line in lines:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and "elapsed_s" in rec and "event" not in rec and rec.get("step", 0) <= step:
            last = float(rec["elapsed_s"])
    return last


class TrainingCommand:
    """What train, finetune and mnist train do around their run, once: the processes, the
    options record (the log's first line), the backend, the outputs checked before any work,
    --resume opened, the summary line, the log (appended to when a run resumes with the log it
    had), the drive of the run, and the final line.

    outs: {option: path or None} of every file the command will write (checked here, on rank 0).
    """

    def __init__(self, context: typer.Context, command: str, *, backend: str, threads: int | None, outs: dict,
                 save_every: int = 0, checkpoint_dir: pathlib.Path | None = None, on_save_error: str = "stop",
                 resume: pathlib.Path | None = None, log: pathlib.Path | None = None, quiet: bool = False):
        self.t_start = time.perf_counter()
        self.command = command
        self.world = start_world()
        self.record = config_record(context)
        self.backend = make_backend(backend, threads)
        self.save_every, self.checkpoint_dir, self.on_save_error = save_every, checkpoint_dir, on_save_error
        self.resume, self.log_path, self.quiet = resume, log, quiet
        self.outs = outs
        if self.lead:   # the one process that writes
            check_checkpoint_options(save_every, checkpoint_dir, on_save_error)
            written = {**outs, "--log": log}
            for option, path in written.items():
                if path is not None:
                    check_out(path, option)
            check_apart(written, command_paths(context, {**written, "--checkpoint-dir": None}))
        self.ckpt, self.start = open_resume(resume, command)
        self.log = None

    @property
    def lead(self) -> bool:
        return self.world.lead

    def say(self, line: str) -> None:
        """A line on stderr from the process that writes."""
        if self.lead:
            typer.echo(line, err=True)

    def summary(self, words: str, run: Run) -> None:
        """The line before training: the command's words, the planned memory and what computes."""
        mem = run.step.memory
        self.say(f"{words}; planned memory {mem.peak / 2**20:.1f} MiB (arena {mem.arena / 2**20:.1f} MiB); "
                 f"{self.backend.describe()}")

    def open_log(self, run: Run, **start) -> JsonLog:
        """The --log of the run: a new file, or, when the run resumes a checkpoint and the log
        exists, that file appended to (a "resumed" record; elapsed_s goes on from the log's last
        step at the checkpoint); `start` (if any) is written as an {"event": "start"} record."""
        resumed = self.ckpt is not None and self.log_path is not None and self.log_path.is_file()
        if resumed and self.lead:
            run.elapsed_offset = _last_elapsed(self.log_path, run.updates)
        self.log = JsonLog(self.log_path if self.lead else None, append=resumed)
        self.log.write(self.record)
        if resumed:
            self.log.write({"event": "resumed", "step": run.updates, "checkpoint": str(self.resume)})
        if start:
            self.log.write({"event": "start", "load_s": time.perf_counter() - self.t_start, **start})
        return self.log

    def drive(self, run: Run, batches, val, checkpoint: Callable[[pathlib.Path], None], out: pathlib.Path,
              **kw) -> dict:
        """drive() with the command's checkpoint options and log."""
        return drive(run, batches, val, log=self.log, quiet=self.quiet, save_every=self.save_every,
                     checkpoint_dir=self.checkpoint_dir, out=out, checkpoint=checkpoint,
                     on_save_error=self.on_save_error, resumed_from=self.resume if self.ckpt is not None else None,
                     **kw)

    def finish(self, result: dict, out: pathlib.Path, words: str, done: dict | None = None) -> None:
        """The log's "done" record (drive's result, or `done`) and the final line; the Ctrl-C
        checkpoint this run resumed from beside --out is removed (the run it belongs to is
        complete)."""
        self.log.write({"event": "done", **(result if done is None else done), "out": str(out)})
        self.log.close()
        stale = interrupt_checkpoint(out)
        if self.resume is not None and self.ckpt is not None and self.resume.resolve() == stale.resolve() \
                and stale.exists():
            stale.unlink()
            words += f"; removed {stale} (the interrupted run is complete)"
        self.say(f"done: {result['stopped']}; {words}")
