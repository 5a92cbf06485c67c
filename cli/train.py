"""`ggtrain train`: a llama from scratch on a text file, with checkpoints and resume (layer 6)."""
from __future__ import annotations

import dataclasses
import pathlib

import typer

from ggtrain.cli.common import file_errors, read_corpus
from ggtrain.cli.loop import TrainingCommand, check_length, check_resume_data, continue_run, optimizer_settings, validation_words
from ggtrain.cli.main import app
from ggtrain.cli.options import (BACKEND, CHECKPOINT_DIR, CHECKPOINTING, CONFIG, DATA, EARLY_STOP_PATIENCE, EVAL_EVERY,
                                 GRAD_ACC, GRAD_CLIP, LOG, LR_MIN, MIN_DELTA, MODEL, MOE_AUX_LOSS, MOMENTUM,
                                 ON_SAVE_ERROR, OPTIMIZER, QUIET, SAVE_EVERY, STEPS, THREADS, TOKEN_CACHE, Backend, OnSaveError,
                                 Optimizer, choice, opt_batch, opt_epochs, opt_lr, opt_resume, opt_seed,
                                 opt_val_split, opt_warmup, opt_weight_decay, warmup_updates)
from ggtrain.core.data import TokenWindows, eval_windows, split_tokens
from ggtrain.core.distributed import Shard
from ggtrain.core.models.config import ModelConfig, init_params
from ggtrain.core.models.families import FAMILIES, NAMES
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


