"""`ggtrain mnist train|eval`: ggml's MNIST classifiers (layer 6)."""
from __future__ import annotations

import dataclasses
import json
import pathlib

import typer

from ggtrain.cli.common import make_backend
from ggtrain.cli.loop import TrainingCommand, check_length, check_resume_data, continue_run, optimizer_settings
from ggtrain.cli.main import app
from ggtrain.cli.options import (BACKEND, CHECKPOINT_DIR, CONFIG, DATA, EARLY_STOP_PATIENCE, LOG, MIN_DELTA, MODEL,
                                 MOMENTUM, ON_SAVE_ERROR, OPTIMIZATION, OPTIMIZER, QUIET, SAVE_EVERY, STEPS, THREADS,
                                 Backend, OnSaveError, Optimizer, choice, opt_batch, opt_epochs, opt_lr, opt_resume,
                                 opt_seed, opt_val_split)
from ggtrain.core.data import fingerprint_arrays
from ggtrain.core.models import mnist as model
from ggtrain.core.train_classifier import ClassifierConfig, ClassifierRun, classifier_data, split_train_val
from ggtrain.errors import ConfigError
from ggtrain.formats.checkpoint import Checkpoint, save_checkpoint
from ggtrain.formats.idx import load_mnist
from ggtrain.formats.mnist import load_mnist_model, save_mnist_model

BUNDLED = pathlib.Path(__file__).resolve().parent / "data" / "mnist"

mnist_app = typer.Typer(help="Train and evaluate ggml's MNIST classifiers (mnist-fc, mnist-cnn).",
                        no_args_is_help=True)
app.add_typer(mnist_app, name="mnist", rich_help_panel="Train")


Arch, ARCH = choice("fc", "--arch", values=model.ARCHS, panel=MODEL,
                    help="fc (784-500-10) or cnn (two 3x3 convolutions).")


@mnist_app.command("train")
def train(
    context: typer.Context,
    out: pathlib.Path = typer.Option(..., "--out", rich_help_panel=MODEL, show_default=False,
                                     help="The model to write (GGUF)."),
    arch: Arch = ARCH,
    data: pathlib.Path = typer.Option(None, "--data", rich_help_panel=DATA, show_default=False,
                                      help="Folder of the MNIST IDX files (.gz or raw) (default: a bundled "
                                           "5000-image subset)."),
    limit: int = typer.Option(0, "--limit", rich_help_panel=DATA, help="Only the first N training images (0: all)."),
    steps: int = STEPS,
    epochs: float = opt_epochs("30; with --resume, the run's new total"),
    batch: int = opt_batch(1000, "Images an update takes (each process's under mpiexec); more than the "
                                 "training split: all of it. Run --physical-batch at a time."),
    physical_batch: int = typer.Option(500, "--physical-batch", rich_help_panel=OPTIMIZATION,
                                       help="Images one native run takes; an update adds up the gradients of "
                                            "--batch / this runs."),
    lr: float = opt_lr("1e-3"),
    optimizer: Optimizer = OPTIMIZER,
    momentum: float = MOMENTUM,
    early_stop_patience: int = EARLY_STOP_PATIENCE,
    min_delta: float = MIN_DELTA,
    val_split: float = opt_val_split(0.05, "evaluated every epoch"),
    checkpoint_dir: pathlib.Path = CHECKPOINT_DIR,
    save_every: int = SAVE_EVERY,
    on_save_error: OnSaveError = ON_SAVE_ERROR,
    resume: pathlib.Path = opt_resume("same --data and --limit; the run's other settings are the checkpoint's"),
    seed: int = opt_seed("the initialization, the split and the order"),
    threads: int = THREADS,
    backend: Backend = BACKEND,
    log: pathlib.Path = LOG,
    quiet: bool = QUIET,
    config: pathlib.Path = CONFIG,
):
    """Train an MNIST classifier with ggml's defaults and write it as GGUF; checkpoints and
    --resume as `ggtrain train`'s (Ctrl-C writes one)."""
    check_length(steps, epochs)
    cmd = TrainingCommand(context, "mnist train", backend=backend, threads=threads, outs={"--out": out},
                          save_every=save_every, checkpoint_dir=checkpoint_dir, on_save_error=on_save_error,
                          resume=resume, log=log, quiet=quiet)
    world, ckpt = cmd.world, cmd.ckpt
    if ckpt is not None:   # the run's settings are the checkpoint's
        arch = ckpt.model_config["arch"]
        more = {"epochs": epochs, "steps": 0} if epochs is not None else {"steps": steps} if steps is not None else {}
        cfg = ClassifierConfig(**{**ckpt.train_config, **more})
        limit = ckpt.run_config.get("limit", 0)
        if ckpt.run_config.get("world", 1) != world.size:
            raise ConfigError(f"--resume {resume}: the run had {ckpt.run_config.get('world', 1)} processes, "
                              f"{world.size} were started")
    else:
        lr, _, _ = optimizer_settings(optimizer, lr, None, None, 1e-3, 0.0)
        cfg = ClassifierConfig(epochs=30 if epochs is None else epochs, steps=steps or 0, batch=batch,
                               physical_batch=physical_batch, lr=lr, val_split=val_split, seed=seed,
                               optimizer=optimizer, momentum=momentum, early_stop_patience=early_stop_patience,
                               min_delta=min_delta)   # checked before reading
    images, labels = load_mnist(data or BUNDLED, "train")
    if limit:
        images, labels = images[:limit], labels[:limit]
    n_train = len(split_train_val(len(labels), cfg.val_split, cfg.seed)[0])
    per = cfg.physical_batch * world.size   # the global batch is batch x processes
    if ckpt is None and cfg.batch * world.size > n_train >= per:   # a full batch: every training image each update
        full = n_train // per * cfg.physical_batch
        total = full * world.size
        procs = f" ({full} on each of {world.size} processes)" if world.size > 1 else ""
        cmd.say(f"--batch is more than the {n_train} training images: a full batch of {total}{procs}"
                + (f" ({n_train - total} left out: not a multiple of --physical-batch"
                   + (" x processes" if world.size > 1 else "") + ")" if n_train > total else ""))
        cfg = dataclasses.replace(cfg, batch=full)
    fingerprint = fingerprint_arrays(images, labels)
    if ckpt is not None:
        check_resume_data(ckpt, fingerprint, resume, data or BUNDLED)
    init = ckpt.state["params"] if ckpt is not None else model.init_params(arch, cfg.seed)
    run = ClassifierRun(lambda p, x: model.forward(arch, p, x), init, (28, 28), cfg, cmd.backend, world=world)
    batches, val = classifier_data(images, labels, cfg, world)
    if ckpt is not None:
        continue_run(run, batches, ckpt)
    cmd.summary(f"mnist-{arch}: {sum(v.size for v in init.values()):,} parameters, {len(labels):,} images", run)
    train_json = dataclasses.asdict(cfg)
    run_json = {"limit": limit, "world": world.size, "options": cmd.record["options"]}

    def checkpoint(path: pathlib.Path) -> None:
        save_checkpoint(path, Checkpoint("mnist", {"arch": arch}, train_json, run.state(), None, batches.state(),
                                         fingerprint, run_config=run_json))

    cmd.open_log(run)
    result = cmd.drive(run, batches, val, checkpoint, out, describe_eval=_epoch_line, evals_when_quiet=True)
    if world.lead:
        save_mnist_model(out, arch, run.param_values(), model.PARAM_SHAPES[arch])
        kept = run.kept()     # of the model written: the best epoch's with early stopping
        done = {"epochs": run.last["epoch"] if run.last else 0, "elapsed_s": result["elapsed_s"],
                "stop_reason": run.stop_reason, "stopped": result["stopped"], "samples_seen": result["samples_seen"]}
        if kept:
            done.update({k: kept.get(k) for k in ("epoch", "val_loss", "val_accuracy", "train_loss",
                                                  "train_accuracy")})
        cmd.finish(result, out, f"wrote {out}", done=done)


