"""`ggtrain imatrix --model M --data TEXT --out imatrix.gguf` (layer 6): the importance matrix
llama.cpp's llama-imatrix computes (core/models/importance.py), written in its GGUF layout
(formats/imatrix.py) for `convert-checkpoint --imatrix` and llama-quantize.

As llama-imatrix: the whole text tokenized (BOS first where the vocabulary asks for one, special
tokens as text), cut into chunks of --ctx tokens (at least two chunks' worth), each chunk's
first token replaced by BOS where the vocabulary asks for one, each run from an empty context;
the sums cover the block matrices (not the token embedding or the output matrix) and the
routed experts' stacked matrices, per expert.

NOTE: llama-imatrix decodes in micro-batches of 512 tokens and skips a product of fewer than 16
rows, so a chunk longer than 1024 tokens whose length is 1..15 past a multiple of 512 loses its
last rows there; every row is summed here (not emulated).
"""
from __future__ import annotations

import pathlib

import typer

from ggtrain.cli.common import file_errors, make_backend, numerics_for, option_named, progress_bar
from ggtrain.cli.loop import check_apart, check_out
from ggtrain.cli.main import app
from ggtrain.cli.options import (BACKEND, CACHE_TYPE, DATA, MODEL, QUIET, THREADS, Backend, CacheType,
                                 opt_numerics, opt_out)
from ggtrain.core.models.config import ModelConfig
from ggtrain.core.models.importance import MIN_ROWS, importance_sums
from ggtrain.errors import ConfigError
from ggtrain.formats.datafile import read_text
from ggtrain.formats.imatrix import write_imatrix
from ggtrain.formats.model_file import open_model

Numerics, NUMERICS_OPTION = opt_numerics(
    "the default", "its attention without flash attention, its KV cache as --cache-type says; CPU only): ~2x "
    "slower; docs/converting.md says how close each comes to llama-imatrix's own sums")


def chunk_windows(ids, ctx: int, chunks: int, bos_id: int | None) -> list:
    """llama-imatrix's chunks of the token ids: as many whole windows of ctx tokens as the text
    has (at most `chunks` where that is >= 0), each starting with bos_id where given."""
    n = len(ids) // ctx if chunks < 0 else min(chunks, len(ids) // ctx)
    windows = []
    for i in range(n):
        w = ids[i * ctx:(i + 1) * ctx].copy()
        if bos_id is not None:
            w[0] = bos_id
        windows.append(w)
    return windows


@app.command("imatrix", rich_help_panel="Files")
def imatrix_cmd(
    model: pathlib.Path = typer.Option(..., "--model", rich_help_panel=MODEL, show_default=False,
                                       help="The GGUF model (any type its weights are stored in)."),
    data: pathlib.Path = typer.Option(..., "--data", rich_help_panel=DATA, show_default=False,
                                      help="A plain text file (UTF-8), read whole (llama-imatrix's -f)."),
    out: pathlib.Path = opt_out("The importance matrix to write, in llama-imatrix's GGUF layout "
                                "(convert-checkpoint --imatrix and llama-quantize --imatrix read it)."),
    ctx: int = typer.Option(512, "--ctx", rich_help_panel=DATA,
                            help=f"Tokens a chunk (llama-imatrix's -c; {MIN_ROWS} up to the model's context)."),
    chunks: int = typer.Option(-1, "--chunks", rich_help_panel=DATA,
                               help="Chunks to use at most (-1: every whole chunk of the text)."),
    numerics: Numerics = NUMERICS_OPTION,
    cache_type: CacheType = CACHE_TYPE,
    threads: int = THREADS,
    backend: Backend = BACKEND,
    quiet: bool = QUIET,
):
    """Compute a model's importance matrix on a text, as llama.cpp's llama-imatrix does."""
    check_out(out, "--out")
    check_apart({"--out": out}, {"--model": model, "--data": data})
    if chunks == 0 or chunks < -1:
        raise ConfigError(f"--chunks {chunks}: must be -1 (every chunk) or >= 1")
    be = make_backend(backend, threads)
    numerics = numerics_for(numerics, be)
    with file_errors(f"--model {model}"), option_named("--model"):
        config, weights, tok = open_model(model, be)
    cfg = ModelConfig(**config)
    if not MIN_ROWS <= ctx <= cfg.ctx:
        raise ConfigError(f"--ctx {ctx}: must be in {MIN_ROWS}..{cfg.ctx} (llama-imatrix sums no product of fewer "
                          f"than {MIN_ROWS} tokens; the model's context is {cfg.ctx})")
    with file_errors(f"--data {data}", "text file"):
        text = read_text(data)
    if not text:
        raise ConfigError(f"--data {data}: the file is empty")
    ids = tok.encode(text, add_bos=tok.add_bos)
    if len(ids) < 2 * ctx:
        raise ConfigError(f"--data {data}: {len(ids)} tokens; llama-imatrix needs at least {2 * ctx} (two chunks "
                          f"of --ctx {ctx})")
    windows = chunk_windows(ids, ctx, chunks, tok.bos_id if tok.add_bos else None)
    bar = progress_bar(quiet, total=len(windows), unit="chunk", desc=f"imatrix of {model.name}", leave=False)
    sums, counts = importance_sums(cfg, weights, be, windows, numerics=numerics, kv_f16=cache_type == "f16",
                                  progress=None if bar is None else lambda i: bar.update(1))
    if bar is not None:
        bar.close()
    write_imatrix(out, sums, counts, datasets=[str(data)], chunk_count=len(windows), chunk_size=ctx)
    typer.echo(f"wrote {out}: the importance of {len(sums)} matrices over {len(windows)} chunks of {ctx} tokens")
