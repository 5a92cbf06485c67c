"""`ggtrain finetune`: LoRA (or full) fine-tuning of a GGUF model of any family on text, chat,
instruction or preference data (layer 6).

The base model stays in the types its file stores them in (no f32 copy) and frozen; LoRA
factors are trained in f32 and written as a llama.cpp adapter (`--out`), optionally also
merged into a model (`--merged-out`). With --full every weight is trained, from the base
dequantized once, and `--out` is a model. Checkpoints resume bit-identically; a checkpoint
is tied to its base model and data by their fingerprints. The base file is read once.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import pathlib

import numpy as np
import typer

from ggtrain.cli.common import file_errors, imatrix_option, progress_bar
from ggtrain.cli.finetune_data import DataOptions, training_data
from ggtrain.cli.loop import TrainingCommand, check_length, check_resume_data, continue_run, optimizer_settings, validation_words
from ggtrain.cli.main import app
from ggtrain.cli.options import (BACKEND, CHECKPOINT_DIR, CHECKPOINTING, CONFIG, DATA, EARLY_STOP_PATIENCE,
                                 EVAL_EVERY, EVALUATION, GRAD_ACC, GRAD_CLIP, HELLASWAG, LOG, LORA, LR_MIN, MIN_DELTA,
                                 MODEL, MOE_AUX_LOSS, MOMENTUM, OBJECTIVE, ON_SAVE_ERROR, OPTIMIZER, QUIET, SAVE_EVERY,
                                 STEPS, THREADS, TOKEN_CACHE, WINOGRANDE, Backend, OnSaveError, Optimizer, choice,
                                 flag, opt_batch, opt_epochs, opt_imatrix, opt_lr, opt_resume, opt_seed, opt_val_split,
                                 opt_warmup, opt_weight_decay, task_format, warmup_updates)
from ggtrain.cli.tasks import run_task, task_words
from ggtrain.core.backend import StoredTensor
from ggtrain.core.distributed import Shard
from ggtrain.core.models.config import ModelConfig
from ggtrain.core.models.families import NAMES
from ggtrain.core.models.lora import TARGETS, LoraConfig, factor_names, init_lora
from ggtrain.core.preference import METHODS, PreferenceConfig
from ggtrain.core.train import TextConfig, TextRun
from ggtrain.errors import ConfigError
from ggtrain.formats.checkpoint import Checkpoint, save_checkpoint
from ggtrain.formats.gguf import read_gguf
from ggtrain.formats.lora import write_lora, write_merged
from ggtrain.formats.mixture import OUT_TYPES
from ggtrain.formats.model_file import carried_kv, check_write_type, open_model, save_model
from ggtrain.formats.tasks import read_task
from ggtrain.native.dtypes import dtype, nbytes
from ggtrain.words import count

# Defaults that learn ../shared/data/chat/dummy_conversation.json (the Vicuna identity, 41k
# tokens) in one epoch on SmolLM2-135M: 84 updates of one packed 512-token window at 5e-4
# (21 updates of four windows at 2e-4 lowered the loss from 3.4 to 0.7 without the name).
LR_LORA, LR_FULL = 5e-4, 1e-5

Method, METHOD = choice("sft", "--method", values=METHODS, panel=OBJECTIVE,
                        help="sft: the completions' likelihood; on {\"prompt\", \"chosen\", \"rejected\"} pairs dpo "
                             "(against the model before training) or orpo (odds ratio plus SFT, no reference).")


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


@dataclasses.dataclass
class _Base:
    """The model fine-tuned: its path, config, weights (stored, or f32 from a model
    checkpoint), tokenizer, file (read once) and fingerprint."""
    path: pathlib.Path
    cfg: ModelConfig
    weights: dict
    tok: object
    file: object
    fingerprint: str


def _open_base(cmd: TrainingCommand, model: pathlib.Path | None, full: bool) -> _Base:
    start, resume = cmd.start, cmd.resume
    if start is not None and not full:
        raise ConfigError(f"--resume {resume}: a model checkpoint (no run yet) continues with --full; for LoRA, give "
                          f"the model itself as --model")
    if model is None and start is None:
        raise ConfigError("--model is required: the base model to fine-tune")
    path = resume if start is not None else model
    with file_errors(f"--model {path}", "GGUF file"):
        f = read_gguf(path)
        if start is not None:   # the checkpoint is the base (f32)
            arch, weights, tok = start.model_config, start.state["params"], start.tokenizer
        else:
            arch, weights, tok = open_model(path, cmd.backend, file=f)
    fp = fingerprint_weights(weights)
    if cmd.ckpt is not None and cmd.ckpt.run_config["base_fingerprint"] != fp:
        raise ConfigError(f"--resume {resume}: the checkpoint was trained on another base model than {path}")
    return _Base(path, ModelConfig(**arch), weights, tok, f, fp)


def _adapters(lora_cfg: LoraConfig, cfg: ModelConfig, trained: dict, with_scale: bool) -> dict:
    """{weight: (A, B)} (or (A, B, scale)) of the trained factors."""
    return {w: (trained[factor_names(w)[0]], trained[factor_names(w)[1]]) + ((lora_cfg.scale,) if with_scale else ())
            for w in lora_cfg.weights(cfg)}


@app.command("finetune", rich_help_panel="Train",
             help="Fine-tune a GGUF model: LoRA adapters (or every weight) on text, chat, instruction or "
                  "preference data.")
def finetune(
    context: typer.Context,
    model: pathlib.Path = typer.Option(None, "--model", rich_help_panel=MODEL, show_default=False,
                                       help=f"The base GGUF model ({NAMES}; any type llama.cpp writes)."),
    out: pathlib.Path = typer.Option(..., "--out", rich_help_panel=MODEL, show_default=False,
                                     help="The LoRA adapter to write (llama.cpp's format); with --full, the model. "
                                          "Also --lora-out, --output-adapter."),
    merged_out: pathlib.Path = typer.Option(None, "--merged-out", rich_help_panel=MODEL, show_default=False,
                                            help="Also write the base with the adapter merged in."),
    out_type: str = typer.Option(None, "--out-type", rich_help_panel=MODEL, show_default=False, metavar="TYPE",
                                 help=f"Type of a written model: {', '.join(OUT_TYPES)} (default: f16 where the "
                                      "base has under 8 bits a weight, else the base's; f32 with --full)."),
    imatrix: str = opt_imatrix(MODEL),
    data: pathlib.Path = typer.Option(..., "--data", rich_help_panel=DATA, show_default=False,
                                      help="Text (.txt), or records (JSON lines, JSON, Parquet, CSV, or a folder of "
                                           "them): text, prompt/completion, chat, Alpaca, Dolly or preference "
                                           "pairs. Also --train-data."),
    chat_template: pathlib.Path = typer.Option(None, "--chat-template", rich_help_panel=DATA, show_default=False,
                                               help="A Jinja chat template (default: the model's)."),
    train_on_inputs: bool = flag(False, "--train-on-inputs", panel=DATA,
                                 help="Loss on every token, not only the answers."),
    packing: bool = flag(True, "--packing/--no-packing", panel=DATA,
                         help="Several samples a window, each seeing only itself."),
    drop_long: bool = flag(False, "--drop-long", panel=DATA, help="Drop samples longer than --ctx (not cut)."),
    ctx: int = typer.Option(0, "--ctx", rich_help_panel=DATA, show_default=False,
                            help="Tokens a window (default, or 0: 512, or the model's context when shorter)."),
    token_cache: str = TOKEN_CACHE,
    full: bool = flag(False, "--full", panel=LORA, help="Train every weight instead (--out is then a model)."),
    lora_rank: int = typer.Option(16, "--lora-rank", rich_help_panel=LORA, help="Rank r of each adapter."),
    lora_alpha: float = typer.Option(32.0, "--lora-alpha", rich_help_panel=LORA, help="Adapters scaled by alpha / r."),
    lora_targets: str = typer.Option("all", "--lora-targets", rich_help_panel=LORA,
                                     help=f"Weights to adapt, comma-separated, or all (the family's defaults; of "
                                          f"{', '.join(TARGETS)}: the *_exps experts only when named). "
                                          "Also --lora-modules."),
    lora_dropout: float = typer.Option(0.0, "--lora-dropout", rich_help_panel=LORA,
                                       help="Dropout on each adapter's input while training: in x A^T B^T "
                                            "only (the frozen product sees all of x), this fraction of x "
                                            "zeroed, the rest scaled by 1 / (1 - it); [0, 1), 0: none."),
    method: Method = METHOD,
    beta: float = typer.Option(0.1, "--beta", rich_help_panel=OBJECTIVE, help="DPO's beta."),
    orpo_lambda: float = typer.Option(0.1, "--orpo-lambda", rich_help_panel=OBJECTIVE,
                                      help="ORPO's weight of the odds ratio."),
    rpo_alpha: float = typer.Option(0.0, "--rpo-alpha", rich_help_panel=OBJECTIVE,
                                    help="DPO: plus this times the chosen answers' SFT loss (RPO)."),
    steps: int = STEPS,
    epochs: float = opt_epochs("1"),
    batch: int = opt_batch(1, "Windows of --ctx tokens a micro-batch; an update is --batch x --grad-acc of "
                              "them (on each process under mpiexec). One by default: small data learns in a few "
                              "updates."),
    grad_acc: int = GRAD_ACC,
    lr: float = opt_lr(f"{LR_LORA:g}; {LR_FULL:g} with --full"),
    lr_min: float = LR_MIN,
    warmup: float = opt_warmup(0.05),
    weight_decay: float = opt_weight_decay("0.01"),
    optimizer: Optimizer = OPTIMIZER,
    momentum: float = MOMENTUM,
    grad_clip: float = GRAD_CLIP,
    moe_aux_loss: float = MOE_AUX_LOSS,
    eval_every: int = EVAL_EVERY,
    eval_task: pathlib.Path = typer.Option(None, "--eval-task", rich_help_panel=EVALUATION, show_default=False,
                                           help="A multiple-choice task (as eval --task reads): its accuracy at "
                                                "every --eval-every and at the end."),
    hellaswag: bool = HELLASWAG,
    winogrande: bool = WINOGRANDE,
    early_stop_patience: int = EARLY_STOP_PATIENCE,
    min_delta: float = MIN_DELTA,
    val_split: float = opt_val_split(0.0, "0: small fine-tuning sets train on every sample"),
    checkpointing: bool = CHECKPOINTING,
    checkpoint_dir: pathlib.Path = CHECKPOINT_DIR,
    save_every: int = SAVE_EVERY,
    on_save_error: OnSaveError = ON_SAVE_ERROR,
    resume: pathlib.Path = opt_resume("same --model and --data"),
    seed: int = opt_seed("the adapters' initialization and the data order"),
    threads: int = THREADS,
    backend: Backend = BACKEND,
    log: pathlib.Path = LOG,
    quiet: bool = QUIET,
    config: pathlib.Path = CONFIG,
):
    cmd = TrainingCommand(context, "finetune", backend=backend, threads=threads,
                          outs={"--out": out, "--merged-out": merged_out}, save_every=save_every,
                          checkpoint_dir=checkpoint_dir, on_save_error=on_save_error, resume=resume, log=log,
                          quiet=quiet)
    out_type = _check_options(full, merged_out, out_type, steps, epochs)
    im = imatrix_option(imatrix, out_type)
    task_items = None
    fmt = task_format(hellaswag, winogrande, eval_task, "--eval-task")
    if eval_task is not None:
        with file_errors(f"--eval-task {eval_task}"):
            task_items = read_task(eval_task, fmt)
    ckpt, world = cmd.ckpt, cmd.world
    opts = DataOptions(data, ctx, packing, drop_long, train_on_inputs, val_split, seed, chat_template, token_cache)
    pref = PreferenceConfig(method, beta, orpo_lambda, rpo_alpha) if method != "sft" else None
    if ckpt is not None:   # the run's settings are the checkpoint's
        rc = ckpt.run_config
        full = ckpt.kind == "finetune-full"
        opts = DataOptions(data, rc["ctx"], rc["packing"], rc["drop_long"], rc["train_on_inputs"], rc["val_split"],
                           seed, chat_template, token_cache)
        pref = PreferenceConfig(**rc["preference"]) if rc.get("preference") else None
    if moe_aux_loss and not full:   # before the base and the data are read
        raise ConfigError("--moe-aux-loss is for --full: it balances routers trained whole, not LoRA adapters")
    if moe_aux_loss and pref is not None:
        raise ConfigError(f"--moe-aux-loss is for --method sft: it balances routers trained on text, not under "
                          f"{pref.method}'s preference objective")
    base = _open_base(cmd, model, full)
    opts = dataclasses.replace(opts, ctx=opts.ctx or min(512, base.cfg.ctx))
    if not 2 <= opts.ctx <= base.cfg.ctx:
        raise ConfigError(f"--ctx {opts.ctx} must be in 2..{base.cfg.ctx} (the model's context)")
    train_cfg = (TextConfig(**{**ckpt.train_config, **({"steps": steps} if steps is not None else {})})
                 .on(world.size) if ckpt is not None else None)
    td = training_data(opts, base.tok, base.file, train_cfg.global_batch if ckpt else batch * world.size, pref,
                       quiet, world)
    if ckpt is not None:
        check_resume_data(ckpt, td.fingerprint, resume, data)
        lora_cfg = None if full else LoraConfig(**ckpt.run_config["lora"])
    else:
        n_steps = steps if steps is not None else max(1, math.ceil((epochs or 1.0) * td.per_epoch / grad_acc))
        peak, decay, clip = optimizer_settings(optimizer, lr, weight_decay, grad_clip,
                                               LR_FULL if full else LR_LORA, 0.01)
        train_cfg = TextConfig(steps=n_steps, batch=batch, grad_acc=grad_acc, lr=peak,
                               lr_min=lr_min if lr_min is not None else peak / 10,
                               warmup=warmup_updates(warmup, n_steps), weight_decay=decay, grad_clip=clip,
                               checkpointing=checkpointing, eval_every=eval_every, seed=seed, world=world.size,
                               optimizer=optimizer, momentum=momentum, early_stop_patience=early_stop_patience,
                               min_delta=min_delta, moe_aux_loss=moe_aux_loss)
        lora_cfg = None if full else LoraConfig(lora_rank, lora_alpha, _targets(lora_targets), lora_dropout)
    init, frozen = _start_params(cmd, base, lora_cfg, train_cfg.seed)
    loss_rows, counted = td.loss_rows(train_cfg.batch, cmd.backend.skips_uncounted_rows)
    run = TextRun(base.cfg, ckpt.state["params"] if ckpt else init, train_cfg, cmd.backend, frozen=frozen,
                  lora=lora_cfg, ctx=opts.ctx, packed=td.packed is not None, loss_rows=loss_rows, world=world,
                  preference=pref, pairs=td.pairs)
    if ckpt is not None:
        continue_run(run, td.batches, ckpt)
    elif pref is not None and pref.method == "dpo":   # the reference: the model before training, once a pair
        sets = [td.packed] + ([td.val_packed] if td.val_packed is not None else [])
        bar = progress_bar(quiet or not world.lead, total=sum(d.rows for d in sets), unit="row", desc="reference")
        run.compute_reference(sets, td.n_pairs, progress=bar.update if bar is not None else None)
        if bar is not None:
            bar.close()
    procs = f" on each of {world.size} processes" if world.size > 1 else ""
    cmd.summary(f"finetune: {'all' if full else 'LoRA'} {sum(v.size for v in init.values()):,} trained parameters "
                f"({'' if full else f'rank {lora_cfg.rank}, alpha {lora_cfg.alpha:g}, '}{base.cfg.layers} blocks); "
                f"{td.summary}; {count(train_cfg.steps, 'update')} of {train_cfg.batch} x {train_cfg.grad_acc} "
                f"window{'' if train_cfg.batch * train_cfg.grad_acc == 1 else 's'}{procs}",
                run)
    kind_name = "finetune-full" if full else "finetune-lora"
    run_json = {"ctx": opts.ctx, "packing": opts.packing, "drop_long": opts.drop_long,
                "train_on_inputs": opts.train_on_inputs, "val_split": opts.val_split,
                "base_fingerprint": base.fingerprint, "base": str(base.path),
                "base_type": _base_type(base.file if full else base.weights),
                "lora": None if full else dataclasses.asdict(lora_cfg), "options": cmd.record["options"],
                "preference": dataclasses.asdict(pref) if pref is not None else None}
    model_json, train_json, carried = dataclasses.asdict(base.cfg), dataclasses.asdict(train_cfg), carried_kv(base.file)

    def checkpoint(path: pathlib.Path) -> None:
        save_checkpoint(path, Checkpoint(kind_name, model_json, train_json, run.state(), base.tok, td.batches.state(),
                                         td.fingerprint, run_config=run_json, extra_kv=carried))

    def task_accuracy() -> dict:
        """--eval-task's scores of the model as trained so far."""
        trained = run.param_values()
        weights, adapters = (trained, None) if full else (frozen, _adapters(lora_cfg, base.cfg, trained, True))
        scores = run_task(task_items, base.tok, base.cfg, weights, cmd.backend, adapters, n_ctx=opts.ctx, quiet=True)
        return {f"task_{k}": v for k, v in scores.items()}

    # FLOPs per token as the kernels do them: the loss head's for the rows a batch fills (its
    # trained positions), the rest for every position
    cmd.open_log(run, flop_per_token=run.flop_per_token(counted), updates=train_cfg.steps, kind=kind_name)
    result = cmd.drive(run, Shard(td.batches, world), [world.shard(v) for v in td.val_batches], checkpoint, out,
                       evaluate_task=task_accuracy if task_items else None)
    if not world.lead:
        return
    wrote = _write_outputs(cmd, base, run.param_values(), lora_cfg, model_json, carried, out, merged_out, out_type, im)
    task = f"; task {task_words(result, 'task_')}" if "task_acc" in result else ""
    cmd.finish(result, out, f"{validation_words(result)}{task}; {wrote}")


