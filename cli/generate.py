"""`ggtrain generate` and `ggtrain eval`: run a GGUF model of any family (layer 6).

The model's weights stay in the types the file stores them in (F32 ... Q4_0, K-quants),
read straight into backend memory; a LoRA adapter is applied on the fly, as llama.cpp
applies one (no merged copy of the weights).
"""
from __future__ import annotations

import codecs
import secrets
import json
import math
import pathlib
import sys
import time

import numpy as np
import typer

from ggtrain.cli.common import file_errors, make_backend, numerics_for, option_named, progress_bar
from ggtrain.cli.options import (BACKEND, CACHE_TYPE, HELLASWAG, SAMPLING, THREADS, WINOGRANDE, Backend, CacheType,
                                 opt_numerics, task_format)
from ggtrain.cli.tasks import run_task, task_words
from ggtrain.cli.main import app
from ggtrain.core.models.config import ModelConfig
from ggtrain.core.models.inference import Decoder, Runner, generate
from ggtrain.core.numerics import EXACT, LLAMA
from ggtrain.core.models.families import NAMES
from ggtrain.core.sampling import Sampler
from ggtrain.errors import ConfigError
from ggtrain.formats.chat import chat_template as find_template
from ggtrain.formats.datafile import read_text
from ggtrain.formats.dataset import chat_prompt
from ggtrain.formats.gguf import read_gguf
from ggtrain.formats.model_file import open_model
from ggtrain.formats.lora import lora_adapters
from ggtrain.formats.tasks import read_task

# the context generate reserves when it runs until end of generation (-n -1) and no --ctx is given
UNTIL_EOG_CTX = 4096
Numerics, NUMERICS_OPTION = opt_numerics(
    "the default of generate and eval", "its logits, so its greedy text and perplexity; CPU only): ~20% faster for "
    "generate, 2-3x slower for eval over whole windows")
# the flags --numerics replaced, kept one release (each says what replaces it)
OLD_EXACT = typer.Option(False, "--exact", hidden=True)
OLD_INT8 = typer.Option(False, "--int8", hidden=True)


def _open(model, lora, lora_scale, backend):
    """Config, weights in backend memory, tokenizer, and the adapter (or None) of a model."""
    with file_errors(f"--model {model}"), option_named("--model"):
        config, weights, tok = open_model(model, backend)
    adapters = None
    if lora is not None:
        with file_errors(f"--lora {lora}"), option_named("--lora"):
            adapters = lora_adapters(lora, {n: w.shape for n, w in weights.items()}, lora_scale, config["arch"])
    return ModelConfig(**config), weights, tok, adapters


@app.command("generate", rich_help_panel="Run", help="Continue a prompt with a GGUF model (or answer one chat "
             "turn), printing the continuation as it comes.")