def _epoch_line(s: dict) -> str:
    val = f", val loss {s['val_loss']:.4f} acc {100 * s['val_accuracy']:.2f}%" if "val_loss" in s else ""
    return (f"epoch {s['epoch']}: train loss {s['train_loss']:.4f} acc {100 * s['train_accuracy']:.2f}%{val} "
            f"({s['epoch_s']:.2f} s)")


@mnist_app.command("eval")
def evaluate(
    model_path: pathlib.Path = typer.Option(..., "--model", help="An MNIST model GGUF (mnist-fc or mnist-cnn)."),
    data: pathlib.Path = typer.Option(None, "--data", help="Folder with the MNIST IDX files; "
                                      "default: the bundled 1000-image test subset."),
    as_json: bool = typer.Option(False, "--json", help='Print {"loss": .., "accuracy": ..} as JSON.'),
    threads: int = THREADS,
    backend: Backend = BACKEND,
):
    """Test loss and accuracy (with standard errors) of an MNIST model on the t10k set."""
    arch, params = load_mnist_model(model_path, model.PARAM_SHAPES)
    images, labels = load_mnist(data or BUNDLED, "test")
    be = make_backend(backend, threads)
    config = ClassifierConfig(epochs=0, batch=500, physical_batch=500)
    run = ClassifierRun(lambda p, x: model.forward(arch, p, x), params, (28, 28), config, be)
    ev = run.evaluate(images, labels)
    if as_json:
        typer.echo(json.dumps({"loss": ev["loss"], "loss_se": ev["loss_se"], "accuracy": ev["accuracy"],
                               "accuracy_se": ev["accuracy_se"], "n": ev["n"], "arch": f"mnist-{arch}"}))
    else:
        typer.echo(f"mnist-{arch} on {ev['n']} test images: loss {ev['loss']:.4f} ± {ev['loss_se']:.4f}, "
                   f"accuracy {100 * ev['accuracy']:.2f} ± {100 * ev['accuracy_se']:.2f}%")