def _start_params(cmd: TrainingCommand, base, lora_cfg, seed: int) -> tuple:
    """(the trained parameters' first values, the frozen weights or None): with --full every
    weight of the base (dequantized to f32 once for a new run), else new LoRA adapters."""
    if lora_cfg is not None:
        shapes = {w: base.weights[w].shape for w in lora_cfg.weights(base.cfg)}
        return init_lora(lora_cfg, shapes, seed), base.weights
    if cmd.start is not None:
        return base.weights, None
    cmd.say(f"--full: dequantizing the base's {len(base.weights)} tensors to f32 once")
    return {name: np.ascontiguousarray(base.file.tensor_f32(name).reshape(w.shape), np.float32)
            for name, w in base.weights.items()}, None


def _write_outputs(cmd: TrainingCommand, base, trained: dict, lora_cfg, model_json: dict, carried: dict,
                   out: pathlib.Path, merged_out, out_type, imatrix=None) -> str:
    """Write what the run made (the model with --full; else the adapter, and with --merged-out
    the merged model, warning where its types lose the fine-tune), quantized with the importance
    matrix `imatrix` where given; the words that say so."""
    if lora_cfg is None:
        save_model(out, model_json, trained, base.tok, name="ggtrain finetune", out_type=out_type or "f32",
                   extra_kv=carried, imatrix=imatrix)
        return f"wrote the model {out}"
    pairs = _adapters(lora_cfg, base.cfg, trained, False)
    write_lora(out, base.cfg.arch, lora_cfg.alpha, pairs)
    wrote = f"wrote the adapter {out}"
    if merged_out is not None:
        merged = write_merged(merged_out, base.file, pairs, lora_cfg.alpha, out_type=out_type, src=out, imatrix=imatrix)
        wrote += f" and the merged model {merged_out} ({merged.words()})"
        if merged.warning():
            cmd.say(merged.warning())
    return wrote


def _check_options(full: bool, merged_out, out_type, steps, epochs) -> str | None:
    """The option combinations refused before anything is read; --out-type as ggtrain names it."""
    if merged_out is not None and full:
        raise ConfigError("--merged-out is for LoRA runs; with --full, --out is already the model")
    check_length(steps, epochs)
    if out_type is not None:
        out_type = check_write_type(out_type)
        if not full and merged_out is None:
            raise ConfigError(f"--out-type {out_type} is for a model (--full or --merged-out); the adapter is "
                              f"written F32, as llama.cpp reads adapters")
    return out_type
