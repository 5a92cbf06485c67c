"""`ggtrain finetune`: LoRA (or full) fine-tuning of a GGUF model of any family on text, chat or
preference data (layer 6).

The base model stays in the types its file stores them in (no f32 copy) and frozen; LoRA
factors are trained in f32 and written as a llama.cpp adapter (`--out`), optionally also
merged into a model (`--merged-out`). With --full every weight is trained, from the base
dequantized once, and `--out` is a model. Checkpoints resume bit-identically; a checkpoint
is tied to its base model and data by their fingerprints.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import pathlib
import time

import sys

import numpy as np
import typer
from tqdm import tqdm

from ggtrain.cli.common import JsonLog, make_backend, file_errors, read_corpus, read_records, start_world
from ggtrain.cli.tasks import run_task, task_words
from ggtrain.cli.config import config_record
from ggtrain.cli.loop import (BACKEND, CHECKPOINT_DIR, CHECKPOINTING, CONFIG, EARLY_STOP_PATIENCE, EVAL_EVERY,
                              GRAD_CLIP, LOG, MIN_DELTA, MOMENTUM, OPTIMIZER, QUIET, SAVE_EVERY, THREADS, TOKEN_CACHE, ON_SAVE_ERROR,
                              check_checkpoint_options, check_out, check_resume_data, continue_run, drive,
                              open_resume, optimizer_settings, validation_words)
from ggtrain.cli.main import app
from ggtrain.core.backend import StoredTensor
from ggtrain.core.data import (PackedBatches, Picked, TokenWindows, eval_windows, pack, pack_pairs, split_samples,
                               split_tokens)
from ggtrain.core.distributed import Shard
from ggtrain.core.models.config import ModelConfig
from ggtrain.core.models.families import NAMES
from ggtrain.core.models.lora import TARGETS, LoraConfig, factor_names, init_lora
from ggtrain.core.preference import METHODS, PreferenceConfig, pair_slots
from ggtrain.core.train import TextConfig, TextRun
from ggtrain.errors import ConfigError
from ggtrain.formats.checkpoint import Checkpoint, save_checkpoint
from ggtrain.formats.chat import ChatTemplate, template_id
from ggtrain.formats.corpus import packed_rows
from ggtrain.formats.dataset import is_plain_text, record_template
from ggtrain.formats.gguf import read_gguf
from ggtrain.formats.mixture import OUT_TYPES
from ggtrain.formats.model_file import carried_kv, check_write_type, open_model, save_model
from ggtrain.formats.lora import write_lora, write_merged
from ggtrain.formats.tasks import read_task
from ggtrain.native.dtypes import dtype, nbytes

# Defaults that learn ../shared/data/chat/dummy_conversation.json (the Vicuna identity, 41k
# tokens) in one epoch on SmolLM2-135M: 84 updates of one packed 512-token window at 5e-4
# (21 updates of four windows at 2e-4 lowered the loss from 3.4 to 0.7 without the name).
LR_LORA, LR_FULL = 5e-4, 1e-5


def fingerprint_weights(weights: dict) -> str:
    """sha256 over the base weights' names, types, shapes and bytes (as loaded)."""
    h = hashlib.sha256()
    for name in sorted(weights):
        w = weights[name]
        if isinstance(w, StoredTensor):
            raw = w.buffer.host(nbytes(w.shape, w.dtype))
            h.update(f"{name}:{w.dtype}:{tuple(w.shape)}".encode())
        else:
            raw = np.ascontiguousarray(w, np.float32).view(np.uint8).reshape(-1)
            h.update(f"{name}:f32:{tuple(w.shape)}".encode())
        h.update(memoryview(raw))
    return h.hexdigest()


def _dequantized(weights: dict, path: pathlib.Path) -> dict:
    """f32 copies of every weight (for --full), read from the file once."""
    f = read_gguf(path)
    return {name: np.ascontiguousarray(f.tensor_f32(name).reshape(w.shape), np.float32)
            for name, w in weights.items()}