def generate_cmd(
    model: pathlib.Path = typer.Option(..., "--model", help=f"A GGUF model (families {NAMES}; F32, F16, Q8_0, Q4_0, K-quants, ...)."),
    lora: pathlib.Path = typer.Option(None, "--lora", help="A LoRA adapter GGUF (llama.cpp's format) to apply."),
    lora_scale: float = typer.Option(1.0, "--lora-scale", help="Scale of the adapter (as llama.cpp's --lora-scaled)."),
    prompt: str = typer.Option(..., "--prompt", help="Text to continue (with --chat: the user's message)."),
    chat: bool = typer.Option(False, "--chat", help="Render --prompt as one user turn with the model's chat "
                              "template (and its generation prompt); the answer stops at the end of its turn."),
    system: str = typer.Option(None, "--system", help="With --chat: a system message before the user's."),
    chat_template: pathlib.Path = typer.Option(None, "--chat-template",
                                               help="With --chat: a Jinja chat template instead of the model's."),
    n: int = typer.Option(64, "-n", "--n-predict", rich_help_panel=SAMPLING,
                          help="Tokens to generate; -1: until an end-of-generation token or the context is full. "
                               "Also --n-tokens."),
    temp: float = typer.Option(0.0, "--temp", rich_help_panel=SAMPLING, help="Sampling temperature; 0 is greedy (llama.cpp's greedy tokens)."),
    top_k: int = typer.Option(40, "--top-k", rich_help_panel=SAMPLING, help="Sample among the K most likely tokens (0: all)."),
    top_p: float = typer.Option(0.95, "--top-p", rich_help_panel=SAMPLING, help="Sample among the most likely tokens holding this much "
                                "probability (1: all)."),
    min_p: float = typer.Option(0.05, "--min-p", rich_help_panel=SAMPLING, help="Drop tokens less likely than this fraction of the most "
                                "likely one (0: off)."),
    repeat_penalty: float = typer.Option(1.0, "--repeat-penalty", rich_help_panel=SAMPLING,
                                         help="Penalize the last 64 tokens' ids (1: off; llama.cpp's rule)."),
    seed: int = typer.Option(None, "--seed", rich_help_panel=SAMPLING, show_default=False,
                             help="Seed of the sampler (default: a random one, printed with --timings)."),
    ctx: int = typer.Option(0, "--ctx", show_default=False, help="Positions of the KV cache (default, or 0: prompt + n, or "
                            f"min({UNTIL_EOG_CTX}, the model's context) with -n -1)."),
    threads: int = THREADS,
    backend: Backend = BACKEND,
    numerics: Numerics = NUMERICS_OPTION,
    cache_type: CacheType = CACHE_TYPE,
    exact: bool = OLD_EXACT,
    timings: bool = typer.Option(False, "--timings", help='Print {"load_s", "prompt_tokens", "prompt_s", '
                                 '"tokens", "tokens_per_s", "seed"} as JSON on stderr at the end.'),
):
    """Continue a prompt with a GGUF model (KV-cached); prints only the continuation, as it comes."""
    t_start = time.perf_counter()
    if n < -1:
        raise ConfigError(f"-n must be >= 0, or -1 for 'until end of generation', got {n}")
    if top_k < 0:
        raise ConfigError(f"--top-k must be >= 0, got {top_k}")
    for option, value in (("--top-p", top_p), ("--min-p", min_p)):
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"{option} is a probability (0..1), got {value}")
    if temp < 0 or repeat_penalty <= 0:
        raise ConfigError(f"--temp must be >= 0 and --repeat-penalty > 0, got {temp}, {repeat_penalty}")
    if ctx < 0:
        raise ConfigError(f"--ctx must be >= 1 (0: the default), got {ctx}")
    seed = secrets.randbits(31) if seed is None else seed     # (llama.cpp's default is random too)
    sampler = Sampler(temp=temp, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty,
                      seed=seed)
    be = make_backend(backend, threads)
    numerics = numerics_for(EXACT if exact else numerics, be, "--exact" if exact else None)
    cfg, weights, tok, adapters = _open(model, lora, lora_scale, be)
    if chat:
        messages = ([{"role": "system", "content": system}] if system is not None else []) + \
            [{"role": "user", "content": prompt}]
        with option_named("--chat"):
            template = find_template(read_gguf(model), chat_template)
        ids = chat_prompt(messages, tok, template).tolist()
    elif system is not None or chat_template is not None:
        raise ConfigError("--system and --chat-template apply to --chat")
    else:
        ids = tok.encode(prompt, add_bos=tok.add_bos).tolist()
    if not ids:
        raise ConfigError("--prompt gives no tokens (and the model adds no BOS): nothing to continue")
    n_ctx = ctx or (min(cfg.ctx, len(ids) + n) if n >= 0 else min(cfg.ctx, UNTIL_EOG_CTX))
    if ctx > cfg.ctx:
        raise ConfigError(f"--ctx {ctx} exceeds the model's context of {cfg.ctx}")
    if len(ids) >= n_ctx and n != 0:
        raise ConfigError(f"--prompt has {len(ids)} tokens; the context is {n_ctx} "
                          f"(the model's: {cfg.ctx}; set it with --ctx)")
    if n == 0:
        sys.stdout.write("\n")
        return
    decoder = Decoder(cfg, weights, be, n_ctx=n_ctx, adapters=adapters, numerics=numerics,
                      kv_f16=cache_type == "f16")
    text = codecs.getincrementaldecoder("utf-8")(errors="replace")
    stop = frozenset(tok.eog_ids)
    t_loaded = time.perf_counter()
    stamps = []     # time after each token was chosen (the first: after the prompt)
    stopped = False
    for t in generate(decoder, ids, n, sampler, stop):
        stamps.append(time.perf_counter())
        if t in stop:
            stopped = True
            break
        sys.stdout.write(text.decode(tok.decode_bytes([t])))
        sys.stdout.flush()
    sys.stdout.write(text.decode(b"", final=True) + "\n")
    if not stopped and len(ids) + len(stamps) >= n_ctx and (n < 0 or len(stamps) < n):
        sys.stderr.write(f"note: stopped at the context of {n_ctx} positions ({len(ids)} of the prompt, "
                         f"{len(stamps)} generated{f' of -n {n}' if n >= 0 else ''}; the model's context is "
                         f"{cfg.ctx}{'' if n_ctx == cfg.ctx else ', --ctx sets ours'})\n")
    if timings:
        rate = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0
        sys.stderr.write(json.dumps({"load_s": round(t_loaded - t_start, 4), "prompt_tokens": len(ids),
                                     "prompt_s": round(stamps[0] - t_loaded, 4), "tokens": len(stamps),
                                     "tokens_per_s": round(rate, 3), "seed": seed}) + "\n")