def _scratch(arch: str, layers: int, dim: int, heads: int, kv_heads: int | None, head_dim: int | None,
             ctx: int) -> dict:
    """The family's fields of a model built from scratch: the KV heads (--kv-heads, default
    --heads), its required keys' unset values, then what Family.scratch lays over the layers from
    the sizes given (lfm2: attention in some layers only; gemma4: its local layers; qwen35: its
    DeltaNet's sizes)."""
    fam = FAMILIES[arch]
    kv = heads if kv_heads is None else kv_heads
    out = dict(kv_heads=kv, **{k.field: k.unset for k in fam.keys if k.required and k.unset is not None})
    if fam.scratch is not None:
        out.update(fam.scratch(dict(layers=layers, dim=dim, heads=heads, kv_heads=kv,
                                    head_dim=head_dim or dim // heads, ctx=ctx)))
    return out


Arch, ARCH = choice("llama", "--arch", values=tuple(sorted(FAMILIES)), panel=MODEL, metavar="NAME",
                    help=f"The model family (its graph and GGUF layout): {NAMES}.")


@app.command("train", rich_help_panel="Train")
def train(
    context: typer.Context,
    out: pathlib.Path = typer.Option(..., "--out", rich_help_panel=MODEL, show_default=False,
                                     help="The model to write (a GGUF file llama.cpp loads)."),
    arch: Arch = ARCH,
    dim: int = typer.Option(256, "--dim", rich_help_panel=MODEL, help="Embedding width."),
    layers: int = typer.Option(4, "--layers", rich_help_panel=MODEL, help="Transformer blocks."),
    heads: int = typer.Option(8, "--heads", rich_help_panel=MODEL, help="Attention heads."),
    kv_heads: int = typer.Option(None, "--kv-heads", rich_help_panel=MODEL, show_default=False,
                                 help="Key/value heads (fewer: grouped-query attention) (default: --heads)."),
    head_dim: int = typer.Option(None, "--head-dim", rich_help_panel=MODEL, show_default=False,
                                 help="Head size (default: --dim / --heads)."),
    ff: int = typer.Option(768, "--ff", rich_help_panel=MODEL, help="Feed-forward width."),
    ctx: int = typer.Option(128, "--ctx", rich_help_panel=MODEL, help="Context length (tokens a window)."),
    data: pathlib.Path = typer.Option(None, "--data", rich_help_panel=DATA, show_default=False,
                                      help="UTF-8 text to train on (default: the bundled tiny shakespeare). "
                                           "Also --train-data."),
    tokenizer: str = typer.Option("byte", "--tokenizer", rich_help_panel=DATA,
                                  help="byte, bpe:N (learnt from the first 64 MB of --data) or VOCAB.gguf."),
    token_cache: str = TOKEN_CACHE,
    steps: int = STEPS,
    epochs: float = opt_epochs("1000 updates"),
    batch: int = opt_batch(8, "Windows of --ctx tokens a micro-batch; an update is --batch x --grad-acc of them "
                              "(on each process under mpiexec)."),
    grad_acc: int = GRAD_ACC,
    lr: float = opt_lr("1e-3"),
    lr_min: float = LR_MIN,
    warmup: float = opt_warmup(100),
    weight_decay: float = opt_weight_decay("0.1"),
    optimizer: Optimizer = OPTIMIZER,
    momentum: float = MOMENTUM,
    grad_clip: float = GRAD_CLIP,
    moe_aux_loss: float = MOE_AUX_LOSS,
    eval_every: int = EVAL_EVERY,
    early_stop_patience: int = EARLY_STOP_PATIENCE,
    min_delta: float = MIN_DELTA,
    val_split: float = opt_val_split(0.05, "the text's end"),
    checkpointing: bool = CHECKPOINTING,
    checkpoint_dir: pathlib.Path = CHECKPOINT_DIR,
    save_every: int = SAVE_EVERY,
    on_save_error: OnSaveError = ON_SAVE_ERROR,
    resume: pathlib.Path = opt_resume("same --data"),
    seed: int = opt_seed("the initialization and the window order"),
    threads: int = THREADS,
    backend: Backend = BACKEND,
    log: pathlib.Path = LOG,
    quiet: bool = QUIET,
    config: pathlib.Path = CONFIG,
):
    """Train a model of any family (llama by default) from scratch on a text file."""
    check_length(steps, epochs)
    cmd = TrainingCommand(context, "train", backend=backend, threads=threads, outs={"--out": out},
                          save_every=save_every, checkpoint_dir=checkpoint_dir, on_save_error=on_save_error,
                          resume=resume, log=log, quiet=quiet)
    world, ckpt, start = cmd.world, cmd.ckpt, cmd.start   # start: a model checkpoint, a new run from its weights
    data = data or BUNDLED_TEXT
    if start is not None:
        cmd.say(f"--resume {resume}: a model checkpoint; training it with this command's options (its architecture "
                f"and tokenizer replace --dim, --layers, ..., --tokenizer)")
    source = ckpt or start
    tok = source.tokenizer if source else load_tokenizer(
        tokenizer, _bpe_text(data) if tokenizer.startswith("bpe:") else None)
    corpus = read_corpus(data, tok, False, token_cache, quiet, world)
    if ckpt:
        model_cfg = ModelConfig(**ckpt.model_config)
        tc = dict(ckpt.train_config)
        val_split = tc.pop("val_split")  # the split must be the one the run started with
        if steps is not None:
            tc["steps"] = steps  # extend (or shorten) a run; everything else as saved
        train_cfg = TextConfig(**tc).on(world.size)
        check_resume_data(ckpt, corpus.fingerprint, resume, data)
    else:
        model_cfg = ModelConfig(**start.model_config) if start else ModelConfig(
            vocab=tok.n_vocab, dim=dim, layers=layers, heads=heads, ff=ff, ctx=ctx, arch=arch, head_dim=head_dim or 0,
            **_scratch(arch, layers, dim, heads, kv_heads, head_dim, ctx))
    train_ids, val_ids = split_tokens(corpus.ids, val_split, model_cfg.ctx)
    if ckpt is None:
        per_epoch = TokenWindows(train_ids, model_cfg.ctx, batch * world.size, seed).windows_per_epoch
        n_steps = steps if steps is not None else (
            max(1, round(epochs * per_epoch / grad_acc)) if epochs is not None else 1000)
        lr, weight_decay, grad_clip = optimizer_settings(optimizer, lr, weight_decay, grad_clip, 1e-3, 0.1)
        train_cfg = TextConfig(steps=n_steps, batch=batch, grad_acc=grad_acc, lr=lr,
                               lr_min=lr_min if lr_min is not None else lr / 10,
                               warmup=warmup_updates(warmup, n_steps), weight_decay=weight_decay, grad_clip=grad_clip,
                               checkpointing=checkpointing, eval_every=eval_every, seed=seed, world=world.size,
                               optimizer=optimizer, momentum=momentum, early_stop_patience=early_stop_patience,
                               min_delta=min_delta, moe_aux_loss=moe_aux_loss)
    init = source.state["params"] if source else init_params(model_cfg, train_cfg.seed)
    run = TextRun(model_cfg, init, train_cfg, cmd.backend, world=world)
    # every process draws the global batches and trains on its rows of them
    windows = TokenWindows(train_ids, model_cfg.ctx, train_cfg.global_batch, train_cfg.seed + 1)
    if ckpt:
        continue_run(run, windows, ckpt)
    val_batches = [world.shard(b) for b in eval_windows(val_ids, model_cfg.ctx, train_cfg.global_batch,
                                                        train_cfg.eval_batches)] if len(val_ids) else []
    cmd.summary(f"{model_cfg.arch}: {sum(v.size for v in init.values()):,} parameters, vocab {tok.n_vocab:,} "
                f"({tokenizer if not source else 'from checkpoint'}), {len(train_ids):,} training / "
                f"{len(val_ids):,} validation tokens", run)
    model_json = dataclasses.asdict(model_cfg)
    train_json = dict(dataclasses.asdict(train_cfg), val_split=val_split)
    carried = source.extra_kv if source else []

    def checkpoint(path: pathlib.Path) -> None:
        save_checkpoint(path, Checkpoint("train", model_json, train_json, run.state(), tok, windows.state(),
                                         corpus.fingerprint, run_config={"options": cmd.record["options"]},
                                         extra_kv=carried))

    cmd.open_log(run)
    summary = cmd.drive(run, Shard(windows, world), val_batches, checkpoint, out)
    if world.lead:
        save_model(out, model_json, run.param_values(), tok, extra_kv=carried)
        cmd.finish(summary, out, f"{validation_words(summary)}; wrote {out}")