def _eval_batches(data, batch: int) -> list:
    """Every row of packed data once, in order, as batches (the last padded with empty rows)."""
    out = []
    for start in range(0, data.rows, batch):
        part = {k: v[start:start + batch] for k, v in data.fields().items()}
        short = batch - len(part["tokens"])
        if short:
            fill = {"tokens": 0, "targets": -1, "pos": 0, "seg": -1, "pair": -1}
            part = {k: np.concatenate([v, np.full((short, data.ctx), fill[k], np.int32)]) for k, v in part.items()}
        out.append(part)
    return out


def _base_type(weights) -> str:
    """The type most of the base's matrices are stored in ("f32" for arrays)."""
    if isinstance(weights, dict):
        types = [w.dtype if isinstance(w, StoredTensor) else "f32" for w in weights.values() if len(w.shape) == 2]
    else:    # a GGUFFile
        types = [dtype(int(t.type)).name for t in weights.tensors.values() if len(t.shape) == 2]
    return max(set(types), key=types.count) if types else "f32"


def _targets(text: str) -> tuple:
    """--lora-targets as a tuple; () for all."""
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    if not names:
        raise ConfigError(f"--lora-targets: no target given (all, or some of {', '.join(TARGETS)})")
    return () if names == ("all",) else names


def _warmup_updates(warmup: float, steps: int) -> int:
    """--warmup: a fraction of the run (< 1) or a number of updates."""
    if warmup < 0:
        raise ConfigError(f"--warmup must be >= 0, got {warmup}")
    return int(round(warmup * steps)) if warmup < 1 else int(warmup)


@app.command("finetune", help=f"Fine-tune a GGUF model (families {NAMES}): LoRA adapters on the "
             "frozen base (or every weight with --full), on text, chat or preference data (SFT, DPO, ORPO).")