@app.command("eval", rich_help_panel="Run", help="A model's perplexity on a text, or its accuracy on a "
             "multiple-choice task.")
def eval_cmd(
    model: pathlib.Path = typer.Option(..., "--model", help=f"A GGUF model (families {NAMES})."),
    lora: pathlib.Path = typer.Option(None, "--lora", help="A LoRA adapter GGUF (llama.cpp's format) to apply."),
    lora_scale: float = typer.Option(1.0, "--lora-scale", help="Scale of the adapter."),
    data: pathlib.Path = typer.Option(None, "--data", help="A UTF-8 plain-text file: its perplexity (records, "
                                      "binary files and formats ggtrain does not read are errors)."),
    task: pathlib.Path = typer.Option(None, "--task", help="A multiple-choice task: JSON lines of {\"context\", "
                                      "\"choices\", \"gold\"} (or llama-perplexity's files with --hellaswag / "
                                      "--winogrande); accuracy as lm-evaluation-harness scores it."),
    hellaswag: bool = HELLASWAG,
    winogrande: bool = WINOGRANDE,
    limit: int = typer.Option(0, "--limit", help="Score only the first N task items (0: all)."),
    ctx: int = typer.Option(0, "--ctx", show_default=False, help="Window length (default, or 0: min(model context, 512)); for --task the "
                            "most tokens a choice may take (default: the model's context)."),
    half_window: bool = typer.Option(False, "--half-window", help="Score --data as llama-perplexity does: "
                                     "--ctx chunks, each begun with BOS, the second half of each scored."),
    as_json: bool = typer.Option(False, "--json", help='Print {"perplexity", "nll", "tokens"} (--task: {"items", '
                                 '"acc", "acc_stderr", "acc_norm", "acc_norm_stderr"}) as JSON.'),
    quiet: bool = typer.Option(False, "--quiet", help="No progress bar."),
    threads: int = THREADS,
    backend: Backend = BACKEND,
    numerics: Numerics = NUMERICS_OPTION,
    cache_type: CacheType = CACHE_TYPE,
    int8: bool = OLD_INT8,
):
    """Perplexity of a model on a text (non-overlapping windows, every token scored once; or
    llama-perplexity's half windows), or its accuracy on a multiple-choice task."""
    if (data is None) == (task is None):
        raise ConfigError("give --data TEXT (perplexity) or --task FILE (multiple choice), one of them")
    fmt = task_format(hellaswag, winogrande, task, "--task")
    if half_window and task is not None:
        raise ConfigError("--half-window scores --data (a text), not --task")
    if limit < 0:
        raise ConfigError(f"--limit must be >= 0, got {limit}")
    be = make_backend(backend, threads)
    numerics = numerics_for(LLAMA if int8 else numerics, be, "--int8" if int8 else None)
    f16 = cache_type == "f16"
    cfg, weights, tok, adapters = _open(model, lora, lora_scale, be)
    if task is not None:
        with file_errors(f"--task {task}"):
            items = read_task(task, fmt)
        items = items[:limit] if limit else items
        if not 0 <= ctx <= cfg.ctx:
            raise ConfigError(f"--ctx {ctx}: must be in 1..{cfg.ctx} (the model's context)")
        result = run_task(items, tok, cfg, weights, be, adapters, n_ctx=ctx, numerics=numerics, kv_f16=f16,
                          quiet=quiet)
        if as_json:
            typer.echo(json.dumps(result))
        else:
            typer.echo(task_words(result))
        return
    length = ctx or min(cfg.ctx, 512)
    if not 1 <= length <= cfg.ctx:
        raise ConfigError(f"--ctx {ctx}: must be in 1..{cfg.ctx} (the model's context)")
    with file_errors(f"--data {data}", "text file"):
        text = read_text(data)
    ids = tok.encode(text, add_bos=tok.add_bos)
    if len(ids) < 2:
        raise ConfigError(f"--data {data}: fewer than 2 tokens to score")
    windows = _half_windows(ids, length, tok) if half_window else _windows(ids, length)
    runner = Runner(cfg, weights, be, length=len(windows[0][0]), adapters=adapters, n_ctx=length,
                    numerics=numerics, kv_f16=f16)
    # llama.cpp's kernels (so its float order) depend on a product's row count: in its numbers
    # a shorter last window runs at its own length, not padded to the others'
    last = len(windows[-1][0])
    tail = Runner(cfg, weights, be, length=last, adapters=adapters, n_ctx=length, numerics=LLAMA, kv_f16=f16) \
        if numerics == LLAMA and last < runner.length \
        else runner
    total, count = 0.0, 0
    bar = progress_bar(quiet, total=sum(len(x) for x, _ in windows), unit="token", unit_scale=True,
                       desc=f"scoring {data.name}", leave=False)
    for x, y in windows:
        total += (tail if x.size < runner.length else runner).nll(x[None, :], y[None, :])
        count += int((y >= 0).sum())
        if bar is not None:
            bar.update(x.size)
            bar.set_postfix_str(f"perplexity {math.exp(total / count):.3f}", refresh=False)
    if bar is not None:
        bar.close()
    result = {"perplexity": math.exp(total / count), "nll": total / count, "tokens": count}
    if as_json:
        typer.echo(json.dumps(result))
    else:
        typer.echo(f"perplexity {result['perplexity']:.4f} (mean NLL {result['nll']:.4f} over {count} tokens)")


def _windows(ids: np.ndarray, length: int) -> list:
    """[(tokens, targets)]: non-overlapping windows of up to `length` tokens, each token after
    the first scored once (the last window shorter)."""
    n = len(ids) - 1
    return [(ids[s:min(s + length, n)], ids[s + 1:s + length + 1]) for s in range(0, n, length)]


def _half_windows(ids: np.ndarray, length: int, tok) -> list:
    """[(tokens, targets)] as llama-perplexity scores a text: chunks of `length` tokens (the
    last partial one dropped), each begun with BOS where the vocabulary adds one, the whole
    chunk fed, and only the tokens after its first half scored (targets -1 elsewhere)."""
    if len(ids) < 2 * length:
        raise ConfigError(f"--half-window: the text gives {len(ids)} tokens; llama-perplexity's scoring needs at "
                          f"least 2 x --ctx = {2 * length}")
    out = []
    for s in range(0, len(ids) - length + 1, length):
        chunk = ids[s:s + length].copy()
        if tok.add_bos:
            chunk[0] = tok.bos_id
        targets = np.full(length, -1, np.int32)
        targets[length // 2:-1] = chunk[length // 2 + 1:]
        out.append((chunk, targets))
    return out
