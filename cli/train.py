"""`ggtrain train`: a llama from scratch on a text file, with checkpoints and resume (layer 6)."""
from __future__ import annotations

import dataclasses
import pathlib

import typer

from ggtrain.cli.common import JsonLog, make_backend, file_errors, read_corpus, start_world
from ggtrain.cli.config import config_record
from ggtrain.cli.loop import (BACKEND, CHECKPOINT_DIR, CHECKPOINTING, CONFIG, EARLY_STOP_PATIENCE, EVAL_EVERY,
                              GRAD_CLIP, LOG, MIN_DELTA, MOMENTUM, OPTIMIZER, QUIET, SAVE_EVERY, THREADS, TOKEN_CACHE, ON_SAVE_ERROR,
                              check_checkpoint_options, check_out, check_resume_data, continue_run, drive,
                              open_resume, optimizer_settings, validation_words)
from ggtrain.cli.main import app
from ggtrain.core.data import TokenWindows, eval_windows, split_tokens
from ggtrain.core.distributed import Shard
from ggtrain.core.models.config import ModelConfig, init_params
from ggtrain.core.models.families import NAMES
from ggtrain.core.train import TextConfig, TextRun
from ggtrain.errors import ConfigError
from ggtrain.formats.checkpoint import Checkpoint, save_checkpoint
from ggtrain.formats.datafile import decode, require_text
from ggtrain.formats.model_file import save_model
from ggtrain.formats.tokenizer import load_tokenizer

BUNDLED_TEXT = pathlib.Path(__file__).resolve().parent / "data" / "tinyshakespeare.txt"
BPE_SAMPLE = 64 << 20     # bytes of --data that --tokenizer bpe:N learns its merges from


def _bpe_text(path: pathlib.Path) -> str:
    """What --tokenizer bpe:N is trained on: the text's first BPE_SAMPLE bytes (to a line's end)."""
    with file_errors(f"--data {path}"):
        require_text(path)
        with open(path, "rb") as f:
            raw = f.read(BPE_SAMPLE)
            if len(raw) == BPE_SAMPLE:
                raw = raw + f.readline()
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    if not raw.strip():
        raise ConfigError(f"--data {path}: the file is empty")
    return decode(raw, str(path))