def finetune(
    context: typer.Context,
    model: pathlib.Path = typer.Option(None, "--model",
                                       help=f"The base GGUF model (families {NAMES}; F32 ... Q4_0, K-quants); not needed with "
                                            "--full --resume of a model checkpoint (convert-checkpoint --to checkpoint)."),
    data: pathlib.Path = typer.Option(..., "--data", "--train-data",
                                      help="Training data: plain text (.txt), or records in JSON lines, a JSON "
                                           "array, Parquet or CSV (or a folder of such files): {\"text\"}, "
                                           "{\"prompt\", \"completion\"}, {\"messages\"} (OpenAI), "
                                           "{\"conversations\"} (ShareGPT), {\"instruction\", \"input\", \"output\"} "
                                           "(Alpaca), {\"instruction\", \"context\", \"response\"} (Dolly) or "
                                           "{\"prompt\", \"chosen\", \"rejected\"}."),
    out: pathlib.Path = typer.Option(..., "--out", "--lora-out", "--output-adapter",
                                     help="Where to write the LoRA adapter (llama.cpp's format); with --full, the model."),
    lora_rank: int = typer.Option(16, "--lora-rank", help="Rank r of each adapter."),
    lora_alpha: float = typer.Option(32.0, "--lora-alpha", help="Alpha: the adapters are scaled by alpha / r."),
    lora_targets: str = typer.Option("all", "--lora-targets", "--lora-modules",
                                     help=f"Comma-separated weights to adapt in every block, or all (every one the "
                                          f"model's family has; of {', '.join(TARGETS)})."),
    lora_dropout: float = typer.Option(0.0, "--lora-dropout", help="Dropout on the adapters' input."),
    full: bool = typer.Option(False, "--full", help="Train every weight (from the base, dequantized once); "
                              "--out is then a model."),
    merged_out: pathlib.Path = typer.Option(None, "--merged-out",
                                            help="Also write the base with the adapter merged in (a llama.cpp model)."),
    out_type: str = typer.Option(None, "--out-type",
                                 help=f"Type of the written model (--full, --merged-out), as llama.cpp's quantizer "
                                      f"names and mixes them: {', '.join(OUT_TYPES)} (default: f32 for --full; for "
                                      "--merged-out the base's type where it has 8 bits or more, else f16)."),
    method: str = typer.Option("sft", "--method",
                               help="sft (supervised: the completions' likelihood), or on preference pairs "
                                    "({\"prompt\", \"chosen\", \"rejected\"} records) dpo (Direct Preference "
                                    "Optimization against the model before training) or orpo (odds-ratio "
                                    "preference plus SFT on the chosen side, no reference)."),
    beta: float = typer.Option(0.1, "--beta", help="DPO's beta: how far the policy may move from the reference."),
    orpo_lambda: float = typer.Option(0.1, "--orpo-lambda", help="ORPO's weight of the odds-ratio term."),
    rpo_alpha: float = typer.Option(0.0, "--rpo-alpha", help="DPO: add this times the chosen answers' SFT loss "
                                    "(RPO, TRL's rpo_alpha), so the model also learns to write them."),
    eval_task: pathlib.Path = typer.Option(None, "--eval-task",
                                           help="A multiple-choice task (JSON lines of {\"context\", \"choices\", "
                                                "\"gold\"}, as `eval --task` reads): its accuracy at every "
                                                "--eval-every and at the end."),
    chat_template: pathlib.Path = typer.Option(None, "--chat-template",
                                               help="A Jinja chat template for chat data (default: the model's own)."),
    train_on_inputs: bool = typer.Option(False, "--train-on-inputs",
                                         help="Loss on every token of chat, instruction and prompt/completion records, "
                                              "not only the assistant turns / completions."),
    packing: bool = typer.Option(True, "--packing/--no-packing",
                                 help="Pack several samples into each --ctx window (each sees only itself)."),
    drop_long: bool = typer.Option(False, "--drop-long", help="Drop samples longer than --ctx instead of cutting them."),
    ctx: int = typer.Option(0, "--ctx", help="Tokens per window (default: min(512, the model's context))."),
    batch: int = typer.Option(1, "--batch", help="Windows of --ctx tokens per physical batch, of each process "
                              "under mpiexec (the default update is one window of 512 tokens)."),
    grad_acc: int = typer.Option(1, "--grad-acc", help="Physical batches per optimizer update."),
    steps: int = typer.Option(None, "--steps", help="Optimizer updates (default: one epoch)."),
    epochs: float = typer.Option(None, "--epochs", help="Instead of --steps: passes over the training data."),
    lr: float = typer.Option(None, "--lr", help=f"Peak learning rate (default {LR_LORA:g}; {LR_FULL:g} with --full)."),
    lr_min: float = typer.Option(None, "--lr-min", help="Floor of the cosine schedule (default --lr / 10)."),
    warmup: float = typer.Option(0.05, "--warmup", help="Linear warmup: a fraction of the run (< 1) or updates."),
    weight_decay: float = typer.Option(None, "--weight-decay", help="Decay of matrices (default 0.01; "
                                       "AdamW decoupled, SGD L2; lbfgs: none)."),
    optimizer: str = OPTIMIZER,
    momentum: float = MOMENTUM,
    grad_clip: float = GRAD_CLIP,
    checkpointing: bool = CHECKPOINTING,
    checkpoint_dir: pathlib.Path = CHECKPOINT_DIR,
    save_every: int = SAVE_EVERY,
    on_save_error: str = ON_SAVE_ERROR,
    resume: pathlib.Path = typer.Option(None, "--resume", help="Continue from a checkpoint (same --model and --data)."),
    eval_every: int = EVAL_EVERY,
    early_stop_patience: int = EARLY_STOP_PATIENCE,
    min_delta: float = MIN_DELTA,
    val_split: float = typer.Option(0.0, "--val-split", help="Fraction of the samples (text: of its end) held out."),
    seed: int = typer.Option(0, "--seed", help="Seed of the adapters' initialisation and the data order."),
    threads: int = THREADS,
    backend: str = BACKEND,
    log: pathlib.Path = LOG,
    quiet: bool = QUIET,
    token_cache: str = TOKEN_CACHE,
    config: pathlib.Path = CONFIG,
):
    """Fine-tune a GGUF model: LoRA adapters on the frozen base (or every weight with --full)."""
    t_start = time.perf_counter()
    world = start_world()
    record = config_record(context)
    be = make_backend(backend, threads)
    if world.lead:   # the one process that writes
        check_checkpoint_options(save_every, checkpoint_dir, on_save_error)
        check_out(out)
    if merged_out is not None:
        if world.lead:
            check_out(merged_out, "--merged-out")
        if full:
            raise ConfigError("--merged-out is for LoRA runs; with --full, --out is already the model")
    if steps is not None and epochs is not None:
        raise ConfigError("give --steps or --epochs, not both")
    if (steps is not None and steps < 1) or (epochs is not None and not epochs > 0):
        raise ConfigError("--steps must be >= 1 and --epochs > 0")
    if out_type is not None:
        out_type = check_write_type(out_type)
        if not full and merged_out is None:
            raise ConfigError(f"--out-type {out_type} is for a model (--full or --merged-out); the adapter is "
                              f"written F32, as llama.cpp reads adapters")
    if method not in METHODS:
        raise ConfigError(f"--method {method!r}: expected one of {', '.join(METHODS)}")
    task_items = None
    if eval_task is not None:
        with file_errors(f"--eval-task {eval_task}"):
            task_items = read_task(eval_task)
    ckpt, start = open_resume(resume, "finetune")   # start: a model checkpoint, a new --full run from it
    if start is not None and not full:
        raise ConfigError(f"--resume {resume}: a model checkpoint (no run yet) continues with --full; "
                          f"for LoRA, give the model itself as --model")
    if model is None and start is None:
        raise ConfigError("--model is required: the base model to fine-tune")
    if ckpt is not None:   # the run's settings are the checkpoint's
        rc = ckpt.run_config
        full = ckpt.kind == "finetune-full"
        ctx, packing, drop_long, train_on_inputs = rc["ctx"], rc["packing"], rc["drop_long"], rc["train_on_inputs"]
        val_split = rc["val_split"]
        pref = rc.get("preference") or {}
        method = pref.get("method", "sft")
        beta, orpo_lambda = pref.get("beta", beta), pref.get("orpo_lambda", orpo_lambda)
        rpo_alpha = pref.get("rpo_alpha", rpo_alpha)
    preference = PreferenceConfig(method, beta, orpo_lambda, rpo_alpha) if method != "sft" else None

    if start is not None:   # the checkpoint is the base (f32)
        model = resume
        arch, weights, tok = start.model_config, start.state["params"], start.tokenizer
    else:
        with file_errors(f"--model {model}", "GGUF file"):
            arch, weights, tok = open_model(model, be)
    base_file = read_gguf(model)
    carried = carried_kv(base_file)
    model_cfg = ModelConfig(**arch)
    ctx = ctx or min(512, model_cfg.ctx)
    if not 2 <= ctx <= model_cfg.ctx:
        raise ConfigError(f"--ctx {ctx} must be in 2..{model_cfg.ctx} (the model's context)")
    base_fp = fingerprint_weights(weights)
    if ckpt is not None and ckpt.run_config["base_fingerprint"] != base_fp:
        raise ConfigError(f"--resume {resume}: the checkpoint was trained on another base model than {model}")

    # ---- data: every process draws the global batches (batch x processes) --------------
    train_cfg = (TextConfig(**{**ckpt.train_config, **({"steps": steps} if steps is not None else {})})
                 .on(world.size) if ckpt is not None else None)
    global_batch = train_cfg.global_batch if ckpt is not None else batch * world.size
    def check_kind(kind: str, layout: str) -> None:
        if (kind == "preference") != (preference is not None):
            raise ConfigError(f"--data {data}: preference pairs train with --method dpo or orpo" if preference is None
                              else f"--method {method} trains on preference pairs ({{\"prompt\", \"chosen\", "
                                   f"\"rejected\"}} records); --data {data} holds "
                                   f"{'plain text' if kind == 'plain' else layout + ' records'}")
        if preference is not None and train_on_inputs:
            raise ConfigError(f"--train-on-inputs does not apply to --method {method}: its loss compares the answers")

    def template_of(kind: str, conversational: bool) -> ChatTemplate | None:
        return record_template(kind, conversational, base_file, chat_template)

    with file_errors(f"--data {data}"):
        plain = is_plain_text(data)
    if plain:
        check_kind("plain", "plain")
        kind = "plain"
    else:
        records = read_records(data, tok, template_of, template_id(base_file, chat_template), train_on_inputs,
                               token_cache, quiet, world, check_kind)
        kind = records.kind
    pairs = 0    # pair slots of a physical batch
    n_pairs = 0
    if not plain:   # packed rows are kept beside the samples, keyed by what decides them
        spec = f"ctx={ctx}|packing={packing}|drop_long={drop_long}|val={val_split}|seed={seed}"

        def packed_part(part: str, make) -> tuple:
            return packed_rows(records.cache_dir, records.key, f"{part}|{spec}", make)
    if kind == "preference":
        every = records.samples
        train_p, val_p = split_samples(every, val_split, seed)
        packed_data, stats, data_fp, _ = packed_part("train", lambda allocate: pack_pairs(
            train_p, ctx, packing=packing, drop_long=drop_long, where=Picked(records.where, train_p.idx),
            allocate=allocate))
        n_pairs = len(every)
        if packed_data.rows < global_batch:
            raise ConfigError(f"--data {data}: {packed_data.rows} windows of {ctx} tokens, fewer than "
                              f"one batch of {global_batch}; use a smaller --batch or --ctx")
        batches = PackedBatches(packed_data, global_batch, seed + 1)
        val_data = (packed_part("val", lambda allocate: pack_pairs(
            val_p, ctx, packing=packing, drop_long=drop_long, first_id=len(train_p),
            where=Picked(records.where, val_p.idx), allocate=allocate))[0] if len(val_p) else None)
        val_batches = _eval_batches(val_data, global_batch) if len(val_p) else []
        per_epoch = batches.batches_per_epoch
        packed = True
        pairs = pair_slots(packed_data.pair, global_batch // world.size)
        if val_data is not None:
            pairs = max(pairs, pair_slots(val_data.pair, global_batch // world.size))
        summary = (f"{stats.packed} preference pairs ({stats.truncated} cut, {stats.dropped} dropped at --ctx {ctx}), "
                   f"{stats.trained} trained of {stats.tokens} tokens in {stats.rows} windows; {method}")
    elif plain:
        corpus = read_corpus(data, tok, tok.add_bos, token_cache, quiet, world)
        ids = corpus.ids
        train_ids, val_ids = split_tokens(ids, val_split, ctx)
        batches = TokenWindows(train_ids, ctx, global_batch, seed + 1)
        val_batches = eval_windows(val_ids, ctx, global_batch, 8) if len(val_ids) else []
        per_epoch = batches.windows_per_epoch
        data_fp = corpus.fingerprint
        packed = False
        summary = f"{len(train_ids)} training / {len(val_ids)} validation tokens in windows of {ctx}"
    else:
        train_s, val_s = split_samples(records.samples, val_split, seed)
        packed_data, stats, data_fp, _ = packed_part("train", lambda allocate: pack(
            train_s, ctx, packing=packing, drop_long=drop_long, allocate=allocate))
        if packed_data.rows < global_batch:
            raise ConfigError(f"--data {data}: {packed_data.rows} windows of {ctx} tokens, fewer than "
                              f"one batch of {global_batch}; use a smaller --batch or --ctx")
        batches = PackedBatches(packed_data, global_batch, seed + 1)
        val_batches = _eval_batches(packed_part("val", lambda allocate: pack(
            val_s, ctx, packing=packing, drop_long=drop_long, allocate=allocate))[0], global_batch) if len(val_s) else []
        per_epoch = batches.batches_per_epoch
        packed = True
        summary = (f"{stats.samples} samples, {stats.trained} trained of {stats.tokens} tokens "
                   f"({stats.truncated} cut, {stats.dropped} dropped at --ctx {ctx}, {stats.empty} with "
                   f"nothing to train) in {stats.rows} windows{'' if packing else ' (no packing)'}")
    if ckpt is not None:
        check_resume_data(ckpt, data_fp, resume, data)

    # ---- what is trained ----------------------------------------------------------------
    val_batches = [world.shard(v) for v in val_batches]
    if ckpt is not None:
        lora_cfg = None if full else LoraConfig(**ckpt.run_config["lora"])
    else:
        n_steps = steps if steps is not None else max(1, math.ceil((epochs or 1.0) * per_epoch / grad_acc))
        peak, weight_decay, grad_clip = optimizer_settings(optimizer, lr, weight_decay, grad_clip,
                                                          LR_FULL if full else LR_LORA, 0.01)
        train_cfg = TextConfig(steps=n_steps, batch=batch, grad_acc=grad_acc, lr=peak,
                               lr_min=lr_min if lr_min is not None else peak / 10,
                               warmup=_warmup_updates(warmup, n_steps), weight_decay=weight_decay,
                               grad_clip=grad_clip, checkpointing=checkpointing, eval_every=eval_every, seed=seed,
                               world=world.size, optimizer=optimizer, momentum=momentum,
                               early_stop_patience=early_stop_patience, min_delta=min_delta)
        lora_cfg = None if full else LoraConfig(rank=lora_rank, alpha=lora_alpha, targets=_targets(lora_targets),
                                                dropout=lora_dropout)
    if full:
        if start is None and world.lead:
            typer.echo(f"--full: dequantizing the base's {len(weights)} tensors to f32 once", err=True)
        init, frozen = (weights if start is not None else _dequantized(weights, model)), None
        del weights
    else:
        names = lora_cfg.weights(model_cfg)
        init = init_lora(lora_cfg, {w: weights[w].shape for w in names}, train_cfg.seed)
        frozen = weights
    # logits only where a target is: at most the trained positions of the `batch` fullest rows
    loss_rows, counted = 0, 1.0     # counted: the mean share of the loss rows a batch fills
    if packed:   # (of this process's share)
        per_row = np.sort(packed_data.trained_per_row())[::-1]
        loss_rows = int(per_row[:train_cfg.batch].sum())
        if be.skips_uncounted_rows:
            counted = min(1.0, float(per_row.mean()) * train_cfg.batch / max(loss_rows, 1))
        if val_batches:
            loss_rows = max(loss_rows, max(int((v["targets"] >= 0).sum()) for v in val_batches))
    run = TextRun(model_cfg, ckpt.state["params"] if ckpt else init, train_cfg, be, frozen=frozen,
                  lora=lora_cfg, ctx=ctx, packed=packed, loss_rows=loss_rows, world=world,
                  preference=preference, pairs=pairs)
    if ckpt is not None:
        continue_run(run, batches, ckpt)
    elif preference is not None and preference.method == "dpo":
        # the reference: the model before training, once per pair (each process: every pair)
        sets = [packed_data] + ([val_data] if val_data is not None else [])
        rows = sum(d.rows for d in sets)
        bar = None if quiet or not world.lead else tqdm(total=rows, unit="row", desc="reference", file=sys.stderr)
        run.compute_reference(sets, n_pairs, progress=bar.update if bar is not None else None)
        if bar is not None:
            bar.close()
    mem = run.step.memory
    n_train = sum(v.size for v in init.values())
    if world.lead:
        procs = f" on each of {world.size} processes" if world.size > 1 else ""
        typer.echo(f"finetune: {'all' if full else 'LoRA'} {n_train} trained parameters "
                   f"({'' if full else f'rank {lora_cfg.rank}, alpha {lora_cfg.alpha:g}, '}"
                   f"{model_cfg.layers} blocks); {summary}; {train_cfg.steps} updates of {train_cfg.batch} x "
                   f"{train_cfg.grad_acc} windows{procs}; planned memory {mem.peak / 2**20:.1f} MiB; "
                   f"{be.describe()}", err=True)

    model_json = dataclasses.asdict(model_cfg)
    train_json = dataclasses.asdict(train_cfg)
    run_json = {"ctx": ctx, "packing": packing, "drop_long": drop_long, "train_on_inputs": train_on_inputs,
                "val_split": val_split, "base_fingerprint": base_fp, "base": str(model),
                "base_type": _base_type(weights if not full else base_file),
                "lora": None if full else dataclasses.asdict(lora_cfg), "options": record["options"],
                "preference": dataclasses.asdict(preference) if preference is not None else None}
    kind_name = "finetune-full" if full else "finetune-lora"

    def checkpoint(path: pathlib.Path) -> None:
        save_checkpoint(path, Checkpoint(kind_name, model_json, train_json, run.state(), tok, batches.state(),
                                         data_fp, run_config=run_json, extra_kv=carried))

    def task_accuracy() -> dict:
        """--eval-task's scores of the model as trained so far (a KV decoder over the trained weights)."""
        trained = run.param_values()
        if full:
            weights_, adapters_ = trained, None
        else:
            weights_ = frozen
            adapters_ = {w: (trained[factor_names(w)[0]], trained[factor_names(w)[1]], lora_cfg.scale)
                         for w in lora_cfg.weights(model_cfg)}
        with_errors = run_task(task_items, tok, model_cfg, weights_, be, adapters_, n_ctx=ctx, quiet=True)
        return {f"task_{k}": v for k, v in with_errors.items()}

    logf = JsonLog(log if world.lead else None)
    logf.write(record)
    # FLOPs per token as the kernels do them: the loss head's for the rows a batch fills (its
    # trained positions), the rest for every position
    logf.write({"event": "start", "load_s": time.perf_counter() - t_start, "flop_per_token": run.flop_per_token(counted),
                "updates": train_cfg.steps, "kind": kind_name})
    result = drive(run, Shard(batches, world), val_batches, log=logf, quiet=quiet, save_every=save_every,
                   checkpoint_dir=checkpoint_dir, out=out, checkpoint=checkpoint,
                    on_save_error=on_save_error, resumed_from=resume if ckpt is not None else None,
                   evaluate_task=task_accuracy if task_items else None)
    if not world.lead:
        return
    trained = run.param_values()
    if full:
        save_model(out, model_json, trained, tok, name="ggtrain finetune", out_type=out_type or "f32",
                   extra_kv=carried)
        wrote = f"wrote the model {out}"
    else:
        pairs = {w: (trained[factor_names(w)[0]], trained[factor_names(w)[1]])
                 for w in lora_cfg.weights(model_cfg)}
        write_lora(out, model_cfg.arch, lora_cfg.alpha, pairs)
        wrote = f"wrote the adapter {out}"
        if merged_out is not None:
            merged = write_merged(merged_out, base_file, pairs, lora_cfg.alpha, out_type=out_type, src=out)
            wrote += f" and the merged model {merged_out} ({merged.words()})"
            if merged.warning():
                typer.echo(merged.warning(), err=True)
    logf.write({"event": "done", **result, "out": str(out)})
    logf.close()
    task = f"; task {task_words(result, 'task_')}" if "task_acc" in result else ""
    typer.echo(f"done: {result['stopped']}; {validation_words(result)}{task}; {wrote}", err=True)
