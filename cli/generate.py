"""`ggtrain generate` and `ggtrain eval`: run a llama GGUF model (layer 6)."""
from __future__ import annotations

import json
import math
import pathlib
import sys

import typer

from ggtrain.cli.common import cpu_backend
from ggtrain.cli.main import app
from ggtrain.core.models.llama import LlamaConfig, LlamaRunner, generate
from ggtrain.errors import ConfigError
from ggtrain.formats.llama_model import load_llama
from ggtrain.formats.lora import merge_lora


def _load(model, lora, lora_scale):
    """Config, f32 weights (with the adapter merged in, if any) and tokenizer of a model."""
    config, weights, tok = load_llama(model)
    if lora is not None:
        weights = merge_lora(weights, lora, lora_scale)
    return config, weights, tok


@app.command("generate")
def generate_cmd(
    model: pathlib.Path = typer.Option(..., "--model", help="A llama GGUF model (F32, F16, Q8_0, Q4_0, ...)."),
    lora: pathlib.Path = typer.Option(None, "--lora", help="A LoRA adapter GGUF (llama.cpp's format) to apply."),
    lora_scale: float = typer.Option(1.0, "--lora-scale", help="Scale of the adapter (as llama.cpp's --lora-scaled)."),
    prompt: str = typer.Option(..., "--prompt", help="Text to continue."),
    n: int = typer.Option(64, "-n", "--n-tokens", help="Tokens to generate (fewer if EOS comes first)."),
    temp: float = typer.Option(0.0, "--temp", help="Sampling temperature; 0 is greedy (llama.cpp's greedy tokens)."),
    top_k: int = typer.Option(0, "--top-k", help="Sample among the K most likely tokens (0: all)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the sampler."),
    threads: int = typer.Option(None, "--threads", help="CPU threads (default: all available)."),
):
    """Continue a prompt with a llama model; prints only the continuation."""
    if n < 0 or temp < 0 or top_k < 0:
        raise ConfigError("-n, --temp and --top-k must be >= 0")
    config, weights, tok = _load(model, lora, lora_scale)
    cfg = LlamaConfig(**config)
    ids = tok.encode(prompt, add_bos=tok.add_bos).tolist()
    if len(ids) >= cfg.ctx:
        raise ConfigError(f"--prompt has {len(ids)} tokens; the model's context is {cfg.ctx}")
    runner = LlamaRunner(cfg, weights, cpu_backend("cpu", threads), length=min(cfg.ctx, len(ids) + n))
    out = []
    for t in generate(runner, ids, n, temp, top_k, seed, eos=tok.eos_id):
        if t == tok.eos_id:
            break
        out.append(t)
    sys.stdout.write(tok.decode(out))
    sys.stdout.write("\n")


@app.command("eval")
def eval_cmd(
    model: pathlib.Path = typer.Option(..., "--model", help="A llama GGUF model."),
    lora: pathlib.Path = typer.Option(None, "--lora", help="A LoRA adapter GGUF (llama.cpp's format) to apply."),
    lora_scale: float = typer.Option(1.0, "--lora-scale", help="Scale of the adapter."),
    data: pathlib.Path = typer.Option(..., "--data", help="A UTF-8 text file."),
    ctx: int = typer.Option(0, "--ctx", help="Window length (default: min(model context, 512))."),
    as_json: bool = typer.Option(False, "--json", help='Print {"perplexity", "nll", "tokens"} as JSON.'),
    threads: int = typer.Option(None, "--threads", help="CPU threads (default: all available)."),
):
    """Perplexity of a llama model on a text: non-overlapping windows, every token scored once."""
    config, weights, tok = _load(model, lora, lora_scale)
    cfg = LlamaConfig(**config)
    length = ctx or min(cfg.ctx, 512)
    if not 1 <= length <= cfg.ctx:
        raise ConfigError(f"--ctx {ctx}: must be in 1..{cfg.ctx} (the model's context)")
    try:
        text = data.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"--data {data}: not UTF-8 text ({exc})") from None
    ids = tok.encode(text, add_bos=tok.add_bos)
    if len(ids) < 2:
        raise ConfigError(f"--data {data}: fewer than 2 tokens to score")
    runner = LlamaRunner(cfg, weights, cpu_backend("cpu", threads), length=length)
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, length):
        window = ids[start:start + length + 1]
        x, y = window[:-1][None, :], window[1:][None, :]
        total += runner.nll(x, y)
        count += y.size
    result = {"perplexity": math.exp(total / count), "nll": total / count, "tokens": count}
    if as_json:
        typer.echo(json.dumps(result))
    else:
        typer.echo(f"perplexity {result['perplexity']:.4f} (mean NLL {result['nll']:.4f} over {count} tokens)")