@app.command("train")
def train(
    context: typer.Context,
    data: pathlib.Path = typer.Option(None, "--data", help="A UTF-8 plain-text file to train on (default: bundled tiny "
                                  "shakespeare); records, binary files and formats ggtrain does not read are errors."),
    out: pathlib.Path = typer.Option(..., "--out", help="Where to write the trained model (GGUF llama.cpp loads)."),
    tokenizer: str = typer.Option("byte", "--tokenizer", help="byte, bpe:N (trained on the first 64 MB of "
                                  "--data) or VOCAB.gguf."),
    arch: str = typer.Option("llama", "--arch", help=f"Model family: {NAMES}."),
    dim: int = typer.Option(256, "--dim", help="Embedding width."),
    layers: int = typer.Option(4, "--layers", help="Transformer blocks."),
    heads: int = typer.Option(8, "--heads", help="Attention heads."),
    kv_heads: int = typer.Option(None, "--kv-heads", help="Key/value heads (default --heads; fewer: "
                                 "grouped-query attention)."),
    head_dim: int = typer.Option(None, "--head-dim", help="Head size (default --dim / --heads; qwen3 models "
                                 "often have a larger one)."),
    ff: int = typer.Option(768, "--ff", help="Feed-forward width."),
    ctx: int = typer.Option(128, "--ctx", help="Context length (tokens per window)."),
    batch: int = typer.Option(8, "--batch", help="Windows per physical batch (of each process under mpiexec)."),
    grad_acc: int = typer.Option(1, "--grad-acc", help="Physical batches per optimizer update."),
    steps: int = typer.Option(None, "--steps", help="Optimizer updates (default 1000)."),
    epochs: float = typer.Option(None, "--epochs", help="Instead of --steps: passes over the training tokens."),
    lr: float = typer.Option(None, "--lr", help="Peak learning rate (default 1e-3; lbfgs: first trial step, 1)."),
    lr_min: float = typer.Option(1e-4, "--lr-min", help="Floor of the cosine schedule."),
    warmup: int = typer.Option(100, "--warmup", help="Linear warmup updates."),
    weight_decay: float = typer.Option(None, "--weight-decay", help="Decay of matrices (default 0.1; "
                                       "AdamW decoupled, SGD L2; lbfgs: none)."),
    optimizer: str = OPTIMIZER,
    momentum: float = MOMENTUM,
    grad_clip: float = GRAD_CLIP,
    checkpointing: bool = CHECKPOINTING,
    checkpoint_dir: pathlib.Path = CHECKPOINT_DIR,
    save_every: int = SAVE_EVERY,
    on_save_error: str = ON_SAVE_ERROR,
    resume: pathlib.Path = typer.Option(None, "--resume", help="Continue from a checkpoint (same --data)."),
    eval_every: int = EVAL_EVERY,
    early_stop_patience: int = EARLY_STOP_PATIENCE,
    min_delta: float = MIN_DELTA,
    val_split: float = typer.Option(0.05, "--val-split", help="Fraction of the text (its end) held out."),
    seed: int = typer.Option(0, "--seed", help="Seed of initialisation and window sampling."),
    threads: int = THREADS,
    backend: str = BACKEND,
    log: pathlib.Path = LOG,
    quiet: bool = QUIET,
    token_cache: str = TOKEN_CACHE,
    config: pathlib.Path = CONFIG,
):
    """Train a model of any family (llama by default) from scratch on a text file."""
    world = start_world()
    record = config_record(context)
    be = make_backend(backend, threads)
    if steps is not None and steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {steps}")
    if epochs is not None and not epochs > 0:
        raise ConfigError(f"--epochs must be > 0, got {epochs:g}")
    if world.lead:   # the one process that writes
        check_checkpoint_options(save_every, checkpoint_dir, on_save_error)
        check_out(out)
    data = data or BUNDLED_TEXT
    ckpt, start = open_resume(resume, "train")   # start: a model checkpoint, a new run from its weights
    if start is not None:
        if world.lead:
            typer.echo(f"--resume {resume}: a model checkpoint; training it with this command's options "
                       f"(its architecture and tokenizer replace --dim, --layers, ..., --tokenizer)", err=True)
    source = ckpt or start
    tok = source.tokenizer if source else load_tokenizer(
        tokenizer, _bpe_text(data) if tokenizer.startswith("bpe:") else None)
    corpus = read_corpus(data, tok, False, token_cache, quiet, world)
    ids = corpus.ids
    if ckpt:
        model_cfg = ModelConfig(**ckpt.model_config)
        tc = dict(ckpt.train_config)
        val_split = tc.pop("val_split")  # the split must be the one the run started with
        if steps is not None:
            tc["steps"] = steps  # extend (or shorten) a run; everything else as saved
        train_cfg = TextConfig(**tc).on(world.size)
        check_resume_data(ckpt, corpus.fingerprint, resume, data)
    elif start:
        model_cfg = ModelConfig(**start.model_config)
        train_cfg = None
    else:
        model_cfg = ModelConfig(vocab=tok.n_vocab, dim=dim, layers=layers, heads=heads,
                                kv_heads=heads if kv_heads is None else kv_heads, ff=ff, ctx=ctx, arch=arch,
                                head_dim=head_dim or 0)
        train_cfg = None
    train_ids, val_ids = split_tokens(ids, val_split, model_cfg.ctx)
    if ckpt is None:
        windows_probe = TokenWindows(train_ids, model_cfg.ctx, batch * world.size, seed)
        if steps is not None and epochs is not None:
            raise ConfigError("give --steps or --epochs, not both")
        n_steps = steps if steps is not None else (
            max(1, round(epochs * windows_probe.windows_per_epoch / grad_acc)) if epochs is not None else 1000)
        lr, weight_decay, grad_clip = optimizer_settings(optimizer, lr, weight_decay, grad_clip, 1e-3, 0.1)
        train_cfg = TextConfig(steps=n_steps, batch=batch, grad_acc=grad_acc, lr=lr, lr_min=lr_min,
                               warmup=warmup, weight_decay=weight_decay, grad_clip=grad_clip,
                               checkpointing=checkpointing, eval_every=eval_every, seed=seed, world=world.size,
                               optimizer=optimizer, momentum=momentum, early_stop_patience=early_stop_patience,
                               min_delta=min_delta)
    init = source.state["params"] if source else init_params(model_cfg, train_cfg.seed)
    run = TextRun(model_cfg, init, train_cfg, be, world=world)
    # every process draws the global batches and trains on its rows of them
    windows = TokenWindows(train_ids, model_cfg.ctx, train_cfg.global_batch, train_cfg.seed + 1)
    if ckpt:
        continue_run(run, windows, ckpt)
    val_batches = [world.shard(b) for b in eval_windows(val_ids, model_cfg.ctx, train_cfg.global_batch,
                                                        train_cfg.eval_batches)] if len(val_ids) else []
    mem = run.step.memory
    n_params = sum(v.size for v in init.values())
    if world.lead:
        typer.echo(f"{model_cfg.arch}: {n_params} parameters, vocab {tok.n_vocab} ({tokenizer if not source else 'from checkpoint'}), "
                   f"{len(train_ids)} training / {len(val_ids)} validation tokens; planned memory "
                   f"{mem.peak / 2**20:.1f} MiB (arena {mem.arena / 2**20:.1f} MiB); {be.describe()}",
                   err=True)

    model_json = dataclasses.asdict(model_cfg)
    train_json = dict(dataclasses.asdict(train_cfg), val_split=val_split)
    fingerprint = corpus.fingerprint
    carried = source.extra_kv if source else []

    def checkpoint(path: pathlib.Path) -> None:
        save_checkpoint(path, Checkpoint("train", model_json, train_json, run.state(), tok, windows.state(),
                                         fingerprint, run_config={"options": record["options"]}, extra_kv=carried))

    logf = JsonLog(log if world.lead else None)
    logf.write(record)
    summary = drive(run, Shard(windows, world), val_batches, log=logf, quiet=quiet, save_every=save_every,
                    checkpoint_dir=checkpoint_dir, out=out, checkpoint=checkpoint,
                    on_save_error=on_save_error, resumed_from=resume if ckpt is not None else None)
    if world.lead:
        save_model(out, model_json, run.param_values(), tok, extra_kv=carried)
        logf.write({"event": "done", **summary, "out": str(out)})
        logf.close()
        typer.echo(f"done: {summary['stopped']}; {validation_words(summary)}; wrote {out}", err=True)
