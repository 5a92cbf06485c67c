"""`ggtrain mnist train|eval`: ggml's MNIST classifiers (layer 6)."""
from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
import time

import typer
from tqdm import tqdm

from ggtrain.cli.common import JsonLog, make_backend, start_world, stop_on_ctrl_c
from ggtrain.cli.config import config_record
from ggtrain.cli.loop import CONFIG, EARLY_STOP_PATIENCE, MIN_DELTA, MOMENTUM, OPTIMIZER, optimizer_settings
from ggtrain.cli.main import app
from ggtrain.core.models import mnist as model
from ggtrain.core.fit import stop_message
from ggtrain.core.train import ClassifierConfig, ClassifierRun, split_train_val
from ggtrain.errors import ConfigError
from ggtrain.formats.idx import load_mnist
from ggtrain.formats.mnist import load_mnist_model, save_mnist_model

BUNDLED = pathlib.Path(__file__).resolve().parent / "data" / "mnist"

mnist_app = typer.Typer(help="Train and evaluate ggml's MNIST classifiers (mnist-fc, mnist-cnn).",
                        no_args_is_help=True)
app.add_typer(mnist_app, name="mnist")


@mnist_app.command("train")
def train(
    context: typer.Context,
    arch: str = typer.Option("fc", "--arch", help="Model: fc (784-500-10) or cnn (two 3x3 convs)."),
    data: pathlib.Path = typer.Option(None, "--data", help="Folder with the MNIST IDX files (.gz or raw); "
                                      "default: a bundled 5000-image subset."),
    out: pathlib.Path = typer.Option(..., "--out", help="Where to write the model (GGUF)."),
    epochs: int = typer.Option(30, "--epochs", help="Passes over the training split (>= 1)."),
    batch: int = typer.Option(1000, "--batch", help="Logical batch: samples per optimizer update, of each "
                              "process under mpiexec (more than the training split: all of it, a full batch)."),
    physical_batch: int = typer.Option(500, "--physical-batch",
                                       help="Samples per native run; gradients accumulate over batch/physical."),
    lr: float = typer.Option(None, "--lr", help="Learning rate (default 1e-3; lbfgs: first trial step, 1)."),
    optimizer: str = OPTIMIZER,
    momentum: float = MOMENTUM,
    early_stop_patience: int = EARLY_STOP_PATIENCE,
    min_delta: float = MIN_DELTA,
    val_split: float = typer.Option(0.05, "--val-split", help="Fraction of training data held out for validation."),
    seed: int = typer.Option(0, "--seed", help="Seed of initialisation, split and shuffling."),
    threads: int = typer.Option(None, "--threads", help="CPU threads (default: all available)."),
    backend: str = typer.Option("cpu", "--backend", help="cpu (cuda in builds that have it)."),
    log: pathlib.Path = typer.Option(None, "--log", help="Write per-step and per-epoch JSON lines here."),
    limit: int = typer.Option(0, "--limit", help="Use only the first N training images (0: all)."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress bar."),
    config: pathlib.Path = CONFIG,
):
    """Train an MNIST classifier with ggml's defaults and write it as GGUF."""
    world = start_world()
    record = config_record(context)
    if arch not in model.ARCHS:
        raise ConfigError(f"--arch {arch!r}: expected one of {', '.join(model.ARCHS)}")
    if epochs < 1:
        raise ConfigError(f"--epochs must be >= 1, got {epochs}")
    lr, _, _ = optimizer_settings(optimizer, lr, None, None, 1e-3, 0.0)
    cfg = ClassifierConfig(epochs=epochs, batch=batch, physical_batch=physical_batch, lr=lr, val_split=val_split,
                           seed=seed, optimizer=optimizer, momentum=momentum,
                           early_stop_patience=early_stop_patience, min_delta=min_delta)   # checked before reading
    if world.lead and out.parent and not out.parent.is_dir():
        raise ConfigError(f"--out {out}: folder {out.parent} does not exist")
    images, labels = load_mnist(data or BUNDLED, "train")
    if limit:
        images, labels = images[:limit], labels[:limit]
    n_train = len(split_train_val(len(labels), val_split, seed)[0])
    per = physical_batch * world.size   # the global batch is batch x processes
    if batch * world.size > n_train >= per:   # a full batch: every training image in each update
        batch = n_train // per * physical_batch
        if world.lead:
            total = batch * world.size
            procs = f" ({batch} on each of {world.size} processes)" if world.size > 1 else ""
            typer.echo(f"--batch is more than the {n_train} training images: a full batch of {total}{procs}"
                       + (f" ({n_train - total} left out: not a multiple of --physical-batch"
                          + (" x processes" if world.size > 1 else "") + ")" if n_train > total else ""),
                       err=True)
        cfg = dataclasses.replace(cfg, batch=batch)
    be = make_backend(backend, threads)
    run = ClassifierRun(lambda p, x: model.forward(arch, p, x), model.init_params(arch, seed),
                        (28, 28), cfg, be, world=world)
    mem = run.step.memory
    quiet = quiet or not world.lead
    if world.lead:
        typer.echo(f"mnist-{arch}: {sum(v.size for v in model.init_params(arch, seed).values())} parameters, "
                   f"{len(labels)} images, planned memory {mem.peak / 2**20:.1f} MiB "
                   f"(arena {mem.arena / 2**20:.1f} MiB), {be.n_threads} threads", err=True)
    logf = JsonLog(log if world.lead else None)
    logf.write(record)
    bar = None

    def on_step(info):
        logf.write({k: info[k] for k in ("step", "epoch", "loss", "lr", "grad_norm", "samples_per_s", "elapsed_s",
                                         "evals", "step_size") if k in info})
        nonlocal bar
        if quiet:
            return
        if bar is None or info["update_in_epoch"] == 1:
            if bar is not None:
                bar.close()
            bar = tqdm(total=info["updates_per_epoch"], desc=f"epoch {info['epoch']}/{epochs}", unit="step",
                       file=sys.stderr, leave=False)
        bar.set_postfix(loss=f"{info['loss']:.4f}", speed=f"{info['samples_per_s']:.0f}/s")
        bar.update(1)

    def on_epoch(s):
        if bar is not None:
            bar.close()
        logf.write({"step": s["step"], "epoch": s["epoch"], "val_loss": s.get("val_loss"),
                    "val_accuracy": s.get("val_accuracy"), "train_loss": s["train_loss"],
                    "train_accuracy": s["train_accuracy"]})
        val = (f", val loss {s['val_loss']:.4f} acc {100 * s['val_accuracy']:.2f}%"
               if "val_loss" in s else "")
        if not world.lead:
            return
        typer.echo(f"epoch {s['epoch']}: train loss {s['train_loss']:.4f} acc "
                   f"{100 * s['train_accuracy']:.2f}%{val} ({s['epoch_s']:.2f} s)", err=True)

    t0 = time.perf_counter()
    try:
        with stop_on_ctrl_c(run):
            history = run.fit(images, labels, on_step, on_epoch)
    finally:
        if bar is not None:
            bar.close()
    if world.lead:
        save_mnist_model(out, arch, run.param_values(), model.PARAM_SHAPES[arch])
        stopped = stop_message(run.stop_reason, run.early_stopping, len(history))
        done = {"event": "done", "epochs": len(history), "elapsed_s": time.perf_counter() - t0,
                "interrupted": run.interrupted, "stop_reason": run.stop_reason, "stopped": stopped,
                "out": str(out)}
        if history:   # of the model written: the best epoch's with early stopping
            last = run.best or history[-1]
            done.update({k: last.get(k) for k in ("epoch", "val_loss", "val_accuracy", "train_loss",
                                                  "train_accuracy")})
        logf.write(done)
        logf.close()
        typer.echo(f"{stopped}; wrote {out}", err=True)
    if run.interrupted:
        raise typer.Exit(130)


@mnist_app.command("eval")
def evaluate(
    model_path: pathlib.Path = typer.Option(..., "--model", help="An MNIST model GGUF (mnist-fc or mnist-cnn)."),
    data: pathlib.Path = typer.Option(None, "--data", help="Folder with the MNIST IDX files; "
                                      "default: the bundled 1000-image test subset."),
    as_json: bool = typer.Option(False, "--json", help='Print {"loss": .., "accuracy": ..} as JSON.'),
    threads: int = typer.Option(None, "--threads", help="CPU threads (default: all available)."),
    backend: str = typer.Option("cpu", "--backend", help="cpu (cuda in builds that have it)."),
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
